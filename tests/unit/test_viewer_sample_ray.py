"""The training loop's one call, against a real buffer actor on a local Ray cluster: after the learner's batch has
been sampled, ``sample.record(step, buffer.latest_batch.remote(sample.per_step))`` keeps a few of that very batch
(the reference resolved in the driver, decoded with the project's tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
from transformers import AutoTokenizer

from async_agent_rl.config import build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from buffer.actor import create_buffer_actor, push_all
from monitoring.episode_sample import EpisodeSample, step_file

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray")]

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "data" / "learns_warm_start"
GROUP, BATCH = 4, 8


def episode(tok, gid: str, member: int) -> bytes:
    p = tok.encode("Question: who wrote it?\n", add_special_tokens=False)
    s = tok.encode("<search>who wrote it</search>", add_special_tokens=False)
    i = tok.encode("\n\n<information>Doc 1(Title: It) written by Bo.</information>\n\n", add_special_tokens=False)
    a = tok.encode("<answer>bo</answer>", add_special_tokens=False)
    n = len(s) + len(i) + len(a)
    return Trajectory(
        prompt_ids=p, response_ids=s + i + a, loss_mask=[1] * len(s) + [0] * len(i) + [1] * len(a),
        behavior_logprobs=[-0.1] * n, versions=[0] * len(s) + [-1] * len(i) + [0] * len(a),
        turns=[TurnSpan("model", 0, len(s)), TurnSpan("observation", len(s), len(s) + len(i)),
               TurnSpan("model", len(s) + len(i), n)],
        reward=float(member % 2), reward_components={"exact_match": float(member % 2)},
        meta=EpisodeMeta(data_source="world_single", group_id=gid, trajectory_id=f"{gid}/{member}"),
    ).encode()


def test_the_loops_one_call_keeps_a_few_of_the_batch_the_learner_got(tmp_path):
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = build_config({
        "rollout": {"group_size": GROUP, "num_actors": 1, "max_concurrent_episodes": 16},
        "learner": {"batch_size": BATCH, "mini_batch_size": BATCH, "micro_batch_size": BATCH},
        "buffer": {"max_staleness": 1}, "cluster": {"buffer_cpus": 0},
    })  # fmt: skip
    buffer = create_buffer_actor(cfg, pad_id=0)
    for g in ("g1", "g2", "g3"):
        assert ray.get(buffer.try_start.remote(GROUP, 0, g, "actor0")) == GROUP
        push_all(buffer, [episode(tok, g, m) for m in range(GROUP)])
    batch = ray.get(buffer.sample_batch.remote(0, 10.0))  # what the learner's step gets (two whole groups)
    assert batch is not None

    sample = EpisodeSample(tmp_path, str(TOKENIZER), per_step=3)
    assert sample.record(1, buffer.latest_batch.remote(sample.per_step)) == 3
    records = [json.loads(x) for x in step_file(tmp_path, 1).read_text().splitlines()]
    groups = [r["group_id"] for r in records]
    assert len(set(groups[:2])) == 2 and set(groups) < {"g1", "g2", "g3"}  # two groups of the batch, not the third
    assert [t["kind"] for t in records[0]["turns"]] == ["prompt", "model", "search", "information", "model", "answer"]
    assert records[0]["question"] == "who wrote it?" and sample.failures == 0
