#!/usr/bin/env bash
# Side by side, one after another on an otherwise idle machine: samples/s of each algorithm.proximal mode at eta 8
# on the seed-0 world (same warm start, 15 steps), plus standard PPO (no proximal pass). The learning comparison over
# seeds 0-2 is benchmarks/proximal_study.sh; this one only times the modes against each other in one sitting.
# Outputs: <out>/proximal_speed_<mode>/ (report.md, report.json, the arms' run folders). Usage: proximal_speed.sh [out]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench}  # each mode in <out>/proximal_speed_<mode>; worlds in <out>/worlds, shared with the other studies
common=(--config configs/quickstart.yaml --seeds 0 --eval-every 15 --warm-starts runs/bench/warm_start --etas 8)
mkdir -p "$out"
for mode in recompute skip_fresh interpolate behavior; do
  extra=(--no-ppo-arm)
  [ "$mode" = recompute ] && extra=()
  async-agent-rl bench staleness "${common[@]}" --out "$out/proximal_speed_$mode" "${extra[@]}" "algorithm.proximal=$mode" \
    >> "$out/proximal_speed_$mode.log" 2>&1
  echo "$mode rc $?"
done
