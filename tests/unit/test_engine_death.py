"""An engine death is one fault: a rollout worker whose engine says it is dead (vLLM's ``EngineDeadError``, its
engine core process gone) stops at its first failed episode, not after ``failures_in_a_row_limit`` of them (64 for the
quickstart), and the cause names the death."""

from __future__ import annotations

import asyncio

import pytest

from actors.rollout_worker import RolloutFailure, engine_dead
from tests.unit.test_rollout_failures import DeadEngineRunner, keep, worker

pytestmark = pytest.mark.unit


def test_an_engine_that_says_it_is_dead_stops_the_worker_at_its_first_failed_episode():
    """vLLM fails every request with ``EngineDeadError`` once its engine core process is gone. The worker used to go
    on to ``failures_in_a_row_limit`` failures (64 for the quickstart: a killed engine core cost 64 lost episodes and
    as many error lines before the restart); now that error stops it at the first, with the cause."""
    from vllm.v1.engine.exceptions import EngineDeadError

    class DeadEngine(DeadEngineRunner):
        async def run(self, ex, group_id="", trajectory_id="", seed=None):
            try:
                return await super().run(ex, group_id, trajectory_id, seed)
            except RuntimeError as e:
                raise EngineDeadError() from e

    runner = DeadEngine(healthy_first=3)
    w = worker(runner, sink=keep)

    async def go():
        return await asyncio.wait_for(w.run(), timeout=10)

    with pytest.raises(RolloutFailure) as info:
        asyncio.run(go())
    msg = str(info.value)
    assert "actor7: the engine failed: EngineFailing: its engine died (EngineDeadError: " in msg, msg
    assert w.stats.failed < 8, f"{w.stats.failed} episodes failed before it stopped: not at the first"


def test_an_error_raised_from_an_engine_death_counts_as_one():
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        try:
            raise EngineDeadError()
        except EngineDeadError as e:
            raise RuntimeError("episode failed") from e
    except RuntimeError as e:
        assert engine_dead(e)
    assert not engine_dead(RuntimeError("EngineCore died unexpectedly"))
