#!/usr/bin/env bash
# The main job timed whole from a fresh clone, as a new user runs it: `git clone`, `bash scripts/setup.sh run`, then
# `bash scripts/run.sh`, each timed by the shell. The run's small files and the timings go to
# benchmarks/results/main_job/<date>_<commit>/ of this checkout; the clone is removed afterwards.
#   bash benchmarks/main_job_time.sh [overrides...]     (run on idle cores; about 4 minutes, 10 with `sft.prebuilt=`)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
commit=$(git rev-parse --short HEAD)
suffix=""  # overrides name the folder too: `sft.prebuilt=` -> <date>_<commit>_sft.prebuilt
[ $# -gt 0 ] && suffix="_$(echo "$*" | tr -cs 'A-Za-z0-9._' '_' | sed 's/_*$//')"
out="$repo/benchmarks/results/main_job/$(date -u +%F)_$commit$suffix"
clone=$(mktemp -d)
trap 'rm -rf "$clone"' EXIT
git clone -q "$repo" "$clone/repo"
cd "$clone/repo"
mkdir -p "$out"
{ git log -1 --format='%h %s'; date -u +%FT%TZ; } > "$out/timing.txt"
t0=$(date +%s.%N); bash scripts/setup.sh run > "$out/setup.log" 2>&1; t1=$(date +%s.%N)
echo "setup wall $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") s" >> "$out/timing.txt"
rc=0; bash scripts/run.sh "$@" > "$out/console.txt" 2>&1 || rc=$?; t2=$(date +%s.%N)
{ echo "run wall $(awk "BEGIN{printf \"%.1f\", $t2 - $t1}") s"; echo "rc $rc"; } >> "$out/timing.txt"
r=runs/quickstart
cp "$r"/{config.yaml,eval.jsonl,metrics.jsonl,summary.json} "$out"/ 2>/dev/null || true
cp "$r"/sft/sft_summary.json "$out"/ 2>/dev/null || true
sha256sum "$r"/sft/model.safetensors > "$out/warm_start.sha256" 2>/dev/null || true
cat "$out/timing.txt"
exit "$rc"
