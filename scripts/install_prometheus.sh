#!/usr/bin/env bash
# Idempotent: install the Debian `prometheus` package (the server binary the monitoring tests start on loopback)
# when no `prometheus` is on PATH, then print its version. Needs root (as on the project machines and in CI).
set -euo pipefail

if ! command -v prometheus >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # The package's post-install tries to start a system service; with no init system that is skipped harmlessly.
    apt-get install -y -q --no-install-recommends prometheus
fi
prometheus --version 2>&1 | head -n 1
