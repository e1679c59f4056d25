"""The collective weight path (``weight_sync.method: collective``, gloo on CPU) against the object-store path, on
REAL parts: a learner rank as a Ray actor (DeepSpeed), two vLLM engines in Ray actors (CPU build). The learner trains
one response until it is its greedy continuation, then publishes the same version to one engine through the object
store and to the other by broadcast: both engines then give the same greedy tokens, the same per-token log-probs
and the same version stamps. A learner whose model does not fit the engines is refused before anything is sent, and
the engine keeps its weights and version. The group listens on loopback only."""

from __future__ import annotations

import os

import numpy as np
import psutil
import pytest
import ray

from async_agent_rl.batch import pack_batch
from async_agent_rl.config import Config, TinyModelConfig, build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from async_agent_rl.tiny_model import init_tiny_model
from learner.actor import create_learner_group
from driver.weight_sync import CollectivePublisher, ObjectStorePublisher, WeightsRefused
from tests.helpers import VLLM_ENV, EngineHost

# slow: a learner actor and two vLLM engines; 160 s measured on 2 loaded cores (the fast tier's longest test by far)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]

PROMPT = [101, 102, 103, 104]
TARGET = [501, 502, 503, 504, 505, 506]


def learner_cfg(model_dir) -> Config:
    return build_config({
        "model": {"path": str(model_dir), "max_model_len": 256},
        "data": {"max_prompt_length": 128},
        "rollout": {"group_size": 1, "max_response_length": 128, "max_obs_length": 64},  # what 256 - 128 leaves
        "learner": {"batch_size": 1, "mini_batch_size": 1, "micro_batch_size": 1, "ppo_epochs": 2, "lr": 1e-3},
        "algorithm": {"advantage_estimator": "grpo", "policy_loss": "decoupled_ppo"},
        "weight_sync": {"method": "collective"},
        "cluster": {"learner_cpus": 0.5},
    })


def listening(pid: int) -> set[tuple[str, int]]:
    """Listening sockets of ``pid`` and its descendants (an engine's vLLM worker runs in its EngineCore child)."""
    root = psutil.Process(pid)
    return {(c.laddr.ip, c.laddr.port) for proc in (root, *root.children(recursive=True))
            for c in proc.net_connections("inet") if c.status == "LISTEN"}  # fmt: skip


def test_collective_publish_equals_object_store_publish(tiny_model_dir, tmp_path):
    cfg = learner_cfg(tiny_model_dir)
    host_cls = ray.remote(num_cpus=0)(EngineHost).options(runtime_env={"env_vars": VLLM_ENV})
    by_store, by_broadcast = host_cls.remote(), host_cls.remote()
    ray.get([h.start.remote(str(tiny_model_dir), cfg) for h in (by_store, by_broadcast)], timeout=300)
    engine_pids = ray.get([h.pid.remote() for h in (by_store, by_broadcast)])
    before = ray.get(by_broadcast.greedy.remote(PROMPT, len(TARGET)))
    assert before[0] != TARGET

    n = len(TARGET)
    episode = Trajectory(prompt_ids=PROMPT, response_ids=TARGET, loss_mask=[1] * n, behavior_logprobs=[-8.0] * n,
                         versions=[0] * n, turns=[TurnSpan("model", 0, n)], reward=1.0, meta=EpisodeMeta())
    learner = create_learner_group(cfg)
    for _ in range(6):
        learner.train_step(pack_batch([episode], pad_id=0))
    version = learner.bump_version()

    learner_pid = ray.get(learner.actors[0].__ray_call__.remote(lambda actor: os.getpid()))
    pids = [learner_pid, *engine_pids]
    ports_before = {pid: listening(pid) for pid in pids}
    collective = CollectivePublisher([by_broadcast], learner, backend="gloo", timeout_s=60)
    stats = collective.publish(version)
    # everything the group opened listens on loopback
    opened = {pid: listening(pid) - ports_before[pid] for pid in pids}
    assert opened[learner_pid] and opened[engine_pids[1]], opened  # the store and gloo, and the worker's gloo
    assert all(ip == "127.0.0.1" for ports in opened.values() for ip, _ in ports), opened
    ObjectStorePublisher([by_store]).publish(version, learner.state_dict_ref())

    ids_s, lps_s, versions_s, v_s = ray.get(by_store.greedy.remote(PROMPT, n))
    ids_b, lps_b, versions_b, v_b = ray.get(by_broadcast.greedy.remote(PROMPT, n))
    assert ids_s == TARGET and ids_b == ids_s
    np.testing.assert_allclose(lps_b, lps_s, rtol=0, atol=1e-6)
    assert versions_b == versions_s == [version] * n and v_b == v_s == version
    lps_b_first = lps_b
    state = ray.get(learner.state_dict_ref())
    assert stats.method == "collective" and stats.num_actors == 1 and stats.version == version
    assert stats.bytes == sum(a.nbytes for a in state.values())
    assert 0 < stats.actor_seconds[0] <= stats.seconds

    # a second publish goes over the same group (made once), the engine follows the learner again
    learner.train_step(pack_batch([episode], pad_id=0))
    generation = collective.generation
    collective.publish(learner.bump_version())
    assert collective.generation == generation
    ObjectStorePublisher([by_store]).publish(version + 1, learner.state_dict_ref())
    ids_s, lps_s, _, v_s = ray.get(by_store.greedy.remote(PROMPT, n))
    ids_b, lps_b, _, v_b = ray.get(by_broadcast.greedy.remote(PROMPT, n))
    assert ids_b == ids_s == TARGET and v_b == v_s == version + 1
    np.testing.assert_allclose(lps_b, lps_s, rtol=0, atol=1e-6)  # the new weights, not the first publish's
    assert np.max(np.abs(np.array(lps_b) - np.array(lps_b_first))) > 1e-4  # which differ

    # a learner on a model of another shape: refused by the engine before anything is sent, naming the tensors
    other_dir = init_tiny_model(tmp_path / "other", TinyModelConfig(vocab_size=2048, intermediate_size=256,
                                                                     num_hidden_layers=3), tokenizer=tiny_model_dir)
    other = create_learner_group(learner_cfg(other_dir))
    wrong = CollectivePublisher([by_broadcast], other, backend="gloo", timeout_s=60)
    with pytest.raises(WeightsRefused, match=r"unknown parameters.*layers\.2.*mlp.*shape \(256, 128\)"):
        wrong.publish(version + 2)
    after = ray.get(by_broadcast.greedy.remote(PROMPT, n))
    assert after[3] == version + 1 and after[0] == TARGET  # weights and version unchanged
