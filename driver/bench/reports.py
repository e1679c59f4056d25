"""The one-seed report of a study (``report.md``, ``report.json``): the table, the plots, the staleness guidance and
the async/sync comparison.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from driver.bench.arms import ArmRun
from driver.bench.plots import plot_staleness, plot_study
from driver.bench.results import COLUMNS, TIME_COLUMNS, TIME_NOTE, time_to_em


def table(runs: Sequence[ArmRun], columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    head = ["study", "arm", "overrides", *(c[0] for c in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [r.arm.study, r.arm.label, "`" + " ".join(r.arm.overrides) + "`"]
        if r.error:
            cells += [f"failed: {r.error}"] + [""] * (len(columns) - 1)
        else:
            cells += [fmt.format(r.result[key]) for _, key, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


STALENESS_GUIDANCE = """\
How to choose eta (`buffer.max_staleness`): eta bounds how many policy versions the oldest token of a trained
trajectory may lag the learner. eta = 0 is on-policy: actors may only generate one batch per version, so they idle
while the learner trains and the learner idles while they generate. Each step of eta lets actors run one batch
further ahead, which buys throughput until generation and training overlap fully (beyond that, larger eta only
adds staleness). The decoupled PPO loss corrects for the lag with importance weights against the behavior
policy, capped at `algorithm.behavior_weight_cap`; the more stale the data, the more weights are capped
(`iw_capped_frac` in the learner metrics) and the noisier the update. Pick the smallest eta at which samples/s
stops rising in this table; raise it only if the learner still waits for batches (`sample_wait_s`), and lower it if
reward per step drops or `iw_capped_frac` climbs. AReaL reports eta of 4-8 working for math RL on GPUs; on CPU
machines where actors and learner share cores, overlap buys less and a small eta (1-2) is enough."""


def write_report(kind: str, runs: Sequence[ArmRun], out: Path, command: str, extra: str = "") -> Path:
    results = {r.arm.name: {"arm": asdict(r.arm), "overrides": r.overrides, "run_dir": str(r.run_dir),
                            "seconds": r.seconds, "reused": r.reused, "error": r.error, **r.result} for r in runs}
    (out / "report.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# bench {kind}", "", "Command:", "", f"    {command}", "",
             f"{len(runs)} arms, run one after the other on {os.cpu_count()} cores; every number below is read "
             f"from the arm's run folder (`{out}/<arm>/metrics.jsonl`, `eval.jsonl`, `summary.json`). Held-out exact "
             f"match is greedy, on `eval.num_questions` test questions whose subjects never appear in training.", ""]
    if extra:
        lines += [extra, ""]
    lines += [table(runs), "", TIME_NOTE, "", table(runs, TIME_COLUMNS), ""]
    studies = [s for s in dict.fromkeys(r.arm.study for r in runs) if s != "baseline"]
    baseline = [r for r in runs if r.arm.study == "baseline"]  # ablations: drawn in every study's plot
    for study in studies:
        group = baseline + [r for r in runs if r.arm.study == study]
        png = plot_study(group, out / f"{study}.png", f"{kind}: {study}")
        if png is not None:
            lines += [f"![{study}]({png.name})", ""]
    if kind == "staleness":
        png = plot_staleness(runs, out / "staleness_throughput.png")
        if png is not None:
            lines += [f"![throughput]({png.name})", ""]
        lines += [STALENESS_GUIDANCE, ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def sync_summary(runs: Sequence[ArmRun]) -> tuple[str, dict[str, Any]]:
    """Async against sync: trained samples/s ratio, and training time to the same held-out exact match (the
    lower of the two arms' best, so both reach it)."""
    by = {r.arm.name: r.result for r in runs if r.result}
    if set(by) != {"async", "sync"}:
        return "one of the arms failed: no comparison", {}
    a, s = by["async"], by["sync"]
    target = min(a["em_best"], s["em_best"])
    ta, ts = time_to_em(a, target), time_to_em(s, target)
    d = {"samples_per_s_ratio": a["samples_per_s"] / s["samples_per_s"] if s["samples_per_s"] else None,
         "target_em": target, "async_time_to_em_s": ta, "sync_time_to_em_s": ts,
         "time_to_em_ratio": ts / ta if ta and ts else None}
    text = (f"Asynchronous / synchronous trained samples/s: **{d['samples_per_s_ratio']:.2f}x** "
            f"({a['samples_per_s']:.2f} against {s['samples_per_s']:.2f}). Training time to held-out exact match "
            f"{target:.3f} (the lower of the two arms' best): async {ta if ta is None else round(ta)} s, sync "
            f"{ts if ts is None else round(ts)} s" + (f", **{d['time_to_em_ratio']:.2f}x**." if d["time_to_em_ratio"]
                                                      else "."))
    return text, d
