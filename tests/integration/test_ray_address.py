"""``cluster.ray_address`` on the real ``async-agent-rl train`` command.

- A port that accepts connections but is not a Ray cluster: until 60e3570 (2026-12-07) a plain HTTP server at the
  address had ``train`` print Ray's "Failed to connect to GCS" warnings every 5-40 s and no error for 160 s, until
  it was killed (deaf to SIGTERM meanwhile); a stopped GCS the same. Now: one ``error:`` line naming the address,
  exit 2, within a minute.
- A real cluster of nodes on loopback (``tests/multinode.py``): the check lets it through; a 2-step training on it
  keeps the actors' engine and library lines (``(RolloutActor pid=...) ... INFO ...``, 196 of 260 console lines of
  a 10-step run) off the console, in the session's logs the run folder links (``ray_logs``), as a local run does.
  Then its GCS is stopped (SIGSTOP): the next ``train`` ends in one ``error:`` line naming the address.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.helpers import Run, cluster_processes, world_overrides
from tests.multinode import LocalNodes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FORWARDED = re.compile(r"\((\w+) pid=\d+(, ip=[^)]*)?\)")  # how Ray prefixes an actor's line it forwards


def train(tmp_path: Path, address: str, *extra: str, env: dict | None = None) -> Run:
    return Run([sys.executable, "-m", "driver.cli", "train", "--config", str(REPO / "configs/quickstart.yaml"),
                f"cluster.ray_address={address}", f"run.output_dir={tmp_path}", "run.name=run", *extra],
               env=env)  # fmt: skip


def one_error(run: Run, address: str, within_s: float) -> str:
    t0 = time.monotonic()
    rc = run.finish(within_s + 30)
    took = time.monotonic() - t0
    errors = [x for x in run.err if x.startswith("error:")]
    assert rc == 2 and len(errors) == 1, run.text()
    assert "Traceback" not in run.text(), run.text()
    assert errors[0].startswith(f"error: cluster.ray_address={address}: "), errors
    assert took < within_s, f"{took:.0f} s:\n{run.text()}"
    return errors[0]


@pytest.mark.timeout(300)
def test_a_port_that_answers_http_is_one_error_line_within_a_minute(tmp_path):
    http = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{http.server_address[1]}"
        line = one_error(train(tmp_path, address), address, 60)
        assert "not a Ray cluster" in line, line
        assert not (tmp_path / "run" / "checkpoints").exists()
    finally:
        http.shutdown()


@pytest.mark.timeout(1200)
def test_a_real_cluster_passes_keeps_actor_lines_off_the_console_and_a_stopped_gcs_is_one_error(
        tmp_path, world_dir, tiny_model_dir):
    import psutil

    from driver.cluster import check_answers

    small = ["learner.batch_size=8", "learner.mini_batch_size=8", "learner.micro_batch_size=8",
             "rollout.group_size=4", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
             "monitoring.enabled=false", "sft.enabled=false", "buffer.group_filter=none", "learner.total_steps=2",
             *world_overrides(world_dir, tiny_model_dir)]  # fmt: skip
    with LocalNodes({"num_cpus": 4, "resources": {}}, {}) as nodes:
        check_answers(nodes.address, "cluster.ray_address")  # a Ray GCS (it wants a token: that is its answer)
        run = train(tmp_path, nodes.address, *small, env=nodes.env)
        try:
            assert run.finish(600) == 0, run.text()
        finally:
            run.kill()
        console = run.out + run.err
        forwarded = [x for x in console if FORWARDED.search(x)]
        assert not forwarded, "\n".join(forwarded[:20])
        assert not [x for x in console if " INFO " in x or "\x1b[" in x], run.text()
        logs = tmp_path / "run" / "ray_logs"
        assert logs.is_symlink() and any(logs.glob("worker-*")), "the actors' lines are in the session's logs"

        gcs = [p for p in cluster_processes(nodes.temp_dir, nodes.proc.pid) if p.name() == "gcs_server"]
        assert len(gcs) == 1, gcs
        gcs[0].send_signal(signal.SIGSTOP)
        try:
            line = one_error(train(tmp_path, nodes.address, *small, env=nodes.env), nodes.address, 60)
            assert "nothing answers within" in line, line
        finally:
            try:
                gcs[0].send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
