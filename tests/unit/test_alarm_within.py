"""``alarm_within``: the bound of a blocking call that must run in the main thread (``ray.init``)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from async_agent_rl.waits import WaitTimeout, alarm_within

pytestmark = pytest.mark.unit


def _timer_as_before(left_before: float, t0: float) -> bool:
    """The ITIMER_REAL timer is what it was before the call (none, or the test runner's, less the time gone)."""
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    if left_before == 0:
        return left == 0
    return left_before - (time.monotonic() - t0) - 0.5 <= left <= left_before


def _spin(seconds: float) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # a retry loop of short sleeps, as Ray's connection loops are
        time.sleep(0.01)
    return "done"


def test_a_call_within_its_limit_returns_and_leaves_no_timer_and_the_old_handler():
    before, left, t0 = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()
    assert alarm_within(_spin, 0.05, timeout_s=5, what="spin") == "done"
    assert _timer_as_before(left, t0) and signal.getsignal(signal.SIGALRM) is before


def test_a_call_past_its_limit_ends_in_wait_timeout_naming_it_at_the_limit():
    before, left, t0 = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()
    with pytest.raises(WaitTimeout, match=r"ray.init\(address=x\) did not answer within 0.3 s"):
        alarm_within(_spin, 30, timeout_s=0.3, what="ray.init(address=x)")
    assert time.monotonic() - t0 < 2.0
    assert _timer_as_before(left, t0) and signal.getsignal(signal.SIGALRM) is before


def test_a_call_that_swallows_the_timeout_and_raises_its_own_error_is_still_a_timeout():
    def swallow():
        try:
            _spin(30)
        except WaitTimeout:
            raise RuntimeError("could not connect") from None

    with pytest.raises(WaitTimeout):
        alarm_within(swallow, timeout_s=0.2, what="swallow")


def test_the_call_s_own_error_is_its_own():
    def fail():
        raise ConnectionError("refused")

    left, t0 = signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()
    with pytest.raises(ConnectionError, match="refused"):
        alarm_within(fail, timeout_s=5, what="fail")
    assert _timer_as_before(left, t0)


@pytest.mark.parametrize("limit", [None, -1, float("inf"), "10"])
def test_a_missing_or_bad_limit_is_refused_before_the_call(limit):
    called = []
    with pytest.raises(ValueError, match="needs a limit"):
        alarm_within(called.append, 1, timeout_s=limit, what="x")
    assert not called


def test_off_the_main_thread_it_refuses_rather_than_wait_unbounded():
    out = []

    def run():
        try:
            alarm_within(_spin, 0.01, timeout_s=1, what="x")
        except RuntimeError as e:
            out.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert out and "main thread" in out[0]


def test_a_timer_already_running_is_kept_and_fires_in_its_turn():
    outer = []
    runner_left = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's own, put back at the end
    previous = signal.signal(signal.SIGALRM, lambda *a: outer.append(time.monotonic()))
    try:
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # a test runner's limit, due before ours ends
        with pytest.raises(WaitTimeout):
            alarm_within(_spin, 30, timeout_s=1.0, what="x")
        assert len(outer) == 1 and 0.4 < outer[0] - t0 < 0.9  # the outer handler ran at its time, ours after it
        signal.setitimer(signal.ITIMER_REAL, 5.0)  # and one due after ours ends is set again with what is left
        assert alarm_within(_spin, 0.1, timeout_s=1.0, what="y") == "done"
        assert 4.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 5.0
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, *runner_left)
