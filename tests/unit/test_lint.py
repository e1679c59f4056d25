"""The linter: ``ruff check`` (its rules in pyproject.toml, ``[tool.ruff]``) finds nothing in the project's code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ["async_agent_rl", "retriever", "buffer", "actors", "learner", "warm_start", "monitoring", "driver",
           "benchmarks", "tests"]


def test_ruff_finds_nothing():
    assert importlib.util.find_spec("ruff") is not None, "ruff is not installed: it is in the dev extra"
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                          *FOLDERS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"ruff check found problems:\n{run.stdout}{run.stderr}"
