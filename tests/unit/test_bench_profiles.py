"""The profiling helpers of ``benchmarks/weight_sync_bench.py --phases`` and ``benchmarks/rollout_bench.py --profile``:
profile lines keep no machine path, phases add up, the memory search never calls the retriever, the timed tokenizer
answers as the tokenizer does."""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def rollout():
    """``benchmarks/rollout_bench.py``, imported without keeping the vLLM settings it puts in the environment."""
    saved = dict(os.environ)
    import benchmarks.rollout_bench as module

    os.environ.clear()
    os.environ.update(saved)
    return module


@pytest.fixture
def wsync():
    import benchmarks.weight_sync_bench as module

    return module


LINES = """   Ordered by: internal time
   List reduced from 900 to 3 due to restriction <3>

   ncalls  tottime  percall  cumtime  percall filename:lineno(function)
       24    0.300    0.012    0.300    0.012 /srv/x/.venv/lib/python3.11/site-packages/vllm/_custom_ops.py:10(create_onednn_mm)
        1    0.010    0.010    0.500    0.500 /home/someone/repo/actors/vllm_worker.py:61(refresh_derived_weights)
      100    0.001    0.000    0.001    0.000 {method 'copy_' of 'torch._C.TensorBase' objects}
        3    0.000    0.000    0.000    0.000 /usr/lib/python3.11/asyncio/events.py:80(_run)
"""


@pytest.mark.parametrize("which", ["wsync", "rollout"])
def test_profile_lines_keep_the_package_path_and_no_machine_path(which, request):
    lines = request.getfixturevalue(which).trim_profile(LINES)
    assert lines[0].split() == ["ncalls", "tottime", "percall", "cumtime", "percall", "filename:lineno(function)"]
    assert lines[1].endswith(" vllm/_custom_ops.py:10(create_onednn_mm)")
    assert lines[2].endswith(" actors/vllm_worker.py:61(refresh_derived_weights)")
    assert lines[3].endswith("{method 'copy_' of 'torch._C.TensorBase' objects}")
    assert lines[4].endswith(" asyncio/events.py:80(_run)")
    assert len(lines) == 5 and not any(s in line for line in lines for s in ("/srv", "/home", "/usr", "Ordered"))


def test_phases_add_up_and_the_row_names_the_rpc_overhead(wsync):
    phases: dict[str, float] = {}
    t = wsync.lap(phases, "a", 0.0)
    wsync.lap(phases, "a", t - 1.0)  # a second lap of the same phase adds to it
    assert phases["a"] == pytest.approx(t + 1.0, abs=0.01)
    worker = {"worker: receive": 0.2, "worker: vLLM reload_weights": 0.5, "repacked": 3, "profiled_s": {"x": 1.0}}
    row = wsync.finish_row({"learner": 0.1}, {"engine: worker call (total)": 1.0, "worker": worker}, 1.5)
    assert row["phases"]["worker: RPC into the engine core process"] == pytest.approx(0.3)
    assert row["phases"]["total"] == 1.5 and row["repacked"] == 3 and row["profiled_s"] == {"x": 1.0}
    assert "repacked" not in row["phases"] and "worker" not in row["phases"]


def test_memory_search_answers_without_the_retriever(rollout):
    class Retriever:
        calls = 0

        async def search(self, query):
            Retriever.calls += 1
            return [f"hit for {query}"]

    clock = rollout.Clock()
    timed = rollout.TimedSearch(Retriever(), clock)
    asyncio.run(timed.search("a"))
    asyncio.run(timed.search("b"))
    assert clock.calls["search"] == 2 and Retriever.calls == 2
    memory = rollout.MemorySearch(timed.memory)
    assert asyncio.run(memory.search("b")) == ["hit for b"]
    assert asyncio.run(memory.search("never asked")) in (["hit for a"], ["hit for b"])
    assert Retriever.calls == 2


def test_timed_tokenizer_answers_as_the_tokenizer_and_counts_each_method(rollout):
    class Tok:
        eos_token_id = 7

        def encode(self, text, add_special_tokens=True):
            return [len(text), int(add_special_tokens)]

        def decode(self, ids, skip_special_tokens=False):
            return "-".join(map(str, ids))

        def __len__(self):
            return 100

    clock = rollout.Clock()
    tok = rollout.TimedTokenizer(Tok(), clock)
    assert tok.encode("abc", add_special_tokens=False) == [3, 0]
    assert tok.decode([1, 2]) == "1-2" and tok.eos_token_id == 7 and len(tok) == 100
    tok.encode("x")
    assert dict(clock.calls) == {"tokenizer.encode": 2, "tokenizer.decode": 1}
    assert all(v >= 0 for v in clock.seconds.values())


def test_cpu_delta_by_process(rollout):
    assert rollout.cpu_delta({"main": 1.0}, {"main": 3.5, "retriever server": 0.25}) == {
        "main": 2.5, "retriever server": 0.25}
    now = rollout.cpu_seconds()
    assert now["main process (episodes, vLLM front end)"] > 0


def test_finite_by_sum_raises_as_require_finite_does(wsync):
    import numpy as np
    import torch

    from learner.learner import NonFiniteError

    good = {"a": np.ones((3, 4), np.float32), "b": torch.zeros(5)}
    wsync.finite_by_sum(7, "parameters", iter(good.items()))
    # finite elements whose float32 sum overflows: the sum is infinite, the elementwise check clears them
    wsync.finite_by_sum(7, "parameters", iter({"big": np.full(4, 3e38, np.float32)}.items()))
    for bad in (np.nan, np.inf, -np.inf):
        values = {"a": np.ones(4, np.float32), "w": np.array([1.0, bad, 2.0], np.float32), "c": torch.ones(2)}
        with pytest.raises(NonFiniteError, match=r"learner step 7: non-finite parameters: w;"):
            wsync.finite_by_sum(7, "parameters", iter(values.items()))
    both = {"x": np.array([np.inf, -np.inf], np.float32), "y": torch.tensor([float("nan")])}
    with pytest.raises(NonFiniteError, match=r"non-finite parameters: x, y;"):
        wsync.finite_by_sum(7, "parameters", iter(both.items()))
