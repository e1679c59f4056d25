#!/usr/bin/env bash
# The README's run command: set up (idempotent), then train on the embedded default task.
# Extra arguments are config overrides, e.g. `bash scripts/run.sh learner.total_steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh run   # the main job's packages only; scripts/test.sh adds the test tools
# shellcheck disable=SC1091
. "${AAR_VENV:-.venv}/bin/activate"
exec async-agent-rl train --config configs/quickstart.yaml "$@"
