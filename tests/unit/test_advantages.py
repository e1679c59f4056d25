"""Advantage estimators against hand-computed cases, a loop reference, and properties (docs/ALGORITHMS.md section 2)."""

from __future__ import annotations

import math
import random
import statistics
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_agent_rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    STEPWISE_MODES,
    UnknownAlgorithmError,
    compute_advantages,
    gae_advantages,
    get_advantage_estimator,
    get_stepwise_mode,
    grpo_no_std_scores,
    grpo_scores,
    place_outcome_rewards,
    reinforce_pp_advantages,
    rloo_scores,
    stepwise_broadcast,
    stepwise_per_step,
    turn_index_from_mask,
    whiten_advantages,
)
from async_agent_rl.config import AlgorithmConfig

pytestmark = pytest.mark.unit

unit_interval = st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ registries
def test_registry_names_match_config_literals():
    fields = AlgorithmConfig.model_fields
    assert tuple(ADVANTAGE_ESTIMATORS) == get_args(fields["advantage_estimator"].annotation)
    assert tuple(STEPWISE_MODES) == get_args(fields["stepwise_advantage"].annotation)


def test_unknown_names_list_the_allowed_ones():
    with pytest.raises(UnknownAlgorithmError, match=r"'ppo_gae'.*'grpo', 'grpo_no_std', 'rloo', 'reinforce_pp', 'gae'"):
        get_advantage_estimator("ppo_gae")
    with pytest.raises(ValueError, match=r"'none', 'broadcast', 'per_step'"):
        get_stepwise_mode("every_step")


# -------------------------------------------------------------------------------------------- token helpers
def test_place_outcome_rewards_on_last_action_token():
    mask = t([[1, 1, 0, 0, 1, 1, 0],  # trailing padding after the last model turn
              [1, 0, 1, 0, 0, 0, 0]])
    rewards = place_outcome_rewards(t([0.5, -2.0]), mask)
    assert torch.equal(rewards, t([[0, 0, 0, 0, 0, 0.5, 0],
                                   [0, 0, -2.0, 0, 0, 0, 0]]))


def test_place_outcome_rewards_rejects_rows_without_action_tokens():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        place_outcome_rewards(t([1.0, 1.0]), t([[1, 0], [0, 0]]))


def test_turn_index_numbers_runs_of_action_tokens():
    mask = t([[0, 1, 1, 0, 0, 1, 0, 1, 1],
              [1, 1, 1, 1, 0, 0, 0, 0, 0]])
    assert turn_index_from_mask(mask).tolist() == [[-1, 0, 0, -1, -1, 1, -1, 2, 2],
                                                   [0, 0, 0, 0, -1, -1, -1, -1, -1]]


# ---------------------------------------------------------------------------------------- group-relative scores
# Rows interleave groups 7, 3 and a singleton 42 (group ids are labels, not positions).
GROUPS = torch.tensor([7, 3, 7, 3, 7, 3, 7, 42])
SCORES = t([1.0, 2.0, 0.0, 4.0, 0.0, 9.0, 1.0, 0.7])
# group 7: scores 1, 0, 0, 1   mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3
# group 3: scores 2, 4, 9      mean 5,   deviations -3, -1, 4, unbiased var = (9 + 1 + 16) / 2 = 13
# group 42: one rollout -> its raw score 0.7
S7, S3 = math.sqrt(1 / 3) + 1e-6, math.sqrt(13) + 1e-6


def test_grpo_hand_computed():
    expected = [0.5 / S7, -3 / S3, -0.5 / S7, -1 / S3, -0.5 / S7, 4 / S3, 0.5 / S7, 0.7]
    torch.testing.assert_close(grpo_scores(SCORES, GROUPS), t(expected))


def test_grpo_no_std_hand_computed():
    expected = [0.5, -3.0, -0.5, -1.0, -0.5, 4.0, 0.5, 0.7]
    torch.testing.assert_close(grpo_no_std_scores(SCORES, GROUPS), t(expected))


def test_rloo_hand_computed():
    # A_i = s_i - mean of the OTHER rollouts of the group
    # group 7: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3;  group 3: 2 - 6.5, 4 - 5.5, 9 - 3
    expected = [2 / 3, -4.5, -2 / 3, -1.5, -2 / 3, 6.0, 2 / 3, 0.7]
    torch.testing.assert_close(rloo_scores(SCORES, GROUPS), t(expected))


@given(
    lone=st.floats(-10, 10, allow_nan=False),
    others=st.lists(st.floats(-10, 10, allow_nan=False), min_size=0, max_size=6),
    normalizer=st.sampled_from([grpo_scores, grpo_no_std_scores, rloo_scores]),
)
def test_group_of_one_gets_its_raw_score(lone, others, normalizer):
    # the lone rollout sits among rollouts of another group; its advantage is its score, whatever they are
    scores = t([*others, lone])
    groups = torch.tensor([1] * len(others) + [99])
    assert normalizer(scores, groups)[-1].item() == pytest.approx(lone, abs=1e-6)


@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=8), st.integers(0, 2**40))
def test_group_labels_are_only_labels(scores, offset):
    scores = t(scores)
    groups = torch.arange(len(scores)) % 2
    relabeled = groups * 1_000_003 + offset
    torch.testing.assert_close(grpo_scores(scores, groups), grpo_scores(scores, relabeled))


@pytest.mark.parametrize("name, normalizer", [("grpo", grpo_scores), ("grpo_no_std", grpo_no_std_scores),
                                              ("rloo", rloo_scores)])
def test_outcome_estimators_put_the_sequence_advantage_on_action_tokens_only(name, normalizer):
    mask = t([[1, 1, 0, 0, 1, 1, 0, 0],
              [1, 0, 0, 1, 1, 1, 1, 0],
              [1, 1, 1, 0, 0, 0, 0, 0],
              [1, 0, 1, 1, 0, 0, 0, 0]])
    scores = t([1.0, 0.0, 0.25, 3.0])
    groups = torch.tensor([5, 5, 5, 8])
    rewards = place_outcome_rewards(scores, mask)
    adv, returns = ADVANTAGE_ESTIMATORS[name](rewards, mask, group_index=groups)
    expected = normalizer(scores, groups).unsqueeze(1) * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, adv)


def test_outcome_estimators_need_groups():
    with pytest.raises(ValueError, match="group_index"):
        ADVANTAGE_ESTIMATORS["grpo"](t([[1.0]]), t([[1]]))


# -------------------------------------------------------------------------------------------------------- GAE
def test_gae_hand_computed_skips_the_observation():
    # gamma = lam = 0.5; token 1 is an observation whose value (99) must not matter; token 3 is padding.
    # t=2: delta = 1 + 0.5*0 - 2 = -1                 A2 = -1
    # t=1: observation: next_value (2) and last (-1) carry over
    # t=0: delta = 0 + 0.5*2 - 1 = 0                  A0 = 0 + 0.25 * (-1) = -0.25
    # returns = A + V on action tokens: 0.75, 1
    rewards, values, mask = t([[0, 0, 1, 0]]), t([[1, 99, 2, 55]]), t([[1, 0, 1, 0]])
    adv, ret = gae_advantages(rewards, mask, values=values, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, t([[-0.25, 0, -1, 0]]))
    torch.testing.assert_close(ret, t([[0.75, 0, 1, 0]]))


def test_gae_hand_computed_two_tokens_before_an_observation_span():
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72); tokens 2, 3 are an observation
    # t=4: delta = 1 - 2 = -1                         A4 = -1
    # t=1: delta = 0 + 0.9*2 - 1 = 0.8                A1 = 0.8 + 0.72*(-1) = 0.08
    # t=0: delta = 0 + 0.9*1 - 0.5 = 0.4              A0 = 0.4 + 0.72*0.08 = 0.4576
    rewards, values, mask = t([[0, 0, 0, 0, 1]]), t([[0.5, 1.0, 7, -3, 2.0]]), t([[1, 1, 0, 0, 1]])
    adv, ret = gae_advantages(rewards, mask, values=values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, t([[0.4576, 0.08, 0, 0, -1]]))
    torch.testing.assert_close(ret, t([[0.9576, 1.08, 0, 0, 1.0]]))


def gae_loop_reference(rewards, values, mask, gamma, lam):
    """Obviously-correct reference: drop the observation columns, run textbook GAE in Python floats, put back."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        steps = [i for i in range(T) if mask[b][i]]
        running = 0.0
        for k in reversed(range(len(steps))):
            i = steps[k]
            next_value = values[b][steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = rewards[b][i] + gamma * next_value - values[b][i]
            running = delta + gamma * lam * running
            adv[b][i] = running
    ret = [[adv[b][i] + values[b][i] if mask[b][i] else 0.0 for i in range(T)] for b in range(B)]
    return adv, ret


@st.composite
def episodes(draw, max_b=4, max_t=12):
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    value = st.floats(-10, 10, allow_nan=False, width=32)
    mask = [draw(st.lists(st.booleans(), min_size=T, max_size=T)) for _ in range(B)]
    rewards = [draw(st.lists(value, min_size=T, max_size=T)) for _ in range(B)]
    values = [draw(st.lists(value, min_size=T, max_size=T)) for _ in range(B)]
    return mask, rewards, values


@settings(max_examples=200, deadline=None)
@given(episodes(), unit_interval, unit_interval)
def test_gae_matches_the_loop_reference(episode, gamma, lam):
    mask, rewards, values = episode
    # the estimator ignores rewards at observation positions; the reference never reads them
    adv, ret = gae_advantages(t(rewards), t(mask), values=t(values), gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_loop_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, t(ref_adv), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ret, t(ref_ret), atol=1e-3, rtol=1e-4)


@settings(max_examples=200, deadline=None)
@given(episodes(), unit_interval, unit_interval, st.randoms(use_true_random=False))
def test_gae_does_not_depend_on_values_at_observation_positions(episode, gamma, lam, rng):
    mask, rewards, values = episode
    other = [[v if m else rng.uniform(-1e4, 1e4) for v, m in zip(vr, mr)] for vr, mr in zip(values, mask)]
    adv1, ret1 = gae_advantages(t(rewards), t(mask), values=t(values), gamma=gamma, lam=lam)
    adv2, ret2 = gae_advantages(t(rewards), t(mask), values=t(other), gamma=gamma, lam=lam)
    assert torch.equal(adv1, adv2)
    assert torch.equal(ret1 * t(mask), ret2 * t(mask))


@settings(max_examples=100, deadline=None)
@given(unit_interval, unit_interval, st.randoms(use_true_random=False))
def test_gae_deepeyes_check(gamma, lam, rng):
    """Port of the DeepEyes GAE correctness check (seed 002): two critics that differ only on observation
    positions (t0-t1, t5-t6) and padding (t9-t10) must give identical advantages and masked returns."""
    rewards = t([[0.0, 0.0, 0.1, 0.1, 0.1, 0.0, 0.0, 0.1, 1.0, 0.0, 0.0]])
    values1 = t([[rng.uniform(-100.0, 100.0), rng.random(), 4.0, 5.0, 6.0, rng.uniform(-100.0, 0), rng.random(),
                  7.0, 9.0, 0.0, 0.0]])
    values2 = t([[rng.random(), rng.uniform(-100.0, 100.0), 4.0, 5.0, 6.0, rng.random(), rng.uniform(0.0, 100.0),
                  7.0, 9.0, 0.0, 0.0]])
    eos_mask = t([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]])
    adv1, ret1 = gae_advantages(rewards, eos_mask, values=values1, gamma=gamma, lam=lam)
    adv2, ret2 = gae_advantages(rewards, eos_mask, values=values2, gamma=gamma, lam=lam)
    assert torch.equal(adv1, adv2), f"{adv1=}, {adv2=}"
    assert torch.equal(ret1 * eos_mask, ret2 * eos_mask), f"{ret1=}, {ret2=}"


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        gae_advantages(t([[1.0]]), t([[1]]))


# ------------------------------------------------------------------------------------------------ REINFORCE++
def test_reinforce_pp_discounts_across_observations_once_and_whitens_over_action_tokens():
    # gamma 0.5. Row 0: actions at t0, t2 with the observation t1 between; outcome 1 on t2.
    #   G2 = 1, G0 = 0 + 0.5 * 1 = 0.5 (one discount per action step; no reset at the observation)
    # Row 1: actions t0, t1, outcome 0 -> G = 0, 0.
    # Whitened over the four action tokens with the unbiased std.
    mask = t([[1, 0, 1], [1, 1, 0]])
    rewards = place_outcome_rewards(t([1.0, 0.0]), mask)
    adv, returns = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, t([[0.5, 0, 1.0], [0, 0, 0]]))
    g = [0.5, 1.0, 0.0, 0.0]
    mean, std = statistics.mean(g), statistics.stdev(g)
    z = [(x - mean) / std for x in g]
    torch.testing.assert_close(adv, t([[z[0], 0, z[1]], [z[2], z[3], 0]]))


# --------------------------------------------------------------------------------------------------- whitening
def test_whitening_is_batch_global_with_unbiased_variance():
    # action tokens 1, 2, 3 (across two rows): mean 2, unbiased var 1 -> -1, 0, 1 (biased would give +-1.2247)
    adv = t([[1.0, 100.0], [2.0, 3.0]])
    mask = t([[1, 0], [1, 1]])
    torch.testing.assert_close(whiten_advantages(adv, mask), t([[-1.0, 0.0], [0.0, 1.0]]))


# ------------------------------------------------------------------------------------------------- step-wise
def test_stepwise_broadcast_gives_every_step_the_final_step_advantage():
    mask = t([[1, 1, 0, 1, 1, 0],
              [1, 1, 1, 0, 0, 0]])
    turns = turn_index_from_mask(mask)
    adv = t([[5, 6, 0, 1, 3, 0],  # final turn (tokens 3, 4) has mean advantage 2
             [1, 2, 3, 0, 0, 0]])  # one turn: mean 2
    out = stepwise_broadcast(adv, torch.zeros_like(adv), mask, turns)
    torch.testing.assert_close(out, 2.0 * mask)


def test_stepwise_broadcast_is_the_identity_for_grpo():
    mask = t([[1, 1, 0, 1], [1, 0, 1, 1], [1, 1, 1, 1]])
    rewards = place_outcome_rewards(t([1.0, 0.0, 0.0]), mask)
    kwargs = dict(estimator="grpo", group_index=torch.tensor([0, 0, 0]), turn_index=turn_index_from_mask(mask))
    plain, _ = compute_advantages(rewards, mask, stepwise="none", **kwargs)
    broadcast, _ = compute_advantages(rewards, mask, stepwise="broadcast", **kwargs)
    torch.testing.assert_close(broadcast, plain)


def _episode_rows(turn_counts, T=8):
    """Rows of 2-token model turns separated by one observation token, padded to T."""
    mask = []
    for k in turn_counts:
        row = ([1, 1, 0] * k)[:-1]
        mask.append(row + [0] * (T - len(row)))
    return t(mask)


def test_stepwise_per_step_hand_computed():
    # The seed 003 example, gamma 0.95, Dr. GRPO normalizer (mean only) so the discount stays visible.
    # group 5: A has 3 steps, reward 1 -> G = [0.9025, 0.95, 1.0]
    #          B has 3 steps, reward 0 -> G = [0, 0, 0]
    #          C has 2 steps, reward 1 -> G = [0.95, 1.0]
    # group 2: D has 2 steps, reward 1 -> alone at every step: raw G = [0.95, 1.0]
    # step 0 of group 5: mean(0.9025, 0, 0.95) = 0.6175 -> A 0.285, B -0.6175, C 0.3325
    # step 1 of group 5: mean(0.95, 0, 1.0)    = 0.65   -> A 0.3,   B -0.65,   C 0.35
    # step 2 of group 5: only A and B: mean 0.5          -> A 0.5,   B -0.5
    mask = _episode_rows([3, 2, 3, 2])  # rows: A, D, B, C
    rewards = place_outcome_rewards(t([1.0, 1.0, 0.0, 1.0]), mask)
    groups = torch.tensor([5, 2, 5, 5])
    out = stepwise_per_step(torch.zeros_like(mask), rewards, mask, turn_index_from_mask(mask), group_index=groups,
                            estimator="grpo_no_std", gamma=0.95)

    def row(step_values):
        values = []
        for v in step_values:
            values += [v, v, 0.0]
        values = values[:-1]
        return values + [0.0] * (8 - len(values))

    expected = t([row([0.285, 0.3, 0.5]), row([0.95, 1.0]), row([-0.6175, -0.65, -0.5]), row([0.3325, 0.35])])
    torch.testing.assert_close(out, expected)


def test_stepwise_per_step_with_grpo_normalizes_each_step_index_separately():
    # two rollouts, rewards 1 and 0, gamma 0.9: every step pair (g, 0) normalizes to +-1/sqrt(2) (unbiased std of
    # two values a, 0 is a/sqrt(2)), regardless of the discount
    mask = _episode_rows([3, 3], T=8)
    rewards = place_outcome_rewards(t([1.0, 0.0]), mask)
    out, _ = compute_advantages(rewards, mask, estimator="grpo", stepwise="per_step", group_index=torch.tensor([0, 0]),
                                turn_index=turn_index_from_mask(mask), gamma=0.9)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(out, torch.stack([s * mask[0], -s * mask[1]]), atol=1e-5, rtol=1e-5)


def test_stepwise_per_step_rejects_estimators_without_a_group_normalizer():
    mask = _episode_rows([2])
    with pytest.raises(UnknownAlgorithmError, match=r"'gae'.*'grpo', 'grpo_no_std', 'rloo'"):
        stepwise_per_step(mask, mask, mask, turn_index_from_mask(mask), group_index=torch.tensor([0]),
                          estimator="gae")


# --------------------------------------------------------------------------------------------------- pipeline
def test_compute_advantages_whitens_after_the_estimator():
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    rewards = place_outcome_rewards(t([1.0, 0.0, 0.5]), mask)
    groups = torch.tensor([0, 0, 1])
    raw, _ = compute_advantages(rewards, mask, estimator="grpo_no_std", group_index=groups)
    whitened, _ = compute_advantages(rewards, mask, estimator="grpo_no_std", group_index=groups, whiten=True)
    # raw on action tokens: 0.5, 0.5 | -0.5 | 0.5, 0.5, 0.5 (the singleton keeps its raw 0.5)
    g = [0.5, 0.5, -0.5, 0.5, 0.5, 0.5]
    mean, std = statistics.mean(g), statistics.stdev(g)
    torch.testing.assert_close(raw, t([[0.5, 0.5, 0], [-0.5, 0, 0], [0.5, 0.5, 0.5]]))
    torch.testing.assert_close(whitened[mask.bool()], t([(x - mean) / std for x in g]))
    assert torch.equal(whitened[~mask.bool()], torch.zeros(3))


def test_compute_advantages_gae_returns_are_not_whitened():
    rewards, values, mask = t([[0, 0, 0, 0, 1]]), t([[0.5, 1.0, 7, -3, 2.0]]), t([[1, 1, 0, 0, 1]])
    adv, ret = compute_advantages(rewards, mask, estimator="gae", values=values, gamma=0.9, lam=0.8, whiten=True)
    torch.testing.assert_close(ret, t([[0.9576, 1.08, 0, 0, 1.0]]))
    assert adv[mask.bool()].mean().abs() < 1e-6


def test_random_seeded_smoke_every_combination_runs():
    rng = random.Random(0)
    mask = _episode_rows([3, 2, 3, 1], T=8)
    rewards = place_outcome_rewards(t([rng.random() for _ in range(4)]), mask)
    values = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for estimator in ADVANTAGE_ESTIMATORS:
        for stepwise in STEPWISE_MODES:
            if stepwise == "per_step" and estimator in ("reinforce_pp", "gae"):
                continue
            adv, ret = compute_advantages(rewards, mask, estimator=estimator, stepwise=stepwise,
                                          group_index=torch.tensor([0, 0, 1, 1]), values=values,
                                          turn_index=turn_index_from_mask(mask), gamma=0.9, lam=0.95)
            assert adv.shape == ret.shape == mask.shape
            assert torch.isfinite(adv).all() and torch.equal(adv * (1 - mask), torch.zeros_like(adv))
