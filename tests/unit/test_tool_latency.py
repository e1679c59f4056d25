"""The tool-latency models (``retriever/latency.py``): seeded, near their targets, one table for the server and the
benchmark; the config keys and CLI flags that carry them to the server the driver spawns; bad input as one error
line."""

from __future__ import annotations

import asyncio
import math
import os
import random
import socket
import statistics
import typing

import pytest

from async_agent_rl.config import RetrieverConfig, ToolLimitsConfig
from retriever import cli
from retriever.latency import LATENCY_MODELS, LatencySampler, latency_model
from retriever.server import slow_tool_args, spawn_server

pytestmark = pytest.mark.unit

N = 20000


def test_same_seed_same_sequence_other_seed_other_sequence():
    a = LatencySampler("web", seed=7).sample_many(500)
    assert a == LatencySampler("web", seed=7).sample_many(500)
    assert a != LatencySampler("web", seed=8).sample_many(500)
    assert LatencySampler("local", 3).sample_many(50) == LatencySampler("local", 3).sample_many(50)


def test_none_adds_nothing():
    assert set(LatencySampler("none", 0).sample_many(100)) == {0.0}
    assert LATENCY_MODELS["none"].is_none


def test_web_is_long_tailed_near_its_targets_with_two_percent_hangs():
    draws = LatencySampler("web", seed=0).sample_many(N)
    hangs = sum(math.isinf(d) for d in draws)
    assert 0.015 < hangs / N < 0.025
    finite = sorted(d for d in draws if not math.isinf(d))
    median, p99 = finite[len(finite) // 2], finite[int(0.99 * len(finite))]
    assert 0.45 < median < 0.55  # about half a second
    assert 2.5 < p99 < 4.5  # several seconds
    assert max(finite) <= 8.0
    assert LATENCY_MODELS["web"].quantile(0.5) == pytest.approx(0.5)
    assert p99 == pytest.approx(LATENCY_MODELS["web"].quantile(0.99), rel=0.15)


def test_local_is_fast_and_draws_as_the_benchmark_always_did():
    draws = LatencySampler("local", seed=0).sample_many(N)
    assert not any(math.isinf(d) for d in draws)
    assert 0.018 < statistics.median(draws) < 0.022 and max(draws) <= 0.5
    rng = random.Random(0)  # the benchmark's own formula before the shared table: same sequence
    assert draws[:200] == [min(0.5, rng.lognormvariate(math.log(0.02), 0.5)) for _ in range(200)]


@pytest.fixture
def bench():
    """``benchmarks/rollout_bench.py``, imported without keeping the vLLM settings it puts in the environment."""
    saved = dict(os.environ)
    import benchmarks.rollout_bench as module

    os.environ.clear()
    os.environ.update(saved)
    return module


def test_one_table_for_config_server_and_benchmark(bench):
    assert list(typing.get_args(RetrieverConfig.model_fields["latency"].annotation)) == list(LATENCY_MODELS)
    assert bench.LATENCY_MODELS is LATENCY_MODELS
    with pytest.raises(ValueError, match="unknown latency model 'slow'"):
        latency_model("slow")


def test_benchmark_harness_draws_the_shared_sequence_and_turns_a_hang_into_the_client_timeout(bench, monkeypatch):
    class Inner:
        async def search(self, query):
            return [query]

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(seconds):
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    seed = next(s for s in range(5000) if math.isinf(LatencySampler("web", s).sample()))
    harness = bench.LatencySearch(Inner(), LATENCY_MODELS["web"], seed, hang_s=0.01)
    assert asyncio.run(harness.search("q")) == ["q"]
    assert slept == [0.01] and harness.delays == [0.01]
    harness = bench.LatencySearch(Inner(), LATENCY_MODELS["local"], 5)
    for _ in range(20):
        asyncio.run(harness.search("q"))
    assert harness.delays == LatencySampler("local", 5).sample_many(20)


# ----------------------------------------------------------------------------------------- config and the CLI
def _parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["retriever", *argv])


def test_spawn_server_passes_latency_and_limits_and_serve_reads_them_back(monkeypatch):
    cfg = RetrieverConfig(latency="web", latency_seed=11, latency_hang_s=9.5,
                          tool_limits=ToolLimitsConfig(max_concurrent=4, rate_per_s=2.5, burst=3))
    captured: dict = {}

    class Fake:
        def __init__(self, argv, timeout_s, log_file):
            captured["argv"] = argv

    monkeypatch.setattr("retriever.server.ServerProcess", Fake)
    spawn_server("corpus.jsonl", cfg)
    argv = captured["argv"]
    assert all(flag in argv for flag in slow_tool_args(cfg))
    back = cli._config_from_args(_parse(argv[argv.index("serve"):]))
    assert (back.latency, back.latency_seed, back.latency_hang_s) == ("web", 11, 9.5)
    assert back.tool_limits == cfg.tool_limits


def test_defaults_are_off():
    cfg = RetrieverConfig()
    assert cfg.latency == "none" and cfg.tool_limits.max_concurrent == 0 and cfg.tool_limits.rate_per_s == 0


def test_url_with_latency_or_limits_points_to_the_proxy():
    with pytest.raises(ValueError, match="retriever proxy"):
        RetrieverConfig(url="http://127.0.0.1:8000", latency="web")
    with pytest.raises(ValueError, match="retriever proxy"):
        RetrieverConfig(url="http://127.0.0.1:8000", tool_limits=ToolLimitsConfig(max_concurrent=2))
    RetrieverConfig(url="http://127.0.0.1:8000")


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("argv, name", [
    (["serve", "--corpus", "none.jsonl", "--latency", "slow"], "--latency"),
    (["serve", "--corpus", "none.jsonl", "--rate-per-s", "-1"], "--rate-per-s"),
    (["serve", "--corpus", "none.jsonl", "--max-concurrent", "-2"], "--max-concurrent"),
    (["proxy", "--upstream", "http://127.0.0.1:PORT", "--burst", "-1"], "--burst"),
    (["proxy", "--upstream", "http://127.0.0.1:PORT"], "not reachable"),
    (["proxy", "--upstream", "ftp://x"], "--upstream"),
])
def test_bad_input_is_one_error_line(argv, name, capsys):
    argv = [a.replace("PORT", str(_closed_port())) for a in argv]
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert name in lines[0]
