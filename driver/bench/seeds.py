"""``bench staleness|sync|ablations --seeds 0,1,2``: every arm once per seed, each seed its own world, tiny model,
warm start and training seeds (``bench.seed_overrides``), and one report of means and standard errors over seeds.

Layout under ``--out`` (default ``runs/bench/<kind>``): ``seed<s>/<arm>/`` run folders and logs, ``report.md``,
``report.json``; the worlds live in ``OUT/../worlds/seed_<s>`` and the warm starts in ``OUT/../warm_start``, so the
staleness, sync and ablation benches share one warm start per seed. A finished arm is reused (``bench.run_arms``),
so a study interrupted between arms resumes where it stopped.

Time to accuracy (per seed): training seconds (evaluations taken out) until held-out greedy exact match first
reaches ``TARGET_FRACTION`` of the lowest final exact match among the study's reference arms in that seed (both arms
of ``sync``; the decoupled-loss arms of ``staleness``; every arm of ``ablations``), so every reference arm reaches
it. An arm that never reaches it has no time (counted in the report).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from driver.bench.arms import Arm, ArmRun, seed_overrides
from driver.bench.plots import plot_seeds
from driver.bench.results import TIME_COLUMNS, TIME_NOTE, mean_of, mean_se, pm, time_to_em
from driver.bench.runner import run_arms
from driver.plots import read_jsonl


TARGET_FRACTION = 0.9


EM_MARGIN = 0.05  # the staleness recommendation: arms within this of the best final exact match are "as accurate"


def parse_seeds(text: str) -> list[int]:
    seeds = [int(x) for x in text.split(",") if x.strip()]
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds needs distinct values >= 0, got {text!r}")
    return seeds


def run_seeds(config: str, overrides: list[str], arms: Sequence[Arm], out: Path, seeds: Sequence[int],
              steps: int | None, eval_every: int | None, force: bool, warm_starts: Path | None,
              say: Callable[[str], None] = print, report_only: bool = False) -> dict[int, list[ArmRun]]:
    """Every arm for every seed, one after the other (a seed's arms share its warm start)."""
    worlds = out.parent / "worlds"
    runs = {}
    for s in seeds:
        say(f"[seed {s}]")
        runs[s] = run_arms(config, [*overrides, *seed_overrides(s, worlds / f"seed_{s}")], arms, out / f"seed{s}",
                           steps, eval_every, force, say=say, warm_starts=warm_starts or out.parent / "warm_start",
                           report_only=report_only)
    return runs


def extra_numbers(run: ArmRun) -> dict[str, Any]:
    """What the seeds' report adds to ``bench.arm_result``: the realized staleness distribution of the consumed
    trajectories, the importance-weight statistics, and the length shares generated against trained on."""
    metrics = read_jsonl(run.run_dir / "metrics.jsonl")
    last = metrics[-1]
    learner = [m["learner"] for m in metrics]
    hist = {int(k): v for k, v in last.get("buffer_staleness_histogram", {}).items()}
    lengths = last.get("buffer_length_tokens", {})

    generated, evicted = lengths.get("generated", {}), lengths.get("evicted", {})
    kept = {k: v - evicted.get(k, 0) for k, v in generated.items()}  # not evicted (by the group filter, staleness)
    stages = {"generated": generated, "kept": kept, "consumed": lengths.get("consumed", {})}
    # kept but not trained on: what the buffer still held (or pending groups) when the run ended
    stages["left"] = {k: v - stages["consumed"].get(k, 0) for k, v in kept.items()}

    # generated over the last quarter of the steps (the counts are cumulative): what the end's backlog was made of
    quarter = metrics[-max(1, len(metrics) // 4) - 1].get("buffer_length_tokens", {}).get("generated", {}) \
        if len(metrics) > 1 else {}
    stages["generated_late"] = {k: v - quarter.get(k, 0) for k, v in generated.items()}

    def share_long(stage: str) -> float:  # share of trajectories of 256 response tokens or more
        counts = stages[stage]
        total = sum(counts.values())
        return sum(v for k, v in counts.items() if not k.startswith("<") and int(k.split("-")[0]) >= 256) / total \
            if total > 0 else float("nan")

    return {
        "staleness_histogram": hist,
        "staleness_max": max(hist) if hist else 0,
        "iw_mean": mean_of(x.get("iw_mean", float("nan")) for x in learner if x.get("iw_mean") is not None),
        "iw_max": max((x["iw_max"] for x in learner if x.get("iw_max") is not None), default=float("nan")),
        "iw_capped_frac": mean_of(x["iw_capped_frac"] for x in learner if x.get("iw_capped_frac") is not None),
        **{f"long_share_{k}": share_long(k) for k in stages},
        "left_at_end": sum(stages["left"].values()),
        "evicted_stale": last.get("buffer_evicted", {}).get("stale", 0),
    }


def per_seed_rows(runs: dict[int, list[ArmRun]], reference: Callable[[Arm], bool]) -> dict[str, list[dict]]:
    """Per arm name, one row per seed that finished it, with its time to accuracy."""
    rows: dict[str, list[dict]] = {}
    for seed, seed_runs in runs.items():
        done = [r for r in seed_runs if r.result and not r.error]
        refs = [r.result["em_end"] for r in done if reference(r.arm)]
        target = TARGET_FRACTION * min(refs) if refs else float("nan")
        for r in done:
            row = {"seed": seed, **r.result, **extra_numbers(r), "target_em": target,
                   "time_to_acc_s": time_to_em(r.result, target) if refs else None}
            rows.setdefault(r.arm.name, []).append(row)
    return rows


SEED_COLUMNS = [("final EM", "em_end", "{:.3f}"), ("best EM", "em_best", "{:.3f}"),
                ("time to acc. s", "time_to_acc_s", "{:.0f}"), ("samples/s", "samples_per_s", "{:.2f}"),
                ("train s", "train_s", "{:.0f}"), ("staleness mean", "staleness_mean", "{:.2f}"),
                ("iw mean", "iw_mean", "{:.3f}"), ("iw capped", "iw_capped_frac", "{:.3f}")]


def summarize(rows: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    out = {}
    for arm, rs in rows.items():
        s: dict[str, Any] = {key: mean_se([r[key] for r in rs if r.get(key) is not None])
                             for _, key, _ in SEED_COLUMNS + TIME_COLUMNS}
        s["reached"] = f"{sum(r['time_to_acc_s'] is not None for r in rs)}/{len(rs)}"
        hist: Counter = Counter()
        for r in rs:
            hist.update(r["staleness_histogram"])
        s["staleness_histogram"] = dict(sorted(hist.items()))
        s["staleness_max"] = max((r["staleness_max"] for r in rs), default=0)
        s["iw_max"] = max((r["iw_max"] for r in rs), default=float("nan"))
        s["evicted_stale"] = sum(r["evicted_stale"] for r in rs)
        s["long_share"] = {k: mean_se([r[f"long_share_{k}"] for r in rs if f"long_share_{k}" in r])
                           for k in ("generated", "generated_late", "kept", "consumed", "left")}
        s["left_at_end"] = mean_se([r.get("left_at_end", float("nan")) for r in rs])
        s["seeds"] = [r["seed"] for r in rs]
        out[arm] = s
    return out


def seeds_table(arms: Sequence[Arm], summary: dict[str, dict[str, Any]],
                columns: Sequence[tuple[str, str, str]] = SEED_COLUMNS, counts: bool = True) -> str:
    """``columns`` per arm, mean ± s.e. over seeds; ``counts``: then the arm's reached target, max staleness and
    stale evictions."""
    tail = ["reached target", "max staleness", "stale evicted"] if counts else []
    head = ["arm", "seeds", *(c[0] for c in columns), *tail]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        s = summary.get(arm.name)
        if s is None:
            lines.append(f"| {arm.label} | 0 |" + " |" * (len(head) - 2))
            continue
        cells = [arm.label, str(len(s["seeds"]))]
        cells += ["n/a" if not s[key]["n"] else pm(s[key], fmt) for _, key, fmt in columns]
        if counts:
            cells += [s["reached"], str(s["staleness_max"]), str(s["evicted_stale"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def staleness_recommendation(arms: Sequence[Arm], summary: dict[str, dict[str, Any]]) -> str:
    """The eta that reaches the accuracy target soonest among the decoupled arms as accurate as the best (final EM
    within ``EM_MARGIN``), from this bench's own numbers; and the throughput/accuracy trade-off."""
    dec = [(a, summary[a.name]) for a in arms if a.name in summary and "ppo" not in a.name]
    if not dec:
        return "No decoupled arm finished: no recommendation."
    best_em = max(s["em_end"]["mean"] for _, s in dec)
    ok = [(a, s) for a, s in dec if s["em_end"]["mean"] >= best_em - EM_MARGIN and s["time_to_acc_s"]["n"]]
    lines = []
    if ok:
        a, s = min(ok, key=lambda x: x[1]["time_to_acc_s"]["mean"])
        lines.append(f"**Recommendation: {a.label}**: of the arms whose final held-out EM is within {EM_MARGIN} of "
                     f"the best ({best_em:.3f}), it reached the accuracy target soonest "
                     f"({s['time_to_acc_s']['mean']:.0f} s mean over {s['time_to_acc_s']['n']} seeds).")
    fastest = max(dec, key=lambda x: x[1]["samples_per_s"]["mean"])
    lines.append("Trade-off: trained samples/s " + ", ".join(
        f"{a.label} {s['samples_per_s']['mean']:.2f}" for a, s in dec) +
        "; final EM " + ", ".join(f"{a.label} {s['em_end']['mean']:.3f}" for a, s in dec) +
        f". The highest throughput is {fastest[0].label}.")
    return " ".join(lines)


def sync_comparison(rows: dict[str, list[dict]]) -> tuple[str, dict[str, Any]]:
    """Per seed, sync time to accuracy / async time to accuracy; mean and s.e. over seeds."""
    by_seed = {r["seed"]: {"async": r} for r in rows.get("async", [])}
    for r in rows.get("sync", []):
        by_seed.setdefault(r["seed"], {})["sync"] = r
    ratios, sps = [], []
    for both in by_seed.values():
        if {"async", "sync"} <= set(both):
            a, s = both["async"], both["sync"]
            if a["time_to_acc_s"] and s["time_to_acc_s"]:
                ratios.append(s["time_to_acc_s"] / a["time_to_acc_s"])
            if s["samples_per_s"]:
                sps.append(a["samples_per_s"] / s["samples_per_s"])
    d = {"time_to_acc_ratio": mean_se(ratios), "samples_per_s_ratio": mean_se(sps)}
    if not ratios:
        return "No seed has both arms reaching the target: no time-to-accuracy ratio.", d
    text = (f"Synchronous / asynchronous training time to the accuracy target: "
            f"**{pm(d['time_to_acc_ratio'], '{:.2f}')}x** "
            f"over {len(ratios)} seeds (per seed: {', '.join(f'{x:.2f}' for x in ratios)}); trained samples/s "
            f"async / sync: {pm(d['samples_per_s_ratio'], '{:.2f}')}x.")
    return text, d


def _or_na(x: float, fmt: str) -> str:
    """``x`` formatted, or ``n/a`` where there is no number (a standard-PPO arm has no importance weights; a share of
    no trajectories is none)."""
    return "n/a" if x != x else format(x, fmt)


def write_seeds_report(kind: str, arms: Sequence[Arm], runs: dict[int, list[ArmRun]], out: Path, command: str,
                       reference: Callable[[Arm], bool]) -> Path:
    rows = per_seed_rows(runs, reference)
    summary = summarize(rows)
    plot = plot_seeds(arms, rows, out / f"{kind}_seeds.png", f"bench {kind}: held-out EM over training, per seed")
    lines = [f"# bench {kind} over seeds {', '.join(map(str, runs))}", "", "Command:", "", f"    {command}", "",
             "Each seed is its own world, tiny model, warm start (shared by the seed's arms) and training seeds. Means "
             "± standard error over seeds; held-out exact match is greedy on every held-out question. Time to "
             f"accuracy: training seconds (evaluations excluded) until held-out EM first reached {TARGET_FRACTION} "
             "of the lowest final EM among the reference arms of that seed.", ""]
    extra: dict[str, Any] = {}
    if kind == "sync":
        text, extra = sync_comparison(rows)
        lines += [text, ""]
    if kind == "staleness":
        lines += [staleness_recommendation(arms, summary), ""]
    lines += [seeds_table(arms, summary), "", TIME_NOTE, "", seeds_table(arms, summary, TIME_COLUMNS, counts=False), "",
              "Realized staleness of consumed trajectories (all seeds):", ""]
    for arm in arms:
        if arm.name in summary:
            s = summary[arm.name]
            share = {k: _or_na(v["mean"], ".3f") for k, v in s["long_share"].items()}
            lines.append(f"- {arm.label}: {s['staleness_histogram']}; max importance weight "
                         f"{_or_na(s['iw_max'], '.2f')}; share of trajectories of >= 256 response tokens: generated "
                         f"{share['generated']} (in the last quarter of the steps {share['generated_late']}), kept "
                         f"by the group filter {share['kept']}, trained on {share['consumed']}, left in the buffer at "
                         f"the end {share['left']} (of {s['left_at_end']['mean']:.0f} trajectories)")
    if plot is not None:
        lines += ["", f"![held-out EM over training seconds per seed; staleness of trained-on data]({plot.name})"]
    failed = [f"seed {seed} {r.arm.name}: {r.error}" for seed, rs in runs.items() for r in rs if r.error]
    if failed:
        lines += ["", "Failed arms:", "", *(f"- {f}" for f in failed)]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    (out / "report.json").write_text(json.dumps({"rows": rows, "summary": summary, "comparison": extra},
                                                indent=1, default=str) + "\n")
    return report
