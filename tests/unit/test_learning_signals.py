"""The driver's per-step learning signals: equal-reward share, per-kind rollout means, the flat-groups warning."""

from __future__ import annotations

from driver.train import LearningSignals


def _actor(single: tuple[int, float, float, int], bridge: tuple[int, float, float, int]) -> dict:
    def kind(t: tuple[int, float, float, int]) -> dict:
        return dict(zip(("finished", "reward_sum", "exact_match_sum", "searches"), t))

    return {"by_kind": {"world_single": kind(single), "world_bridge": kind(bridge)}}


def test_means_are_over_the_episodes_finished_since_the_previous_step_summed_over_actors():
    sig = LearningSignals()
    sig.update([_actor((4, 2.0, 2.0, 4), (2, 0.0, 0.0, 3))], {"groups_completed": 2, "groups_zero_variance": 1}, {})
    rec = sig.update(
        [_actor((8, 5.0, 5.0, 8), (4, 1.0, 1.0, 7)), _actor((2, 2.0, 2.0, 2), (0, 0.0, 0.0, 0))],
        {"groups_completed": 6, "groups_zero_variance": 4}, {"entropy": 0.3},
    )
    assert rec["zero_variance_share"] == 3 / 4
    assert rec["entropy"] == 0.3
    single, bridge = rec["by_kind"]["world_single"], rec["by_kind"]["world_bridge"]
    assert single == {"episodes": 6, "reward": 5.0 / 6, "exact_match": 5.0 / 6, "searches": 1.0}
    assert bridge == {"episodes": 2, "reward": 0.5, "exact_match": 0.5, "searches": 2.0}


def test_a_restarted_actor_counts_from_zero_again():
    sig = LearningSignals()
    sig.update([_actor((10, 5.0, 5.0, 10), (0, 0, 0, 0))], {}, {})
    rec = sig.update([_actor((2, 2.0, 2.0, 2), (0, 0, 0, 0))], {}, {})
    assert rec["by_kind"]["world_single"]["episodes"] == 2
    assert rec["zero_variance_share"] is None  # no group completed


def test_warns_once_after_several_steps_of_nearly_all_equal_reward_groups():
    sig = LearningSignals()
    completed = flat = 0
    warned = []
    for step in range(2 * LearningSignals.FLAT_STEPS):
        completed, flat = completed + 10, flat + 10  # every group equal
        sig.update([], {"groups_completed": completed, "groups_zero_variance": flat}, {})
        warned += [(step, w) for w in sig.warnings()]
    assert [s for s, _ in warned] == [LearningSignals.FLAT_STEPS - 1]
    assert "rollout.temperature" in warned[0][1] and "rollout.group_size" in warned[0][1]
    # a step with a spread resets the streak
    sig.update([], {"groups_completed": completed + 10, "groups_zero_variance": flat + 5}, {})
    assert sig._flat_steps == 0
