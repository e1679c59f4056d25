"""The buffer actor's ``sample_batch`` waits for a batch without polling: woken by a push (or a rejection), and at
the next partial-group timeout; None once its timeout is over. (On Ray, with calls served while it waits:
tests/integration/test_buffer_actor.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from async_agent_rl.config import BufferConfig
from buffer.actor import BufferActor
from tests.helpers import LONGEST, traj

pytestmark = pytest.mark.unit


def make(max_staleness: int = 0, **config) -> BufferActor:
    return BufferActor(BufferConfig(max_staleness=max_staleness, **config), group_size=2, consumed_per_version=4,
                       max_concurrent=64, batch_size=4, max_trajectory_tokens=LONGEST, pad_id=7)


def test_none_after_the_timeout_and_a_batch_as_soon_as_it_can_be_made():
    async def go():
        b = make()
        t0 = time.monotonic()
        assert await b.sample_batch(0, timeout_s=0.2) is None
        assert time.monotonic() - t0 >= 0.2
        assert b.try_start(2, 0, "g1", "a0") == 2 and b.try_start(2, 0, "g2", "a0") == 2
        waiting = asyncio.create_task(b.sample_batch(0, timeout_s=30))
        await asyncio.sleep(0.05)
        b.push_many([traj("g1", 0), traj("g1", 1), traj("g2", 0)])
        await asyncio.sleep(0.05)
        assert not waiting.done()  # one group and a half
        t1 = time.monotonic()
        b.reject(["g2"])  # g2 is released short: two whole groups make the batch, padded to 4 rows
        batch = await asyncio.wait_for(waiting, 5)
        assert batch.batch_size == 4 and batch.real_rows == 3 and time.monotonic() - t1 < 1.0
    asyncio.run(go())


def test_a_partial_group_timeout_wakes_the_sampler():
    async def go():
        b = make(max_staleness=1, partial_groups="release", partial_group_timeout_s=0.3)
        assert all(b.try_start(2, 0, g, "a0") == 2 for g in ("g1", "g2"))
        b.push_many([traj("g2", 0)])
        b.push_many([traj("g1", 0), traj("g1", 1)])
        # g2 waits for its second member; timed out, it is released as it is and, with g1, makes up a batch of two
        # groups: the sampler wakes up at the timeout, with no push to wake it
        t0 = time.monotonic()
        batch = await b.sample_batch(0, timeout_s=30)
        assert batch is not None and batch.batch_size == 4 and batch.real_rows == 3
        assert 0.25 <= time.monotonic() - t0 < 5.0
        assert b.stats().groups_released_partial == 1
        b.push_many([traj("g2", 1)])  # the straggler arrives after its group was consumed: dropped, counted
        assert b.stats().late_pushes == 1 and b.admission.running == 0

    asyncio.run(go())
