"""The shipped job learns what it is evaluated on: the README's main job, shortened, raises HELD-OUT exact match.

``configs/quickstart.yaml`` as shipped (its world, tiny model, SFT warm start and RL settings) with fewer RL steps, on
a world seed the shipped run does not use. The start and end evaluations are greedy on every held-out question
(subjects never seen in training). The criterion is statistical: the gain must exceed 2.5 standard errors of the
difference of two proportions, treating the two evaluations as independent samples, which overstates the noise
(they are the same questions, so the errors are positively correlated) and keeps the test conservative. With
``learner.lr`` near 0 the end equals the start and the test fails.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from async_agent_rl.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
WORLD_SEED = 7


def z_gain(start: float, end: float, n: int) -> float:
    """(end - start) over the standard error of a difference of two independent proportions on n questions."""
    se = math.sqrt((start * (1 - start) + end * (1 - end)) / n)
    return (end - start) / se if se > 0 else float("inf")


def test_z_gain_is_zero_without_change_and_large_for_a_clear_gain():
    assert z_gain(0.3, 0.3, 500) == 0
    assert z_gain(0.30, 0.40, 500) > 3


def test_rl_raises_held_out_exact_match(tmp_path):
    from async_agent_rl.train import Trainer

    run = tmp_path / "runs"
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        f"run.output_dir={run}", "run.name=learn", f"model.path={run}/model", f"data.world_dir={run}/world",
        f"data.train_files=[{run}/world/train.parquet]", f"data.test_files=[{run}/world/test.parquet]",
        f"data.corpus_file={run}/world/corpus.jsonl", f"data.world.seed={WORLD_SEED}",
        f"learner.total_steps={STEPS}", "eval.every_steps=0", "monitoring.enabled=false",
    ])  # fmt: skip
    summary = Trainer(cfg, quiet=True).run()
    start, end = summary["eval_start"]["all"], summary["eval_end"]["all"]
    z = z_gain(start["exact_match"], end["exact_match"], end["n"])
    assert z > 2.5, (start, end, z)
