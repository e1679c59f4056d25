"""``async-agent-rl bench ablations`` end to end: real short trainings (Ray, vLLM CPU, DeepSpeed, BM25 server) for
the masking study, one shared SFT warm start, and a report whose every number matches the arms' own run files.

About 2-3 minutes on 2 cores (a tiny warm start and two 2-step trainings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from driver.plots import read_jsonl
from tests.helpers import world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def bench(out: Path, world_dir: Path, model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "driver.cli", "bench", "ablations", "--config", "configs/quickstart.yaml",
        "--studies", "masking", "--steps", "2", "--eval-every", "1", "--out", str(out), *extra,
        *world_overrides(world_dir, model_dir),
        "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8", "eval.num_questions=8",
        "sft.num_demos=32", "sft.epochs=1", "sft.pretrain_steps=0", "sft.warmup_steps=1",
    ]  # fmt: skip
    env = dict(os.environ)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_ablation_report_matches_the_runs_own_files(tmp_path, world_dir, tiny_model_dir):
    out = tmp_path / "bench"
    res = bench(out, world_dir, tiny_model_dir)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]

    report = json.loads((out / "report.json").read_text())
    assert list(report) == ["baseline", "masking-false"]
    # one warm start, shared; each arm trained from it, with only its own switch changed
    (ws,) = [p for p in (tmp_path / "warm_start").iterdir() if p.is_dir()]
    assert (ws / "warm_start_inputs.json").is_file()
    for name, masked in (("baseline", True), ("masking-false", False)):
        cfg = yaml.safe_load((out / name / "config.yaml").read_text())
        assert cfg["algorithm"]["mask_observations"] is masked
        assert cfg["model"]["path"] == str(ws) and cfg["sft"]["enabled"] is False
        assert cfg["learner"]["total_steps"] == 2

        # the report's numbers, recomputed here from the run's own files
        metrics = read_jsonl(out / name / "metrics.jsonl")
        evals = read_jsonl(out / name / "eval.jsonl")
        r = report[name]
        assert r["steps"] == len(metrics) == 2
        assert [c["step"] for c in r["eval_curve"]] == [e["step"] for e in evals] == [0, 1, 2]
        assert r["em_start"] == evals[0]["all"]["exact_match"] and r["em_end"] == evals[-1]["all"]["exact_match"]
        last = metrics[-max(1, len(metrics) // 4):]
        assert r["reward_last"] == pytest.approx(sum(m["batch_reward"] for m in last) / len(last))
        assert r["searches_last"] == pytest.approx(sum(m["batch"]["searches"] for m in last) / len(last))
        assert r["response_length_last"] == pytest.approx(
            sum(m["batch"]["response_length"] for m in last) / len(last))
        assert 0 < r["train_s"] <= metrics[-1]["elapsed_s"]
        assert r["samples_per_s"] == pytest.approx(2 * 16 / r["train_s"])

    md = (out / "report.md").read_text()
    assert "| masking | observations in the loss | `algorithm.mask_observations=false` |" in md
    row = next(x for x in md.splitlines() if x.startswith("| baseline |"))
    assert f"| {report['baseline']['em_end']:.3f} |" in row
    assert (out / "masking.png").stat().st_size > 1000

    # a second invocation reuses the finished arms instead of training again
    again = bench(out, world_dir, tiny_model_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished run present" in again.stdout and "warm start] present" in again.stdout
    assert json.loads((out / "report.json").read_text())["baseline"]["reused"] is True


def test_bad_study_and_bad_etas_are_refused_before_any_run(tmp_path):
    cli = [sys.executable, "-m", "driver.cli", "bench"]
    r = subprocess.run([*cli, "ablations", "--config", "configs/quickstart.yaml", "--studies", "masking,colour",
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "colour" in r.stderr and "masking, estimator" in r.stderr
    r = subprocess.run([*cli, "staleness", "--config", "configs/quickstart.yaml", "--etas", "0,x",
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "--etas" in r.stderr
    r = subprocess.run([*cli, "learning", "--config", "configs/quickstart.yaml", "--seeds", "0,one",
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("error: --seeds")
    assert not any(tmp_path.iterdir())
