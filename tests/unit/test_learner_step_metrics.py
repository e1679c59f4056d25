"""The learner's step-metric reduction (``_Metrics``) and which tokens count as fresh (``Learner.proximal_version``),
without DeepSpeed: the pieces the mismatch metrics rest on (docs/ALGORITHMS.md section 3)."""

from __future__ import annotations

import pytest
import torch

from async_agent_rl.algorithms import MISMATCH_METRICS, mismatch_metrics
from learner.learner import MAX_METRICS, Learner, _Metrics

pytestmark = pytest.mark.unit


def test_count_weighted_parts_give_the_whole_batch_mean_and_max():
    # two ranks' (or parts') rows: fresh d = 0.1 x3 in part A, 0.4 x1 in part B -> mean |d| over 4 tokens = 0.175
    proximal = torch.zeros(2, 3)
    parts = [(torch.tensor([[0.1, 0.1, 0.1]]), torch.ones(1, 3)), (torch.tensor([[0.4, 0.0, 0.0]]),
                                                                   torch.tensor([[1.0, 0, 0]]))]
    metrics = _Metrics()
    for d, sampled in parts:
        values, counts = mismatch_metrics(proximal[:1], proximal[:1] - d, sampled, torch.ones(1, 3))
        for k, v in values.items():
            metrics.add({k: v}, weight=counts[k])
    whole, counts = mismatch_metrics(proximal, proximal - torch.cat([p[0] for p in parts]),
                                     torch.cat([p[1] for p in parts]), torch.ones(2, 3))
    out = metrics.result()
    assert out["mismatch_abs_logprob_fresh"] == pytest.approx(0.175, rel=1e-5)
    for k in MISMATCH_METRICS:
        assert out[k] == pytest.approx(whole[k].item(), rel=1e-5, abs=1e-7), k
    assert "seq_log_ratio_max" in MAX_METRICS and out["seq_log_ratio_max"] == pytest.approx(0.4, rel=1e-5)
    # no stale token anywhere: the stale means have weight 0 (the learner reports them as absent)
    assert metrics.weight("mismatch_kl_stale") == 0 and metrics.weight("mismatch_kl_fresh") == 4


def test_a_max_metric_over_nothing_has_no_value_and_does_not_win():
    metrics = _Metrics()
    metrics.add({"seq_log_ratio_max": 0.0}, weight=0)  # a part without rows
    assert metrics.weight("seq_log_ratio_max") == 0 and metrics.result()["seq_log_ratio_max"] == 0.0
    metrics.add({"seq_log_ratio_max": -0.5}, weight=2)
    metrics.add({"seq_log_ratio_max": 0.0}, weight=0)
    assert metrics.result()["seq_log_ratio_max"] == -0.5  # the empty part's 0 is not a value
    metrics.add({"iw_max": 3.0})  # the existing max metrics, added with the default weight, are unchanged
    metrics.add({"iw_max": 2.0})
    assert metrics.result()["iw_max"] == 3.0


def bare_learner() -> Learner:
    """A Learner with only its version bookkeeping (no model, no DeepSpeed)."""
    learner = Learner.__new__(Learner)
    learner.step, learner.version, learner._weights_of = 0, 0, (0, 0)
    return learner


def test_tokens_are_fresh_only_while_the_weights_are_the_published_version():
    learner = bare_learner()
    assert learner.proximal_version() == 0  # the initial weights are version 0 in every engine
    learner.step = 1  # trained, not yet published (weight_sync.every_steps > 1): no engine runs these weights
    assert learner.proximal_version() is None
    assert learner.bump_version() == 1
    assert learner.proximal_version() == 1
    learner.step = 2
    assert learner.proximal_version() is None
    learner.step = 3
    learner.bump_version()
    assert learner.proximal_version() == 2


def test_a_restored_checkpoint_is_its_version():
    learner = bare_learner()
    learner.step, learner.version = 7, 3  # as learner.checkpoint restores them; the engines start from these weights
    assert learner.proximal_version() == 3
    learner.step = 8
    assert learner.proximal_version() is None
