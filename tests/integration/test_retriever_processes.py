"""Retrieval server processes (real, on loopback), the slow ones: a killed server and a stopped (hung) one are seen
and restarted on the same port, as the training driver's supervision relies on; a spawned server does not outlive a
parent killed with SIGKILL; `retriever serve` on a busy port is one error line. Slow tier: about 80 s in all, most of
it server processes starting."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_agent_rl.config import RetrieverConfig
from async_agent_rl.data.corpus import Passage, write_corpus
from retriever.server import spawn_server
from tests.helpers import post, title_query

pytestmark = pytest.mark.slow

PASSAGES = [Passage(id=str(i), contents=f'"Title {i}"\nword{i} text about thing {i}') for i in range(20)]


def test_a_server_that_died_or_hangs_is_seen_and_restarted_on_its_port(corpus_file, passages):
    """What the training driver's supervision relies on: ``healthy()`` names a killed server and a stopped (hung)
    one, and ``restart()`` serves again on the same URL, so the rollout actors' URL stays valid."""
    import os
    import signal

    with spawn_server(corpus_file, RetrieverConfig(topk=1)) as server:
        url = server.url
        assert server.healthy(2.0) is None
        os.kill(server.proc.pid, signal.SIGSTOP)  # hung: the port accepts, nothing answers
        why = server.healthy(1.0)
        assert why is not None and "did not answer /health within 1 s" in why, why
        assert server.restart() == url and server.restarts == 1 and server.healthy(2.0) is None
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        assert server.healthy(1.0) == "exited (signal 9)"
        assert server.restart() == url and server.restarts == 2
        status, raw = post(f"{url}/retrieve", {"queries": [title_query(passages[3])], "return_scores": True})
        assert status == 200 and json.loads(raw)["result"][0][0]["document"]["id"] == passages[3].id
    assert server.proc.returncode is not None


def test_a_spawned_server_does_not_outlive_a_parent_killed_with_sigkill(tmp_path, corpus_file):
    """Before: SIGKILL of a training left its retrieval server running (seen for over 7 minutes). The server a
    process spawns watches its parent and stops within about a second of it being gone."""
    import os
    import signal

    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from retriever.server import spawn_server; p = spawn_server(sys.argv[1]); "
         "print(p.proc.pid, flush=True); time.sleep(600)", str(corpus_file)],
        stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive and serving
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"the retrieval server (pid {child}) outlived its killed parent by 15 s")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_serve_on_a_busy_port_is_one_error_line(tmp_path: Path):
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, PASSAGES)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "driver.cli", "retriever", "serve", "--corpus", str(corpus),
                            "--port", str(port)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], r.stderr
