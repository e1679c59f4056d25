"""Benchmarks remove the temporary folders they make, on every exit path."""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """``tempfile`` makes its folders in ``tmp_path``, so what a benchmark leaves behind is visible there."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_sft_bench_loads_an_older_loop_and_keeps_no_copy_of_it(own_tmp):
    from benchmarks.sft_bench import load_before

    module = load_before("HEAD")
    assert callable(module.pretrain_on_texts) and callable(module.train_on_batches)
    assert list(own_tmp.iterdir()) == []


@pytest.fixture
def rollout_bench():
    saved = dict(os.environ)  # the module sets vLLM's environment on import
    import benchmarks.rollout_bench as module

    os.environ.clear()
    os.environ.update(saved)
    return module


@pytest.mark.parametrize("fails", [False, True])
def test_rollout_bench_without_work_removes_its_folder(rollout_bench, own_tmp, monkeypatch, fails):
    seen = []

    async def run(args, work):
        (work / "model").mkdir()  # what the benchmark writes there: world, model, warm start
        seen.append(work)
        if fails:
            raise RuntimeError("engine died")
        return {"ok": True}

    monkeypatch.setattr(rollout_bench, "run", run)
    args = argparse.Namespace(work=None)
    if fails:
        with pytest.raises(RuntimeError):
            asyncio.run(rollout_bench.main(args))
    else:
        assert asyncio.run(rollout_bench.main(args)) == {"ok": True}
    assert seen and seen[0].parent == own_tmp and not seen[0].exists()
    assert list(own_tmp.iterdir()) == []


def test_rollout_bench_keeps_a_given_work_folder(rollout_bench, tmp_path, monkeypatch):
    async def run(args, work):
        (work / "model").mkdir(parents=True)
        return {}

    monkeypatch.setattr(rollout_bench, "run", run)
    asyncio.run(rollout_bench.main(argparse.Namespace(work=str(tmp_path / "w"))))
    assert (tmp_path / "w" / "model").is_dir()
