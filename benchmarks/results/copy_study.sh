#!/bin/bash
# copy_study.sh RUN_DIR DEST: a bench study's report, plots, each finished RL arm's small files (config, metrics,
# evaluations, summary, its warm start's summary and sha256) and each SFT-only arm's summary, scores and config
# into DEST, to be committed.
set -euo pipefail
src=$1; dst=$2
mkdir -p "$dst"
cp "$src"/report.md "$src"/report.json "$src"/*.png "$dst"/ 2>/dev/null || true
for arm in "$src"/*-rl; do
  [ -f "$arm/summary.json" ] || continue
  d="$dst/$(basename "$arm")"; mkdir -p "$d"
  cp "$arm"/{config.yaml,eval.jsonl,metrics.jsonl,summary.json} "$d"/
  ws=$(python3 -c "import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))['model']['path'])" "$arm/config.yaml" 2>/dev/null || true)
  [ -n "$ws" ] || continue
  if [ -f "$ws/sft_summary.json" ]; then cp "$ws/sft_summary.json" "$d"/; fi
  if [ -f "$ws/model.safetensors" ]; then (cd "$ws" && sha256sum model.safetensors) > "$d/warm_start.sha256"; fi
done
for arm in "$src"/*-sft; do
  [ -f "$arm/continue_sft_summary.json" ] || continue
  d="$dst/$(basename "$arm")"; mkdir -p "$d"
  cp "$arm"/{continue_sft_summary.json,scores.json,sft_config.yaml} "$d"/ 2>/dev/null || true
done
