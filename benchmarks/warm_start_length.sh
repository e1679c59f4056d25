#!/usr/bin/env bash
# How short can the warm start be? Warm starts of the seed-1 world (the world `bench learning --seeds 1` makes) by
# recipe, each probed before RL (`async-agent-rl probe`: what the model reads after the scripted expert's search),
# and RL from some of them (the shipped 15 steps, evaluated at the start and the end). One arm at a time; an arm whose
# folder has its probe is kept (a rerun resumes). Result files: benchmarks/results/warm_start_length/ (copied by hand:
# each warm start's sft_summary.json and sha256, probe.md, probe.json; each RL run's summary, eval, metrics, config).
#   bash benchmarks/warm_start_length.sh        (about 95 minutes on 2 idle cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/bench/warm_start_length
w=$out/worlds/seed_1
world=(data.world.seed=1 "data.world_dir=$w" data.make_world_if_missing=true "data.train_files=[\"$w/train.parquet\"]"
       "data.test_files=[\"$w/test.parquet\"]" "data.corpus_file=$w/corpus.jsonl" "model.path=$w/model"
       model.build_if_missing=true model.init.seed=1 sft.seed=1 data.seed=1 rollout.seed=1 learner.seed=1)
cfg=(--config configs/quickstart.yaml)
async-agent-rl prepare "${cfg[@]}" "${world[@]}"
arm() {  # name, recipe overrides: a warm start and its probe
  local name=$1; shift
  [ -f "$out/$name/probe/probe.json" ] && return 0
  async-agent-rl sft "${cfg[@]}" --out "$out/$name" "${world[@]}" "$@"
  async-agent-rl probe "${cfg[@]}" --checkpoint "$out/$name" --out "$out/$name/probe" "${world[@]}"
}
rl() {  # name: the shipped RL from that warm start
  local name=$1
  [ -f "$out/rl_$name/summary.json" ] && return 0
  async-agent-rl train "${cfg[@]}" "${world[@]}" "model.path=$out/$name" sft.enabled=false "run.name=rl_$name" \
    "run.output_dir=$out" eval.every_steps=0
}
arm full                                                                  # the shipped recipe: 500 + 2,500 steps of 16
arm short  sft.pretrain_steps=250 sft.num_demos=16000                     # 40% of its tokens
arm lr6    sft.pretrain_steps=250 sft.num_demos=16000 sft.lr=6e-3         # the same, twice the learning rate
arm nopre  sft.pretrain_steps=0   sft.num_demos=20000                     # no pretraining, its time on demonstrations
arm bs8    sft.pretrain_steps=500 sft.num_demos=16000 sft.batch_size=8    # 40% of the tokens in steps of 8
arm bs4    sft.pretrain_steps=1000 sft.num_demos=16000 sft.batch_size=4   # the same in steps of 4
arm bs8_24k sft.pretrain_steps=500 sft.num_demos=24000 sft.batch_size=8   # steps of 8, 60% of the demonstrations
arm bs8_full sft.pretrain_steps=1000 sft.num_demos=40000 sft.batch_size=8 # the shipped tokens in steps of 8
for name in full short bs8 bs8_24k bs8_full; do rl "$name"; done
# the short recipe on world 0 (the README's world), RL from it:
async-agent-rl bench learning "${cfg[@]}" --seeds 0 --rl-only --eval-every 15 --out $out/world0 \
    sft.pretrain_steps=250 sft.num_demos=16000
# the shipped tokens in steps of 8 on worlds 1-3 (its lead on world 1 checked on two more worlds):
async-agent-rl bench learning "${cfg[@]}" --seeds 1,2,3 --warm-start-seeds "" --rl-only --eval-every 15 \
    --out runs/bench/ws_bs8_full sft.batch_size=8 sft.pretrain_steps=1000 sft.num_demos=40000
