"""The bench command's pure parts: every study's arms are valid configs, the async-vs-sync comparison, and the
learning report's arithmetic (from synthetic run folders)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from async_agent_rl.config import load_config
from driver.bench.arms import STUDIES, Arm, ArmRun, learning_arms, staleness_arms, sync_arms
from driver.bench.learning import learning_summary, seed_row, sft_only_result, write_learning_report
from driver.bench.reports import sync_summary
from driver.bench.results import mean_se, time_to_em

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_every_study_arm_is_a_valid_quickstart_config_that_changes_its_key(study):
    base = load_config("configs/quickstart.yaml").to_dict()
    for arm in STUDIES[study]:
        cfg = load_config("configs/quickstart.yaml", list(arm.overrides)).to_dict()
        key, value = arm.overrides[0].split("=")
        section, name = key.split(".")
        assert str(cfg[section][name]).lower() == value.lower()
        changed = {f"{s}.{k}" for s in base for k in base[s] if base[s][k] != cfg[s][k]}
        assert changed <= {key}, changed
    # the first arm is the quickstart's own value: the shared baseline run stands for it
    first = STUDIES[study][0]
    assert load_config("configs/quickstart.yaml", list(first.overrides)).to_dict() == base


def test_staleness_and_sync_arms():
    assert [a.overrides for a in staleness_arms([0, 4])] == [("buffer.max_staleness=0",), ("buffer.max_staleness=4",)]
    a, s = sync_arms(2)
    assert load_config("configs/quickstart.yaml", list(s.overrides)).rollout.mode == "sync"
    assert load_config("configs/quickstart.yaml", list(s.overrides)).buffer.max_staleness == 0
    assert load_config("configs/quickstart.yaml", list(a.overrides)).buffer.max_staleness == 2


def result(curve, samples_per_s):
    return {"eval_curve": [{"step": i, "train_s": t, "exact_match": em} for i, (t, em) in enumerate(curve)],
            "em_best": max(em for _, em in curve), "samples_per_s": samples_per_s}


def test_time_to_em_is_the_first_evaluation_at_or_above_the_target():
    r = result([(0, 0.2), (50, 0.3), (100, 0.25), (150, 0.35)], 1.0)
    assert time_to_em(r, 0.3) == 50 and time_to_em(r, 0.35) == 150 and time_to_em(r, 0.4) is None


def test_sync_summary_compares_at_the_lower_best():
    fast = result([(0, 0.2), (40, 0.3), (80, 0.32)], 4.0)
    slow = result([(0, 0.2), (100, 0.28), (200, 0.3)], 2.0)
    runs = [ArmRun(Arm("sync", "async", "a", ()), None, [], result=fast),
            ArmRun(Arm("sync", "sync", "s", ()), None, [], result=slow)]
    text, d = sync_summary(runs)
    assert d["target_em"] == 0.3 and d["async_time_to_em_s"] == 40 and d["sync_time_to_em_s"] == 200
    assert d["time_to_em_ratio"] == 5.0 and d["samples_per_s_ratio"] == 2.0
    assert "2.00x" in text and "5.00x" in text
    text, d = sync_summary(runs[:1])
    assert d == {} and "failed" in text


# ------------------------------------------------------------------------------------------ bench learning's report
def learning_folders(tmp_path, seed, curve, sft_scores, train_s=40.0):
    """Synthetic run folders of one seed: the RL run's eval.jsonl (``curve``: per step, (single, bridge) EM and
    searches) and the SFT-only arm's scores.json and continuation summary."""
    from warm_start.sft import CONTINUE_SUMMARY_FILE

    def scores(single, bridge):
        (em1, s1), (em2, s2) = single, bridge
        return {"all": {"n": 4, "exact_match": (3 * em1 + em2) / 4, "searches_per_question": (3 * s1 + s2) / 4},
                "world_single": {"n": 3, "exact_match": em1, "searches_per_question": s1},
                "world_bridge": {"n": 1, "exact_match": em2, "searches_per_question": s2}}

    rl_dir, sft_dir = tmp_path / f"seed{seed}-rl", tmp_path / f"seed{seed}-sft"
    rl_dir.mkdir()
    sft_dir.mkdir()
    (rl_dir / "eval.jsonl").write_text("".join(
        json.dumps({"step": step, "when": "start" if i == 0 else "end" if i == len(curve) - 1 else f"step {step}",
                    **scores(*ems)}) + "\n" for i, (step, ems) in enumerate(curve)))
    (sft_dir / "scores.json").write_text(json.dumps({"checkpoint": str(sft_dir), "scores": scores(*sft_scores)}))
    (sft_dir / CONTINUE_SUMMARY_FILE).write_text(json.dumps(
        {"steps": 7, "rounds": 1, "seconds": train_s + 0.5, "budget_s": train_s, "demo_s": 3.0, "final_loss": 1.0}))
    rl = ArmRun(Arm("learning", f"seed{seed}-rl", f"seed {seed}", ()), rl_dir, [], warm_start=tmp_path / "ws",
                result={"train_s": train_s, "steps": 2})
    sft = ArmRun(Arm("learning", f"seed{seed}-sft", "", ()), sft_dir, [], result=sft_only_result(sft_dir))
    return seed_row(seed, rl, sft)


def test_learning_report_arithmetic(tmp_path):
    # seed 0: single 1/3 -> 2/3 under RL, 1/3 under SFT; bridge 0 -> 1 under RL, 0 under SFT
    r0 = learning_folders(tmp_path, 0, [(0, ((1 / 3, 1.0), (0.0, 2.0))), (2, ((2 / 3, 1.5), (1.0, 2.0)))],
                          ((1 / 3, 1.0), (0.0, 1.0)), train_s=40.0)
    # seed 1: single 0 -> 1/3 under RL, 2/3 under SFT; bridge stays 0
    r1 = learning_folders(tmp_path, 1, [(0, ((0.0, 1.0), (0.0, 2.0))), (1, ((0.0, 1.0), (0.0, 2.0))),
                                        (2, ((1 / 3, 1.0), (0.0, 2.0)))], ((2 / 3, 1.0), (0.0, 2.0)), train_s=60.0)
    single = r0["kinds"]["world_single"]
    assert single["em_start"] == pytest.approx(1 / 3) and single["gain_rl"] == pytest.approx(1 / 3)
    assert single["gain_sft"] == pytest.approx(0) and single["rl_minus_sft"] == pytest.approx(1 / 3)
    assert single["searches_start"] == 1.0 and single["searches_rl"] == 1.5 and single["searches_sft"] == 1.0
    assert r0["kinds"]["all"]["em_rl"] == pytest.approx((3 * 2 / 3 + 1) / 4)
    assert [c["step"] for c in r1["curve"]] == [0, 1, 2] and r1["curve"][-1]["world_single"] == pytest.approx(1 / 3)
    assert r0["sft_steps"] == 7 and r1["rl_s"] == 60.0

    s = learning_summary([r0, r1])
    # mean and standard error (sample std / sqrt(n)) over the two seeds
    g = s["kinds"]["world_single"]["gain_rl"]
    assert g["mean"] == pytest.approx(1 / 3) and g["se"] == pytest.approx(0.0, abs=1e-12) and g["n"] == 2
    g = s["kinds"]["world_single"]["gain_sft"]  # 0 and 2/3: mean 1/3, std sqrt(2) / 3, s.e. 1/3
    assert g["mean"] == pytest.approx(1 / 3) and g["se"] == pytest.approx(1 / 3)
    b = s["kinds"]["world_bridge"]["rl_minus_sft"]  # 1 and 0
    assert b["mean"] == pytest.approx(0.5) and b["se"] == pytest.approx(0.5)
    assert s["rl_s"]["mean"] == 50.0 and s["rl_s"]["se"] == pytest.approx(10.0)
    assert math.isnan(mean_se([0.3])["se"]) and mean_se([0.3])["mean"] == 0.3

    report = write_learning_report([r0, r1], [], tmp_path, "async-agent-rl bench learning --seeds 0,1")
    md = report.read_text()
    assert "    async-agent-rl bench learning --seeds 0,1" in md
    assert "## single-hop" in md and "## bridge (two-hop)" in md
    mean_row = [x for x in md.split("## single-hop")[1].splitlines() if x.startswith("| **mean")][0]
    assert "| 0.167 ± 0.167 |" in mean_row and "| +0.333 ± 0.000 |" in mean_row and "| +0.333 ± 0.333 |" in mean_row
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["kinds"]["all"]["em_rl"]["n"] == 2
    assert (tmp_path / "learning_curves.png").stat().st_size > 1000
    assert (tmp_path / "learning_bars.png").stat().st_size > 1000


def test_seed_overrides_give_each_seed_its_own_world_model_and_seeds(tmp_path):
    a, b = learning_arms([0, 3], tmp_path)
    cfg = load_config("configs/quickstart.yaml", list(b.overrides))
    assert cfg.data.world.seed == 3 and cfg.learner.seed == cfg.rollout.seed == cfg.sft.seed == cfg.data.seed == 3
    assert cfg.data.world_dir == str(tmp_path / "worlds" / "seed_3")
    assert cfg.data.test_files == [str(tmp_path / "worlds" / "seed_3" / "test.parquet")]
    assert cfg.model.path == str(tmp_path / "worlds" / "seed_3" / "model")
    assert cfg.data.world.num_people == load_config("configs/quickstart.yaml").data.world.num_people
    assert a.own_warm_start and a.name == "seed0-rl"


def test_an_arm_with_its_own_warm_start_trains_from_the_warm_start_it_was_named(tmp_path, monkeypatch):
    """The warm start an arm is made from and the one its training loads must be one and the same folder: the
    overrides naming it must not pick up the arm's own ``model.path``/``run.*`` settings on the way (they did, and
    ``bench learning`` trained its RL arm from an empty folder filled with a fresh tiny model)."""
    import driver.bench.runner as runner

    calls: list[tuple[tuple[str, ...], bool]] = []

    def fake_warm_start(config, overrides, root, say, make=True):
        calls.append((tuple(overrides), make))
        return root / str(abs(hash(tuple(overrides))))

    trained: list[list[str]] = []

    def fake_run_logged(cmd, log_file):
        trained.append(cmd)
        return 1, 0.0  # recorded as the arm's error; nothing more is read

    monkeypatch.setattr(runner, "warm_start", fake_warm_start)
    monkeypatch.setattr(runner, "run_logged", fake_run_logged)
    arms = STUDIES["template"]
    runs = runner.run_arms("configs/quickstart.yaml", [], arms, tmp_path / "out", steps=2, eval_every=1,
                           say=lambda *_: None)
    assert len(trained) == len(arms) and all(r.error for r in runs)
    named = [o for o, make in calls if not make]
    made = [o for o, make in calls if make]
    assert named == made == [arm.overrides for arm in arms]
    for run, cmd in zip(runs, trained):
        assert f"model.path={run.warm_start}" in cmd


def test_mean_se_leaves_nan_out_instead_of_failing():
    """The staleness report over 3 seeds crashed (statistics.stdev on NaN): standard PPO has no importance weights."""
    nan = float("nan")
    assert mean_se([1.0, nan, 3.0]) == {"mean": 2.0, "se": 1.0, "n": 2}
    none = mean_se([nan, nan, nan])
    assert math.isnan(none["mean"]) and math.isnan(none["se"]) and none["n"] == 0


def test_report_only_trains_nothing_and_reports_the_unfinished_arms_as_not_run(tmp_path, monkeypatch):
    import driver.bench.runner as runner

    def must_not_train(cmd, log_file):
        raise AssertionError(f"trained with --report-only: {cmd}")

    monkeypatch.setattr(runner, "run_logged", must_not_train)
    monkeypatch.setattr(runner, "warm_start", lambda config, overrides, root, say, make=True: root / "ws")
    arms = staleness_arms([0, 2])
    runs = runner.run_arms("configs/quickstart.yaml", [], arms, tmp_path / "out", steps=2, eval_every=1,
                           say=lambda *_: None, report_only=True)
    assert [r.error for r in runs] == [runner.NOT_RUN] * 2
    report = tmp_path / "report.md"
    report.write_text("r\n")
    assert runner.finish(report, runs) == 0


def test_warm_start_seed_and_thread_arms_differ_from_the_config_only_by_their_warm_start(tmp_path):
    from warm_start.sft import warm_start_inputs

    arms = learning_arms([], tmp_path, warm_start_seeds=[2, 4], sft_threads=[1, 2])
    assert [a.name for a in arms] == ["ws2-rl", "ws4-rl", "ws2-threads1-rl", "ws2-threads2-rl"]
    base = load_config("configs/quickstart.yaml")
    cfgs = [load_config("configs/quickstart.yaml", list(a.overrides)) for a in arms]
    for a, cfg in zip(arms, cfgs):
        assert a.own_warm_start
        assert cfg.data.world_dir == base.data.world_dir and cfg.model.path == base.model.path
        assert cfg.learner.seed == base.learner.seed and cfg.rollout.seed == base.rollout.seed
    assert [c.sft.seed for c in cfgs] == [2, 4, 2, 2] and [c.sft.threads for c in cfgs] == [0, 0, 1, 2]
    # every arm names a warm start of its own; the default thread count leaves older warm starts' inputs as they were
    inputs = [json.dumps(warm_start_inputs(c, c.model.path), sort_keys=True) for c in cfgs]
    assert len(set(inputs)) == 4
    assert "threads" not in warm_start_inputs(base, base.model.path)["sft"]


def test_a_learning_row_without_an_sft_only_arm_has_empty_sft_columns(tmp_path):
    full = learning_folders(tmp_path, 0, [(0, ((1 / 3, 1.0), (0.0, 2.0))), (2, ((2 / 3, 1.5), (1.0, 2.0)))],
                            ((1 / 3, 1.0), (0.0, 1.0)))
    rl = ArmRun(Arm("learning", "seed0-rl", "seed 0", ()), tmp_path / "seed0-rl", [], warm_start=tmp_path / "ws",
                result={"train_s": 40.0, "steps": 2})
    row = seed_row("warm start 0", rl, None)
    assert row["seed"] == "warm start 0" and row["kinds"]["all"]["em_rl"] == full["kinds"]["all"]["em_rl"]
    assert row["kinds"]["all"]["em_sft"] != row["kinds"]["all"]["em_sft"]  # NaN: no SFT-only arm
    summary = learning_summary([row])
    assert summary["kinds"]["all"]["em_sft"]["n"] == 0 and summary["kinds"]["all"]["em_rl"]["n"] == 1
    report = write_learning_report([row], [], tmp_path, "async-agent-rl bench learning --rl-only").read_text()
    assert "| EM RL |" in report and "SFT-only" not in report.split("## all questions")[1]  # no empty columns


def test_the_learning_report_breaks_held_out_em_down_by_relation(tmp_path):
    """Per relation, from the ids each evaluation got right and the run's own test file: a relation one warm start
    reads at 0 (years, say) while others read it shows in the table, where the per-kind EM hides it."""
    from async_agent_rl.data.search_r1 import QAExample, write_qa_parquet

    def q(i, rel, hops):
        return QAExample(id=f"test_{i}", question=f"q{i}?", gold_answers=["a"], data_source="world_single",
                         split="test", index=i, extra={"relation": rel, "hops": hops, "subject": "s", "bridge": ""})

    # 20 birth_year and 20 employer (one-hop), 20 birth_country (two-hop), 2 founder (too rare for the table)
    qs = [q(i, "birth_year", 1) for i in range(20)] + [q(20 + i, "employer", 1) for i in range(20)] + \
         [q(40 + i, "birth_country", 2) for i in range(20)] + [q(60 + i, "founder", 1) for i in range(2)]
    rows = []
    for seed, years_read in ((0, 20), (1, 0)):
        run_dir = tmp_path / f"seed{seed}-rl"
        run_dir.mkdir()
        test = write_qa_parquet(run_dir / "test.parquet", qs)
        load_config(None, [f"data.test_files=[\"{test}\"]"]).save(run_dir / "config.yaml")
        start = ["test_20"]  # the warm start got one employer question right
        end = [f"test_{i}" for i in range(years_read)] + [f"test_{20 + i}" for i in range(15)] + ["test_40"]
        (run_dir / "eval.jsonl").write_text("".join(json.dumps(
            {"step": step, "when": when, "all": {"n": len(qs), "exact_match": len(c) / len(qs),
                                                 "searches_per_question": 1.0, "correct": c}}) + "\n"
            for step, when, c in ((0, "start", start), (2, "end", end))))
        rl = ArmRun(Arm("learning", f"seed{seed}-rl", f"seed {seed}", ()), run_dir, [], warm_start=tmp_path / "ws",
                    result={"train_s": 40.0, "steps": 2})
        rows.append(seed_row(seed, rl, None))
    rel = rows[1]["relations"]
    assert list(rel) == ["birth_year", "employer", "founder", "birth_country"]  # one-hop first, most asked first
    assert rel["birth_year"] == {"n": 20, "hops": 1, "em_start": 0.0, "em_rl": 0.0}
    assert rel["employer"]["em_start"] == pytest.approx(0.05) and rel["employer"]["em_rl"] == pytest.approx(0.75)
    assert rows[0]["relations"]["birth_year"]["em_rl"] == 1.0 and rel["birth_country"]["em_rl"] == pytest.approx(0.05)
    md = write_learning_report(rows, [], tmp_path, "async-agent-rl bench learning --rl-only").read_text()
    table = md.split("## after RL, by relation")[1]
    assert "| seed | birth_year (one-hop) | employer (one-hop) | birth_country (two-hop) |" in table
    assert "founder" not in table  # asked twice: noise
    assert "| **mean ± s.e.** | 0.50 ± 0.50 | 0.75 ± 0.00 | 0.05 ± 0.00 |" in table
    assert "| worst | 0.00 | 0.75 | 0.05 |" in table

    # a run whose evaluation covered part of the questions (eval.num_questions), or whose test file is gone: no table
    (tmp_path / "seed1-rl" / "test.parquet").unlink()
    assert seed_row(1, rl, None)["relations"] == {}


def test_a_finished_arm_stays_reusable_when_a_setting_was_added_since_at_its_default(tmp_path):
    """A long study resumes from its finished arms across commits: a run folder whose saved config lacks a setting
    added later (the new key at its default keeps the old behaviour) is still that arm's finished run; one made with
    another value of any setting is not, nor one naming a setting that no longer exists."""
    from driver.bench.runner import finished_with

    cfg = load_config("configs/quickstart.yaml", ["learner.total_steps=3"])
    run = tmp_path / "arm"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    saved = cfg.to_dict()
    del saved["sft"]["threads"], saved["cluster"]["max_actor_restarts"]  # "added since", both at their defaults
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert finished_with(run, cfg)
    assert not finished_with(run, load_config("configs/quickstart.yaml", ["learner.total_steps=3", "sft.threads=1"]))
    assert not finished_with(run, load_config("configs/quickstart.yaml", ["learner.total_steps=4"]))
    saved["sft"]["a_setting_removed_since"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert not finished_with(run, cfg)
    (run / "config.yaml").write_text("- not a config\n")
    assert not finished_with(run, cfg)


def test_an_arm_finished_before_sft_prebuilt_existed_is_reused(tmp_path, monkeypatch):
    """The quickstart names a prebuilt warm start (``sft.prebuilt``) since the setting came; an arm trains from its
    own warm start, so the setting is cleared in its config, and the finished arms of a study begun before it are
    still its finished arms (they were all to be trained again)."""
    import driver.bench.runner as runner

    monkeypatch.setattr(runner, "warm_start", lambda config, overrides, root, say, make=True: root / "ws")
    monkeypatch.setattr(runner, "arm_result", lambda run_dir: {"em_start": 0.0, "em_end": 0.5, "reward_last": 0.5,
                                                                "samples_per_s": 1.0})
    arms = staleness_arms([0])
    args = ("configs/quickstart.yaml", [], arms, tmp_path / "out")
    kw = dict(steps=2, eval_every=1, say=lambda *_: None, report_only=True)
    (first,) = runner.run_arms(*args, **kw)
    assert load_config("configs/quickstart.yaml").sft.prebuilt, "the quickstart names one"
    saved = load_config("configs/quickstart.yaml", first.overrides).to_dict()
    del saved["sft"]["prebuilt"]  # the setting did not exist
    first.run_dir.mkdir(parents=True)
    (first.run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    (first.run_dir / "summary.json").write_text("{}")
    (again,) = runner.run_arms(*args, **kw)
    assert again.reused and not again.error


def test_the_learning_report_gives_each_group_of_arms_its_own_mean_and_worst(tmp_path):
    """Worlds (--seeds) and warm starts of one world (--warm-start-seeds) answer different questions: each group
    gets its own mean ± s.e. and worst, beside the pooled tables."""
    from driver.bench.learning import arm_group, group_table

    def row(seed, em):
        return {"seed": seed, "kinds": {"all": {"em_rl": em}, "world_single": {"em_rl": em - 0.1}}}

    rows = [row(1, 0.6), row(2, 0.8), row("warm start 0", 0.5), row("warm start 1", 0.7), row("warm start 2", 0.9),
            row("warm start 0, 1 thread", 0.5)]
    assert [arm_group(r["seed"]) for r in rows] == ["worlds (`--seeds`)"] * 2 + \
        ["warm starts (`--warm-start-seeds`)"] * 3 + ["thread counts (`--sft-threads`)"]
    table = group_table(rows)
    assert "| worlds (`--seeds`) | 2 | 0.700 ± 0.100 (worst 0.600) | 0.600 ± 0.100 (worst 0.500) |" in table
    assert "| warm starts (`--warm-start-seeds`) | 3 | 0.700 ± 0.115 (worst 0.500) |" in table
    assert "| thread counts (`--sft-threads`) | 1 | 0.500 ± n/a (worst 0.500) |" in table


@pytest.mark.parametrize("flags, names", [
    ([], ["eta0", "eta8", "eta8-ppo"]),
    (["--no-ppo-arm"], ["eta0", "eta8"]),
])
def test_bench_staleness_with_seeds_adds_the_standard_ppo_arm_unless_told_not_to(monkeypatch, flags, names):
    import argparse

    import driver.bench.cli as cli

    seen = {}

    def fake_seeds(args, kind, arms, base, out, command):
        seen["arms"] = [a.name for a in arms]
        return 0

    monkeypatch.setattr(cli, "_cmd_bench_seeds", fake_seeds)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["bench", "staleness", "--config", "configs/quickstart.yaml", "--seeds", "0",
                              "--etas", "0,8", *flags])
    assert cli.cmd_bench(args) == 0
    assert seen["arms"] == names
