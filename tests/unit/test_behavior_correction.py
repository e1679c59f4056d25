"""Behavior-weight corrections at token, sequence and turn level, the IcePop band, the floor veto, and the
engine/trainer mismatch metrics, against hand-computed values (docs/ALGORITHMS.md section 3)."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from async_agent_rl.algorithms import (
    BEHAVIOR_WEIGHT_LEVELS,
    MISMATCH_METRICS,
    behavior_correction,
    decoupled_ppo_loss,
    level_log_weight,
    mismatch_metrics,
    ppo_loss,
    turn_index_from_mask,
)
from async_agent_rl.config import AlgorithmConfig, ConfigError, load_config
from async_agent_rl.stats import LearnerStats

pytestmark = pytest.mark.unit

LN = math.log


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def logprobs_for(weights: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(proximal, behavior)`` whose token weights ``exp(proximal - behavior)`` are ``weights``."""
    proximal = torch.full((len(weights), len(weights[0])), -1.0)
    return proximal, proximal - t(weights).log()


def close(x: torch.Tensor, rows) -> None:
    torch.testing.assert_close(x, t(rows), rtol=1e-5, atol=1e-6)


def test_levels_match_the_config_literal_and_defaults_are_unchanged():
    fields = AlgorithmConfig.model_fields
    assert BEHAVIOR_WEIGHT_LEVELS == get_args(fields["behavior_weight_level"].annotation)
    alg = AlgorithmConfig()
    assert (alg.behavior_weight_level, alg.behavior_weight_mode, alg.behavior_weight_cap) == ("token", "truncate", 2.0)
    assert alg.icepop_band is None and alg.behavior_weight_floor is None


# ------------------------------------------------------------------------------------------------ sequence level
# row 0: token weights 4 and 1 -> geometric mean W = 2; row 1: 1.21 and 1 -> W = 1.1. Cap 1.5.
SEQ_WEIGHTS = [[4.0, 1.0], [1.21, 1.0]]


def test_sequence_truncate_gives_every_token_min_of_the_geometric_mean_and_the_cap():
    proximal, behavior = logprobs_for(SEQ_WEIGHTS)
    weight, m = behavior_correction(proximal, behavior, torch.ones(2, 2), level="sequence", mode="truncate", cap=1.5)
    close(weight, [[1.5, 1.5], [1.1, 1.1]])
    assert m["iw_capped_frac"].item() == pytest.approx(0.5)  # both tokens of row 0
    assert m["iw_capped_seq_frac"].item() == pytest.approx(0.5)  # row 0 of 2
    assert m["iw_mean"].item() == pytest.approx((4 + 1 + 1.21 + 1) / 4, rel=1e-5)  # of the raw token weights


def test_sequence_mask_drops_the_whole_sequence_over_the_cap():
    proximal, behavior = logprobs_for(SEQ_WEIGHTS)
    weight, m = behavior_correction(proximal, behavior, torch.ones(2, 2), level="sequence", mode="mask", cap=1.5)
    close(weight, [[0.0, 0.0], [1.1, 1.1]])
    assert m["iw_capped_seq_frac"].item() == pytest.approx(0.5)
    # token level would have capped only the token of weight 4
    _, tm = behavior_correction(proximal, behavior, torch.ones(2, 2), level="token", mode="mask", cap=1.5)
    assert tm["iw_capped_frac"].item() == pytest.approx(0.25)


def test_sequence_mean_is_over_sampled_tokens_only():
    # an unmasked observation (a loss position never sampled) takes its row's weight but does not dilute the mean
    proximal, behavior = logprobs_for([[4.0, 1.0, 1.0]])
    behavior[0, 1] = -40.0  # garbage there: not sampled, ignored
    mask, sampled = t([[1, 1, 1]]), t([[1, 0, 1]])
    weight, _ = behavior_correction(proximal, behavior, mask, level="sequence", cap=5.0, sampled_mask=sampled)
    close(weight, [[2.0, 2.0, 2.0]])  # exp((ln 4 + 0) / 2), not exp(ln 4 / 3)


# --------------------------------------------------------------------------------------------------- turn level
# One episode: turn 0 (tokens 0-1) weights 9 and 1 -> W0 = 3; observation (tokens 2-3, garbage log-probs);
# turn 1 (tokens 4-5) weights 0.25 and 1 -> W1 = 0.5. The sequence as a whole: (9 * 0.25)^(1/4) = 1.5^(1/2).
TURN_MASK = [[1, 1, 0, 0, 1, 1]]


def turn_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    proximal, behavior = logprobs_for([[9.0, 1.0, 1.0, 1.0, 0.25, 1.0]])
    behavior[0, 2:4] = t([-60.0, 30.0])
    return proximal, behavior, t(TURN_MASK)


def test_turns_of_one_episode_get_different_weights():
    proximal, behavior, mask = turn_case()
    assert turn_index_from_mask(mask).tolist() == [[0, 0, -1, -1, 1, 1]]
    log_w = level_log_weight((proximal - behavior) * mask, mask.bool(), "turn")
    close(log_w.exp() * mask, [[3.0, 3.0, 0.0, 0.0, 0.5, 0.5]])
    weight, m = behavior_correction(proximal, behavior, mask, level="turn", mode="truncate", cap=2.0)
    close(weight * mask, [[2.0, 2.0, 0.0, 0.0, 0.5, 0.5]])  # turn 0 truncated to the cap, turn 1 kept
    assert m["iw_capped_frac"].item() == pytest.approx(0.5)
    assert m["iw_capped_seq_frac"].item() == pytest.approx(1.0)
    weight, _ = behavior_correction(proximal, behavior, mask, level="turn", mode="mask", cap=2.0)
    close(weight * mask, [[0.0, 0.0, 0.0, 0.0, 0.5, 0.5]])
    # the same episode at sequence level: one weight 1.5^(1/2) < cap for every token, nothing capped
    weight, m = behavior_correction(proximal, behavior, mask, level="sequence", mode="mask", cap=2.0)
    close(weight * mask, [[1.5 ** 0.5] * 2 + [0.0] * 2 + [1.5 ** 0.5] * 2])
    assert m["iw_capped_frac"].item() == 0.0


def test_turn_index_given_explicitly_decides_the_turns():
    # two turns with no observation between them (e.g. an invalid-action message trimmed): the record's turn_index
    # tells them apart where the mask cannot
    proximal, behavior = logprobs_for([[9.0, 1.0, 0.25, 1.0]])
    mask = torch.ones(1, 4)
    weight, _ = behavior_correction(proximal, behavior, mask, level="turn", cap=5.0,
                                    turn_index=torch.tensor([[0, 0, 1, 1]]))
    close(weight, [[3.0, 3.0, 0.5, 0.5]])
    weight, _ = behavior_correction(proximal, behavior, mask, level="turn", cap=5.0)  # one run of actions: one turn
    close(weight, [[1.5 ** 0.5] * 4])


def test_turn_level_loss_hand_computed():
    proximal, behavior, mask = turn_case()
    logprobs = proximal.clone().requires_grad_(True)
    adv = torch.ones(1, 6)
    loss, metrics = decoupled_ppo_loss(logprobs, proximal, behavior, adv, mask, behavior_weight_level="turn",
                                       behavior_weight_cap=2.0)
    # ratio 1, A = 1: token-mean of -w over the 4 action tokens = -(2 + 2 + 0.5 + 0.5) / 4
    torch.testing.assert_close(loss, torch.tensor(-1.25))
    loss.backward()
    close(logprobs.grad, [[-0.5, -0.5, 0.0, 0.0, -0.125, -0.125]])
    assert metrics["iw_capped_frac"].item() == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------ IcePop and floor veto
def test_icepop_band_masks_tokens_outside_it():
    proximal, behavior = logprobs_for([[4.0, 1.0, 0.25, 1.5]])
    mask = torch.ones(1, 4)
    weight, m = behavior_correction(proximal, behavior, mask, cap=5.0, icepop_band=(0.5, 2.0))
    close(weight, [[0.0, 1.0, 0.0, 1.5]])
    assert m["icepop_masked_frac"].item() == pytest.approx(0.5)
    assert m["iw_capped_frac"].item() == 0.0
    _, m = behavior_correction(proximal, behavior, mask, cap=5.0)
    assert "icepop_masked_frac" not in m and "floor_veto_frac" not in m  # off: not computed


def test_floor_veto_masks_a_sequence_with_any_token_below_the_floor():
    proximal, behavior = logprobs_for([[1.0, 0.25, 1.0], [1.2, 1.0, 0.5]])
    mask = t([[1, 1, 0], [1, 1, 1]])  # row 0's last position is padding: its weight 1 does not matter
    behavior[0, 2] = 50.0  # padding garbage (w ~ 0) must not veto anything
    weight, m = behavior_correction(proximal, behavior, mask, cap=5.0, floor=0.3)
    close(weight * mask, [[0.0, 0.0, 0.0], [1.2, 1.0, 0.5]])
    assert m["floor_veto_seq_frac"].item() == pytest.approx(0.5)
    assert m["floor_veto_frac"].item() == pytest.approx(2 / 5)


def test_corrections_compose_in_the_loss():
    # sequence truncate at cap 1.5 (row 0: W = 2 -> 1.5), the band masks the 4, the floor vetoes row 1 (0.2 < 0.3)
    proximal, behavior = logprobs_for([[4.0, 1.0], [5.0, 0.2]])
    logprobs = proximal.clone().requires_grad_(True)
    loss, m = decoupled_ppo_loss(logprobs, proximal, behavior, torch.ones(2, 2), torch.ones(2, 2),
                                 behavior_weight_level="sequence", behavior_weight_cap=1.5, icepop_band=(0.1, 3.0),
                                 behavior_weight_floor=0.3)
    # weights: row 0 [0 (band), 1.5], row 1 vetoed [0, 0] -> -(1.5) / 4
    torch.testing.assert_close(loss, torch.tensor(-1.5 / 4))
    assert m["icepop_masked_frac"].item() == pytest.approx(0.5)  # 4 and 5
    assert m["floor_veto_seq_frac"].item() == pytest.approx(0.5)


def test_plain_ppo_ignores_the_corrections():
    proximal, behavior = logprobs_for([[4.0, 1.0]])
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    plain, _ = ppo_loss(behavior.clone(), None, behavior, adv, mask)
    again, _ = ppo_loss(behavior.clone(), None, behavior, adv, mask, behavior_weight_level="turn",
                        icepop_band=(0.5, 2.0), behavior_weight_floor=0.5)
    torch.testing.assert_close(plain, again)


@pytest.mark.parametrize("kwargs, match", [
    ({"icepop_band": (1.0, 2.0)}, "icepop_band"),
    ({"icepop_band": (0.5, 0.9)}, "icepop_band"),
    ({"floor": 1.0}, "behavior_weight_floor"),
    ({"floor": 0.0}, "behavior_weight_floor"),
    ({"level": "episode"}, "'token', 'sequence', 'turn'"),
    ({"cap": 1.0}, "behavior_weight_cap"),
])
def test_bad_correction_arguments_are_errors(kwargs, match):
    proximal, behavior = logprobs_for([[1.0]])
    with pytest.raises(ValueError, match=match):
        behavior_correction(proximal, behavior, torch.ones(1, 1), **kwargs)


@pytest.mark.parametrize("override, message", [
    ("algorithm.icepop_band=[1.0,2.0]", "0 <= low < 1 < high"),
    ("algorithm.icepop_band=[0.5,1.0]", "0 <= low < 1 < high"),
    ("algorithm.icepop_band=[-0.1,2.0]", "0 <= low < 1 < high"),
    ("algorithm.behavior_weight_floor=1", "less than 1"),
    ("algorithm.behavior_weight_floor=0", "greater than 0"),
    ("algorithm.behavior_weight_level=episode", "'token', 'sequence' or 'turn'"),
])
def test_bad_correction_config_is_rejected_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert override.split("=")[0] in str(e.value) and message in str(e.value)


def test_good_correction_config_loads():
    alg = load_config(None, ["algorithm.behavior_weight_level=turn", "algorithm.behavior_weight_mode=mask",
                             "algorithm.icepop_band=[0.5,2]", "algorithm.behavior_weight_floor=0.01"]).algorithm
    assert (alg.behavior_weight_level, alg.icepop_band, alg.behavior_weight_floor) == ("turn", (0.5, 2.0), 0.01)


# ------------------------------------------------------------------------------------------------- mismatch
def test_mismatch_separates_fresh_tokens_from_stale_ones():
    # d = proximal - behavior. Row 0: fresh 0.1, stale 0.5, an observation (garbage); row 1: fresh -0.1; row 2:
    # filler (nothing sampled)
    d = t([[0.1, 0.5, 7.0], [-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]])
    proximal = torch.full((3, 3), -2.0)
    behavior = proximal - d
    sampled = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    fresh = t([[1, 0, 1], [1, 1, 0], [0, 0, 0]])  # only where sampled counts
    values, counts = mismatch_metrics(proximal, behavior, sampled, fresh)
    assert set(values) == set(counts) == set(MISMATCH_METRICS)
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    assert values["mismatch_kl_fresh"].item() == pytest.approx((k3(0.1) + k3(-0.1)) / 2, rel=1e-4)
    assert values["mismatch_abs_logprob_fresh"].item() == pytest.approx(0.1, rel=1e-5)
    assert values["mismatch_kl_stale"].item() == pytest.approx(k3(0.5), rel=1e-5)
    assert values["mismatch_abs_logprob_stale"].item() == pytest.approx(0.5, rel=1e-5)
    assert values["seq_log_ratio_mean"].item() == pytest.approx((0.6 - 0.1) / 2, rel=1e-5)  # rows with tokens
    assert values["seq_log_ratio_max"].item() == pytest.approx(0.6, rel=1e-5)
    assert values["fresh_token_fraction"].item() == pytest.approx(2 / 3)
    assert counts == {"mismatch_kl_fresh": 2, "mismatch_abs_logprob_fresh": 2, "mismatch_kl_stale": 1,
                      "mismatch_abs_logprob_stale": 1, "seq_log_ratio_mean": 2, "seq_log_ratio_max": 2,
                      "fresh_token_fraction": 3}


def test_mismatch_of_a_long_episode_drifts_as_a_product():
    # 400 tokens each with weight exp(-0.01) (per token near 1): the sequence log-ratio is -4 (a ratio of 0.018)
    proximal = torch.zeros(1, 400)
    behavior = proximal + 0.01
    values, counts = mismatch_metrics(proximal, behavior, torch.ones(1, 400), torch.zeros(1, 400))
    assert values["seq_log_ratio_mean"].item() == pytest.approx(-4.0, rel=1e-4)
    assert values["seq_log_ratio_max"].item() == pytest.approx(4.0, rel=1e-4)  # |drift|, whichever way
    assert counts["mismatch_kl_fresh"] == 0 and values["fresh_token_fraction"].item() == 0.0


def test_mismatch_and_correction_metrics_are_learner_fields():
    keys = [*MISMATCH_METRICS, "iw_capped_seq_frac", "icepop_masked_frac", "floor_veto_frac", "floor_veto_seq_frac"]
    stats = LearnerStats.from_dict({k: 0.25 for k in keys})
    assert all(getattr(stats, k) == 0.25 for k in keys) and stats.extra == {}
