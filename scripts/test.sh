#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the tests.
#   bash scripts/test.sh               the fast tier: every test not marked `slow` (unit + integration)
#   bash scripts/test.sh --all         every tier, `slow` included (what CI runs)
# Other arguments go to pytest, with or without --all, e.g. `bash scripts/test.sh tests/unit -x`,
# `bash scripts/test.sh --all tests/integration/test_train_faults.py`, `bash scripts/test.sh -m unit`.
# A `-m` of your own replaces the default `-m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then all=1; else args+=("$a"); fi
done
select=(-m "not slow")
for a in "${args[@]+"${args[@]}"}"; do
  case "$a" in -m|-m*) select=() ;; esac
done
if [ "$all" -eq 1 ]; then select=(); fi
# the real Prometheus the monitoring tests start on loopback (idempotent; apt-get as root)
bash scripts/install_prometheus.sh
bash scripts/install_chromium.sh  # the headless browser and its WebDriver for the run viewer's browser test
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${AAR_VENV:-.venv}/bin/activate"
exec python -m pytest -q -rs --durations=40 "${select[@]+"${select[@]}"}" "${args[@]+"${args[@]}"}"
