"""A full replay buffer never stalls a run: the rollout actor's own push path, without Ray.

The model in ``test_staleness.py`` found it: with ``buffer.capacity_trajectories`` below what admission lets run
(``(eta + 1) x`` a batch), a new group's first member refused for room held back, in the actor's in-order pushes,
the member that would complete the group the buffer already held; no batch ever formed. Here the real pieces run it:
``RolloutWorker``'s outbox, ``RolloutActor._push`` (the sink a training run uses) and ``_admit``, and the real
``BufferActor`` with its ``sample_batch``, behind a stand-in for the Ray handle.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from actors.rollout_actor import RolloutActor
from actors.rollout_worker import RolloutWorker
from async_agent_rl.config import BufferConfig
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.records import Trajectory
from buffer.actor import BufferActor
from tests.helpers import LONGEST, traj

pytestmark = pytest.mark.unit


class InProcessHandle:
    """``handle.method.remote(...)`` as an awaitable call of ``obj.method`` in this event loop (an async Ray
    actor's calls, without Ray)."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        method = getattr(self.obj, name)

        async def remote(*args, **kwargs):
            result = method(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return SimpleNamespace(remote=remote)


class OrderedRunner:
    """Episodes of the first two groups (X, Y) finish as X/0, Y/0, X/1, Y/1, whatever order they start in."""

    DELAY = {(0, 0): 0.01, (1, 0): 0.05, (0, 1): 0.15, (1, 1): 0.25}

    def __init__(self):
        self.engine = SimpleNamespace(version=0)
        self.groups: list[str] = []
        self.members: Counter[str] = Counter()

    async def run(self, ex, group_id="", trajectory_id="", seed=None):
        if group_id not in self.groups:
            self.groups.append(group_id)
        g, m = self.groups.index(group_id), self.members[group_id]
        self.members[group_id] += 1
        await asyncio.sleep(self.DELAY.get((g, m), 0.01))
        return Trajectory.decode(traj(group_id, m))


def test_a_full_buffer_never_stalls_a_rollout_actors_pushes():
    """eta 1, groups of 2, batch 2 (one group), buffer room for 2 trajectories (one batch, the least a config
    allows), one actor: admission lets groups X and Y run. X/0 is taken, Y/0 is refused (no room for a new group next
    to X), X/1 finishes next. Before, the actor's push of Y/0 waited for room, resending it alone, with X/1 queued
    behind it: the learner never got a batch (this test timed out). Now Y/0 is held and sent again with X/1, the
    buffer takes X/1, the learner takes X, and Y follows."""
    buffer = BufferActor(BufferConfig(max_staleness=1, capacity_trajectories=2), group_size=2,
                         consumed_per_version=2, max_concurrent=4, batch_size=2, max_trajectory_tokens=LONGEST)
    actor = RolloutActor.__new__(RolloutActor)  # the shell's push and admission, without an engine
    actor.buffer, actor.actor_id = InProcessHandle(buffer), "actor0"
    actor.cfg = SimpleNamespace(cluster=SimpleNamespace(actor_timeout_s=5.0))
    runner = OrderedRunner()
    w = RolloutWorker(runner, iter([QAExample(id="q", question="q", gold_answers=["x"])] * 100), actor._push,
                      group_size=2, max_concurrent=4, push_batch_size=1, admit=actor._admit, on_lost=actor._lost,
                      actor_id="actor0", admission_poll_s=0.01)

    async def go():
        task = asyncio.create_task(w.run())
        batches = []
        try:
            for version in range(2):  # the engine stays at version 0: admission allows exactly X and Y
                batch = await buffer.sample_batch(version, timeout_s=3.0)
                assert batch is not None, (f"no batch at learner version {version}: {w.stats.finished} finished, "
                                           f"{w.stats.pushed} pushed, buffer {buffer.stats()}")
                batches.append(batch)
        finally:
            w.stop()
            await asyncio.wait_for(task, timeout=5)
        return batches

    batches = asyncio.run(go())
    assert [b.real_rows for b in batches] == [2, 2]
    stats = buffer.stats()
    assert stats.push_refused >= 1  # the buffer was full: Y/0 was refused at least once
    assert stats.sampled == 4 and stats.size == 0 and w.stats.pushed == w.stats.finished == 4


class QuickRunner:
    """Every episode takes 5 ms and finishes; member numbers count up per group."""

    def __init__(self):
        self.engine = SimpleNamespace(version=0)
        self.members: Counter[str] = Counter()

    async def run(self, ex, group_id="", trajectory_id="", seed=None):
        await asyncio.sleep(0.005)
        self.members[group_id] += 1
        return Trajectory.decode(traj(group_id, self.members[group_id] - 1))


def test_a_worker_whose_buffer_refuses_everything_stops_at_once_and_counts_what_it_dropped():
    """The end of a run with a full buffer waited ~2 minutes (last RL step at 162 s, exit at 289 s): after the
    learner stopped, each worker's flush task offered the refused trajectories again and again until the caller's
    stop timeout. Now the last push is made once, and what is still refused is dropped and counted. Before, this
    worker never returned after stop() (the test's 5 s bound ended it)."""
    offers = []

    async def full(batch):  # a buffer nobody drains: every trajectory refused
        offers.append(len(batch))
        return list(batch)

    w = RolloutWorker(QuickRunner(), iter([QAExample(id="q", question="q", gold_answers=["x"])] * 1000), full,
                      group_size=2, max_concurrent=4, push_batch_size=2, actor_id="actor0", seed=None)

    async def go():
        task = asyncio.create_task(w.run())
        while w.stats.finished < 8:
            await asyncio.sleep(0.01)
        w.stop()
        t0 = time.monotonic()
        stats = await asyncio.wait_for(task, timeout=5)  # before: asyncio.TimeoutError, the flusher retrying on
        return stats, time.monotonic() - t0

    stats, took = asyncio.run(go())
    assert took < 1.0, f"stopping took {took:.2f} s"
    assert stats.pushed == 0 and stats.finished >= 8
    assert stats.dropped_at_stop == stats.finished, stats  # every finished trajectory: refused, then dropped
    message = stats.message()
    assert message.dropped_at_stop == stats.finished  # what the actor reports (RolloutActor.stats, the metric)


def test_a_rollout_actor_with_a_full_buffer_stops_within_a_push_and_reports_the_count():
    """The rollout actor's own stop path with the real ``BufferActor``, full and never sampled (the learner has
    stopped): ``RolloutActor.stop`` returns at once, not after its timeout, and its stats count the refused ones.
    Before, ``stop(timeout_s=30)`` took its 30 s (the test's 5 s bound ended it)."""
    buffer = BufferActor(BufferConfig(max_staleness=8, capacity_trajectories=2), group_size=2,
                         consumed_per_version=2, max_concurrent=4, batch_size=2, max_trajectory_tokens=LONGEST)
    actor = RolloutActor.__new__(RolloutActor)  # the shell's push, admission and stop, without an engine
    actor.buffer, actor.actor_id, actor.index, actor.initial_version, actor._updates = \
        InProcessHandle(buffer), "actor0", 0, 0, []
    actor.cfg = SimpleNamespace(cluster=SimpleNamespace(actor_timeout_s=5.0))
    actor.worker = RolloutWorker(QuickRunner(), iter([QAExample(id="q", question="q", gold_answers=["x"])] * 1000),
                                 actor._push, group_size=2, max_concurrent=4, push_batch_size=2, admit=actor._admit,
                                 on_lost=actor._lost, actor_id="actor0", admission_poll_s=0.01, seed=None)

    async def go():
        actor._task = asyncio.create_task(actor.worker.run())
        while buffer.stats().push_refused < 4:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        stats = await asyncio.wait_for(actor.stop(timeout_s=30), timeout=5)
        return stats, time.monotonic() - t0

    stats, took = asyncio.run(go())
    assert took < 2.0, f"stopping took {took:.2f} s"
    assert stats.done and actor.error() == "its rollouts ended"
    assert stats.pushed == buffer.stats().size == 2  # the buffer's room
    assert stats.dropped_at_stop == stats.finished - stats.pushed > 0, stats
