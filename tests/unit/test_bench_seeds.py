"""bench --seeds: time to accuracy per seed, means and standard errors, the staleness recommendation and the
async/sync ratio, from run folders laid out as a finished training writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.bench.arms import Arm, ArmRun, staleness_arms
from driver.bench.seeds import (parse_seeds, per_seed_rows, staleness_recommendation, summarize, sync_comparison,
                                write_seeds_report)

pytestmark = pytest.mark.unit


def finished(tmp: Path, arm: Arm, seed: int, curve: list[tuple[float, float]], sps: float, hist=None) -> ArmRun:
    """An ArmRun whose result has an eval curve of (train seconds, EM) and whose metrics.jsonl has what
    extra_numbers reads."""
    run_dir = tmp / f"seed{seed}" / arm.name
    run_dir.mkdir(parents=True)
    last = {"learner": {"iw_mean": 1.0, "iw_max": 1.5, "iw_capped_frac": 0.01},
            "buffer_staleness_histogram": {str(k): v for k, v in (hist or {0: 64}).items()},
            "buffer_evicted": {"stale": 0},
            "buffer_length_tokens": {"generated": {"<32": 90, "256-511": 10}, "consumed": {"<32": 45, "256-511": 5}}}
    (run_dir / "metrics.jsonl").write_text(json.dumps(last) + "\n")
    result = {"em_start": curve[0][1], "em_end": curve[-1][1], "em_best": max(e for _, e in curve),
              "samples_per_s": sps, "train_s": curve[-1][0], "staleness_mean": 0.5,
              "eval_curve": [{"train_s": t, "exact_match": e, "step": i} for i, (t, e) in enumerate(curve)]}
    return ArmRun(arm, run_dir, [], result=result)


def test_sync_ratio_is_time_to_90_percent_of_the_lower_final_em_per_seed(tmp_path):
    a, s = Arm("sync", "async", "async", ()), Arm("sync", "sync", "sync", ())
    runs = {
        # seed 0: finals 0.6 / 0.5 -> target 0.45: async at 100 s, sync at 300 s -> 3.0
        0: [finished(tmp_path, a, 0, [(0, 0.0), (100, 0.5), (200, 0.6)], 2.0),
            finished(tmp_path, s, 0, [(0, 0.0), (150, 0.3), (300, 0.5)], 1.0)],
        # seed 1: finals 0.4 / 0.4 -> target 0.36: async at 50 s, sync at 100 s -> 2.0
        1: [finished(tmp_path, a, 1, [(0, 0.0), (50, 0.4), (90, 0.4)], 2.0),
            finished(tmp_path, s, 1, [(0, 0.0), (100, 0.4)], 1.0)],
    }
    rows = per_seed_rows(runs, lambda arm: True)
    assert [r["target_em"] for r in rows["async"]] == pytest.approx([0.45, 0.36])
    text, d = sync_comparison(rows)
    assert d["time_to_acc_ratio"]["mean"] == pytest.approx(2.5) and d["time_to_acc_ratio"]["se"] == pytest.approx(0.5)
    assert d["samples_per_s_ratio"]["mean"] == pytest.approx(2.0)
    assert "2.50 ± 0.50x" in text


def test_staleness_recommendation_is_the_soonest_of_the_accurate_arms(tmp_path):
    arms = staleness_arms([0, 2, 8], ppo=True)
    curves = {"eta0": [(0, 0), (300, 0.5), (600, 0.6)], "eta2": [(0, 0), (150, 0.5), (300, 0.58)],
              "eta8": [(0, 0), (100, 0.3), (200, 0.4)], "eta8-ppo": [(0, 0), (200, 0.1)]}
    runs = {0: [finished(tmp_path, arm, 0, curves[arm.name], 1.0 + i, hist={0: 10, 2: 5})
                for i, arm in enumerate(arms)]}
    rows = per_seed_rows(runs, lambda arm: "ppo" not in arm.name)
    assert rows["eta0"][0]["target_em"] == pytest.approx(0.36)  # 0.9 x eta8's 0.4; the PPO arm is no reference
    assert rows["eta8-ppo"][0]["time_to_acc_s"] is None
    summary = summarize(rows)
    assert summary["eta2"]["staleness_histogram"] == {0: 10, 2: 5} and summary["eta8-ppo"]["reached"] == "0/1"
    text = staleness_recommendation(arms, summary)
    assert "Recommendation: eta=2" in text  # eta 8 is faster but 0.2 below the best final EM
    report = write_seeds_report("staleness", arms, runs, tmp_path, "cmd", lambda arm: "ppo" not in arm.name)
    md = report.read_text()
    assert "Recommendation: eta=2" in md and "eta=8, standard PPO" in md and "| 0/1 |" in md
    assert (tmp_path / "staleness_seeds.png").stat().st_size > 0 and "(staleness_seeds.png)" in md


def test_a_standard_ppo_arm_reports_no_importance_weight(tmp_path):
    arms = staleness_arms([0, 8], ppo=True)
    runs = {0: [finished(tmp_path, arm, 0, [(0, 0), (100, 0.5)], 1.0) for arm in arms]}
    ppo = runs[0][-1].run_dir / "metrics.jsonl"  # the standard loss logs no importance weights
    ppo.write_text(ppo.read_text().replace('"iw_mean": 1.0, "iw_max": 1.5, "iw_capped_frac": 0.01', '"pg_loss": 0.1'))
    md = write_seeds_report("staleness", arms, runs, tmp_path, "cmd", lambda arm: "ppo" not in arm.name).read_text()
    assert "- eta=8, standard PPO: {0: 64}; max importance weight n/a;" in md
    assert "- eta=8: {0: 64}; max importance weight 1.50;" in md


def test_seeds_must_be_distinct_and_non_negative():
    assert parse_seeds("0,1,2") == [0, 1, 2]
    for bad in ("", "1,1", "-1"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_a_study_whose_arms_are_finished_does_not_redo_its_warm_start(tmp_path, monkeypatch):
    """Resuming a study from kept arms (another session, a fresh clone) must not pay for the warm start again; it is
    made only when an arm still has to be trained."""
    from driver.bench import arms as bench_arms, runner

    calls: list[str] = []
    def run_logged(cmd: list[str], log: object) -> tuple[int, float]:
        calls.append(cmd[cmd.index("--config") - 1])  # the subcommand: sft or train
        return 0, 1.0

    monkeypatch.setattr(runner, "run_logged", run_logged)
    monkeypatch.setattr(runner, "arm_result", lambda run_dir: {"em_start": 0.0, "em_end": 0.5, "reward_last": 0.5,
                                                               "samples_per_s": 1.0})
    overrides = list(bench_arms.seed_overrides(0, tmp_path / "worlds" / "seed_0"))
    arms = bench_arms.sync_arms(2)
    monkeypatch.setattr(runner, "finished_with", lambda run_dir, cfg: True)
    runner.run_arms("configs/quickstart.yaml", overrides, arms, tmp_path / "sync", 2, 1, say=lambda _: None)
    assert calls == []  # every arm reused: no sft, no train
    monkeypatch.setattr(runner, "finished_with", lambda run_dir, cfg: run_dir.name == arms[0].name)
    runner.run_arms("configs/quickstart.yaml", overrides, arms, tmp_path / "sync", 2, 1, say=lambda _: None)
    assert calls == ["sft", "train"]  # the second arm is trained: its warm start is made first


def step(learner_s: float, wait_s: float | None, publish_s: float | None, idle: float | None, tool: float | None) -> dict:
    """One metrics.jsonl record, as the driver writes it, with only what ``time_split`` reads."""
    m: dict = {"learner": {"step_time_s": learner_s}, "sample_wait_s": wait_s, "rollout_engine_idle_share": idle,
               "rollout_tool_wait_share": tool}
    if publish_s is not None:
        m["publish"] = {"publish_latency_s": publish_s}
    return m


def test_time_split_sums_the_steps_parts_and_leaves_the_rest_as_other():
    from driver.bench.results import time_split

    metrics = [step(2.0, 1.0, 0.2, 0.1, 0.5), step(3.0, 0.5, None, 0.3, None), step(4.0, 0.0, 0.3, None, 0.7)]
    t = time_split(metrics, train_s=12.0)
    assert (t["learner_s"], t["batch_wait_s"], t["publish_s"]) == pytest.approx((9.0, 1.5, 0.5))
    assert t["other_s"] == pytest.approx(1.0)
    # shares: means over the steps that have one (the first step's tool share may be missing: no episode finished)
    assert t["engine_idle_share"] == pytest.approx(0.2) and t["tool_wait_share"] == pytest.approx(0.6)
    old = time_split([{"learner": {"step_time_s": 1.0}}], train_s=3.0)  # metrics from before the idle stats
    assert old["batch_wait_s"] != old["batch_wait_s"] and old["other_s"] != old["other_s"]  # NaN, not a made-up 0


def test_the_seeds_report_says_where_each_arms_time_went(tmp_path):
    a, s = Arm("sync", "async", "async", ()), Arm("sync", "sync", "sync", ())
    runs = {}
    for seed, (wait_a, wait_s) in enumerate([(1.0, 30.0), (3.0, 50.0)]):
        ra = finished(tmp_path, a, seed, [(0, 0.0), (100, 0.5)], 2.0)
        rs = finished(tmp_path, s, seed, [(0, 0.0), (200, 0.5)], 1.0)
        ra.result.update(learner_s=60.0, batch_wait_s=wait_a, publish_s=5.0, other_s=34.0 - wait_a,
                         engine_idle_share=0.05, tool_wait_share=0.4)
        rs.result.update(learner_s=50.0, batch_wait_s=wait_s, publish_s=5.0, other_s=145.0 - wait_s,
                         engine_idle_share=0.6, tool_wait_share=0.5)
        runs[seed] = [ra, rs]
    md = write_seeds_report("sync", [a, s], runs, tmp_path, "cmd", lambda arm: True).read_text()
    assert "Where the training time goes" in md
    row = next(x for x in md.splitlines() if x.startswith("| sync |") and "±" in x and "0.60" in x)
    assert "| 40 ± 10 |" in row  # the sync arm's wait for its batches, mean ± s.e. over the two seeds
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["async"]["batch_wait_s"]["mean"] == pytest.approx(2.0)


def test_the_one_world_report_has_the_time_split_of_each_arm(tmp_path):
    """``bench`` without ``--seeds``: the time table beside the main one, an arm's own numbers (NaN where its
    metrics predate a key, as ``time_split`` gives it)."""
    from driver.bench.reports import write_report
    from driver.bench.results import COLUMNS

    runs = []
    for name, wait in (("async", 12.0), ("sync", None)):
        result = {key: 1.0 for _, key, _ in COLUMNS} | {
            "eval_curve": [{"step": 0, "exact_match": 0.0}, {"step": 2, "exact_match": 0.5}],
            "steps_curve": [{"step": 1, "reward": 0.5, "response_length": 40, "searches": 1.0}],
            "train_s": 100.0, "learner_s": 70.0, "publish_s": 3.0, "engine_idle_share": 0.25,
            "tool_wait_share": 0.5}
        result |= {"batch_wait_s": wait, "other_s": 15.0} if wait is not None else \
            {"batch_wait_s": float("nan"), "other_s": float("nan")}
        runs.append(ArmRun(Arm("sync", name, name, ()), tmp_path / name, [], result=result))
    md = write_report("sync", runs, tmp_path, "cmd").read_text()
    rows = [x for x in md.splitlines() if x.startswith("| sync | async |")]
    assert len(rows) == 2 and "| 100 | 70 | 12 | 3 | 15 | 0.25 | 0.50 |" in rows[1]
    assert "| nan | 3 | nan |" in [x for x in md.splitlines() if x.startswith("| sync | sync |")][1]
