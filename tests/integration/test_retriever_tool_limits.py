"""The latency model and the tool limits on the real retrieval server (BM25, loopback, in a thread), and through
``retriever proxy``: calls over a limit wait instead of failing, the counters move, the latency model delays the
answers with its seeded sequence, and a call that hangs becomes the client's timeout (a masked error observation
in an episode) without holding its slot."""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request

import pytest

from actors.search_client import SearchClient
from async_agent_rl.config import RetrieverConfig, SearchClientConfig, ToolLimitsConfig
from async_agent_rl.episode import SearchError
from retriever.latency import LatencySampler
from retriever.server import ServerMetrics, ServerThread, create_proxy_app, start_server_in_thread

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from async_agent_rl.data.corpus import read_corpus
    from retriever.backends import BM25Backend

    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": f"passage {i} about topic{i % 5} river city"}) + "\n"
                            for i in range(40)))
    return BM25Backend.build(read_corpus(path))


def metric(metrics: ServerMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def post(url: str, queries: list[str]) -> int:
    req = urllib.request.Request(url + "/retrieve", data=json.dumps({"queries": queries, "topk": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as r:
        assert len(json.loads(r.read())["result"]) == len(queries)
        return r.status


async def concurrently(url: str, n: int, client: SearchClientConfig | None = None) -> list:
    async with SearchClient(url, client or SearchClientConfig(timeout_s=20, deadline_s=30)) as sc:
        return await asyncio.gather(*(sc.search(f"topic{i % 5} river") for i in range(n)), return_exceptions=True)


def seed_where(n: int, ok) -> int:
    """A seed whose first ``n`` web draws all satisfy ``ok`` (so the test's timings are known in advance)."""
    return next(s for s in range(20000) if all(ok(d) for d in LatencySampler("web", s).sample_many(n)))


def test_over_the_cap_waits_then_answers_and_the_latency_model_delays_in_seeded_order(backend):
    seed = seed_where(4, lambda d: 0.1 < d < 0.4)
    draws = LatencySampler("web", seed).sample_many(4)
    cfg = RetrieverConfig(latency="web", latency_seed=seed, tool_limits=ToolLimitsConfig(max_concurrent=1))
    metrics = ServerMetrics()
    with start_server_in_thread(backend, cfg, metrics) as srv:
        start = time.perf_counter()
        results = asyncio.run(concurrently(srv.url, 4))
        elapsed = time.perf_counter() - start
    assert all(isinstance(r, list) and r for r in results), results  # every one answered: waiting, not failing
    assert elapsed >= sum(draws) - 0.02  # one at a time, each after its delay (without the cap: about max(draws))
    assert metric(metrics, "retriever_tool_limit_waits_total") == 3
    assert metric(metrics, "retriever_tool_limit_wait_seconds_count") == 4
    assert metric(metrics, "retriever_tool_limit_wait_seconds_sum") > min(draws)
    assert metric(metrics, "retriever_added_latency_seconds_count") == 4
    assert metric(metrics, "retriever_added_latency_seconds_sum") == pytest.approx(sum(draws))  # the seeded sequence
    assert metric(metrics, "retriever_tool_inflight") == 0
    assert metric(metrics, "retriever_requests_total", code="200") == 4


def test_rate_limit_spaces_calls_and_a_batched_request_waits_for_its_longest_query(backend):
    cfg = RetrieverConfig(tool_limits=ToolLimitsConfig(rate_per_s=20.0, burst=1))
    metrics = ServerMetrics()
    with start_server_in_thread(backend, cfg, metrics) as srv:
        start = time.perf_counter()
        results = asyncio.run(concurrently(srv.url, 5))
        elapsed = time.perf_counter() - start
    assert all(isinstance(r, list) for r in results)
    assert elapsed >= 0.19  # 5 calls, 1 token each, 20 a second, bucket of 1: at least 4/20 s
    assert metric(metrics, "retriever_tool_limit_waits_total") == 4

    seed = seed_where(3, lambda d: 0.05 < d < 0.6)
    draws = LatencySampler("web", seed).sample_many(3)
    metrics = ServerMetrics()
    with start_server_in_thread(backend, RetrieverConfig(latency="web", latency_seed=seed), metrics) as srv:
        start = time.perf_counter()
        assert post(srv.url, ["topic1", "topic2", "topic3"]) == 200
        elapsed = time.perf_counter() - start
    assert max(draws) - 0.02 <= elapsed < sum(draws) + 0.5
    assert metric(metrics, "retriever_added_latency_seconds_count") == 3


def test_a_hung_call_times_out_at_the_client_and_frees_its_slot_and_the_wait_counts_toward_the_timeout(backend):
    seed = seed_where(1, math.isinf)
    assert not math.isinf(LatencySampler("web", seed).sample_many(3)[2])
    cfg = RetrieverConfig(latency="web", latency_seed=seed, latency_hang_s=30.0,
                          tool_limits=ToolLimitsConfig(max_concurrent=1))
    metrics = ServerMetrics()
    quick = SearchClientConfig(timeout_s=0.5, retries=0, deadline_s=1.0)
    with start_server_in_thread(backend, cfg, metrics) as srv:

        async def main():
            async with SearchClient(srv.url, SearchClientConfig(timeout_s=1.5, retries=0, deadline_s=2.0)) as a, \
                    SearchClient(srv.url, quick) as b:
                hung = asyncio.create_task(a.search("topic1"))  # draw 1: hangs, holds the only slot
                await asyncio.sleep(0.2)
                start = time.perf_counter()
                with pytest.raises(SearchError) as queued:  # draw 2: waits at the cap; that wait is its timeout
                    await b.search("topic2")
                waited = time.perf_counter() - start
                with pytest.raises(SearchError) as timed_out:
                    await hung
                return queued.value, waited, timed_out.value

        queued, waited, timed_out = asyncio.run(main())
        assert queued.kind == "timeout" and timed_out.kind == "timeout"  # the episode's masked error observation
        assert 0.4 < waited < 1.2
        assert metric(metrics, "retriever_simulated_timeouts_total") == 1
        assert metric(metrics, "retriever_tool_limit_waits_total") == 1
        deadline = time.monotonic() + 5
        while metric(metrics, "retriever_errors_total", kind="client_gone") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(metrics, "retriever_errors_total", kind="client_gone") == 2  # both left the server
        assert metric(metrics, "retriever_tool_inflight") == 0
        start = time.perf_counter()
        assert post(srv.url, ["topic3"]) == 200  # the slot is free again, long before latency_hang_s
        assert time.perf_counter() - start < 10


def test_proxy_applies_latency_and_limits_in_front_of_an_existing_server(backend):
    seed = seed_where(3, lambda d: 0.05 < d < 0.3)
    draws = LatencySampler("web", seed).sample_many(3)
    cfg = RetrieverConfig(latency="web", latency_seed=seed, tool_limits=ToolLimitsConfig(max_concurrent=1))
    metrics = ServerMetrics()
    with start_server_in_thread(backend) as upstream:
        proxy = ServerThread(None, cfg, app=lambda: create_proxy_app(upstream.url, cfg, metrics)).start()
        try:
            start = time.perf_counter()
            results = asyncio.run(concurrently(proxy.url, 3))
            elapsed = time.perf_counter() - start
            direct = asyncio.run(concurrently(upstream.url, 1))
        finally:
            proxy.stop()
    assert all(isinstance(r, list) and r for r in results), results
    assert results[0] == direct[0]  # the upstream's answer, unchanged
    assert elapsed >= sum(draws) - 0.02
    assert metric(metrics, "retriever_tool_limit_waits_total") == 2
    assert metric(metrics, "retriever_added_latency_seconds_sum") == pytest.approx(sum(draws))
