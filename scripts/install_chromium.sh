#!/usr/bin/env bash
# Idempotent: install Debian's `chromium` and `chromium-driver` (the headless browser and its WebDriver that the run
# viewer's browser test drives on loopback) when either is missing, then print their versions. Needs root (as on
# the project machines and in CI).
set -euo pipefail

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends chromium chromium-driver
fi
chromium --version 2>/dev/null | head -n 1
chromedriver --version 2>/dev/null | head -n 1
