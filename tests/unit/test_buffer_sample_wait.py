"""The buffer actor's ``sample_batch`` waits for a batch without polling: woken by a push (or a rejection), and at
the next partial-group timeout; None once its timeout is over. (On Ray, with calls served while it waits:
tests/integration/test_buffer_actor.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from async_agent_rl.config import BufferConfig
from buffer.actor import BufferActor
from tests.unit.test_replay_buffer import traj

pytestmark = pytest.mark.unit


def make(max_staleness: int = 0, **config) -> BufferActor:
    return BufferActor(BufferConfig(max_staleness=max_staleness, **config), group_size=2, consumed_per_version=4,
                       max_concurrent=64, batch_size=4, pad_id=7)


def test_none_after_the_timeout_and_a_batch_as_soon_as_it_can_be_made():
    async def go():
        b = make()
        t0 = time.monotonic()
        assert await b.sample_batch(0, timeout_s=0.2) is None
        assert time.monotonic() - t0 >= 0.2
        assert b.try_start(4, 0, "g1", "a0") == 4
        waiting = asyncio.create_task(b.sample_batch(0, timeout_s=30))
        await asyncio.sleep(0.05)
        b.push_many([traj("g1", 0), traj("g1", 1), traj("g2", 0)])
        await asyncio.sleep(0.05)
        assert not waiting.done()  # one group and a half
        t1 = time.monotonic()
        b.reject(["g2"])  # g2 is released short ...
        await asyncio.sleep(0.05)
        assert not waiting.done()  # ... but a short group cannot fill an exact batch
        assert b.try_start(2, 0, "g3", "a0") == 2
        b.push_many([traj("g3", 0), traj("g3", 1)])
        batch = await asyncio.wait_for(waiting, 5)
        assert batch.batch_size == 4 and time.monotonic() - t1 < 1.0

    asyncio.run(go())


def test_a_partial_group_timeout_wakes_the_sampler():
    async def go():
        b = make(max_staleness=1, partial_groups="release", partial_group_timeout_s=0.3)
        assert b.try_start(6, 0, "g1", "a0") == 6
        b.push_many([traj("g1", 0), traj("g1", 1), traj("g2", 0), traj("g3", 0)])
        # g2 and g3 wait for their second members; timed out, they are released as they are and, with g1, make up
        # a batch of 4: the sampler wakes up at the timeout, with no push to wake it
        t0 = time.monotonic()
        batch = await b.sample_batch(0, timeout_s=30)
        assert batch is not None and batch.batch_size == 4
        assert 0.25 <= time.monotonic() - t0 < 5.0
        assert b.stats().groups_released_partial == 2

    asyncio.run(go())
