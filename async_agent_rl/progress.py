"""Progress lines for a long loop of known length (the SFT warm start's two phases).

On a terminal a line is printed every ``interval_s`` seconds; written to a file or a pipe (a log), one line per
``fraction`` of the total, so a log gets ~10 lines however long the loop runs. Each line: label, step/total (percent),
steps/s, tokens/s (when the caller counts tokens), the latest loss, elapsed time and the time left at the average pace so far::

    [sft] pretrain 250/1000 (25%)  4.1 steps/s  8,410 tokens/s  loss 3.214  elapsed 1m01s  left 3m03s

``close`` prints the phase's closing line (readable text, never a raw JSON object)::

    [sft] pretrain done: 1000 steps in 4m04s, 8,392 tokens/s, final loss 2.105

Standard library only (``async_agent_rl`` is the Ray- and torch-free core).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, TextIO


def duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``1h02m``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Progress of ``total`` steps, printed to ``stream`` (default stdout).

    ``interactive`` (default: ``stream.isatty()``) selects the time-based lines (every ``interval_s``) over the
    sparse ones (each time the count passes a multiple of ``fraction * total``). ``update(done, tokens=, loss=)``
    takes the steps done so far, the tokens processed so far (cumulative, optional) and the latest loss; it returns
    the line it printed, or None. ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        interval_s: float = 5.0,
        fraction: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ):
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stdout
        if interactive is None:
            isatty = getattr(self.stream, "isatty", None)
            interactive = bool(isatty and isatty())
        self.interactive = interactive
        self.interval_s, self.fraction, self.clock = interval_s, fraction, clock
        self.start = clock()
        self._last_print = self.start
        self._next_mark = 1  # sparse mode: the next multiple of fraction * total to report
        self.done, self.tokens, self.loss = 0, 0, None

    def _due(self, done: int, now: float) -> bool:
        if done >= self.total:
            return False  # the closing line reports the end
        if self.interactive:
            return now - self._last_print >= self.interval_s
        if done < self._mark(self._next_mark):
            return False
        while self._mark(self._next_mark) <= done:
            self._next_mark += 1
        return True

    def _mark(self, k: int) -> int:
        """The step count of the ``k``-th sparse line: ``k * fraction`` of the total, rounded up."""
        return max(1, math.ceil(round(k * self.fraction * self.total, 6)))

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        parts = [f"{self.label} {self.done}/{self.total} ({100 * self.done / max(1, self.total):.0f}%)",
                 f"{rate:.2f} steps/s" if rate < 10 else f"{rate:.0f} steps/s"]
        if self.tokens:
            parts.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        parts.append(f"elapsed {duration(elapsed)}")
        if self.done:
            parts.append(f"left {duration((self.total - self.done) / rate)}")
        return "  ".join(parts)

    def update(self, done: int, *, tokens: int | None = None, loss: float | None = None) -> str | None:
        self.done = done
        if tokens is not None:
            self.tokens = tokens
        if loss is not None:
            self.loss = loss
        now = self.clock()
        if not self._due(done, now):
            return None
        self._last_print = now
        text = self.line(now)
        print(text, file=self.stream, flush=True)
        return text

    def close(self, final_loss: float | None = None, extra: str = "") -> str:
        """Print and return the closing line: steps, time, tokens/s (when counted), final loss."""
        elapsed = self.clock() - self.start
        parts = [f"{self.label} done: {self.done} steps in {duration(elapsed)}"]
        if self.tokens and elapsed > 0:
            parts.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        loss = self.loss if final_loss is None else final_loss
        if loss is not None:
            parts.append(f"final loss {loss:.3f}")
        text = ", ".join(parts) + (f"; {extra}" if extra else "")
        print(text, file=self.stream, flush=True)
        return text
