"""Stop requests: SIGINT and SIGTERM end a run at its next safe point, with a checkpoint and one closing line.

The first SIGINT or SIGTERM asks the run to stop: the RL loop calls ``StopRequests.check`` at every safe point
(between steps, while the learner waits for a batch, at each step of the warm start), which then raises
``StopRequested``; the waits of a start, a checkpoint and a publish look at it between slices
(``driver.limits.wait_phase``); the run writes a checkpoint of its step and ends with ``StopRequests.closing``'s line. A second
one stops the run at once (``Stopped``: one error line, no checkpoint). Without these handlers, Ray's driver handler
(``sys.exit`` from inside Ray's C++ code) ended a SIGTERM in SIGABRT and a C++ stack dump.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from async_agent_rl.errors import InputError


class Stopped(InputError):
    """A second SIGINT or SIGTERM: the run stops at once, without a checkpoint."""


class StopRequested(Exception):
    """SIGINT or SIGTERM received: the run stops at the next safe point (``StopRequests.check``)."""


class StopRequests:
    """The run's stop requests. ``say``: the run's console; ``step``: the learner's step now (what the stop line
    says will happen depends on it)."""

    def __init__(self, say: Callable[[str], None], step: Callable[[], int]):
        self.say, self.step = say, step
        self.signal: int | None = None  # SIGINT or SIGTERM received (negated: a second one came)
        self.at = 0.0  # when the first one came (time.monotonic)
        self.in_warm_start = False

    def catch(self, stack: ExitStack) -> None:
        """Put the handlers in place until ``stack`` closes (called again after ``ray.init``, which puts its own
        SIGTERM handler in place of ours). Only the main thread can."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            old = signal.signal(sig, self._handle)
            stack.callback(signal.signal, sig, old)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            self.signal, self.at = signum, time.monotonic()
            step = self.step()
            when = ("after the current step with a checkpoint" if step > 0 else
                    "at the next step of the warm start, unsaved" if self.in_warm_start else "before the first step")
            self.say(f"[stop] {signal.Signals(signum).name}: stopping {when} (send it again to stop at once)")
        else:
            self.signal = -abs(self.signal)
            raise Stopped(f"stopped at once by a second {signal.Signals(signum).name} at step {self.step()}, "
                          "no checkpoint written")

    def check(self) -> None:
        """A safe point: raise ``StopRequested`` when a stop was asked for."""
        if self.signal is not None:
            raise StopRequested()

    @contextmanager
    def warm_start(self) -> Iterator[None]:
        """While the SFT warm start runs: a stop ends it at its next step, unsaved."""
        self.in_warm_start = True
        try:
            yield
        finally:
            self.in_warm_start = False

    def closing(self, total: int, saved: str | None, run_dir: Path) -> str:
        """The closing line of a stopped run (``saved``: its checkpoint, None: no step yet)."""
        name = signal.Signals(abs(self.signal or signal.SIGTERM)).name
        step = self.step()
        if saved is None:
            return f"[stopped] {name} at step {step} of {total}: no step yet, nothing to checkpoint"
        return (f"[stopped] {name} at step {step} of {total}: checkpoint {saved}; continue "
                f"with `async-agent-rl train --resume {run_dir}`")
