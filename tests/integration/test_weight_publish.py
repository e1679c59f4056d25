"""A learner's published version reaches a REAL vLLM engine through the Ray object store and changes its greedy
output: the learner trains one response until it is the model's greedy continuation of its prompt, publishes, and
the engine (in a Ray actor, vLLM CPU build, in-process engine core) now generates exactly that response, with the
new version stamped on its tokens. The publish latency is recorded."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from async_agent_rl.batch import pack_batch
from async_agent_rl.config import build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from learner.learner import Learner
from driver.weight_sync import ObjectStorePublisher
from tests.helpers import VLLM_ENV, EngineHost

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # ~40 s: a vLLM engine in a Ray actor

PROMPT = [101, 102, 103, 104]
TARGET = [501, 502, 503, 504, 505, 506]


def test_published_weights_reach_vllm_and_change_its_greedy_output(tiny_model_dir):
    cfg = build_config({
        "model": {"path": str(tiny_model_dir), "max_model_len": 256},
        "data": {"max_prompt_length": 128},
        "rollout": {"group_size": 1, "max_response_length": 128, "max_obs_length": 64},  # what 256 - 128 leaves
        "learner": {"batch_size": 1, "mini_batch_size": 1, "micro_batch_size": 1, "ppo_epochs": 2, "lr": 1e-3},
        "algorithm": {"advantage_estimator": "grpo", "policy_loss": "decoupled_ppo"},
    })
    host = ray.remote(num_cpus=0)(EngineHost).options(runtime_env={"env_vars": VLLM_ENV}).remote()
    assert ray.get(host.start.remote(str(tiny_model_dir), cfg), timeout=300) == 0
    before = ray.get(host.greedy.remote(PROMPT, len(TARGET)))[0]
    assert before != TARGET

    # one rewarded episode (a group of one keeps its raw score): its response becomes the greedy one
    n = len(TARGET)
    episode = Trajectory(prompt_ids=PROMPT, response_ids=TARGET, loss_mask=[1] * n, behavior_logprobs=[-8.0] * n,
                         versions=[0] * n, turns=[TurnSpan("model", 0, n)], reward=1.0, meta=EpisodeMeta())
    batch = pack_batch([episode], pad_id=0)
    learner = Learner(cfg)
    for _ in range(6):
        learner.train_step(batch)

    publisher = ObjectStorePublisher([host])
    state = learner.state_dict_for_publish()
    stats = publisher.publish(learner.bump_version(), state)
    after, _, versions, _ = ray.get(host.greedy.remote(PROMPT, n))
    assert after == TARGET
    assert versions == [1] * n
    # the engine computes with exactly the published weights: its log-probs are the learner's own (transformers,
    # same weights). The tiny model ties its output head to the embedding; the learner publishes the embedding once.
    # Before the fix the CPU engine's tied head kept the first weights it loaded: greedy output moved (the other
    # layers did), the log-probs were off.
    ids, logprobs, _, _ = ray.get(host.greedy.remote(PROMPT, n))
    assert "lm_head.weight" not in state and ids == TARGET
    assert np.max(np.abs(np.array(logprobs) - reference_logprobs(tiny_model_dir, state, PROMPT, TARGET))) < 2e-3

    assert stats.version == 1 and stats.num_actors == 1
    assert stats.bytes == sum(a.nbytes for a in state.values())
    assert 0 < stats.put_seconds <= stats.seconds and 0 < stats.actor_seconds[0] <= stats.seconds
    assert stats.as_metrics()["publish_latency_s"] == stats.seconds

    # a reference from the object store is forwarded as it is (the path a learner actor's state takes)
    stats = publisher.publish(learner.bump_version(), ray.put(state))
    assert stats.bytes == -1 and ray.get(host.greedy.remote(PROMPT, n))[2] == [2] * n
    ray.get(host.close.remote())


def reference_logprobs(model_dir, state: dict, prompt: list[int], response: list[int]) -> np.ndarray:
    """Per-token log-probs of ``response`` after ``prompt`` under ``state`` loaded into the transformers model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :].numpy()
