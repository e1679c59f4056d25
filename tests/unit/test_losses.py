"""Policy losses, behavior weights, aggregation, entropy and value loss against hand-computed cases and properties
(docs/ALGORITHMS.md section 3)."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_agent_rl.algorithms import (
    BEHAVIOR_WEIGHT_MODES,
    LOSS_AGGREGATORS,
    POLICY_LOSSES,
    UnknownAlgorithmError,
    agg_loss,
    clipped_value_loss,
    decoupled_ppo_loss,
    entropy_from_logits,
    get_policy_loss,
    ppo_clip_per_token,
    ppo_loss,
)
from async_agent_rl.config import AlgorithmConfig

pytestmark = pytest.mark.unit


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_registry_names_match_config_literals():
    fields = AlgorithmConfig.model_fields
    assert tuple(POLICY_LOSSES) == get_args(fields["policy_loss"].annotation)
    assert tuple(BEHAVIOR_WEIGHT_MODES) == get_args(fields["behavior_weight_mode"].annotation)
    assert tuple(LOSS_AGGREGATORS) == get_args(fields["loss_agg_mode"].annotation)


def test_unknown_names_list_the_allowed_ones():
    with pytest.raises(UnknownAlgorithmError, match=r"'grpo_loss'.*'ppo', 'decoupled_ppo'"):
        get_policy_loss("grpo_loss")
    with pytest.raises(ValueError, match=r"'token-mean', 'seq-mean-token-sum'"):
        agg_loss(t([[1.0]]), t([[1]]), "sum")
    with pytest.raises(ValueError, match=r"'truncate', 'mask'"):
        decoupled_ppo_loss(t([[0.0]]), t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1]]), behavior_weight_mode="clip")


# ---------------------------------------------------------------------------------------------- PPO clipping
# eps_low 0.2, eps_high 0.28, dual clip c = 3.  L = max(-A r, -A clip(r, 0.8, 1.28)), then min(L, 3|A|) for A < 0
RATIO = t([[1.5, 1.25, 0.5, 5.0, 0.5, 1.1, 10.0]])
ADV = t([[1.0, 1.0, -1.0, -1.0, 2.0, -2.0, 1.0]])
PPO_EXPECTED = t([[
    -1.28,  # A=+1, r=1.5:  max(-1.5, -1.28) -> clipped at 1 + eps_high
    -1.25,  # A=+1, r=1.25: inside the asymmetric range (a symmetric 0.2 would clip it to -1.2)
    0.8,  # A=-1, r=0.5:  max(0.5, 0.8) -> clipped at 1 - eps_low
    3.0,  # A=-1, r=5:    max(5, 1.28) = 5, dual clip min(5, 3*1) = 3
    -1.0,  # A=+2, r=0.5:  max(-1.0, -1.6) = -1.0, unclipped (clipping never makes the loss smaller)
    2.2,  # A=-2, r=1.1:  max(2.2, 2.2), unclipped
    -1.28,  # A=+1, r=10:   max(-10, -1.28) -> clipped; the dual clip does not apply to A > 0
]])


def test_ppo_clip_hand_computed():
    loss, clipped, dual = ppo_clip_per_token(RATIO, ADV, clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0)
    torch.testing.assert_close(loss, PPO_EXPECTED)
    assert clipped.tolist() == [[True, False, True, False, False, False, True]]
    assert dual.tolist() == [[False, False, False, True, False, False, False]]


def test_ppo_clip_symmetric_and_without_dual_clip():
    loss, _, dual = ppo_clip_per_token(RATIO, ADV, clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip_c=None)
    # only tokens 0, 1, 3, 6 change: -1.2, -1.2, 5 (no dual clip), -1.2
    torch.testing.assert_close(loss, t([[-1.2, -1.2, 0.8, 5.0, -1.0, 2.2, -1.2]]))
    assert not dual.any()


def test_ppo_loss_value_gradient_and_metrics_hand_computed():
    behavior = t([[-1.0, -2.0, -0.5, -3.0, -1.5, -0.7, -4.0, -1.0]])  # last token: an observation
    logprobs = torch.cat([RATIO.log(), t([[123.0]])], dim=1) + behavior  # garbage log-prob on the observation
    logprobs.requires_grad_(True)
    adv = torch.cat([ADV, t([[50.0]])], dim=1)
    mask = t([[1, 1, 1, 1, 1, 1, 1, 0]])
    loss, metrics = ppo_loss(logprobs, None, behavior, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                             dual_clip_c=3.0)
    # token-mean over 7 action tokens of PPO_EXPECTED: (-1.28 - 1.25 + 0.8 + 3 - 1 + 2.2 - 1.28) / 7 = 1.19 / 7
    torch.testing.assert_close(loss, torch.tensor(1.19 / 7))
    loss.backward()
    # d/dlogprob of -A r = -A r on unclipped tokens (1: -1.25, 4: -1.0, 5: 2.2), 0 on clipped/dual-clipped ones
    torch.testing.assert_close(logprobs.grad, t([[0, -1.25, 0, 0, -1.0, 2.2, 0, 0]]) / 7)
    assert metrics["clip_frac"].item() == pytest.approx(3 / 7)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 7)
    # approx_kl = mean over action tokens of (r - 1) - log r
    r = RATIO.flatten().tolist()
    assert metrics["approx_kl"].item() == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 7, rel=1e-5)


@settings(max_examples=100, deadline=None)
@given(
    ratio=st.lists(st.floats(0.01, 50.0), min_size=1, max_size=16),
    adv=st.lists(st.floats(-5.0, 5.0, allow_nan=False), min_size=16, max_size=16),
    c=st.floats(1.01, 10.0),
)
def test_dual_clip_only_bites_for_negative_advantages(ratio, adv, c):
    ratio = t([ratio])
    adv = t([adv[: ratio.shape[1]]])
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    with_dual, _, dual = ppo_clip_per_token(ratio, adv, dual_clip_c=c, **kwargs)
    without, _, _ = ppo_clip_per_token(ratio, adv, dual_clip_c=None, **kwargs)
    nonneg = adv >= 0
    assert torch.equal(with_dual[nonneg], without[nonneg])
    assert not dual[nonneg].any()
    # where A < 0 the loss is min(L, c|A|), and the dual-clip flag marks exactly where it changed
    neg = ~nonneg
    torch.testing.assert_close(with_dual[neg], torch.minimum(without[neg], c * adv[neg].abs()))
    assert torch.equal(dual[neg], without[neg] > c * adv[neg].abs())


def test_dual_clip_constant_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_per_token(RATIO, ADV, clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip_c=1.0)


# ------------------------------------------------------------------------------------------------ decoupled PPO
def _stale_case():
    # A = 1 everywhere, live == proximal (r = 1, no clipping), so each action token's loss is -1 * w.
    # w = exp(proximal - behavior) = 0.5, 1.5, 3.0, (observation), 10.0; cap 2.
    weights = [0.5, 1.5, 3.0, 1.0, 10.0]
    proximal = t([[-1.0, -2.0, -0.5, -1.0, -3.0]])
    behavior = proximal - t([weights]).log()
    behavior[0, 3] = -50.0  # an observation: any behavior value there is ignored
    logprobs = proximal.clone().requires_grad_(True)
    mask = t([[1, 1, 1, 0, 1]])
    return logprobs, proximal, behavior, torch.ones(1, 5), mask


def test_decoupled_truncate_hand_computed():
    logprobs, proximal, behavior, adv, mask = _stale_case()
    loss, metrics = decoupled_ppo_loss(logprobs, proximal, behavior, adv, mask, behavior_weight_mode="truncate",
                                       behavior_weight_cap=2.0)
    # truncated weights 0.5, 1.5, 2, 2 -> loss = -(0.5 + 1.5 + 2 + 2) / 4
    torch.testing.assert_close(loss, torch.tensor(-1.5))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[-0.5, -1.5, -2.0, 0, -2.0]]) / 4)
    assert metrics["iw_mean"].item() == pytest.approx((0.5 + 1.5 + 3 + 10) / 4, rel=1e-5)
    assert metrics["iw_max"].item() == pytest.approx(10.0, rel=1e-5)
    assert metrics["iw_capped_frac"].item() == pytest.approx(0.5)
    # KL(behavior || proximal) by k3: mean of w - 1 - log w
    expected_kl = sum(w - 1 - math.log(w) for w in (0.5, 1.5, 3.0, 10.0)) / 4
    assert metrics["behavior_kl"].item() == pytest.approx(expected_kl, rel=1e-5)
    assert metrics["clip_frac"].item() == 0.0 and metrics["approx_kl"].item() == 0.0


def test_decoupled_mask_hand_computed():
    logprobs, proximal, behavior, adv, mask = _stale_case()
    loss, metrics = decoupled_ppo_loss(logprobs, proximal, behavior, adv, mask, behavior_weight_mode="mask",
                                       behavior_weight_cap=2.0)
    # tokens with w > 2 are dropped but stay in the denominator: -(0.5 + 1.5) / 4
    torch.testing.assert_close(loss, torch.tensor(-0.5))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[-0.5, -1.5, 0, 0, 0]]) / 4)
    assert metrics["iw_capped_frac"].item() == pytest.approx(0.5)


@st.composite
def policy_batches(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 8))
    logp = st.floats(-6.0, 0.0, allow_nan=False, width=32)
    rows = lambda strategy: [draw(st.lists(strategy, min_size=T, max_size=T)) for _ in range(B)]  # noqa: E731
    mask = rows(st.booleans())
    return t(rows(logp)), t(rows(logp)), t(rows(logp)), t(rows(st.floats(-3.0, 3.0, width=32))), t(mask)


LOSS_KWARGS = st.fixed_dictionaries({
    "clip_ratio_low": st.sampled_from([0.1, 0.2]),
    "clip_ratio_high": st.sampled_from([0.2, 0.28]),
    "dual_clip_c": st.sampled_from([None, 3.0]),
    "behavior_weight_mode": st.sampled_from(list(BEHAVIOR_WEIGHT_MODES)),
    "behavior_weight_cap": st.sampled_from([1.5, 2.0, 5.0]),
    "loss_agg_mode": st.sampled_from(list(LOSS_AGGREGATORS)),
})


@settings(max_examples=150, deadline=None)
@given(policy_batches(), LOSS_KWARGS)
def test_decoupled_equals_ppo_when_behavior_is_proximal(batch, kwargs):
    logprobs, proximal, _, adv, mask = batch
    live_a = logprobs.clone().requires_grad_(True)
    live_b = logprobs.clone().requires_grad_(True)
    dec, dec_metrics = decoupled_ppo_loss(live_a, proximal, proximal.clone(), adv, mask, **kwargs)
    ppo, ppo_metrics = ppo_loss(live_b, None, proximal.clone(), adv, mask, **kwargs)
    torch.testing.assert_close(dec, ppo, rtol=0, atol=0)
    (grad_dec,) = torch.autograd.grad(dec, live_a, allow_unused=True)
    (grad_ppo,) = torch.autograd.grad(ppo, live_b, allow_unused=True)
    torch.testing.assert_close(grad_dec, grad_ppo, rtol=0, atol=0)
    for key in ("clip_frac", "dual_clip_frac", "approx_kl"):
        torch.testing.assert_close(dec_metrics[key], ppo_metrics[key])
    assert dec_metrics["iw_capped_frac"].item() == 0.0


@settings(max_examples=150, deadline=None)
@given(policy_batches(), st.sampled_from([1.5, 2.0, 5.0]))
def test_truncate_and_mask_change_exactly_the_tokens_above_the_cap(batch, cap):
    _, proximal, behavior, adv, mask = batch
    adv = torch.where(adv.abs() < 0.1, torch.ones_like(adv), adv)  # every action token carries gradient
    w = (proximal - behavior).exp()

    def grad(mode, cap):
        live = proximal.clone().requires_grad_(True)  # r = 1: unclipped, d(loss_t)/d(logprob_t) = -A_t w_t / N
        loss, _ = decoupled_ppo_loss(live, proximal, behavior, adv, mask, behavior_weight_mode=mode,
                                     behavior_weight_cap=cap, dual_clip_c=None)
        (g,) = torch.autograd.grad(loss, live)
        return g

    uncapped = grad("truncate", 1e30)
    truncated, masked = grad("truncate", cap), grad("mask", cap)
    above = (w > cap) & mask.bool()
    below = ~above
    assert torch.equal(truncated[below], uncapped[below])
    assert torch.equal(masked[below], uncapped[below])
    torch.testing.assert_close(truncated[above], uncapped[above] * cap / w[above])
    assert torch.equal(masked[above], torch.zeros_like(masked[above]))
    assert (truncated[above] != 0).all() and (uncapped[above] != masked[above]).all()
    for mode in BEHAVIOR_WEIGHT_MODES:
        _, affected = BEHAVIOR_WEIGHT_MODES[mode](w, cap)
        assert torch.equal(affected & mask.bool(), above)


def test_behavior_and_proximal_logprobs_receive_no_gradient():
    logprobs, proximal, behavior, adv, mask = _stale_case()
    proximal.requires_grad_(True)
    behavior.requires_grad_(True)
    loss, _ = decoupled_ppo_loss(logprobs * 1.1, proximal, behavior, adv, mask, behavior_weight_cap=100.0)
    g_live, g_prox, g_behav = torch.autograd.grad(loss, [logprobs, proximal, behavior], allow_unused=True)
    assert g_live is not None and g_prox is None and g_behav is None


def test_decoupled_differs_from_ppo_under_staleness():
    logprobs, proximal, behavior, adv, mask = _stale_case()
    dec, _ = decoupled_ppo_loss(logprobs, proximal, behavior, adv, mask, behavior_weight_cap=2.0)
    ppo, _ = ppo_loss(logprobs, proximal, behavior, adv, mask)
    # PPO anchors on behavior: r = w = 0.5, 1.5, 3, 10 -> clip to 0.8: max(-0.5, -0.8) = -0.5, -1.2, -1.2, -1.2
    torch.testing.assert_close(ppo, torch.tensor((-0.5 - 1.2 - 1.2 - 1.2) / 4))
    assert not torch.isclose(dec, ppo)


def test_decoupled_needs_proximal_logprobs_and_a_cap_above_one():
    logprobs, proximal, behavior, adv, mask = _stale_case()
    with pytest.raises(ValueError, match="proximal_logprobs"):
        decoupled_ppo_loss(logprobs, None, behavior, adv, mask)
    with pytest.raises(ValueError, match="behavior_weight_cap"):
        decoupled_ppo_loss(logprobs, proximal, behavior, adv, mask, behavior_weight_cap=1.0)


def test_policy_losses_ignore_garbage_at_masked_positions():
    logprobs = t([[-1.0, float("nan"), -2.0]]).requires_grad_(True)
    behavior = t([[-1.2, float("inf"), -1.5]])
    proximal = t([[-1.1, -1e9, -1.9]])
    adv, mask = t([[1.0, float("nan"), -1.0]]), t([[1, 0, 1]])
    for name, fn in POLICY_LOSSES.items():
        loss, metrics = fn(logprobs, proximal, behavior, adv, mask)
        (g,) = torch.autograd.grad(loss, logprobs)
        assert torch.isfinite(loss), name
        assert torch.isfinite(g).all() and g[0, 1] == 0, name
        assert all(torch.isfinite(v) for v in metrics.values()), name


# -------------------------------------------------------------------------------------------------- aggregation
NAN = float("nan")
AGG_LOSS = t([[1.0, 2.0, 3.0, NAN],
              [4.0, NAN, NAN, NAN],
              [NAN, NAN, NAN, NAN]])  # the last sequence has no action token
AGG_MASK = t([[1, 1, 1, 0],
              [1, 0, 0, 0],
              [0, 0, 0, 0]])


@pytest.mark.parametrize("mode, horizon, expected", [
    ("token-mean", None, 10 / 4),  # (1 + 2 + 3 + 4) / 4 tokens
    ("seq-mean-token-sum", None, (6 + 4) / 2),  # sums 6 and 4, mean over the 2 non-empty sequences
    ("seq-mean-token-mean", None, (2 + 4) / 2),  # means 2 and 4
    ("seq-mean-token-sum-norm", None, (6 / 4 + 4 / 4) / 2),  # horizon defaults to T = 4
    ("seq-mean-token-sum-norm", 10, (6 / 10 + 4 / 10) / 2),  # a constant horizon (the response budget)
])
def test_aggregation_modes_hand_computed(mode, horizon, expected):
    assert agg_loss(AGG_LOSS, AGG_MASK, mode, horizon=horizon).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", list(LOSS_AGGREGATORS))
def test_aggregation_of_an_empty_mask_is_zero(mode):
    assert agg_loss(AGG_LOSS, torch.zeros_like(AGG_MASK), mode).item() == 0.0


# ------------------------------------------------------------------------------------------ entropy and value
def test_entropy_from_logits():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    logits[0, 0] = 0.0  # uniform over 7 -> log 7
    mask = t([[1, 1, 0], [1, 0, 1]])
    entropy = entropy_from_logits(logits, mask)
    expected = torch.distributions.Categorical(logits=logits).entropy() * mask
    torch.testing.assert_close(entropy, expected)
    assert entropy[0, 0].item() == pytest.approx(math.log(7), rel=1e-6)
    torch.testing.assert_close(entropy_from_logits(logits), torch.distributions.Categorical(logits=logits).entropy())


def test_clipped_value_loss_hand_computed():
    # value_clip 0.2; V_clip = old + clamp(V - old, -0.2, 0.2)
    # token 0: old 1, V 1.5, R 2  -> V_clip 1.2; (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64 -> 0.64 (clipped term wins)
    # token 1: old 1, V 0.9, R 1  -> V_clip 0.9; both 0.01 -> 0.01
    # token 2: old 0, V 1.0, R 0.1 -> V_clip 0.2; 0.81 vs 0.01 -> 0.81
    # token 3: masked
    values = t([[1.5, 0.9, 1.0, 7.0]]).requires_grad_(True)
    old = t([[1.0, 1.0, 0.0, -7.0]])
    returns = t([[2.0, 1.0, 0.1, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, metrics = clipped_value_loss(values, old, returns, mask, value_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.64 + 0.01 + 0.81) / 3))
    assert metrics["vf_clip_frac"].item() == pytest.approx(1 / 3)
    (g,) = torch.autograd.grad(loss, values)
    # token 0: the active clipped term is constant in V (clamped) -> 0; token 2: 0.5 * 2 * (1.0 - 0.1) / 3
    assert g[0, 0].item() == 0.0 and g[0, 3].item() == 0.0
    assert g[0, 2].item() == pytest.approx(0.9 / 3, rel=1e-5)
