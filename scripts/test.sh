#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_prometheus.sh  # the real Prometheus the monitoring tests start on loopback (idempotent; apt-get as root)
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${AAR_VENV:-.venv}/bin/activate"
if [ "$#" -eq 0 ]; then set -- tests; fi
exec python -m pytest -q -rs --durations=15 "$@"
