"""The driver's per-step learning signals: equal-reward share, per-kind rollout means, the flat-groups warning."""

from __future__ import annotations

import pytest

from async_agent_rl.stats import BufferStats, LearnerStats, RolloutStats
from driver.console import LearningSignals

pytestmark = pytest.mark.unit


def _actor(single: tuple[int, float, float, int], bridge: tuple[int, float, float, int], index: int = 0,
           incarnation: str = "a") -> RolloutStats:
    def kind(t: tuple[int, float, float, int]) -> dict:
        return dict(zip(("finished", "reward_sum", "exact_match_sum", "searches"), t))

    return RolloutStats(index=index, incarnation=incarnation,
                        by_kind={"world_single": kind(single), "world_bridge": kind(bridge)})


def _buffer(completed: int = 0, flat: int = 0) -> BufferStats:
    return BufferStats(groups_completed=completed, groups_zero_variance=flat)


def test_means_are_over_the_episodes_finished_since_the_previous_step_summed_over_actors():
    sig = LearningSignals()
    sig.update([_actor((4, 2.0, 2.0, 4), (2, 0.0, 0.0, 3))], _buffer(2, 1), LearnerStats())
    rec = sig.update(
        [_actor((8, 5.0, 5.0, 8), (4, 1.0, 1.0, 7)), _actor((2, 2.0, 2.0, 2), (0, 0.0, 0.0, 0), index=1)],
        _buffer(6, 4), LearnerStats(entropy=0.3),
    )
    assert rec.zero_variance_share == 3 / 4
    assert rec.entropy == 0.3
    single, bridge = rec.by_kind["world_single"], rec.by_kind["world_bridge"]
    assert single == {"episodes": 6, "reward": 5.0 / 6, "exact_match": 5.0 / 6, "searches": 1.0}
    assert bridge == {"episodes": 2, "reward": 0.5, "exact_match": 0.5, "searches": 2.0}


def test_a_restarted_actor_counts_from_zero_again():
    sig = LearningSignals()
    sig.update([_actor((10, 5.0, 5.0, 10), (0, 0, 0, 0))], _buffer(), LearnerStats())
    # a new incarnation (a new process) counts from zero, even once past its old totals
    rec = sig.update([_actor((2, 2.0, 2.0, 2), (0, 0, 0, 0), incarnation="b")], _buffer(), LearnerStats())
    assert rec.by_kind["world_single"]["episodes"] == 2
    assert rec.by_kind["world_single"]["reward"] == 1.0
    rec = sig.update([_actor((14, 7.0, 2.0, 14), (0, 0, 0, 0), incarnation="c")], _buffer(), LearnerStats())
    assert rec.by_kind["world_single"]["episodes"] == 14
    assert rec.zero_variance_share is None  # no group completed


def test_warns_once_after_several_steps_of_nearly_all_equal_reward_groups():
    sig = LearningSignals()
    completed = flat = 0
    warned = []
    for step in range(2 * LearningSignals.FLAT_STEPS):
        completed, flat = completed + 10, flat + 10  # every group equal
        sig.update([], _buffer(completed, flat), LearnerStats())
        warned += [(step, w) for w in sig.warnings()]
    assert [s for s, _ in warned] == [LearningSignals.FLAT_STEPS - 1]
    assert "rollout.temperature" in warned[0][1] and "rollout.group_size" in warned[0][1]
    # a step with a spread resets the streak
    sig.update([], _buffer(completed + 10, flat + 5), LearnerStats())
    assert sig._flat_steps == 0


def test_after_a_resume_the_first_step_counts_only_its_own_groups():
    """A resumed run's buffer comes back with the checkpoint's group counts: the first step after the resume counted
    every group of the run as its own (a zero-variance share over the whole history)."""
    sig = LearningSignals()
    sig.resumed(_buffer(100, 90))
    rec = sig.update([], _buffer(104, 90), LearnerStats())
    assert rec.zero_variance_share == 0.0
