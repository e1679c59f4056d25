#!/bin/bash
cd "$(dirname "$0")/../.."
source .venv/bin/activate
async-agent-rl train --config configs/quickstart.yaml model.path=runs/screen/q3h8_ws0/model model.build_if_missing=true sft.seed=0 sft.reading_target=1.0 sft.reading_max_rounds=0 model.init.architecture=qwen3 model.init.head_dim=32 model.init.num_attention_heads=8 model.init.num_key_value_heads=4 sft.output_dir=runs/screen/q3h8_ws0/sft run.output_dir=runs/screen/q3h8_ws0 run.name=rl monitoring.enabled=false
