#!/bin/bash
# screen.sh NAME WORLD SFT_SEED [overrides...]: a warm start and its per-relation reading check, no RL.
# WORLD: a world seed (its own world, model and seeds, as `bench learning --seeds`) or "q" (the quickstart world)
set -e
cd "$(dirname "$0")/../.."
source .venv/bin/activate
NAME=$1; WORLD=$2; SS=$3; shift 3
D=runs/screen/$NAME
mkdir -p $D
if [ "$WORLD" = q ]; then
  O="model.path=$D/model model.build_if_missing=true sft.seed=$SS"
else
  W=runs/screen/world$WORLD
  O="data.world.seed=$WORLD data.world_dir=$W data.make_world_if_missing=true data.train_files=[\"$W/train.parquet\"] data.test_files=[\"$W/test.parquet\"] data.corpus_file=$W/corpus.jsonl model.path=$D/model model.build_if_missing=true model.init.seed=$WORLD sft.seed=$SS data.seed=$WORLD rollout.seed=$WORLD learner.seed=$WORLD"
fi
O="$O sft.reading_target=1.0 sft.reading_max_rounds=0"
echo "overrides: $O $*" > $D/command.txt
async-agent-rl prepare --config configs/quickstart.yaml $O "$@" > $D/prepare.log 2>&1
async-agent-rl sft --config configs/quickstart.yaml --out $D/sft $O "$@" > $D/sft.log 2>&1
grep "reads" $D/sft.log | tail -2
