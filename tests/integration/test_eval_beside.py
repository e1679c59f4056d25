"""Issue 33: evaluation beside training (``eval.beside``), on a real short training (real Ray, vLLM CPU engines,
DeepSpeed learner, retrieval server).

The evaluator's process is frozen (SIGSTOP) as the evaluation of step 1 is handed to it and thawed after step 3: the
learner goes on stepping meanwhile (the loop never waits for the evaluation), the evaluations due while it runs are
skipped (one line, counted), and the step-1 evaluation is written once it is done, tagged with the step and the
policy version it measured; the end evaluation runs on rollout actor 0 as without ``eval.beside``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from async_agent_rl.config import load_config
from driver.plots import read_jsonl
from tests.helpers import world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
THAW_AFTER_STEP = 3


@pytest.mark.timeout(900)
def test_evaluations_run_beside_training_tagged_with_the_version_they_measured(tmp_path, world_dir, tiny_model_dir,
                                                                              capsys):
    import ray

    from driver.train import Trainer

    cfg = load_config(REPO / "configs/quickstart.yaml", [
        "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8",
        "rollout.group_size=4", "eval.at_start=false", "eval.at_end=true", "eval.every_steps=1", "eval.beside=true",
        "eval.num_questions=8", "monitoring.enabled=false", "sft.enabled=false", "buffer.group_filter=none",
        "learner.total_steps=9",
        f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir),
    ])  # fmt: skip
    trainer = Trainer(cfg)
    frozen: dict = {}
    evaluate_beside, train_step = trainer.evaluate_beside, trainer.train_step

    def freeze_then_evaluate() -> None:
        if not frozen:  # the first evaluation beside training: its engine frozen before it gets the work
            frozen["pid"] = ray.get(trainer.beside.evaluator.stats.remote(), timeout=60).pid
            os.kill(frozen["pid"], signal.SIGSTOP)
            frozen["step"] = trainer.step
        evaluate_beside()

    def step_then_thaw(t0: float) -> None:
        train_step(t0)
        if frozen and trainer.step == THAW_AFTER_STEP:
            os.kill(frozen["pid"], signal.SIGCONT)

    trainer.evaluate_beside, trainer.train_step = freeze_then_evaluate, step_then_thaw
    try:
        summary = trainer.run()
    finally:  # never leave a frozen process behind
        if frozen and _alive(frozen["pid"]):
            os.kill(frozen["pid"], signal.SIGCONT)
    run_dir = tmp_path / "run"
    assert summary["steps"] == 9 and frozen["step"] == 1
    evals = read_jsonl(run_dir / "eval.jsonl")
    beside = [e for e in evals if e.get("beside")]
    versions = {m["step"]: m["version"] for m in read_jsonl(run_dir / "metrics.jsonl")}
    # the step-1 evaluation: done while the learner went on, written with the step and version it measured
    first = beside[0]
    assert first["step"] == 1 and first["version"] == versions[1] and first["done_at_step"] >= THAW_AFTER_STEP, first
    assert first["all"]["n"] == 8
    # the evaluations due while it ran were skipped; those after it ran; each measured its own step's version
    assert summary["evals_skipped"] >= THAW_AFTER_STEP - 1, summary  # steps 2 and 3 at least
    assert summary["evals_beside"] == len(beside) >= 2 and summary["evaluator_failed"] is None, summary
    assert [e["step"] for e in beside] == sorted(e["step"] for e in beside)
    assert all(e["version"] == versions[e["step"]] for e in beside), (beside, versions)
    # the end evaluation as always: on rollout actor 0, after the last step
    assert evals[-1]["when"] == "end" and not evals[-1].get("beside") and evals[-1]["step"] == 9
    assert json.loads((run_dir / "summary.json").read_text())["evals_beside"] == len(beside)
    console = capsys.readouterr().out
    assert console.count("is skipped: the one of step 1 is still running") == 1, console  # once, however many
    assert "[eval step 1] held-out exact match" in console and "beside training: version" in console


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
