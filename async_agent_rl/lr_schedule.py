"""The learning-rate schedule of the RL learner and of the SFT warm start: pure arithmetic."""

from __future__ import annotations

import math


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the base LR for learner step ``step`` (0-based); the schedule counts learner steps, as verl.

    Warmup: ``(step + 1) / warmup_steps`` for ``step < warmup_steps``. Then, with
    ``progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)`` clamped to [0, 1]:
    ``constant`` 1, ``linear`` ``1 - progress``, ``cosine`` ``(1 + cos(pi * progress)) / 2``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule {schedule!r}; allowed: constant, linear, cosine")
