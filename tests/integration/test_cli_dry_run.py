"""``async-agent-rl train --dry-run`` as a user runs it, in a subprocess, from an empty folder: the GPU config on
this CPU machine (its model, data and GPUs missing) and the quickstart config (everything buildable: exit 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_agent_rl.config import RetrieverConfig
from async_agent_rl.data.corpus import Passage
from retriever.backends import BM25Backend
from retriever.server import start_server_in_thread

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def dry_run(cwd: Path, config: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "driver.cli", "train", "--config", str(REPO / "configs" / config), "--dry-run",
         *overrides],
        capture_output=True, text=True, cwd=cwd, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def test_gpu_config_reports_every_missing_piece_and_a_live_retriever(tmp_path):
    backend = BM25Backend.build([Passage(id="0", contents='"Paris"\nParis is the capital of France.')])
    with start_server_in_thread(backend, RetrieverConfig()) as server:
        r = dry_run(tmp_path, "search_r1_nq_gpu.yaml", f"retriever.url={server.url}/retrieve")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = r.stderr.splitlines()
    assert errors and all(line.startswith("error: ") for line in errors), r.stderr
    for expected in ("model.path", "data.train_files", "data.test_files", "data.corpus_file", "GPU(s)"):
        assert any(expected in line for line in errors), (expected, r.stderr)
    assert f"{server.url}/retrieve: reachable" in r.stdout
    assert "4 actor(s) x 1 GPU; each vLLM engine takes 80%" in r.stdout and "4 rank(s) x 1 GPU, ZeRO-3" in r.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written, no run folder


def test_unreachable_retriever_is_one_error_line(tmp_path):
    r = dry_run(tmp_path, "search_r1_nq_gpu.yaml", "retriever.url=http://127.0.0.1:9/retrieve")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    unreachable = "retriever.url http://127.0.0.1:9/retrieve: not reachable"
    assert sum(unreachable in line for line in r.stderr.splitlines()) == 1


def test_quickstart_config_is_ready_to_run(tmp_path):
    r = dry_run(tmp_path, "quickstart.yaml")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "the run builds a tiny one" in r.stdout and "started by the run: bm25" in r.stdout
    assert r.stdout.rstrip().endswith("ok: nothing missing that can be checked here")
    assert list(tmp_path.iterdir()) == []
