"""The one bounded way to wait on another process (a Ray actor's answer, an object reference, a thread).

A stopped component (SIGSTOP, a hang) never answers, and a wait without a limit holds its caller for good. Every wait
in ``driver/``, ``actors/``, ``learner/`` and ``buffer/`` goes through these functions, each with a limit in seconds
that is checked before the wait starts: ``None``, a negative, an infinite or a non-number limit raises ``ValueError``
at once (a limit held in a variable that turned out to be ``None`` is a bug found on the spot, not a wait for ever).
``tests/unit/test_bounded_waits.py`` checks the source for waits that bypass them.

- ``bounded(ray.get, refs, timeout_s=..., what=...)``, ``bounded(ray.wait, refs, timeout_s=..., ...)``: a blocking
  wait function called with ``timeout=`` the checked limit; whatever it raises or returns is its own (``ray.get``
  still raises ``GetTimeoutError``, ``ray.wait`` still returns the references not ready). The Ray function is passed
  in by the caller: this module is the Ray-free core and imports no Ray.
- ``await within(aw, timeout_s, what)``: one awaitable (an actor call's ``ObjectRef``, a coroutine, a task);
  ``WaitTimeout`` past the limit (the awaitable is cancelled, as ``asyncio.wait_for`` does).
- ``await all_within(aws, timeout_s, what)``: several awaitables at once (``asyncio.gather`` under one limit).
- ``call_within(fn, *args, timeout_s=..., what=..., **kwargs)``: a blocking call that takes no limit of its own
  run in a daemon thread; ``WaitTimeout`` past the limit (the thread is left behind).
- ``alarm_within(fn, *args, timeout_s=..., what=..., **kwargs)``: a blocking call with no limit of its own that must
  run in the main thread (``ray.init`` installs signal handlers, which only the main thread may do), bounded by a
  one-shot ``SIGALRM`` timer whose handler raises ``WaitTimeout`` inside the call.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
from typing import Any, Awaitable, Callable, Iterable


class WaitTimeout(TimeoutError):
    """A wait passed its limit: ``what`` did not answer within ``limit_s`` seconds (hung or stopped). A
    ``TimeoutError``, so ``except asyncio.TimeoutError`` (the same class) still catches it."""

    def __init__(self, what: str, limit_s: float):
        super().__init__(f"{what} did not answer within {limit_s:g} s (hung or stopped)")
        self.what, self.limit_s = what, limit_s


def limit_s(timeout_s: Any, what: str) -> float:
    """``timeout_s`` as a float when it is a finite number of seconds >= 0; ``ValueError`` naming ``what`` otherwise
    (``None`` included: a wait here always has a limit)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s < 0:
        raise ValueError(f"waiting on {what} needs a limit in seconds (a finite number >= 0), not {timeout_s!r}")
    return float(timeout_s)


def bounded(wait: Callable[..., Any], *args: Any, timeout_s: float, what: str, **kwargs: Any) -> Any:
    """``wait(*args, timeout=<timeout_s checked>, **kwargs)``: ``ray.get`` or ``ray.wait`` (or any blocking wait with
    a ``timeout`` keyword) with a limit that cannot be missing. Its result and its exceptions are its own."""
    return wait(*args, timeout=limit_s(timeout_s, what), **kwargs)


async def within(aw: Awaitable[Any], timeout_s: float, what: str) -> Any:
    """``await aw`` for at most ``timeout_s`` seconds; ``WaitTimeout`` naming ``what`` after that (``aw`` is
    cancelled). An ``ObjectRef`` (``actor.method.remote(...)``) is awaitable: this is how an async actor waits on
    another."""
    try:
        limit = limit_s(timeout_s, what)
    except ValueError:
        _close(aw)
        raise
    try:
        return await asyncio.wait_for(aw, limit)
    except asyncio.TimeoutError:
        raise WaitTimeout(what, limit) from None


async def all_within(aws: Iterable[Awaitable[Any]], timeout_s: float, what: str, *,
                     return_exceptions: bool = False) -> list[Any]:
    """``asyncio.gather(*aws, return_exceptions=...)`` for at most ``timeout_s`` seconds; ``WaitTimeout`` naming
    ``what`` after that (every one not done is cancelled)."""
    aws = list(aws)
    try:
        limit = limit_s(timeout_s, what)
    except ValueError:
        for aw in aws:
            _close(aw)
        raise
    try:
        return list(await asyncio.wait_for(asyncio.gather(*aws, return_exceptions=return_exceptions), limit))
    except asyncio.TimeoutError:
        raise WaitTimeout(what, limit) from None


def call_within(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread, waited for at most ``timeout_s`` seconds: for a blocking call with
    no limit of its own (``ray.init`` connecting to a cluster that does not answer). Its result, or its exception;
    ``WaitTimeout`` naming ``what`` past the limit (the thread is left behind: nothing can stop it)."""
    limit = limit_s(timeout_s, what)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name=f"call_within: {what}"[:60], daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise WaitTimeout(what, limit)
    if "error" in out:
        raise out["error"]
    return out.get("value")


def alarm_within(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in this, the main, thread, for at most ``timeout_s`` seconds: a one-shot ``SIGALRM``
    timer's handler raises ``WaitTimeout`` naming ``what`` inside the call once the limit passes (at the call's next
    Python instruction: a wait in a loop of short sleeps or retries, as Ray's connection loops are). A timer already
    running (a test runner's own limit) is kept: whichever is due first fires, the earlier one's handler is called
    when it is its turn, and it is set again with what is left of it afterwards. The previous handler is restored on
    every way out. ``RuntimeError`` off the main thread (signals are delivered there only)."""
    limit = limit_s(timeout_s, what)
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"alarm_within({what}) needs the main thread")
    t0 = time.monotonic()
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    ours_due = t0 + limit
    outer_due = t0 + outer_left if outer_left > 0 else math.inf
    fired = []

    def on_alarm(signum: int, frame: Any) -> None:
        nonlocal outer_due
        if time.monotonic() >= ours_due - 1e-3 or not callable(previous):
            fired.append(True)
            raise WaitTimeout(what, limit)
        outer_due = math.inf  # the outer timer's turn: it is done (set again below if it repeats)
        signal.setitimer(signal.ITIMER_REAL, max(ours_due - time.monotonic(), 1e-3))
        previous(signum, frame)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, max(min(ours_due, outer_due) - time.monotonic(), 1e-3))
        try:
            return fn(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except WaitTimeout:
        raise
    except BaseException:
        if fired:  # the call caught our WaitTimeout and raised something else in its place: still our limit
            raise WaitTimeout(what, limit) from None
        raise
    finally:
        signal.signal(signal.SIGALRM, previous)
        if outer_due != math.inf:
            signal.setitimer(signal.ITIMER_REAL, max(outer_due - time.monotonic(), 1e-3), outer_interval)
        elif outer_interval > 0:
            signal.setitimer(signal.ITIMER_REAL, outer_interval, outer_interval)


def _close(aw: Any) -> None:
    """A coroutine that will never be awaited is closed (no "was never awaited" warning)."""
    close = getattr(aw, "close", None)
    if asyncio.iscoroutine(aw) and close is not None:
        close()
