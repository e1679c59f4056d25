"""``async-agent-rl view RUN_DIR`` as a real process: the page and its JSON endpoints over HTTP on 127.0.0.1 only
(the port printed), errors as JSON, only the page's own files served, bad input one ``error:`` line."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import cli, listening_sockets

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]




def get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = tmp_path / "run"
    (run / "episodes").mkdir(parents=True)
    (run / "config.yaml").write_text("learner:\n  total_steps: 4\n")
    rows = [{"step": s, "batch_reward": 0.25 * s, "rollout_exact_match": 0.2, "elapsed_s": 5.0 * s,
             "episodes_total": 16 * s, "searches_total": 4 * s, "rollout_tool_wait_s": 0.4} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "garbage\n")
    ep = {"schema": 1, "step": 2, "kind": "world_single", "question": "<script>alert(1)</script>?", "reward": 1.0,
          "turns": [{"kind": "prompt", "text": "Question: q", "tokens": 3, "loss": False},
                    {"kind": "model", "text": "<answer>a</answer>", "tokens": 4, "loss": True,
                     "runs": [{"text": "<answer>a</answer>", "version": 1, "tokens": 4}]},
                    {"kind": "answer", "text": "a"}]}
    (run / "episodes" / "step_000002.jsonl").write_text(json.dumps(ep) + "\n")
    return run


@pytest.fixture
def viewer(run_dir):
    proc = subprocess.Popen([*cli(), "view", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    assert line.startswith(f"viewer of {run_dir} on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    url = line.split(" on ")[1].split()[0].rstrip("/")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_the_page_and_its_json_on_loopback_only(viewer, run_dir):
    proc, url = viewer
    port = int(url.rsplit(":", 1)[1])
    assert [(addr, p) for addr, p, _ in listening_sockets(proc.pid)] == [("127.0.0.1", port)]
    status, headers, body = get(url + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    html = body.decode()
    assert '<script src="/static/viewer.js"' in html and "http://" not in html and "https://" not in html
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    for name, kind in (("viewer.js", "text/javascript"), ("viewer.css", "text/css")):
        status, headers, body = get(f"{url}/static/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind) and b"https://" not in body

    status, _, body = get(url + "/api/run")
    run = json.loads(body)
    assert status == 200 and (run["step"], run["total_steps"], run["episode_steps"]) == (2, 4, 1)
    status, _, body = get(url + "/api/series")
    series = json.loads(body)
    assert series["steps"] == [1, 2] and series["reward"]["batch_reward"] == [0.25, 0.5]
    assert series["tool"]["seconds_per_search"] == [0.1, 0.1] and series["skipped"] == {"metrics.jsonl": 1}
    status, _, body = get(url + "/api/episodes?kind=world_single&reward=positive")
    listing = json.loads(body)
    assert listing["total"] == 1 and listing["episodes"][0]["question"] == "<script>alert(1)</script>?"
    status, _, body = get(url + "/api/episode?step=2&index=0")
    assert status == 200 and [t["kind"] for t in json.loads(body)["turns"]] == ["prompt", "model", "answer"]

    # a run writing on: the next request reads the new step
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "batch_reward": 0.9}) + "\n")
    assert json.loads(get(url + "/api/series")[2])["steps"] == [1, 2, 3]


@pytest.mark.parametrize(("path", "status", "message"), [
    ("/api/episodes?limit=abc", 400, "limit='abc' is not an integer"),
    ("/api/episodes?reward=big", 400, "reward='big'"),
    ("/api/episode?step=2", 400, "step and index are required"),
    ("/api/episode?step=2&index=5", 404, "nothing at /api/episode?step=2&index=5"),
    ("/static/runs.py", 404, "no file 'runs.py'"),
    ("/static/..%2fserver.py", 404, "no file"),
    ("/metrics.jsonl", 404, "nothing at /metrics.jsonl"),
])  # fmt: skip
def test_errors_are_json_naming_what_is_wrong(viewer, path, status, message):
    _, url = viewer
    got, headers, body = get(url + path)
    assert got == status and headers["Content-Type"].startswith("application/json")
    assert message in json.loads(body)["error"]


def test_sigterm_stops_it_cleanly(viewer):
    proc, url = viewer
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/api/run", timeout=2)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*cli(), *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_bad_input_is_one_error_line(tmp_path, run_dir):
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    for args, message in (
        ([str(tmp_path / "missing")], "no such folder"),
        ([str(tmp_path / "afile")], "not a folder"),
        ([str(tmp_path / "empty")], "not a run folder (none of config.yaml"),
        ([str(run_dir), "--port", "70000"], "--port 70000: must be between 0 and 65535"),
    ):
        r = run_cli("view", *args)
        assert r.returncode == 2 and r.stdout == "", (args, r)
        assert r.stderr.startswith("error: ") and message in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = run_cli("view", str(run_dir), "--port", str(port))
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    assert r.stderr.strip() == f"error: --port {port}: in use on 127.0.0.1 (give another, or 0 for any free port)"
