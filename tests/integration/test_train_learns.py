"""The whole system learns: a short asynchronous run (Ray, vLLM CPU actor, BM25 server, buffer, DeepSpeed learner,
weight publishing) raises the reward it is trained on.

The policy is the hot SFT warm start of ``searching_model_dir`` (it writes the Search-R1 tags but rarely in a
well-formed episode: its exact-match, retrieval-hit and strict-format rewards are all near 0, no signal) and the
reward is ``tag_count`` (open-r1's graded tag check: think and answer pairs, a search answered by information,
nothing after the answer). Measured over 24 steps in two runs: batch reward 0.26 -> 0.40 and 0.25 -> 0.32 (first
against last 6 steps; per-step noise about 0.05, a least-squares slope of +0.0034 to +0.006 per step, t = 2.2 to
6). Over 40 steps the test asks for a rising trend with t > 2.5 and a higher mean in the last 10 steps than in the
first 10. It fails if any link is broken: rewards
not reaching the learner, the loss on the wrong tokens or with the wrong sign, weights not reaching the engine,
versions mislabeled so the importance weights are wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_agent_rl.config import load_config
from tests.helpers import world_overrides

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 40


def test_a_short_run_raises_the_trained_reward(tmp_path, world_dir, searching_model_dir):
    from driver.train import Trainer

    cfg = load_config(REPO / "configs/quickstart.yaml", [
        f"run.output_dir={tmp_path}", "run.name=learn", *world_overrides(world_dir, searching_model_dir),
        "reward.terms=[{name: tag_count, weight: 1.0}]",
        f"learner.total_steps={STEPS}", "learner.batch_size=32", "learner.mini_batch_size=32",
        "learner.micro_batch_size=16", "learner.lr=1e-3", "buffer.max_staleness=1", "buffer.group_filter=none",
        "sft.enabled=false", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
        "monitoring.enabled=false",
    ])  # fmt: skip
    summary = Trainer(cfg, quiet=True).run()
    assert summary["steps"] == STEPS
    rows = [json.loads(x) for x in (tmp_path / "learn" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["batch_reward"] for r in rows]
    slope, t = trend(rewards)
    assert slope > 0 and t > 2.5, (slope, t, rewards)
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10, rewards


def trend(ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` against their index, and its t statistic."""
    n = len(ys)
    xm, ym = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - xm) ** 2 for x in range(n))
    slope = sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / sxx
    resid = [y - ym - slope * (x - xm) for x, y in enumerate(ys)]
    se = (sum(r * r for r in resid) / (n - 2) / sxx) ** 0.5
    return slope, slope / se if se > 0 else float("inf")
