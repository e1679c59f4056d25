"""Checkpoint -> resume: a resumed learner's next step matches the uninterrupted run; the saved policy loads with
transformers. Real DeepSpeed (CPU, gloo), GAE with a critic so both engines and their optimizers round-trip, two
mini-batches x two epochs so the Adam moments matter."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from async_agent_rl.batch import pack_batch
from async_agent_rl.config import build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.learner import Learner

pytestmark = pytest.mark.integration


def episode(prompt: list[int], model1: list[int], obs: list[int], model2: list[int], reward: float, group: str):
    n1, n2, k = len(model1), len(model2), len(obs)
    mask = [1] * n1 + [0] * k + [1] * n2
    return Trajectory(
        prompt_ids=prompt, response_ids=model1 + obs + model2, loss_mask=mask,
        behavior_logprobs=[-7.0 if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask],
        turns=[TurnSpan("model", 0, n1), TurnSpan("observation", n1, n1 + k), TurnSpan("model", n1 + k, n1 + k + n2)],
        reward=reward, meta=EpisodeMeta(group_id=group))


def batch(offset: int):
    rows = [episode([11, 12, 13 + i % 3], [300 + offset + i, 301 + i], [400 + i], [302 + offset, 303 + i],
                    float(i % 2), f"g{i // 2}") for i in range(4)]
    return pack_batch(rows, pad_id=0)


@pytest.fixture
def cfg(tiny_model_dir):
    return build_config({
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"group_size": 2},
        "learner": {"batch_size": 4, "mini_batch_size": 2, "micro_batch_size": 1, "ppo_epochs": 2, "lr": 1e-3,
                    "critic_lr": 1e-3, "zero_stage": 1, "dtype": "bfloat16", "warmup_steps": 1,
                    "lr_schedule": "cosine", "total_steps": 4},
        "algorithm": {"advantage_estimator": "gae", "lam": 0.9, "entropy_coef": 0.01},
    })


def test_resumed_learner_continues_where_it_stopped(cfg, tmp_path):
    from transformers import AutoModelForCausalLM

    b1, b2 = batch(0), batch(50)
    first = Learner(cfg)
    first.train_step(b1)
    first.bump_version()
    save_checkpoint(first, tmp_path / "ckpt")
    saved_policy = first.state_dict_for_publish()
    draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    uninterrupted = first.train_step(b2)
    uninterrupted_params = first.state_dict_for_publish()
    del first

    resumed = Learner(cfg)
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert (resumed.step, resumed.version) == (1, 1)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == draws
    after_resume = resumed.train_step(b2)

    for key in ("policy_loss", "value_loss", "entropy", "grad_norm", "critic_grad_norm", "lr"):
        assert getattr(after_resume, key) == pytest.approx(getattr(uninterrupted, key), rel=1e-4, abs=1e-6), key
    resumed_params = resumed.state_dict_for_publish()
    for name, value in uninterrupted_params.items():
        np.testing.assert_allclose(resumed_params[name], value, rtol=0, atol=1e-6, err_msg=name)

    # the saved policy is a plain transformers folder (bf16 weights, config, tokenizer) with the learner's weights
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "policy")
    assert next(policy.parameters()).dtype == torch.bfloat16
    for name, p in policy.named_parameters():
        np.testing.assert_array_equal(p.detach().float().numpy(), saved_policy[name], err_msg=name)
    assert (tmp_path / "ckpt" / "policy" / "tokenizer.json").is_file()
