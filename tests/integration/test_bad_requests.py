"""Bad inputs to the retrieval server (bad requests, a port in use), over real loopback HTTP: deeply nested JSON is a
400 (not a backend failure), and a client that hangs up in the middle of its body is counted as gone (not a backend
error). ``retriever serve`` on a port that is in use: tests/integration/test_retriever_processes.py (slow tier)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from async_agent_rl.config import RetrieverConfig
from async_agent_rl.data.corpus import Passage, write_corpus
from retriever.backends import BM25Backend
from retriever.server import ServerMetrics, start_server_in_thread

pytestmark = pytest.mark.integration

PASSAGES = [Passage(id=str(i), contents=f'"Title {i}"\nword{i} text about thing {i}') for i in range(20)]


def post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def errors(metrics: ServerMetrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("retriever_errors_total{"):
            out[line.split('kind="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def server():
    metrics = ServerMetrics()
    with start_server_in_thread(BM25Backend.build(PASSAGES), RetrieverConfig(batch_window_ms=0), metrics) as srv:
        yield srv, metrics


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"queries": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"queries": ["a"], "x": ' + b'{"a": ' * 30_000 + b"1" + b"}" * 30_001,
], ids=["array", "queries", "object"])  # fmt: skip
def test_deeply_nested_json_is_a_400_and_not_a_backend_failure(server, body):
    srv, metrics = server
    status, reply = post(f"{srv.url}/retrieve", body)
    assert status == 400, reply
    assert "nested too deeply" in reply["error"]
    assert errors(metrics).get("backend", 0) == 0
    status, reply = post(f"{srv.url}/retrieve", json.dumps({"queries": ["word3"], "topk": 1}).encode())
    assert status == 200 and reply["result"][0][0]["id"] == "3"  # still serving


def test_a_client_that_hangs_up_mid_body_is_not_a_backend_error(server, caplog):
    srv, metrics = server
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    gone_before = errors(metrics).get("client_gone", 0)
    for _ in range(3):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 5000\r\n\r\n" + b'{"queries": ["wor')  # fmt: skip
        time.sleep(0.1)
        s.close()
    deadline = time.monotonic() + 5
    while errors(metrics).get("client_gone", 0) < gone_before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert errors(metrics).get("client_gone", 0) == gone_before + 3
    assert errors(metrics).get("backend", 0) == 0
    assert "Traceback" not in caplog.text and "retrieve failed" not in caplog.text


def test_malformed_requests_are_a_few_log_lines_without_tracebacks(server, caplog):
    """A flood of malformed HTTP (a bad Content-Length, a header line too long) gets a 400 each and, in the log,
    one line for the first of a kind and counted repeats; before, aiohttp logged a traceback per request."""
    srv, _ = server
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    bad = [b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
           b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n"]
    caplog.set_level("DEBUG", logger="aiohttp.server")
    for payload in bad:
        for _ in range(12):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(payload)
                s.settimeout(5)
                assert s.recv(100).split(b" ")[1] == b"400", payload[:40]
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert "Traceback" not in caplog.text and all(r.exc_info is None for r in records), caplog.text
    # per kind: the 1st and the 10th of 12
    assert sorted((r.getMessage().split("refused (")[1].split(":")[0], r.getMessage().rsplit("; ", 1)[1])
                  for r in records) == [("BadHttpMessage", "1 such request(s) so far"),
                                        ("BadHttpMessage", "10 such request(s) so far"),
                                        ("LineTooLong", "1 such request(s) so far"),
                                        ("LineTooLong", "10 such request(s) so far")], caplog.text
    status, reply = post(f"{srv.url}/retrieve", json.dumps({"queries": ["word3"], "topk": 1}).encode())
    assert status == 200  # still serving


def test_a_retriever_child_that_refuses_its_corpus_is_one_input_error(tmp_path: Path):
    """What ``train`` and ``eval`` see when the retrieval server they start refuses the corpus: the child's own
    error line, raised as an InputError (the CLI prints it once), not "exited with code 2"."""
    from async_agent_rl.errors import InputError
    from retriever.server import spawn_server

    corpus = tmp_path / "dup.jsonl"
    write_corpus(corpus, [*PASSAGES[:3], Passage(id="1", contents='"Again"\nsame id')])
    with pytest.raises(InputError, match=r"retrieval server: .*dup.jsonl:4: .*duplicate passage id '1'"):
        spawn_server(corpus)
