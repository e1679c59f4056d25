"""The whole system learns what the default run learns: a short asynchronous RL run (Ray, vLLM CPU actor, BM25
server, buffer, DeepSpeed learner, weight publishing) makes the agent search, which is what its reward pays for, and
the held-out greedy agent answers more questions right.

The warm start is the quickstart's recipe, shortened and without its reading exercises: shuffled-world pretraining
(300 steps of 128-token windows, ``sft.pretrain_questions=false``), then one epoch over 20000 demonstrations of the imperfect expert (half of them answer without searching, half of the searching bridge
ones stop after one search). Greedy, it never searches on held-out questions (EM about 0.03, lucky guesses). The RL
part is the quickstart's with a higher learning rate (5e-4) for 24 steps.

The criteria, statistical:

- the sampled policy searches more, step after step: the per-step searches per episode (the learning signal the
  driver records) have a least-squares slope > 0 with t > 4 (measured: t = 12.8, 0.30 -> 1.06 per episode);
- on held-out questions (greedy, every one, subjects never seen in training) searches per question rise by at least
  0.5 (measured 0.00 -> 1.20) and exact match rises by at least 0.10 (measured 0.033 -> 0.268), with far more
  questions turned right than wrong (exact one-sided sign test on the paired questions, p < 0.001; measured 145
  gained, 15 lost).

Why without the reading exercises: this test is about the system's learning machinery on one short warm start, and
it was measured and passed CI in this form; with the exercises at 300 pretraining steps one run measured 0.033 ->
0.125 (below the bar), and one at 500 steps ran past the time limit beside other work, unmeasured. How well the
shipped recipe learns is a statistic over warm starts and worlds: ``bench learning`` (benchmarks/RESULTS.md,
"Learning on every warm start"), not one test run.

History: before the engine's tied output head followed the published weights (actors/vllm_worker.py), the same run
moved held-out EM 0.033 -> 0.034 and greedy searches 0.00 -> 0.00 (the engine's logits lagged the learner), and this
test asked only for behaviour trends; CI once failed it there. With ``learner.lr`` near 0 (or rewards that never
reach the learner, a loss with the wrong sign, weights that never reach the engine) nothing rises and it fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from async_agent_rl.config import load_config
from tests.helpers import world_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 24
MIN_EM_GAIN = 0.10  # held-out greedy exact match, all questions


def test_rl_makes_the_agent_search_and_answer_more_held_out_questions(tmp_path, world_dir, tiny_model_dir):
    from driver.train import Trainer

    cfg = load_config(REPO / "configs/quickstart.yaml", [
        f"run.output_dir={tmp_path}", "run.name=learn", *world_overrides(world_dir, tiny_model_dir),
        "sft.num_demos=20000", "sft.pretrain_steps=300", "sft.pretrain_questions=false", "learner.lr=5e-4", f"learner.total_steps={STEPS}",
        "sft.pretrain_packing=windows", "sft.pretrain_answer_weight=1",
        "eval.num_questions=0", "eval.every_steps=0", "monitoring.enabled=false",
    ])  # fmt: skip
    summary = Trainer(cfg, quiet=True).run()
    assert summary["steps"] == STEPS
    run_dir = tmp_path / "learn"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    searches = [searches_per_episode(r["learning"]["by_kind"]) for r in rows]
    slope, t = trend(searches)
    start, end = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    n = start["all"]["n"]
    assert n == end["all"]["n"] > 500  # every held-out question, both times
    before, after = set(start["all"]["correct"]), set(end["all"]["correct"])
    gained, lost = len(after - before), len(before - after)
    report = (f"rollout searches/episode {searches[0]:.2f} -> {searches[-1]:.2f} (slope {slope:.4f}, t {t:.1f}); "
              f"held-out searches/q {start['all']['searches_per_question']:.2f} -> "
              f"{end['all']['searches_per_question']:.2f}, EM {start['all']['exact_match']:.3f} -> "
              f"{end['all']['exact_match']:.3f} (gained {gained}, lost {lost})")
    assert slope > 0 and t > 4, report
    assert end["all"]["searches_per_question"] >= start["all"]["searches_per_question"] + 0.5, report
    assert end["all"]["exact_match"] >= start["all"]["exact_match"] + MIN_EM_GAIN, report
    assert sign_test_p(gained, lost) < 0.001, report  # significantly more questions right than before


def searches_per_episode(by_kind: dict) -> float:
    """Searches per finished episode over all question kinds of one step's learning record."""
    n = sum(k["episodes"] for k in by_kind.values())
    return sum(k["searches"] * k["episodes"] for k in by_kind.values()) / n


def trend(ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` against their index, and its t statistic."""
    n = len(ys)
    xm, ym = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - xm) ** 2 for x in range(n))
    slope = sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / sxx
    resid = [y - ym - slope * (x - xm) for x, y in enumerate(ys)]
    se = (sum(r * r for r in resid) / (n - 2) / sxx) ** 0.5
    return slope, slope / se if se > 0 else float("inf")


def sign_test_p(gained: int, lost: int) -> float:
    """Exact one-sided sign test: P(X >= gained) for X ~ Binomial(gained + lost, 1/2); 1.0 when nothing changed."""
    m = gained + lost
    if m == 0:
        return 1.0
    return sum(math.comb(m, k) for k in range(gained, m + 1)) / 2**m


def test_statistics_arithmetic():
    assert trend([0.0, 1.0, 2.0, 3.0])[0] == 1.0 and trend([0.0, 1.0, 2.0, 3.0])[1] == float("inf")
    assert abs(trend([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])[1]) < 1
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(1, 0) == 0.5
    assert sign_test_p(3, 0) == 0.125
    assert sign_test_p(2, 1) == 0.5  # P(X >= 2), X ~ Bin(3, 1/2) = 4/8
    assert sign_test_p(0, 5) == 1.0
    assert sign_test_p(40, 4) < 1e-7
