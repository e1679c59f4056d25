#!/usr/bin/env bash
# One RL run per behaviour-weight correction (algorithm.behavior_weight_level, icepop_band, behavior_weight_floor)
# on the seed-0 world from its warm start, as the web-latency study's asynchronous arm (eta 2, 15 steps) but with no
# tool latency and 32 episode slots. Needs that study's seed-0 world and warm start under runs/bench/ (its command,
# benchmarks/RESULTS.md "Async against sync under web-like tool latency", makes them). Runs go to runs/modes/.
set -uo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p runs/modes
base=benchmarks/results/sync_web_h8/seed0/async/config.yaml
common=(retriever.latency=none rollout.max_concurrent_episodes=32 run.output_dir=runs/modes)
declare -A modes=(
  [token]=""
  [sequence]="algorithm.behavior_weight_level=sequence"
  [turn]="algorithm.behavior_weight_level=turn"
  [icepop]="algorithm.icepop_band=[0.5,2.0]"
  [floor]="algorithm.behavior_weight_floor=0.0001"
)
for m in token sequence turn icepop floor; do
  [ -f "runs/modes/$m/summary.json" ] && continue
  # shellcheck disable=SC2086
  async-agent-rl train --config "$base" "${common[@]}" "run.name=$m" ${modes[$m]} > "runs/modes/$m.log" 2>&1
  echo "$m rc $?"
done
