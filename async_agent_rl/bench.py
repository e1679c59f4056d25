"""``async-agent-rl bench``: short trainings side by side on one config, and a report built from their run folders.

    async-agent-rl bench staleness --config configs/quickstart.yaml --etas 0,1,2,4,8 [--steps N] [overrides]
    async-agent-rl bench ablations --config configs/quickstart.yaml [--studies masking,estimator,topk,group_size]
    async-agent-rl bench sync      --config configs/quickstart.yaml      # asynchronous against synchronous RL

Every arm is a real ``async-agent-rl train`` in a child process (its own local Ray), run one after the other so
they do not share the machine, with the arm's overrides on top of the config and the command line's. Arms start
from one shared SFT warm start, made once by ``async-agent-rl sft``, except arms whose prompt format differs (the
chat-template study), which get their own. Warm starts live in ``OUT/../warm_start/<hash of their inputs>``, so
the staleness, ablation and sync benches of one config share one. Every number in the
report is read back from the run folders' own files (``metrics.jsonl``, ``eval.jsonl``, ``summary.json``,
``config.yaml``); an arm whose run folder already holds a finished run with the same resolved config is not run
again (``--force`` reruns), so a report can be extended study by study.

Output, in ``--out`` (default ``runs/bench/<kind>``): ``report.md`` (the table, the plots, the commands),
``report.json`` (the same numbers), ``<study>.png`` (held-out exact match, reward, response length and searches
per episode over training, one line per arm), one run folder and one log per arm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from async_agent_rl.config import Config, load_config


@dataclass(frozen=True)
class Arm:
    """One short training: ``overrides`` on top of the base config; ``own_warm_start`` when its prompts differ."""

    study: str
    name: str
    label: str
    overrides: tuple[str, ...]
    own_warm_start: bool = False


def _arms(study: str, key: str, values: Sequence[Any], labels: Sequence[str] | None = None,
          own_warm_start: bool = False) -> list[Arm]:
    labels = labels or [f"{key.rsplit('.', 1)[-1]}={v}" for v in values]
    return [Arm(study, f"{study}-{str(v).lower()}", lab, (f"{key}={v}",), own_warm_start)
            for v, lab in zip(values, labels)]


# The seeds' studies (Search-R1's PPO vs GRPO, masking, top-k, group size; chat vs base template; max turns) and the
# group filter. Each is one config key; the first value is the quickstart's.
STUDIES: dict[str, list[Arm]] = {
    "masking": _arms("masking", "algorithm.mask_observations", ["true", "false"],
                     ["observations masked", "observations in the loss"]),
    "estimator": _arms("estimator", "algorithm.advantage_estimator", ["grpo", "gae"], ["GRPO", "PPO (GAE, critic)"]),
    "topk": _arms("topk", "retriever.topk", [3, 1, 5]),
    "group_size": _arms("group_size", "rollout.group_size", [4, 2, 8]),
    "template": _arms("template", "data.apply_chat_template", ["true", "false"],
                      ["chat template (instruct)", "plain prompt (base)"], own_warm_start=True),
    "max_turns": _arms("max_turns", "rollout.max_turns", [4, 2]),
    "group_filter": _arms("group_filter", "buffer.group_filter", ["zero_variance", "none"]),
}
DEFAULT_STUDIES = ("masking", "estimator", "topk", "group_size")


def staleness_arms(etas: Sequence[int]) -> list[Arm]:
    return [Arm("staleness", f"eta{e}", f"eta={e}", (f"buffer.max_staleness={e}",)) for e in etas]


def sync_arms(eta: int) -> list[Arm]:
    """Asynchronous RL (the config's rollout, ``max_staleness=eta``) against synchronous RL: waves of episodes in
    lockstep and on-policy batches (``rollout.mode=sync``, ``max_staleness=0``), as Search-R1 and verl train."""
    return [
        Arm("sync", "async", f"asynchronous, eta={eta}", ("rollout.mode=async", f"buffer.max_staleness={eta}")),
        Arm("sync", "sync", "synchronous (lockstep waves, eta=0)", ("rollout.mode=sync", "buffer.max_staleness=0")),
    ]


# --------------------------------------------------------------------------------------------------------- running
@dataclass
class ArmRun:
    arm: Arm
    run_dir: Path
    overrides: list[str]
    seconds: float = 0.0
    reused: bool = False
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)


def _cli() -> list[str]:
    return [sys.executable, "-m", "async_agent_rl.cli"]


def _run(cmd: list[str], log_file: Path) -> tuple[int, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(log_file, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env).returncode
    return rc, time.monotonic() - t0


def _tail(path: Path, n: int = 15) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(lines[-n:])


def warm_start(config: str, overrides: list[str], root: Path, say) -> Path:
    """The SFT warm start for ``config`` + ``overrides``, in ``root/<hash of its inputs>``: made by
    ``async-agent-rl sft`` unless a finished one is there."""
    import hashlib

    from async_agent_rl.prepare import prepare
    from learner.sft import check_warm_start, warm_start_inputs

    cfg = load_config(config, overrides)
    for line in prepare(cfg):
        say(f"[prepare] {line}")
    inputs = warm_start_inputs(cfg, cfg.model.path)
    folder = root / hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]
    if check_warm_start(folder, inputs):
        say(f"[warm start] present: {folder}")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    say(f"[warm start] {cfg.sft.num_demos} demonstrations -> {folder}")
    rc, s = _run([*_cli(), "sft", "--config", config, "--out", str(folder), *overrides], folder.parent / f"{folder.name}.log")
    if rc != 0:
        raise RuntimeError(f"warm start failed (exit {rc}); log {folder.parent / (folder.name + '.log')}:\n"
                           f"{_tail(folder.parent / (folder.name + '.log'))}")
    say(f"[warm start] done in {s:.0f} s")
    return folder


def run_arms(config: str, overrides: list[str], arms: Sequence[Arm], out: Path, steps: int | None,
             eval_every: int | None, force: bool = False, say=print,
             warm_starts: Path | None = None) -> list[ArmRun]:
    """Run every arm (see the module docstring) and read its results back; failures are recorded, not raised."""
    out.mkdir(parents=True, exist_ok=True)
    base = load_config(config, overrides)
    common = [f"run.output_dir={out}", "monitoring.enabled=false"]
    if steps is not None:
        common.append(f"learner.total_steps={steps}")
    total = steps if steps is not None else base.learner.total_steps
    every = eval_every if eval_every is not None else max(1, total // 4)
    common.append(f"eval.every_steps={every}")
    warm_starts = warm_starts or out.parent / "warm_start"
    shared: Path | None = None
    runs: list[ArmRun] = []
    for arm in arms:
        arm_overrides = [*overrides, *arm.overrides]
        if base.sft.enabled:
            if arm.own_warm_start:
                ws = warm_start(config, arm_overrides, warm_starts, say)
            else:
                shared = shared or warm_start(config, overrides, warm_starts, say)
                ws = shared
            arm_overrides += [f"model.path={ws}", "sft.enabled=false"]
        arm_overrides += [*common, f"run.name={arm.name}"]
        run = ArmRun(arm, out / arm.name, arm_overrides)
        runs.append(run)
        try:
            cfg = load_config(config, arm_overrides)
        except Exception as e:  # noqa: BLE001 - a bad arm is reported with the others
            run.error = f"bad config: {e}"
            say(f"[{arm.name}] {run.error}")
            continue
        if not force and _finished_with(run.run_dir, cfg):
            run.reused = True
            say(f"[{arm.name}] finished run present in {run.run_dir}: reused")
        else:
            say(f"[{arm.name}] {arm.label}: train {' '.join(arm.overrides)} -> {run.run_dir}")
            _clear(run.run_dir)
            rc, run.seconds = _run([*_cli(), "train", "--config", config, *arm_overrides], out / f"{arm.name}.log")
            if rc != 0:
                run.error = f"train exited with {rc}; log {out / (arm.name + '.log')}"
                say(f"[{arm.name}] {run.error}\n{_tail(out / (arm.name + '.log'))}")
                continue
        run.result = arm_result(run.run_dir)
        r = run.result
        say(f"[{arm.name}] held-out EM {r['em_start']:.3f} -> {r['em_end']:.3f}  reward {r['reward_last']:.3f}  "
            f"{r['samples_per_s']:.2f} samples/s  ({run.seconds:.0f} s)")
    return runs


def _finished_with(run_dir: Path, cfg: Config) -> bool:
    import yaml

    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        return (run_dir / "summary.json").is_file() and saved == cfg.to_dict()
    except (OSError, ValueError):
        return False


def _clear(run_dir: Path) -> None:
    """A half-written run folder from an earlier attempt would add its lines to the new run's files."""
    import shutil

    if run_dir.exists():
        shutil.rmtree(run_dir)


# --------------------------------------------------------------------------------------------------------- results
def _mean(xs: Sequence[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def arm_result(run_dir: Path) -> dict[str, Any]:
    """The numbers of one finished run, from its own files. ``*_last``: mean over the last quarter of the steps.
    ``train_s`` excludes the evaluations run during training; ``samples_per_s`` is trained trajectories per second
    of it."""
    import yaml

    from async_agent_rl.plots import read_jsonl

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
        "reward_last": _mean(m["batch_reward"] for m in last),
        "rollout_em_last": _mean(m["rollout_exact_match"] for m in last),
        "response_length_last": _mean(m.get("batch", {}).get("response_length", float("nan")) for m in last),
        "searches_last": _mean(m.get("batch", {}).get("searches", float("nan")) for m in last),
        "train_s": train_s,
        "samples_per_s": len(metrics) * batch / train_s if train_s > 0 else 0.0,
        "episodes_per_s": metrics[-1]["episodes_per_s"],
        "gen_tokens_per_s": metrics[-1]["gen_tokens_per_s"],
        "staleness_mean": _mean(m["learner"].get("staleness_mean", 0.0) for m in metrics),
        "evicted": metrics[-1].get("buffer_evicted", {}),
        "episodes": summary.get("episodes", 0),
        "eval_curve": curve,
        "steps_curve": [{"step": m["step"], "reward": m["batch_reward"],
                         "response_length": m.get("batch", {}).get("response_length"),
                         "searches": m.get("batch", {}).get("searches")} for m in metrics],
    }


def time_to_em(result: dict[str, Any], target: float) -> float | None:
    """Training seconds until held-out exact match first reached ``target`` (None: never)."""
    return next((c["train_s"] for c in result["eval_curve"] if c["exact_match"] >= target - 1e-9), None)


# ---------------------------------------------------------------------------------------------------------- report
COLUMNS = [
    ("EM start", "em_start", "{:.3f}"), ("EM end", "em_end", "{:.3f}"), ("best EM", "em_best", "{:.3f}"),
    ("reward (last 25%)", "reward_last", "{:.3f}"), ("response tokens", "response_length_last", "{:.0f}"),
    ("searches/episode", "searches_last", "{:.2f}"), ("staleness", "staleness_mean", "{:.2f}"),
    ("samples/s", "samples_per_s", "{:.2f}"), ("train s", "train_s", "{:.0f}"),
]


def table(runs: Sequence[ArmRun]) -> str:
    head = ["study", "arm", "overrides", *(c[0] for c in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [r.arm.study, r.arm.label, "`" + " ".join(r.arm.overrides) + "`"]
        if r.error:
            cells += [f"failed: {r.error}"] + [""] * (len(COLUMNS) - 1)
        else:
            cells += [fmt.format(r.result[key]) for _, key, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_study(runs: Sequence[ArmRun], path: Path, title: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r.result]
    if not done:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [("held-out exact match (greedy)", None), ("batch reward", "reward"),
              ("response tokens per episode", "response_length"), ("searches per episode", "searches")]
    for ax, (name, key) in zip(axes.flat, panels):
        for r in done:
            if key is None:
                c = r.result["eval_curve"]
                ax.plot([x["step"] for x in c], [x["exact_match"] for x in c], "o-", label=r.arm.label)
            else:
                pts = [(x["step"], x[key]) for x in r.result["steps_curve"] if x.get(key) is not None]
                ax.plot([p[0] for p in pts], _smooth([p[1] for p in pts]), label=r.arm.label)
        ax.set_title(name)
        ax.set_xlabel("learner step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_staleness(runs: Sequence[ArmRun], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r.result]
    if not done:
        return None
    etas = [int(r.arm.name.removeprefix("eta")) for r in done]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(etas, [r.result["samples_per_s"] for r in done], "o-", label="trained samples/s")
    ax.set_xlabel("max_staleness (eta)")
    ax.set_ylabel("samples/s")
    ax2 = ax.twinx()
    ax2.plot(etas, [r.result["em_end"] for r in done], "s--", color="tab:green", label="held-out EM (end)")
    ax2.plot(etas, [r.result["reward_last"] for r in done], "^--", color="tab:orange", label="reward (last 25%)")
    ax2.set_ylim(0, 1)
    fig.legend(loc="lower right", fontsize=8)
    ax.set_title("throughput and reward against the staleness bound")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _smooth(xs: Sequence[float], k: int = 5) -> list[float]:
    return [_mean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


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
    results = {r.arm.name: {"arm": asdict(r.arm), "overrides": r.overrides, "run_dir": str(r.run_dir), "seconds": r.seconds,
                            "reused": r.reused, "error": r.error, **r.result} for r in runs}
    (out / "report.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# bench {kind}", "", "Command:", "", f"    {command}", "",
             f"{len(runs)} arms, run one after the other on {os.cpu_count()} cores; every number below is read "
             f"from the arm's run folder (`{out}/<arm>/metrics.jsonl`, `eval.jsonl`, `summary.json`). Held-out exact "
             f"match is greedy, on `eval.num_questions` test questions whose subjects never appear in training.", ""]
    if extra:
        lines += [extra, ""]
    lines += [table(runs), ""]
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


# ------------------------------------------------------------------------------------------------------------- CLI
def cmd_bench(args: argparse.Namespace) -> int:
    kind = args.kind
    out = Path(args.out or f"runs/bench/{kind}")
    if kind == "staleness":
        try:
            etas = [int(x) for x in args.etas.split(",") if x.strip()]
        except ValueError:
            print(f"error: --etas must be comma-separated integers, not {args.etas!r}", file=sys.stderr)
            return 2
        if not etas or min(etas) < 0:
            print(f"error: --etas needs at least one value >= 0, got {args.etas!r}", file=sys.stderr)
            return 2
        arms = staleness_arms(etas)
    elif kind == "ablations":
        names = [x.strip() for x in args.studies.split(",") if x.strip()]
        unknown = [n for n in names if n not in STUDIES]
        if unknown or not names:
            print(f"error: unknown studies {unknown}; choose from {', '.join(STUDIES)}", file=sys.stderr)
            return 2
        # every study's first value is the quickstart's: one run of the config as is is everyone's baseline
        arms = [Arm("baseline", "baseline", "baseline (config as is)", ())] + [
            a for n in names for a in STUDIES[n][1:]]
    else:
        arms = sync_arms(args.eta)
    base = load_config(args.config, args.overrides)  # a bad config fails here, before any run
    command = " ".join(["async-agent-rl", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else str(args)
    runs = run_arms(args.config, list(args.overrides), arms, out, args.steps, args.eval_every, args.force,
                    warm_starts=Path(args.warm_starts) if args.warm_starts else None)
    extra = ""
    if kind == "sync":
        extra, numbers = sync_summary(runs)
        (out / "comparison.json").write_text(json.dumps(numbers, indent=1) + "\n")
    if kind == "ablations":
        keys = dict.fromkeys(a.overrides[0].split("=")[0] for a in arms[1:])
        extra = ("The baseline arm is the config as is (" + ", ".join(f"`{k}={_get(base, k)}`" for k in keys) +
                 "); every other arm changes one key. One seed per arm: differences of a few points of exact match "
                 "are within run-to-run noise at this scale.")
    report = write_report(kind, runs, out, command, extra)
    print(report.read_text())
    failed = [r.arm.name for r in runs if r.error]
    if failed:
        print(f"error: arms failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="short trainings side by side: staleness sweep, ablations, async vs sync")
    kinds = bench.add_subparsers(dest="kind", required=True)
    helps = {"staleness": "one training per max_staleness (eta): throughput and reward",
             "ablations": "one training per switch of the seeds' studies, against one baseline",
             "sync": "asynchronous against synchronous (lockstep, eta=0) training"}
    for kind, text in helps.items():
        p = kinds.add_parser(kind, help=text)
        p.add_argument("--config", required=True, help="YAML config file (configs/*.yaml)")
        p.add_argument("--out", help=f"output folder (default runs/bench/{kind})")
        p.add_argument("--steps", type=int, help="learner steps per arm (default learner.total_steps)")
        p.add_argument("--eval-every", type=int, help="held-out evaluation every k steps (default steps/4)")
        p.add_argument("--force", action="store_true", help="rerun arms whose finished run folder is present")
        p.add_argument("--warm-starts", help="folder of the shared SFT warm starts (default OUT/../warm_start)")
        if kind == "staleness":
            p.add_argument("--etas", default="0,1,2,4,8", help="comma-separated max_staleness values")
        elif kind == "ablations":
            p.add_argument("--studies", default=",".join(DEFAULT_STUDIES),
                           help=f"comma-separated, from {', '.join(STUDIES)}")
        else:
            p.add_argument("--eta", type=int, default=2, help="the asynchronous arm's max_staleness")
        p.add_argument("overrides", nargs="*", help="dotted overrides for every arm, e.g. learner.lr=3e-4")
        p.set_defaults(func=cmd_bench)
