"""An arm's numbers, read back from its run folder's own files, and the statistics over arms and seeds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Sequence

import yaml

from driver.plots import read_jsonl


def mean_of(xs: Sequence[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def arm_result(run_dir: Path) -> dict[str, Any]:
    """The numbers of one finished run, from its own files. ``*_last``: mean over the last quarter of the steps.
    ``train_s`` excludes the evaluations run during training; ``samples_per_s`` is trained trajectories per second
    of it."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    if not metrics or not evals:
        raise ValueError(f"{run_dir} has no metrics or no evaluations")
    batch = cfg["learner"]["batch_size"]
    last = metrics[-max(1, len(metrics) // 4):]
    by_step = {m["step"]: m for m in metrics}
    curve, eval_s = [], 0.0
    for e in evals:  # training time at each evaluation, evaluation time taken out
        t = 0.0 if e["step"] == 0 else by_step.get(e["step"], metrics[-1])["elapsed_s"] - eval_s
        curve.append({"step": e["step"], "train_s": t, "exact_match": e["all"]["exact_match"],
                      "f1": e["all"]["f1"], "searches": e["all"]["searches_per_question"]})
        if e["when"].startswith("step"):
            eval_s += e.get("seconds", 0.0)
    train_s = metrics[-1]["elapsed_s"] - eval_s
    return {
        "steps": len(metrics),
        "em_start": curve[0]["exact_match"],
        "em_end": curve[-1]["exact_match"],
        "em_best": max(c["exact_match"] for c in curve),
        "f1_end": curve[-1]["f1"],
        "eval_searches_end": curve[-1]["searches"],
        "reward_last": mean_of(m["batch_reward"] for m in last),
        "rollout_em_last": mean_of(m["rollout_exact_match"] for m in last),
        "response_length_last": mean_of(m.get("batch", {}).get("response_length", float("nan")) for m in last),
        "searches_last": mean_of(m.get("batch", {}).get("searches", float("nan")) for m in last),
        "train_s": train_s,
        "samples_per_s": len(metrics) * batch / train_s if train_s > 0 else 0.0,
        "episodes_per_s": metrics[-1]["episodes_per_s"],
        "gen_tokens_per_s": metrics[-1]["gen_tokens_per_s"],
        "staleness_mean": mean_of(m["learner"].get("staleness_mean", 0.0) for m in metrics),
        "evicted": metrics[-1].get("buffer_evicted", {}),
        **time_split(metrics, train_s),
        "episodes": summary.get("episodes", 0),
        "eval_curve": curve,
        "steps_curve": [{"step": m["step"], "reward": m["batch_reward"],
                         "response_length": m.get("batch", {}).get("response_length"),
                         "searches": m.get("batch", {}).get("searches")} for m in metrics],
    }


def time_split(metrics: Sequence[dict[str, Any]], train_s: float) -> dict[str, float]:
    """Where an arm's training seconds went, summed over its steps from ``metrics.jsonl`` (the driver does these one
    after the other in a step): ``learner_s`` the learner's compute (``learner.step_time_s``), ``batch_wait_s`` its
    wait for the step's batch (``sample_wait_s``), ``publish_s`` the weight publishes (``publish.publish_latency_s``),
    ``other_s`` the rest of ``train_s`` (supervising the fleet, stats, records, checkpoints). Over the steps' means:
    ``engine_idle_share`` (the rollout engines with no request in flight) and ``tool_wait_share`` (the share of the
    episodes' time spent awaiting the search tool). NaN where the metrics predate a key."""
    def total(get: Any) -> float:
        xs = [get(m) for m in metrics]
        return float("nan") if any(x is None for x in xs) else float(sum(xs))

    learner = total(lambda m: m.get("learner", {}).get("step_time_s"))
    wait = total(lambda m: m.get("sample_wait_s"))
    publish = sum(m.get("publish", {}).get("publish_latency_s", 0.0) for m in metrics)  # not every step publishes
    return {
        "learner_s": learner, "batch_wait_s": wait, "publish_s": publish,
        "other_s": train_s - learner - wait - publish,
        "engine_idle_share": mean_of(m["rollout_engine_idle_share"] for m in metrics
                                     if m.get("rollout_engine_idle_share") is not None),
        "tool_wait_share": mean_of(m["rollout_tool_wait_share"] for m in metrics
                                   if m.get("rollout_tool_wait_share") is not None),
    }


TIME_COLUMNS = [("train s", "train_s", "{:.0f}"), ("learner compute s", "learner_s", "{:.0f}"),
                ("waiting for a batch s", "batch_wait_s", "{:.0f}"), ("weight publish s", "publish_s", "{:.0f}"),
                ("other s", "other_s", "{:.0f}"), ("engines idle (share)", "engine_idle_share", "{:.2f}"),
                ("episodes awaiting the tool (share)", "tool_wait_share", "{:.2f}")]
TIME_NOTE = ("Where the training time goes (evaluations excluded), summed over the steps from `metrics.jsonl`: the "
             "learner's compute, its wait for each batch, the weight publishes, and the rest (supervision, stats, "
             "checkpoints); the shares are means over the steps: the rollout engines' time with no request in flight, "
             "and the episodes' time spent awaiting the search tool.")


def time_to_em(result: dict[str, Any], target: float) -> float | None:
    """Training seconds until held-out exact match first reached ``target`` (None: never)."""
    return next((c["train_s"] for c in result["eval_curve"] if c["exact_match"] >= target - 1e-9), None)


COLUMNS = [
    ("EM start", "em_start", "{:.3f}"), ("EM end", "em_end", "{:.3f}"), ("best EM", "em_best", "{:.3f}"),
    ("reward (last 25%)", "reward_last", "{:.3f}"), ("response tokens", "response_length_last", "{:.0f}"),
    ("searches/episode", "searches_last", "{:.2f}"), ("staleness", "staleness_mean", "{:.2f}"),
    ("samples/s", "samples_per_s", "{:.2f}"), ("train s", "train_s", "{:.0f}"),
]


KINDS = {"all": "all questions", "world_single": "single-hop", "world_bridge": "bridge (two-hop)"}


def mean_se(xs: Sequence[float]) -> dict[str, float]:
    """Mean and standard error (sample standard deviation / sqrt(n); NaN for fewer than two values) over the values
    that are numbers: a NaN (a statistic an arm does not have, e.g. importance weights under the standard PPO loss)
    is left out, and ``n`` counts what is left."""
    xs = [x for x in xs if x == x]
    se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
    return {"mean": mean_of(xs), "se": se, "n": len(xs)}


def pm(m: dict[str, float], fmt: str) -> str:
    se = "n/a" if m["se"] != m["se"] else fmt.replace("+", "").format(m["se"])
    return f"{fmt.format(m['mean'])} ± {se}"
