#!/bin/bash
cd "$(dirname "$0")/../.."
source .venv/bin/activate
async-agent-rl train --config configs/quickstart.yaml data.world.seed=3 data.world_dir=runs/screen/world3 data.make_world_if_missing=true data.train_files=["runs/screen/world3/train.parquet"] data.test_files=["runs/screen/world3/test.parquet"] data.corpus_file=runs/screen/world3/corpus.jsonl model.path=runs/screen/q3h8_w3/model model.build_if_missing=true model.init.seed=3 sft.seed=3 data.seed=3 rollout.seed=3 learner.seed=3 sft.reading_target=1.0 sft.reading_max_rounds=0 model.init.architecture=qwen3 model.init.head_dim=32 model.init.num_attention_heads=8 model.init.num_key_value_heads=4 sft.output_dir=runs/screen/q3h8_w3/sft run.output_dir=runs/screen/q3h8_w3 run.name=rl monitoring.enabled=false
