"""Two learner ranks as two real Ray actors (DeepSpeed ZeRO-2, gloo on CPU): identical parameters on both ranks
after training, and the same parameters and the same step metrics (losses, entropy, clip and importance-weight
statistics over the whole batch) as one rank training on the whole batch (data parallelism changes how the work is
split, not the update, nor what is reported about it)."""

from __future__ import annotations


import numpy as np
import pytest
import ray

from async_agent_rl.batch import pack_batch
from async_agent_rl.config import build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from learner.actor import create_learner_group
from learner.learner import Learner

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray")]


def episode(i: int) -> Trajectory:
    """Rows of different lengths and rewards, two groups of two."""
    model1, obs, model2 = [300 + i] * (2 + i), [400 + i] * 2, [350 + i, 351]
    n1, k, n2 = len(model1), len(obs), len(model2)
    mask = [1] * n1 + [0] * k + [1] * n2
    return Trajectory(
        prompt_ids=[11, 12, 13][: 2 + i % 2], response_ids=model1 + obs + model2, loss_mask=mask,
        behavior_logprobs=[-7.0 if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask],
        turns=[TurnSpan("model", 0, n1), TurnSpan("observation", n1, n1 + k), TurnSpan("model", n1 + k, n1 + k + n2)],
        reward=float(i % 2), meta=EpisodeMeta(group_id=f"g{i // 2}"))


def test_two_ranks_train_identical_parameters(tiny_model_dir):
    tree = {
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"group_size": 2},
        "learner": {"batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 1, "ppo_epochs": 2, "lr": 1e-3,
                    "zero_stage": 2, "num_ranks": 2},
        "algorithm": {"advantage_estimator": "grpo", "policy_loss": "decoupled_ppo"},
        "cluster": {"learner_cpus": 0.5},
    }
    batch = pack_batch([episode(i) for i in range(4)], pad_id=0)
    group = create_learner_group(build_config(tree))
    assert group.ready() == [0, 1]
    metrics = [group.train_step(batch) for _ in range(3)]
    assert all(m.grad_norm > 0 for m in metrics)

    rank0, rank1 = ray.get([a.state_dict_for_publish.remote() for a in group.actors])
    assert rank1 is None  # only rank 0 hands out the weights
    rank1 = ray.get(group.actors[1].__ray_call__.remote(lambda actor: actor.learner.state_dict_for_publish()))
    for name, value in rank0.items():
        np.testing.assert_array_equal(rank1[name], value, err_msg=name)

    tree["learner"]["num_ranks"] = 1
    single = Learner(build_config(tree))
    initial = single.state_dict_for_publish()
    single_metrics = [single.train_step(batch) for _ in range(3)]
    alone = single.state_dict_for_publish()
    assert any(not np.array_equal(initial[n], alone[n]) for n in alone)
    # The same update up to float sums in another order. Adam divides by the gradient's running RMS, so where a
    # gradient is near zero that order noise can move an element by a fraction of lr; bound it well below the
    # 3 * lr an element can move in three steps, and require nearly every element to agree to 1e-5.
    lr_total = 3 * tree["learner"]["lr"]
    for name, value in alone.items():
        diff = np.abs(rank0[name] - value)
        assert diff.max() < 0.1 * lr_total, (name, float(diff.max()))
        assert (diff > 1e-5).mean() < 1e-3, (name, float((diff > 1e-5).mean()))

    # What each step reports is about the whole batch, not rank 0's half of it. Before the learner reduced its
    # metrics over the ranks, rank 0's policy_loss, entropy, clip and importance-weight statistics covered only its own
    # rows (here the reward-0 rows 0 and 2: another loss altogether).
    for step, (two, one) in enumerate(zip(metrics, single_metrics), 1):
        for key in ("policy_loss", "entropy", "approx_kl", "clip_frac", "iw_mean", "iw_max", "iw_capped_frac",
                    "behavior_kl", "grad_norm", "reward_mean", "advantage_mean", "loss_tokens", "staleness_max"):
            a, b = getattr(two, key), getattr(one, key)
            assert a == pytest.approx(b, rel=1e-4, abs=1e-6), (step, key, a, b)
