"""Nothing stalls in silence: a rollout worker whose background push fails, or whose report of a lost episode fails,
stops and says why, instead of generating on forever with nowhere to put its episodes (the flush task used to die alone,
its exception seen only at ``stop()``, which a training run never reaches; an episode task's error ended in
``gather(return_exceptions=True)``). The RolloutActor shell is checked too: ``stats().done`` and ``error()`` are what
the driver's supervision reads (tests/integration/test_supervision.py has the driver's reaction)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from actors.rollout_worker import RolloutFailure, RolloutWorker
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.records import Trajectory
from tests.helpers import run_actor_shell_until_done, traj

pytestmark = pytest.mark.unit

EXAMPLES = [QAExample(id=f"q{i}", question="q", gold_answers=["x"]) for i in range(4)]


def forever():
    while True:
        yield from EXAMPLES


class QuickRunner:
    """Every episode takes 5 ms and succeeds (or fails, with ``fail=True``)."""

    def __init__(self, fail: bool = False):
        self.engine = SimpleNamespace(version=0)
        self.fail = fail
        self.episodes = 0

    async def run(self, ex, group_id="", trajectory_id="", seed=None):
        self.episodes += 1
        await asyncio.sleep(0.005)
        if self.fail:
            raise RuntimeError("engine core died")
        return Trajectory.decode(traj(group_id, self.episodes))


async def broken_sink(batch):
    raise ConnectionError("buffer actor unreachable")


def worker(runner, sink=broken_sink, **kw) -> RolloutWorker:
    return RolloutWorker(runner, forever(), sink, group_size=2, max_concurrent=4, push_batch_size=2, seed=None,
                         actor_id="actor7", **kw)


def test_a_failing_push_stops_the_worker_with_the_error():
    runner = QuickRunner()

    async def go():
        return await asyncio.wait_for(worker(runner).run(), timeout=10)

    with pytest.raises(RolloutFailure) as info:  # was: asyncio.TimeoutError, the worker generating on
        asyncio.run(go())
    msg = str(info.value)
    assert "actor7" in msg and "pushing finished episodes failed" in msg and "buffer actor unreachable" in msg
    assert isinstance(info.value.__cause__, ConnectionError)
    assert runner.episodes < 40, "it stopped at once, not after many more episodes"


def test_a_failing_report_of_a_lost_episode_stops_the_worker():
    async def on_lost(group_ids):
        raise ConnectionError("buffer actor unreachable")

    async def sink(batch):
        pass

    async def go():
        return await asyncio.wait_for(worker(QuickRunner(fail=True), sink, on_lost=on_lost).run(), timeout=10)

    with pytest.raises(RolloutFailure, match="an episode task .* failed: ConnectionError: buffer actor unreachable"):
        asyncio.run(go())


def test_a_worker_that_does_not_fail_runs_until_stopped():
    pushed = []

    async def sink(batch):
        pushed.extend(batch)

    async def go():
        w = worker(QuickRunner(), sink)
        task = asyncio.create_task(w.run())
        await asyncio.sleep(0.3)
        assert not task.done()
        w.stop()
        return await asyncio.wait_for(task, timeout=10)

    stats = asyncio.run(go())
    assert stats.finished == stats.pushed == len(pushed) > 0 and stats.failed == 0


def test_the_actor_reports_done_and_the_cause():
    """The Ray shell without Ray: what ``supervise()`` reads after the worker failed."""

    stats, error = asyncio.run(run_actor_shell_until_done(worker(QuickRunner()), index=7))
    assert stats.done and stats.ready
    assert error.startswith("RolloutFailure: rollout worker actor7: pushing finished episodes failed: ConnectionError")


class DeadEngineRunner(QuickRunner):
    """A killed engine core: every episode fails at once; ``healthy_first`` episodes succeed before it dies."""

    def __init__(self, healthy_first: int = 0):
        super().__init__()
        self.healthy_first = healthy_first

    async def run(self, ex, group_id="", trajectory_id="", seed=None):
        self.episodes += 1
        if self.episodes > self.healthy_first:
            raise RuntimeError("EngineCore died unexpectedly")
        await asyncio.sleep(0.005)
        return Trajectory.decode(traj(group_id, self.episodes))


async def keep(batch):
    pass


def test_a_dead_engine_stops_the_worker_after_a_run_of_failures_not_one_episode_at_a_time():
    """Until 9dcc61e (2026-11-26), with its engine core killed, a worker failed 424,424 episodes in a tight loop (each
    failed at once, its group dropped, its admission slot granted again) and never stopped, so supervision never
    restarted it. Now a run of ``failures_in_a_row_limit`` failures with no finished episode between them stops it with
    the cause."""
    runner = DeadEngineRunner(healthy_first=3)
    w = worker(runner, sink=keep)

    async def go():
        return await asyncio.wait_for(w.run(), timeout=10)

    with pytest.raises(RolloutFailure) as info:
        asyncio.run(go())
    msg = str(info.value)
    assert "actor7: the engine failed: EngineFailing: 8 episodes failed in a row, the last with RuntimeError: " \
           "EngineCore died unexpectedly" in msg, msg
    assert runner.episodes < 40 and w.stats.failed >= 8, "it stopped at once, not after many more episodes"


def test_failures_between_finished_episodes_never_stop_the_worker():
    class EveryOtherFails(QuickRunner):
        async def run(self, ex, group_id="", trajectory_id="", seed=None):
            self.episodes += 1
            n = self.episodes
            await asyncio.sleep(0.001)
            if n % 2:
                raise RuntimeError("one bad prompt")
            return Trajectory.decode(traj(group_id, n))

    runner = EveryOtherFails()
    w = worker(runner, sink=keep)

    async def go():
        task = asyncio.create_task(w.run())
        while runner.episodes < 200:
            await asyncio.sleep(0.01)
        w.stop()
        return await asyncio.wait_for(task, timeout=10)

    stats = asyncio.run(go())
    assert stats.failed >= 90 and w.failure is None
