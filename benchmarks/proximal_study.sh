#!/usr/bin/env bash
# The proximal-pass study (algorithm.proximal): one `bench staleness` per mode on the seed 0, 1, 2 worlds, from the
# shared warm starts, 15 steps, held-out EM at the end. Only the arms where a mode differs from the others run:
# at eta 0 every batch is fresh, so skip_fresh, interpolate and behavior all skip the pass (one arm, skip_fresh);
# at eta > 0 skip_fresh skips only all-fresh batches and is recompute's arm otherwise, so interpolate and behavior
# run against recompute at eta 2, 4, 8. recompute also runs the standard-PPO arm at eta 8. Finished arms are kept
# (a rerun resumes). Outputs: runs/bench/proximal_<mode>/ (report.md, report.json, per-arm folders).
set -uo pipefail
cd "$(dirname "$0")/.."
common=(--config configs/quickstart.yaml --seeds 0,1,2 --eval-every 15 --warm-starts runs/bench/warm_start)
run() {  # mode etas [extra flags]
  local mode=$1 etas=$2; shift 2
  async-agent-rl bench staleness "${common[@]}" --etas "$etas" --out "runs/bench/proximal_$mode" "$@" \
    "algorithm.proximal=$mode" >> "runs/bench/proximal_$mode.log" 2>&1
  echo "$mode rc $?"
}
mkdir -p runs/bench
run recompute 0,2,4,8
run skip_fresh 0 --no-ppo-arm
run interpolate 2,4,8 --no-ppo-arm
run behavior 2,4,8 --no-ppo-arm
