"""The learning-rate schedule of the RL learner and of SFT (``async_agent_rl.lr_schedule.lr_factor``): pure
arithmetic."""

from __future__ import annotations

import math

import pytest

from async_agent_rl.lr_schedule import lr_factor

pytestmark = pytest.mark.unit


def test_lr_factor_warmup_then_schedule():
    kw = dict(warmup_steps=2, total_steps=6)
    assert [lr_factor(s, schedule="constant", **kw) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(s, schedule="linear", **kw) for s in range(2, 7)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_factor(4, schedule="cosine", **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_warmup_then_constant_is_the_pretraining_schedule():
    """SFT's pretraining stage: ``min(1, (step + 1) / max(1, warmup))``, with no warmup at all when it is 0."""
    for warmup in (0, 1, 3):
        for step in range(6):
            expected = min(1.0, (step + 1) / max(1, warmup))
            assert lr_factor(step, warmup_steps=warmup, total_steps=4, schedule="constant") == expected
