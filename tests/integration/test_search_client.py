"""SearchClient against real loopback servers: the retrieval server, a flaky one, broken ones and a dead port."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from actors.search_client import SearchClient, SearchError, parse_reply, retrieve_url
from async_agent_rl.config import RetrieverConfig, SearchClientConfig
from async_agent_rl.data.corpus import import_wiki_offline, read_corpus
from retriever.backends import BM25Backend
from retriever.server import start_server_in_thread

pytestmark = pytest.mark.integration

FAST = SearchClientConfig(timeout_s=1.0, retries=3, backoff_base_s=0.01, backoff_max_s=0.05, deadline_s=5.0)


@pytest.fixture(scope="module")
def passages(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    import_wiki_offline(path, limit=300)
    return read_corpus(path)


@pytest.fixture(scope="module")
def retriever(passages):
    with start_server_in_thread(BM25Backend.build(passages), RetrieverConfig()) as srv:
        yield srv


def title(p) -> str:
    return p.title.strip('"')


class LoopbackApp:
    """A real aiohttp server on 127.0.0.1 with a free port, for one test; ``url`` once started.

    ``release`` (an event the handler waits on) is set on exit so that hanging handlers end with the test.
    """

    def __init__(self, handler, release: asyncio.Event | None = None):
        self.app = web.Application()
        self.app.router.add_post("/retrieve", handler)
        self.runner = web.AppRunner(self.app)
        self.release = release

    async def __aenter__(self) -> "LoopbackApp":
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        if self.release is not None:
            self.release.set()
        await self.runner.cleanup()


def reply_for(body: dict, hits: list[dict]) -> dict:
    return {"result": [hits for _ in body["queries"]]}


# ----------------------------------------------------------------------------------------------- happy path
async def test_search_returns_the_servers_hits_best_first(retriever, passages):
    async with SearchClient(retriever.url, FAST) as client:
        hits = await client.search(f"{title(passages[7])} history")
        many = await client.search_many([title(passages[1]), "zzqx nothing", title(passages[2])], topk=5)
        counters = client.counters()
    assert len(hits) == 3 and hits[0].id == passages[7].id and hits[0].contents == passages[7].contents
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert [row[0].id if row else None for row in many] == [passages[1].id, None, passages[2].id]
    assert len(many[0]) == 5
    assert counters["requests"] == counters["attempts"] == 2 and counters["failures"] == counters["retries"] == 0


async def test_full_retrieve_url_and_base_url_are_both_accepted(retriever):
    assert retrieve_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/retrieve"
    assert retrieve_url("http://127.0.0.1:8000/retrieve") == "http://127.0.0.1:8000/retrieve"
    with pytest.raises(ValueError):
        retrieve_url("127.0.0.1:8000")
    async with SearchClient(f"{retriever.url}/retrieve", FAST) as client:
        assert await client.search("music")


async def test_many_concurrent_searches_share_a_bounded_pool():
    in_flight = peak = 0

    async def handler(request: web.Request) -> web.Response:
        nonlocal in_flight, peak
        body = await request.json()
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return web.json_response(reply_for(body, [{"document": {"id": "1", "contents": '"T"\nx'}, "score": 1.0}]))

    async with LoopbackApp(handler) as server:
        async with SearchClient(server.url, FAST.model_copy(update={"pool_size": 4})) as client:
            results = await asyncio.gather(*(client.search(f"q{i}") for i in range(40)))
    assert all(r[0].id == "1" for r in results)
    assert 1 < peak <= 4  # 40 searches at once, never more than the pool's 4 connections


# ------------------------------------------------------------------------------------------------- failures
async def test_a_server_that_fails_then_recovers_is_invisible_to_the_caller(retriever, passages):
    """500, a dropped connection and a reply too slow for the timeout, then the real retriever answers."""
    failures = iter(["500", "drop", "slow"])
    seen = 0
    release = asyncio.Event()

    async def flaky(request: web.Request) -> web.StreamResponse:
        nonlocal seen
        seen += 1
        body = await request.read()
        mode = next(failures, "ok")
        if mode == "500":
            return web.json_response({"error": "warming up"}, status=500)
        if mode == "drop":
            request.transport.close()
            return web.Response()
        if mode == "slow":
            await release.wait()  # longer than the client's per-attempt timeout
        async with upstream.post(f"{retriever.url}/retrieve", data=body) as resp:
            return web.Response(body=await resp.read(), content_type="application/json")

    async with aiohttp.ClientSession() as upstream, LoopbackApp(flaky, release) as server:
        cfg = FAST.model_copy(update={"timeout_s": 0.3})
        async with SearchClient(server.url, cfg, rng=random.Random(0)) as client:
            hits = await client.search(title(passages[4]))
            counters = client.counters()
    assert hits[0].id == passages[4].id
    assert seen == 4
    assert counters["retries"] == 3 and counters["failures"] == 0
    assert counters["errors_http_status"] == counters["errors_connection"] == counters["errors_timeout"] == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_dead_server_gives_a_typed_error_within_the_deadline():
    cfg = SearchClientConfig(timeout_s=0.5, retries=1000, backoff_base_s=0.02, backoff_max_s=0.1, deadline_s=1.0)
    async with SearchClient(f"http://127.0.0.1:{free_port()}", cfg) as client:
        start = time.perf_counter()
        with pytest.raises(SearchError) as e:
            await client.search("anything")
        elapsed = time.perf_counter() - start
        counters = client.counters()
    assert e.value.kind == "connection" and e.value.attempts > 1
    assert elapsed < cfg.deadline_s + 0.5
    assert counters["failures"] == 1 and counters["retries"] == e.value.attempts - 1


async def test_a_server_that_never_answers_times_out_within_the_deadline():
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response()

    async with LoopbackApp(hang, release) as server:
        cfg = SearchClientConfig(timeout_s=0.3, retries=10, backoff_base_s=0.01, backoff_max_s=0.02, deadline_s=0.8)
        async with SearchClient(server.url, cfg) as client:
            start = time.perf_counter()
            with pytest.raises(SearchError) as e:
                await client.search("anything")
            elapsed = time.perf_counter() - start
    assert e.value.kind == "timeout"
    assert elapsed < cfg.deadline_s + 0.5


async def test_client_errors_are_not_retried():
    async def bad_request(request: web.Request) -> web.Response:
        return web.json_response({"error": "'topk' 500 exceeds the limit of 100"}, status=400)

    async with LoopbackApp(bad_request) as server:
        async with SearchClient(server.url, FAST) as client:
            with pytest.raises(SearchError) as e:
                await client.search("q", topk=500)
    assert e.value.kind == "http_status" and e.value.status == 400 and e.value.attempts == 1
    assert "exceeds the limit" in str(e.value)


MALFORMED = [
    ({"results": []}, "expected a JSON object with 'result'"),
    ({"result": []}, "one list per query (1), got 0 lists"),
    ({"result": [{"document": {}}]}, "result[0] must be a list"),
    ({"result": [[{"id": "1", "contents": "x"}]]}, "result[0][0] must be {'document'"),
    ({"result": [[{"document": {"id": "1"}, "score": 1.0}]]}, "result[0][0].document.contents must be a string"),
    ({"result": [[{"document": {"id": [1], "contents": "x"}, "score": 1.0}]]}, "document.id must be a string"),
    ({"result": [[{"document": {"id": "1", "contents": "x"}, "score": "high"}]]}, "score must be a finite number"),
]


@pytest.mark.parametrize("payload,problem", MALFORMED)
async def test_malformed_replies_are_bad_reply_errors_naming_the_problem(payload, problem):
    calls = 0

    async def broken(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.json_response(payload)

    async with LoopbackApp(broken) as server:
        async with SearchClient(server.url, FAST) as client:
            with pytest.raises(SearchError) as e:
                await client.search("q")
    assert e.value.kind == "bad_reply" and problem in e.value.message
    assert calls == 1  # a reply in the wrong shape is not asked for again


async def test_a_reply_that_is_not_json_is_retried_then_reported():
    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text="<html>proxy error</html>", content_type="text/html")

    async with LoopbackApp(garbage) as server:
        async with SearchClient(server.url, FAST) as client:
            with pytest.raises(SearchError) as e:
                await client.search("q")
    assert e.value.kind == "bad_reply" and e.value.attempts == FAST.retries + 1 and "not JSON" in e.value.message


def test_documents_without_id_are_accepted():
    # Search-R1's pyserini BM25 server returns title/text/contents and no id.
    reply = {"result": [[{"document": {"title": "T", "text": "x", "contents": '"T"\nx'}, "score": 2}]]}
    (hit,) = parse_reply(json.loads(json.dumps(reply)), 1)[0]
    assert (hit.id, hit.title, hit.text, hit.score) == ("", '"T"', "x", 2.0)
