"""Proximal log-probs without a second forward pass (``algorithm.proximal``; docs/ALGORITHMS.md section 3): the exact
skip of an all-fresh batch, AReaL's log-linear interpolation and the behavior policy as proximal, against
hand-computed values; and the learner's ``_targets`` on a real tiny model, counting its forward passes."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

from async_agent_rl.algorithms import (
    PROXIMAL_MODES,
    all_loss_tokens_fresh,
    decoupled_ppo_loss,
    interpolated_proximal,
    interpolation_alpha,
    ppo_loss,
)
from async_agent_rl.batch import pack_batch
from async_agent_rl.config import AlgorithmConfig, ConfigError, build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from learner.learner import Learner, _Window

pytestmark = pytest.mark.unit


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_modes_match_the_config_literals():
    assert PROXIMAL_MODES == get_args(AlgorithmConfig.model_fields["proximal"].annotation)


# ------------------------------------------------------------------------------------------------ the exact skip
def test_a_batch_is_all_fresh_only_when_every_loss_token_is_of_the_proximal_version():
    loss = t([[1, 1, 0, 1]])
    sampled = loss.bool()
    versions = torch.tensor([[4, 4, -1, 4]])
    assert all_loss_tokens_fresh(loss, sampled, versions, 4)
    assert not all_loss_tokens_fresh(loss, sampled, versions, 5)  # sampled by weights the learner no longer holds
    assert not all_loss_tokens_fresh(loss, sampled, versions, None)  # weights moved since the publish: none fresh
    stale = torch.tensor([[4, 3, -1, 4]])
    assert not all_loss_tokens_fresh(loss, sampled, stale, 4)  # one token of version 3 is enough to run the pass
    # an unmasked observation takes the loss but was never sampled: not fresh, the pass runs
    assert not all_loss_tokens_fresh(t([[1, 1, 1, 1]]), sampled, versions, 4)
    # a stale token outside the loss (a filler row holds none) does not count; no loss token at all: nothing to run
    assert all_loss_tokens_fresh(t([[1, 1, 0, 0]]), sampled, torch.tensor([[4, 4, -1, 2]]), 4)
    assert all_loss_tokens_fresh(t([[0, 0, 0, 0]]), sampled, stale, 4)


def test_skipping_changes_the_loss_by_the_mismatch_only():
    """proximal := behavior gives w = 1 and ratio exp(lp - behavior): the recomputed proximal's loss at d = 0, and
    within the mismatch d of it otherwise. Hand values: A = 1, behavior -1, live -0.9 (ratio exp(0.1) inside the
    clip), one token."""
    lp, behavior, adv, mask = t([[-0.9]]), t([[-1.0]]), t([[1.0]]), t([[1.0]])
    skipped, _ = decoupled_ppo_loss(lp, behavior, behavior, adv, mask)
    assert skipped.item() == pytest.approx(-math.exp(0.1), rel=1e-6)
    exact, _ = decoupled_ppo_loss(lp, behavior.clone(), behavior, adv, mask)  # the pass computed exactly the engine's
    assert exact.item() == skipped.item()
    # mismatch d = 1e-3: today's loss is -w r = -exp(d) exp(0.1 - d) = -exp(0.1), the same value; its clip anchor
    # moved by d, which matters only at the clip's edge
    today, _ = decoupled_ppo_loss(lp, behavior + 1e-3, behavior, adv, mask)
    assert today.item() == pytest.approx(skipped.item(), abs=1e-6)


# -------------------------------------------------------------------------------------------------- interpolation
def test_interpolation_alpha_by_version():
    versions = torch.tensor([[3, 2, 0, -1]])
    sampled = torch.tensor([[True, True, True, False]])
    # a publish every step: v_prox 3, v_theta 4 -> alpha = s / (s + 1) for s = 0, 1, 3; 0 where nothing was sampled
    alpha = interpolation_alpha(versions, sampled, 3.0, 4.0)
    assert alpha[0].tolist() == pytest.approx([0.0, 0.5, 0.75, 0.0])
    # weight_sync.every_steps 2, one step since the publish of 3: v_prox 3.5, v_theta 4
    # version 3: 0.5 / 1 = 0.5; version 2: 1.5 / 2 = 0.75; version 0: 3.5 / 4 = 0.875
    alpha = interpolation_alpha(versions, sampled, 3.5, 4.0)
    assert alpha[0].tolist() == pytest.approx([0.5, 0.75, 0.875, 0.0])
    with pytest.raises(ValueError, match="v_theta > v_prox"):
        interpolation_alpha(versions, sampled, 3.0, 3.0)


def test_interpolated_proximal_and_the_decoupled_loss_by_hand():
    """Three tokens, versions 3, 2, 0 under v_prox 3, v_theta 4 (alpha 0, 1/2, 3/4); clip 0.2, dual clip 3, cap 2."""
    behavior = t([[-1.0, -2.0, -0.5]])
    lp = t([[-0.9, -1.0, -1.5]]).requires_grad_()
    alpha = interpolation_alpha(torch.tensor([[3, 2, 0]]), torch.ones(1, 3, dtype=torch.bool), 3.0, 4.0)
    prox = interpolated_proximal(behavior, lp, alpha)
    # -1 + 0 * 0.1 = -1;  -2 + 0.5 * 1 = -1.5;  -0.5 + 0.75 * (-1) = -1.25
    assert prox[0].tolist() == pytest.approx([-1.0, -1.5, -1.25])
    assert not prox.requires_grad  # a constant of the loss, like a recomputed one
    adv = t([[1.0, 1.0, -1.0]])
    loss, m = decoupled_ppo_loss(lp, prox, behavior, adv, torch.ones(1, 3))
    # token 0: r = exp(0.1) = 1.10517 (inside the clip), w = 1                      -> -1.10517
    # token 1: r = exp(0.5) = 1.64872, clipped to 1.2 for A > 0, w = exp(0.5) < 2     -> -1.2 * 1.64872 = -1.97846
    # token 2: r = exp(-0.25) = 0.77880, A < 0: max(0.77880, 0.8) = 0.8, w = exp(-0.75) -> 0.8 * 0.47237 = 0.37789
    expected = (-math.exp(0.1) - 1.2 * math.exp(0.5) + 0.8 * math.exp(-0.75)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["iw_mean"].item() == pytest.approx((1 + math.exp(0.5) + math.exp(-0.75)) / 3, rel=1e-5)
    loss.backward()
    # only token 0 is unclipped: d(-r w / 3)/d lp = -exp(0.1) / 3; the proximal point takes no gradient
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(0.1) / 3, 0.0, 0.0], abs=1e-6)


# -------------------------------------------------------------------------------------------------------- bypass
def test_the_behavior_policy_as_proximal_is_plain_ppo():
    g = torch.Generator().manual_seed(0)
    behavior = -torch.rand(3, 6, generator=g) * 3
    live = (behavior + torch.randn(3, 6, generator=g) * 0.5).requires_grad_()
    adv, mask = torch.randn(3, 6, generator=g), (torch.rand(3, 6, generator=g) > 0.2).float()
    bypass, m = decoupled_ppo_loss(live, behavior, behavior, adv, mask)
    (grad_bypass,) = torch.autograd.grad(bypass, live)
    plain, _ = ppo_loss(live, None, behavior, adv, mask)
    (grad_plain,) = torch.autograd.grad(plain, live)
    assert bypass.item() == plain.item()
    assert torch.equal(grad_bypass, grad_plain)
    assert m["iw_mean"].item() == 1.0 and m["iw_capped_frac"].item() == 0.0


# -------------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("algorithm,message", [
    ({"proximal": "behavior", "mask_observations": False}, "needs mask_observations=true"),
    ({"proximal": "interpolate", "policy_loss": "ppo", "mask_observations": False}, "needs mask_observations=true"),
    ({"proximal": "skip"}, "proximal"),
])
def test_bad_proximal_settings_are_refused(algorithm, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"algorithm": algorithm})


def test_skip_fresh_is_the_default_and_every_mode_loads_with_plain_ppo():
    """Under ``ppo`` the key does nothing; ``bench staleness --seeds`` adds a ``policy_loss=ppo`` arm to a sweep run
    with ``algorithm.proximal=...`` for every arm."""
    assert build_config({}).algorithm.proximal == "skip_fresh"
    assert build_config({"algorithm": {"policy_loss": "ppo", "mask_observations": False}}).algorithm.proximal
    for mode in PROXIMAL_MODES:
        assert build_config({"algorithm": {"policy_loss": "ppo", "proximal": mode}}).algorithm.proximal == mode


# ------------------------------------------------------------------------------------- the learner's _targets
def trajectory(prompt, turns, logprobs, version, reward, group) -> Trajectory:
    response = [tok for _, ids in turns for tok in ids]
    mask, spans, pos = [], [], 0
    for kind, ids in turns:
        mask += [1 if kind == "model" else 0] * len(ids)
        spans.append(TurnSpan(kind, pos, pos + len(ids)))
        pos += len(ids)
    return Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=mask,
                      behavior_logprobs=[x if m else 0.0 for x, m in zip(logprobs, mask)],
                      versions=[version if m else -1 for m in mask], turns=spans, reward=reward,
                      meta=EpisodeMeta(group_id=group)).validate()


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def batch_of(model, versions):
    """Two groups of two; behavior log-probs are the model's own (the engine's, without numerical mismatch)."""
    rows = [([5, 6, 7, 8], [("model", [20, 21, 22]), ("observation", [30, 31]), ("model", [23])], 1.0, "a"),
            ([5, 6, 7, 8], [("model", [24, 25])], 0.0, "a"),
            ([9, 10, 11], [("model", [26, 27, 28, 29])], 1.0, "b"),
            ([9, 10, 11], [("model", [40]), ("observation", [41]), ("model", [42, 43])], 0.0, "b")]
    out = []
    for (prompt, turns, reward, group), version in zip(rows, versions):
        ids = prompt + [tok for _, part in turns for tok in part]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        out.append(trajectory(prompt, turns, lp[len(prompt) - 1:].tolist(), version, reward, group))
    return pack_batch(out, 0)


class CountingForwards:
    """The real model, counting its forward passes."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def bare_learner(model, proximal: str, version: int = 2, **algorithm) -> Learner:
    """A Learner around a real model without DeepSpeed: what ``_targets`` uses (config, version bookkeeping, the
    policy's forward)."""
    learner = Learner.__new__(Learner)
    learner.cfg = build_config({"rollout": {"group_size": 2},
                                "learner": {"batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2},
                                "algorithm": {"proximal": proximal, **algorithm}})
    learner.step, learner.version, learner._weights_of = 5, version, (5, version)
    learner.rank, learner.world_size, learner.device = 0, 1, torch.device("cpu")
    learner.temperature, learner.needs_proximal = 1.0, True
    learner.policy = SimpleNamespace(engine=CountingForwards(model))
    learner.reference = learner.critic = None
    return learner


def targets(learner, batch):
    w = _Window.of(batch, learner.cfg.algorithm.mask_observations, learner.device)
    return w, learner._targets(w, batch.batch_size)


def test_skip_fresh_runs_no_forward_for_an_all_fresh_batch_and_the_loss_is_todays(policy):
    batch = batch_of(policy, versions=(2, 2, 2, 2))
    skip = bare_learner(policy, "skip_fresh")
    w, t_skip = targets(skip, batch)
    assert skip.policy.engine.calls == 0 and not t_skip.proximal_pass
    assert torch.equal(t_skip.proximal_logprobs, w.behavior_logprobs)
    recompute = bare_learner(policy, "recompute")
    _, t_today = targets(recompute, batch)
    assert recompute.policy.engine.calls == 2 and t_today.proximal_pass  # 4 rows in micro-batches of 2
    # the loss with a live policy that moved a little: equal up to the (here float-rounding) mismatch
    live = w.behavior_logprobs + 0.05 * torch.sin(torch.arange(w.width, dtype=torch.float32))
    args = (t_skip.advantages, w.mask)
    loss_skip, _ = decoupled_ppo_loss(live, t_skip.proximal_logprobs, t_skip.behavior_logprobs, *args)
    loss_today, _ = decoupled_ppo_loss(live, t_today.proximal_logprobs, t_today.behavior_logprobs, *args)
    assert loss_skip.item() == pytest.approx(loss_today.item(), abs=1e-5)
    assert (t_today.proximal_logprobs - w.behavior_logprobs)[w.mask.bool()].abs().max() < 1e-4  # the mismatch


@pytest.mark.parametrize("case", ["stale token", "weights moved since the publish", "icepop band", "observations"])
def test_skip_fresh_runs_the_pass_when_the_skip_would_not_be_exact(policy, case):
    versions = (2, 1, 2, 2) if case == "stale token" else (2, 2, 2, 2)
    algorithm = {"icepop_band": [0.5, 2.0]} if case == "icepop band" else {}
    if case == "observations":
        algorithm = {"mask_observations": False}
    learner = bare_learner(policy, "skip_fresh", **algorithm)
    if case == "weights moved since the publish":
        learner.step = 6  # trained once more, not published: no engine ran these weights
    _, t = targets(learner, batch_of(policy, versions))
    assert learner.policy.engine.calls == 2 and t.proximal_pass


@pytest.mark.parametrize("proximal", ["interpolate", "behavior"])
def test_interpolate_and_behavior_run_no_forward_even_for_stale_batches(policy, proximal):
    learner = bare_learner(policy, proximal)
    w, t = targets(learner, batch_of(policy, versions=(2, 1, 0, 2)))
    assert learner.policy.engine.calls == 0 and not t.proximal_pass
    if proximal == "behavior":
        assert torch.equal(t.proximal_logprobs, w.behavior_logprobs) and t.interpolation_alpha is None
    else:
        assert t.proximal_logprobs is None
        sampled = w.generated
        # v_prox 2, v_theta 3: versions 2, 1, 0 -> alpha 0, 1/2, 2/3 on sampled tokens, 0 elsewhere
        per_row = [t.interpolation_alpha[r][sampled[r]].unique().tolist() for r in range(4)]
        assert per_row == [[0.0], [0.5], [pytest.approx(2 / 3)], [0.0]]
        assert (t.interpolation_alpha[~sampled] == 0).all()


def test_the_version_clock_of_interpolation(policy):
    learner = bare_learner(policy, "interpolate", version=3)
    assert learner.proximal_version_clock() == (3.0, 4.0)  # published at this step
    learner.cfg.weight_sync.every_steps = 2
    learner.step = 6  # one step past the publish of version 3, every 2 steps a version
    assert learner.proximal_version_clock() == (3.5, 4.0)


def test_a_step_without_the_pass_reports_no_mismatch_and_counts_as_skipped(policy):
    from learner.learner import _Metrics

    batch = batch_of(policy, versions=(2, 2, 2, 2))
    for proximal, skipped in (("skip_fresh", 1.0), ("recompute", 0.0)):
        learner = bare_learner(policy, proximal)
        w, t = targets(learner, batch)
        metrics = _Metrics()
        learner._mismatch(w, t, metrics)
        out = learner._step_metrics(metrics, w, t, 1e-3, 1.0, batch.min_versions(), batch.batch_size)
        assert out["proximal_pass_skipped"] == skipped
        # the pass measures the mismatch of the fresh tokens (float rounding here); a skipped step has none to report
        assert ("mismatch_kl_fresh" in out) == (proximal == "recompute")
        if proximal == "recompute":
            assert out["fresh_token_fraction"] == 1.0 and out["mismatch_abs_logprob_fresh"] < 1e-4
