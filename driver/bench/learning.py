"""``bench learning``: RL from the warm start against more SFT for the same time, one world per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from async_agent_rl.config import load_config
from driver.bench.arms import SEED_KEYS, Arm, ArmRun, learning_arms
from driver.bench.plots import plot_learning, plot_learning_bars
from driver.bench.results import KINDS, mean_se, pm
from driver.bench.runner import (NOT_RUN, clear_run, cli_command, command_line, finish, finished_with, run_arms,
                                 run_logged, tail)
from driver.plots import read_jsonl


def run_sft_only(config: str, rl: ArmRun, out: Path, force: bool = False, say=print,
                 report_only: bool = False) -> ArmRun:
    """The SFT-only arm of one seed: from the RL arm's own warm start, more SFT for as long as RL trained
    (``rl.result['train_s']``: the RL loop without its evaluations), in a child ``bench continue-sft``; then the
    held-out questions of RL's evaluations, greedy, in a child ``eval`` (``scores.json``). Reruns skip a finished
    one made with the same config, warm start and budget."""
    arm = Arm("learning", rl.arm.name.removesuffix("-rl") + "-sft", f"{rl.arm.label} SFT-only", rl.arm.overrides)
    run = ArmRun(arm, out / arm.name, rl.overrides, warm_start=rl.warm_start)
    cfg = load_config(config, rl.overrides)
    budget = rl.result["train_s"]
    log_file = out / f"{arm.name}.log"
    if not force and finished_with(run.run_dir, cfg, "sft_config.yaml", "scores.json") and _same_budget(run, budget):
        run.reused = True
        say(f"[{arm.name}] finished run present in {run.run_dir}: reused")
    elif report_only:
        run.error = NOT_RUN
        say(f"[{arm.name}] {run.error}")
        return run
    else:
        say(f"[{arm.name}] SFT for {budget:.0f} s from {rl.warm_start} -> {run.run_dir}")
        clear_run(run.run_dir)
        limit = ["--limit", str(cfg.eval.num_questions)] if cfg.eval.num_questions else []
        steps = [
            ("continue-sft", [*cli_command(), "bench", "continue-sft", "--config", config,
                              "--warm-start", str(rl.warm_start), "--seconds", repr(budget), "--out", str(run.run_dir),
                              *rl.overrides]),
            ("eval", [*cli_command(), "eval", "--config", config, "--checkpoint", str(run.run_dir),
                      "--out", str(run.run_dir / "scores.json"), *limit, *rl.overrides]),
        ]  # fmt: skip
        for name, cmd in steps:
            rc, s = run_logged(cmd, log_file)
            run.seconds += s
            if rc != 0:
                run.error = f"{name} exited with {rc}; log {log_file}"
                say(f"[{arm.name}] {run.error}\n{tail(log_file)}")
                return run
    run.result = sft_only_result(run.run_dir)
    say(f"[{arm.name}] held-out EM {run.result['scores']['all']['exact_match']:.3f} after "
        f"{run.result['steps']} SFT steps ({run.result['sft_s']:.0f} s)")
    return run


def _same_budget(run: ArmRun, budget: float) -> bool:
    from warm_start.sft import CONTINUE_SUMMARY_FILE

    try:
        done = json.loads((run.run_dir / CONTINUE_SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return done.get("budget_s") == budget and done.get("warm_start") == str(run.warm_start)


def sft_only_result(run_dir: Path) -> dict[str, Any]:
    """The SFT-only arm's numbers from its folder: the continuation's summary and the evaluation's scores."""
    from warm_start.sft import CONTINUE_SUMMARY_FILE

    done = json.loads((run_dir / CONTINUE_SUMMARY_FILE).read_text())
    return {"steps": done["steps"], "rounds": done["rounds"], "sft_s": done["seconds"], "budget_s": done["budget_s"],
            "demo_s": done["demo_s"], "final_loss": done["final_loss"],
            "scores": json.loads((run_dir / "scores.json").read_text())["scores"]}


def _kind_numbers(scores: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Exact match and searches per question of each kind of question present in one evaluation."""
    return {k: {"em": scores[k]["exact_match"], "searches": scores[k]["searches_per_question"], "n": scores[k]["n"]}
            for k in KINDS if k in scores}


def relation_numbers(run_dir: Path, evals: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Held-out exact match by the question's relation (``extra_info.relation`` of the run's test files: birth_year,
    employer_hq, ...) at the start and the end of an RL run, from the ids its evaluations got right: which kinds of
    value a warm start reads and which it does not (a per-kind EM hides a relation read at 0). Empty when the run's
    config or test files cannot be read (said in one line on stderr: a study's process older than a config key its
    later arms saved once dropped their rows unsaid), or an evaluation covered only part of the questions."""
    from async_agent_rl.data.search_r1 import read_qa_parquet

    when = {e["when"]: e for e in evals}
    try:
        cfg = load_config(run_dir / "config.yaml", [])
        questions = [q for f in cfg.data.test_files for q in read_qa_parquet(f)]
    except Exception as e:  # noqa: BLE001 - a report of older or moved runs goes on without this table
        why = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        print(f"[report] {run_dir}: no by-relation numbers, its config or test files do not load ({why})",
              file=sys.stderr)
        return {}
    if not all("correct" in when.get(w, {}).get("all", {}) and when[w]["all"]["n"] == len(questions)
               for w in ("start", "end")):
        return {}
    right = {w: set(when[w]["all"]["correct"]) for w in ("start", "end")}
    out: dict[str, dict[str, float]] = {}
    for q in questions:
        r = out.setdefault(str(q.extra.get("relation") or "?"), {"n": 0, "hops": q.extra.get("hops") or 0,
                                                                  "em_start": 0.0, "em_rl": 0.0})
        r["n"] += 1
        r["em_start"] += q.id in right["start"]
        r["em_rl"] += q.id in right["end"]
    for r in out.values():
        r["em_start"] /= r["n"]
        r["em_rl"] /= r["n"]
    return dict(sorted(out.items(), key=lambda kv: (kv[1]["hops"], -kv[1]["n"], kv[0])))


def seed_row(seed: int | str, rl: ArmRun, sft: ArmRun | None) -> dict[str, Any]:
    """One seed's line of the learning report, from the RL run's ``eval.jsonl`` (its ``start`` evaluation: the warm
    start; its ``end`` one: after RL) and the SFT-only arm's scores."""
    evals = read_jsonl(rl.run_dir / "eval.jsonl")
    when = {e["when"]: e for e in evals}
    start, end = _kind_numbers(when["start"]), _kind_numbers(when["end"])
    # without an SFT-only arm (--rl-only) its columns are not a number
    other = _kind_numbers(sft.result["scores"]) if sft else {k: {"em": float("nan"), "searches": float("nan")}
                                                              for k in start}
    kinds = {}
    for k in start:
        if k in end and k in other:
            x = {"n": start[k]["n"], "em_start": start[k]["em"], "em_rl": end[k]["em"], "em_sft": other[k]["em"],
                 "searches_start": start[k]["searches"], "searches_rl": end[k]["searches"],
                 "searches_sft": other[k]["searches"]}  # fmt: skip
            kinds[k] = {**x, "gain_rl": x["em_rl"] - x["em_start"], "gain_sft": x["em_sft"] - x["em_start"],
                        "rl_minus_sft": x["em_rl"] - x["em_sft"]}  # fmt: skip
    curve = [{"step": e["step"], **{k: e[k]["exact_match"] for k in KINDS if k in e}} for e in evals]
    return {"seed": seed, "rl_s": rl.result["train_s"], "rl_steps": rl.result["steps"],
            "sft_s": sft.result["sft_s"] if sft else float("nan"), "sft_steps": sft.result["steps"] if sft else 0,
            "warm_start": str(rl.warm_start), "kinds": kinds, "curve": curve,
            "relations": relation_numbers(rl.run_dir, evals)}


def learning_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean and standard error over seeds of every number of the seed rows, per kind of question."""
    out: dict[str, Any] = {key: mean_se([r[key] for r in rows]) for key in ("rl_s", "rl_steps", "sft_s", "sft_steps")}
    out["kinds"] = {}
    for k in KINDS:
        have = [r["kinds"][k] for r in rows if k in r["kinds"]]
        if have:
            out["kinds"][k] = {key: mean_se([h[key] for h in have]) for key in have[0]}
    return out


LEARNING_COLUMNS = [
    ("EM warm start", "em_start"), ("EM RL", "em_rl"), ("RL gain", "gain_rl"), ("EM SFT-only", "em_sft"),
    ("SFT gain", "gain_sft"), ("RL - SFT-only", "rl_minus_sft"), ("searches/q warm start", "searches_start"),
    ("searches/q RL", "searches_rl"), ("searches/q SFT-only", "searches_sft"),
]


TIME_COLUMNS = [("RL s", "rl_s"), ("RL steps", "rl_steps"), ("SFT-only s", "sft_s"), ("SFT-only steps", "sft_steps")]


def learning_table(rows: Sequence[dict[str, Any]], summary: dict[str, Any], kind: str) -> str:
    """One kind's table: a line per seed and the mean ± s.e. over seeds; the ``all`` table has the times too. The
    SFT-only columns are left out when no row has an SFT-only arm (``--rl-only``)."""
    cols = LEARNING_COLUMNS + (TIME_COLUMNS if kind == "all" else [])
    if not any(r.get("sft_steps") or r["sft_s"] == r["sft_s"] for r in rows):  # NaN != NaN: no SFT-only arm
        cols = [c for c in cols if "sft" not in c[1]]
    fmts = {key: "{:+.3f}" if key.startswith(("gain", "rl_minus")) else "{:.2f}" if key.startswith("searches")
            else "{:.0f}" if key in dict(TIME_COLUMNS).values() else "{:.3f}" for _, key in cols}  # fmt: skip
    head = ["seed", "n", *(c[0] for c in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if kind in r["kinds"]:
            x = {**r, **r["kinds"][kind]}
            cells = [str(r["seed"]), str(x["n"]), *(fmts[k].format(x[k]) for _, k in cols)]
            lines.append("| " + " | ".join(cells) + " |")
    m = {**summary, **summary["kinds"].get(kind, {})}
    if kind in summary["kinds"]:
        lines.append("| " + " | ".join(["**mean ± s.e.**", "", *(pm(m[k], fmts[k]) for _, k in cols)]) + " |")
    return "\n".join(lines)


def relation_table(rows: Sequence[dict[str, Any]], min_n: int = 20) -> str:
    """Held-out EM after RL by relation: a line per arm, a column per relation asked at least ``min_n`` times in
    every arm's world (rarer ones are noise), and the mean ± s.e. and the worst over arms. Empty without numbers."""
    have = [r for r in rows if r.get("relations")]
    if not have:
        return ""
    rels = [k for k in have[0]["relations"]
            if all(r["relations"].get(k, {}).get("n", 0) >= min_n for r in have)]
    if not rels:
        return ""
    head = ["seed", *(f"{k} ({'two' if have[0]['relations'][k]['hops'] == 2 else 'one'}-hop)" for k in rels)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in have:
        lines.append("| " + " | ".join([str(r["seed"]), *(f"{r['relations'][k]['em_rl']:.2f}" for k in rels)]) + " |")
    stats = {k: mean_se([r["relations"][k]["em_rl"] for r in have]) for k in rels}
    lines.append("| " + " | ".join(["**mean ± s.e.**", *(pm(stats[k], "{:.2f}") for k in rels)]) + " |")
    lines.append("| " + " | ".join(["worst", *(f"{min(r['relations'][k]['em_rl'] for r in have):.2f}" for k in rels)])
                 + " |")
    return "\n".join(lines)


def arm_group(seed: int | str) -> str:
    """Which study a learning row belongs to: a world of its own (``--seeds``), a warm start of the config's world
    (``--warm-start-seeds``) or a pinned thread count (``--sft-threads``)."""
    if isinstance(seed, int):
        return "worlds (`--seeds`)"
    return "thread counts (`--sft-threads`)" if "thread" in str(seed) else "warm starts (`--warm-start-seeds`)"


def group_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per group of arms (``arm_group``): held-out EM after RL, mean ± s.e. and the worst, all questions and by kind."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(arm_group(r["seed"]), []).append(r)
    kinds = [k for k in KINDS if any(k in r["kinds"] for r in rows)]
    head = ["group", "arms", *(f"EM RL, {KINDS[k]}" for k in kinds)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rs in groups.items():
        cells = [name, str(len(rs))]
        for k in kinds:
            xs = [r["kinds"][k]["em_rl"] for r in rs if k in r["kinds"]]
            cells.append(f"{pm(mean_se(xs), '{:.3f}')} (worst {min(xs):.3f})" if xs else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_learning_report(rows: Sequence[dict[str, Any]], runs: Sequence[ArmRun], out: Path, command: str) -> Path:
    """``report.json`` (seed rows, summary, every arm) and ``report.md`` (tables, plots, command) in ``out``."""
    summary = learning_summary(rows) if rows else {}
    arms = {r.arm.name: {"arm": asdict(r.arm), "overrides": r.overrides, "run_dir": str(r.run_dir),
                         "warm_start": str(r.warm_start), "seconds": r.seconds, "reused": r.reused, "error": r.error,
                         **r.result} for r in runs}  # fmt: skip
    numbers = {"seeds": list(rows), "summary": summary, "arms": arms}
    (out / "report.json").write_text(json.dumps(numbers, indent=1) + "\n")
    lines = ["# bench learning", "", "Command:", "", f"    {command}", "",
             f"Does RL learn, on several worlds, and is it worth it against more SFT for the same time? Per seed: "
             f"a world of its own (`data.world.seed`), its own tiny model and tokenizer, its own training seeds "
             f"({', '.join(f'`{k}`' for k in SEED_KEYS)}) and its own SFT warm start. The RL arm trains from the "
             f"warm start (`async-agent-rl train`); the SFT-only arm continues the warm start's SFT on fresh "
             f"demonstrations for as long as RL trained (RL s: the RL loop without its evaluations; warm start "
             f"excluded) and is evaluated by `async-agent-rl eval`. Every EM is greedy on the same held-out "
             f"questions (subjects never seen in training); the warm start's is RL's evaluation at step 0. "
             f"Gains are against the warm start; `RL - SFT-only` is the paired difference. ± is the standard error "
             f"over seeds (sample std / sqrt(n)). Arms ran one after the other on {os.cpu_count()} cores.", ""]
    failed = [r for r in runs if r.error and r.error != NOT_RUN]
    if failed:
        lines += ["Failed arms (their seed is left out): " + "; ".join(f"`{r.arm.name}`: {r.error}" for r in failed),
                  ""]
    not_run = [r.arm.name for r in runs if r.error == NOT_RUN]
    if not_run:
        lines += [f"Not run yet (`--report-only`): {', '.join(f'`{n}`' for n in not_run)}.", ""]
    if len({arm_group(r["seed"]) for r in rows}) > 1:
        lines += ["## by group", "", "The mean rows of the tables below pool every arm; each group's own:", "",
                  group_table(rows), ""]
    for kind, title in KINDS.items():
        if summary and kind in summary["kinds"]:
            lines += [f"## {title}", "", learning_table(rows, summary, kind), ""]
    by_relation = relation_table(rows)
    if by_relation:
        lines += ["## after RL, by relation", "",
                  "Held-out EM after RL of each relation asked at least 20 times in every arm's world: which kinds "
                  "of value a warm start learned to read (a relation near 0 in one arm and near 1 in another is the "
                  "warm start's, since RL changes reading little).", "", by_relation, ""]
    for png in (plot_learning(rows, out / "learning_curves.png"),
                plot_learning_bars(summary, out / "learning_bars.png") if summary else None):
        if png is not None:
            lines += [f"![{png.stem}]({png.name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def cmd_learning(args: argparse.Namespace) -> int:
    """RL against more SFT for the same time, one world per seed (see ``run_sft_only`` and ``seed_overrides``)."""
    lists = {}
    for flag, text in (("--seeds", args.seeds), ("--warm-start-seeds", args.warm_start_seeds),
                       ("--sft-threads", args.sft_threads)):
        try:
            values = [int(x) for x in (text or "").split(",") if x.strip()]
        except ValueError:
            print(f"error: {flag} must be comma-separated integers, not {text!r}", file=sys.stderr)
            return 2
        if (values and min(values) < (1 if flag == "--sft-threads" else 0)) or len(set(values)) != len(values):
            low = 1 if flag == "--sft-threads" else 0
            print(f"error: {flag} needs distinct values >= {low}, got {text!r}", file=sys.stderr)
            return 2
        lists[flag] = values
    seeds = lists["--seeds"]
    if not (seeds or lists["--warm-start-seeds"] or lists["--sft-threads"]):
        print("error: bench learning needs at least one arm: --seeds, --warm-start-seeds or --sft-threads",
              file=sys.stderr)
        return 2
    out = Path(args.out or "runs/bench/learning")
    cfg = load_config(args.config, args.overrides)  # a bad config fails here, before any run
    if not (cfg.sft.enabled and cfg.eval.at_start and cfg.eval.at_end):
        print("error: bench learning compares RL with more SFT from one warm start, evaluated before and after: it "
              "needs sft.enabled, eval.at_start and eval.at_end true", file=sys.stderr)
        return 2
    arms = learning_arms(seeds, out, lists["--warm-start-seeds"], lists["--sft-threads"])
    rl_runs = run_arms(args.config, list(args.overrides), arms, out, args.steps, args.eval_every, args.force,
                       warm_starts=Path(args.warm_starts) if args.warm_starts else None, report_only=args.report_only)
    runs, rows = list(rl_runs), []
    for rl in rl_runs:
        if rl.error:
            continue
        # a world arm's row keeps its seed (a number, as before); the other arms are named by their label
        name = rl.arm.name.removesuffix("-rl")
        label: int | str = int(name[4:]) if name.startswith("seed") and name[4:].isdigit() else rl.arm.label
        if args.rl_only:
            rows.append(seed_row(label, rl, None))
            continue
        sft = run_sft_only(args.config, rl, out, args.force, report_only=args.report_only)
        runs.append(sft)
        if not sft.error:
            rows.append(seed_row(label, rl, sft))
    report = write_learning_report(rows, runs, out, command_line(args))
    return finish(report, runs)


def cmd_continue_sft(args: argparse.Namespace) -> int:
    from warm_start.sft import continue_sft

    if not (Path(args.warm_start) / "config.json").is_file():
        print(f"error: --warm-start {args.warm_start} holds no model", file=sys.stderr)
        return 2
    if not args.seconds > 0:
        print(f"error: --seconds must be > 0, got {args.seconds}", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    cfg.save(Path(args.out) / "sft_config.yaml")
    print(json.dumps(continue_sft(cfg, args.warm_start, args.out, args.seconds)))
    return 0
