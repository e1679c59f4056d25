"""KL estimators against hand-computed values, the exact KL of small categoricals, and properties."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from async_agent_rl.algorithms import KL_ESTIMATORS, UnknownAlgorithmError, get_kl_estimator, kl_k3, kl_penalty
from async_agent_rl.config import AlgorithmConfig

pytestmark = pytest.mark.unit

LN2 = math.log(2.0)


def test_registry_names_match_config_literal():
    assert tuple(KL_ESTIMATORS) == get_args(AlgorithmConfig.model_fields["kl_estimator"].annotation)


def test_unknown_estimator_lists_the_allowed_ones():
    with pytest.raises(UnknownAlgorithmError, match=r"'low_var'.*'k1', 'abs', 'k2', 'k3'"):
        get_kl_estimator("low_var")


@pytest.mark.parametrize("name, expected", [
    # logprob = log 0.5, ref = log 0.25: d = lp - ref = ln 2
    ("k1", LN2),  # d
    ("abs", LN2),  # |d|
    ("k2", 0.5 * LN2**2),  # 0.5 d^2 = 0.2402
    ("k3", 0.5 + LN2 - 1),  # exp(ref - lp) - (ref - lp) - 1 = 0.5 + ln 2 - 1 = 0.1931
])
def test_hand_computed_when_the_policy_is_above_the_reference(name, expected):
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert kl_penalty(lp, ref, name).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("name, expected", [
    # logprob = log 0.25, ref = log 0.5: d = -ln 2
    ("k1", -LN2),
    ("abs", LN2),
    ("k2", 0.5 * LN2**2),
    ("k3", 2.0 - LN2 - 1),  # exp(ln 2) - ln 2 - 1 = 0.3069
])
def test_hand_computed_when_the_policy_is_below_the_reference(name, expected):
    lp, ref = torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.5)]])
    assert kl_penalty(lp, ref, name).item() == pytest.approx(expected, rel=1e-6)


@given(st.floats(-30, 0, allow_nan=False), st.floats(-30, 0, allow_nan=False))
def test_k3_is_non_negative_zero_at_equality_finite_and_clamped(lp, ref):
    value = kl_k3(torch.tensor([lp]), torch.tensor([ref]))
    assert torch.isfinite(value).all()
    assert 0.0 <= value.item() <= 10.0
    assert kl_k3(torch.tensor([lp]), torch.tensor([lp])).item() == 0.0


def test_k3_clamp_bounds_the_value_and_its_gradient_stays_finite():
    lp = torch.tensor([-40.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    value = kl_k3(lp, ref)  # first token: ref - lp = 39 -> exp(20) - 20 - 1 before the clamp to 10
    assert value[0].item() == 10.0 and value[1].item() == 0.0
    value.sum().backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_average_to_the_exact_kl(name):
    # sample tokens from pi, average the estimator, compare with KL(pi || ref) = sum_x pi(x) log(pi(x) / ref(x))
    gen = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(6, generator=gen), dim=0)
    ref = torch.softmax(torch.randn(6, generator=gen), dim=0)
    exact = (pi * (pi / ref).log()).sum().item()
    tokens = torch.multinomial(pi, 400_000, replacement=True, generator=gen)
    samples = kl_penalty(pi.log()[tokens], ref.log()[tokens], name)
    stderr = samples.std().item() / math.sqrt(samples.numel())
    assert abs(samples.mean().item() - exact) < 5 * stderr


def test_k2_and_abs_are_biased_but_non_negative():
    lp = torch.tensor([-0.1, -2.0, -5.0])
    ref = torch.tensor([-3.0, -2.0, -0.5])
    for name in ("k2", "abs"):
        assert (kl_penalty(lp, ref, name) >= 0).all()
