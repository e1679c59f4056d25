"""The tool limits of the retrieval server (``retriever/tool_limits.py``): the token bucket and the FIFO limiter
with its concurrency cap, on a fake clock (no real waiting but the loop's own turns)."""

from __future__ import annotations

import asyncio

import pytest

from retriever.tool_limits import ClientGone, TokenBucket, ToolLimiter, default_burst

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        await asyncio.sleep(0)


# ------------------------------------------------------------------------------------------------ token bucket
def test_bucket_starts_full_then_refills_at_the_rate_up_to_burst():
    clock = FakeClock()
    b = TokenBucket(rate_per_s=4.0, burst=2, clock=clock)
    assert b.try_take() == 0.0 and b.try_take() == 0.0  # the burst goes at once
    assert b.try_take() == pytest.approx(0.25)  # then one token every 1/rate s; nothing taken
    clock.t += 0.1
    assert b.wait_time() == pytest.approx(0.15)
    clock.t += 0.15
    assert b.try_take() == 0.0
    clock.t += 100.0  # a long pause stores at most burst tokens
    assert b.try_take(2) == 0.0
    assert b.try_take() > 0


def test_bucket_request_larger_than_burst_waits_for_a_full_bucket_and_leaves_a_debt():
    clock = FakeClock()
    b = TokenBucket(rate_per_s=1.0, burst=2, clock=clock)
    assert b.try_take(5) == 0.0  # full bucket: 5 go, 3 owed
    assert b.tokens == pytest.approx(-3.0)
    assert b.wait_time(1) == pytest.approx(4.0)  # the debt is waited out: the rate holds on average


def test_bucket_rejects_bad_parameters_and_default_burst():
    with pytest.raises(ValueError):
        TokenBucket(0.0, 1)
    with pytest.raises(ValueError):
        TokenBucket(1.0, 0)
    with pytest.raises(ValueError):
        ToolLimiter(rate_per_s=-1.0)
    assert default_burst(0.5) == 1 and default_burst(7.2) == 8


# ----------------------------------------------------------------------------------------------------- limiter
def test_disabled_limiter_never_waits():
    async def main():
        lim = ToolLimiter()
        assert not lim.enabled
        assert [await lim.acquire(3) for _ in range(100)] == [(False, 0.0)] * 100

    asyncio.run(main())


def test_concurrency_cap_makes_calls_wait_in_arrival_order_and_release_frees_a_slot():
    async def main():
        clock = FakeClock()
        lim = ToolLimiter(max_concurrent=2, clock=clock, sleep=clock.sleep)
        order: list[str] = []

        async def call(name: str):
            waited, _ = await lim.acquire(1)
            order.append(name)
            return waited

        assert await call("a") is False and await call("b") is False
        c = asyncio.create_task(call("c"))
        d = asyncio.create_task(call("d"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["a", "b"] and lim.waiting == 2 and lim.slots_used == 2  # over the cap: waiting, no error
        lim.release(1)
        assert await c is True
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["a", "b", "c"] and not d.done()  # one release, one slot
        lim.release(1)
        assert await d is True and order == ["a", "b", "c", "d"] and lim.waiting == 0

    asyncio.run(main())


def test_a_request_of_more_queries_than_the_cap_takes_every_slot():
    async def main():
        lim = ToolLimiter(max_concurrent=3)
        assert await lim.acquire(10) == (False, 0.0)
        assert lim.slots_used == 3
        small = asyncio.create_task(lim.acquire(1))
        await asyncio.sleep(0.01)
        assert not small.done()
        lim.release(10)
        assert (await small)[0] is True and lim.slots_used == 1

    asyncio.run(main())


def test_rate_limit_spaces_calls_by_one_over_the_rate_on_the_fake_clock():
    async def main():
        clock = FakeClock()
        lim = ToolLimiter(rate_per_s=10.0, burst=1, clock=clock, sleep=clock.sleep)
        start = clock.t
        times, waits = [], []

        async def call():
            waited, seconds = await lim.acquire(1)
            times.append(round(clock.t - start, 6))
            waits.append(waited)
            lim.release(1)

        await asyncio.gather(*(call() for _ in range(5)))
        assert times == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
        assert waits == [False, True, True, True, True]

    asyncio.run(main())


def test_a_waiter_whose_client_is_gone_leaves_the_queue_and_the_next_one_goes():
    async def main():
        lim = ToolLimiter(max_concurrent=1, poll_s=0.01)
        await lim.acquire(1)
        gone = {"flag": False}
        first = asyncio.create_task(lim.acquire(1, alive=lambda: not gone["flag"]))
        second = asyncio.create_task(lim.acquire(1))
        await asyncio.sleep(0.02)
        gone["flag"] = True
        with pytest.raises(ClientGone):
            await first
        assert lim.waiting == 1 and not second.done()
        lim.release(1)
        assert (await second)[0] is True and lim.waiting == 0 and lim.slots_used == 1

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_queue():
    async def main():
        lim = ToolLimiter(max_concurrent=1)
        await lim.acquire(1)
        waiter = asyncio.create_task(lim.acquire(1))
        await asyncio.sleep(0)
        assert lim.waiting == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert lim.waiting == 0 and lim.slots_used == 1

    asyncio.run(main())


def test_on_wait_is_called_once_when_a_call_has_to_wait_even_if_it_then_leaves():
    async def main():
        lim = ToolLimiter(max_concurrent=1, poll_s=0.01)
        calls: list[str] = []
        await lim.acquire(1, on_wait=lambda: calls.append("first"))
        gone = {"flag": False}
        waiter = asyncio.create_task(lim.acquire(1, alive=lambda: not gone["flag"], on_wait=lambda: calls.append("w")))
        await asyncio.sleep(0.05)
        gone["flag"] = True
        with pytest.raises(ClientGone):
            await waiter
        assert calls == ["w"]

    asyncio.run(main())
