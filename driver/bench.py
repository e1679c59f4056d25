"""``async-agent-rl bench``: short trainings side by side on one config, and a report built from their run folders.

    async-agent-rl bench staleness --config configs/quickstart.yaml --etas 0,1,2,4,8 [--steps N] [overrides]
    async-agent-rl bench ablations --config configs/quickstart.yaml [--studies masking,estimator,topk,group_size]
    async-agent-rl bench sync      --config configs/quickstart.yaml      # asynchronous against synchronous RL
    async-agent-rl bench learning  --config configs/quickstart.yaml --seeds 0,1,2   # RL against more SFT, per world

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

``bench learning`` repeats one RL arm per seed, each on a world of its own (``OUT/worlds/seed_<s>``: world, tiny
model, warm start and training seeds all from the seed), and gives each an SFT-only arm: the same warm start
trained further by SFT for RL's training time (``bench continue-sft``, ``warm_start.sft.continue_sft``), then
``async-agent-rl eval`` on the same held-out questions. Its report has one table per kind of question with the mean
and standard error over seeds, ``learning_curves.png`` and ``learning_bars.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from async_agent_rl.config import Config, load_config
from driver.plots import read_jsonl
from driver.prepare import prepare

# warm_start.sft (torch) and matplotlib are imported inside the functions that use them: the CLI imports this module
# for every command, `config show` included.


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


def staleness_arms(etas: Sequence[int], ppo: bool = False) -> list[Arm]:
    """One arm per eta with the decoupled loss; with ``ppo``, one more at the largest eta with the standard PPO loss
    (the behaviour policy taken as the proximal one: no correction for staleness)."""
    arms = [Arm("staleness", f"eta{e}", f"eta={e}", (f"buffer.max_staleness={e}",)) for e in etas]
    if ppo:
        e = max(etas)
        arms.append(Arm("staleness", f"eta{e}-ppo", f"eta={e}, standard PPO",
                        (f"buffer.max_staleness={e}", "algorithm.policy_loss=ppo")))
    return arms


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
    warm_start: Path | None = None


def _cli() -> list[str]:
    return [sys.executable, "-m", "driver.cli"]


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


def warm_start(config: str, overrides: list[str], root: Path, say, make: bool = True) -> Path:
    """The SFT warm start for ``config`` + ``overrides``, in ``root/<hash of its inputs>``: made by
    ``async-agent-rl sft`` unless a finished one is there (or ``make`` is false: then only its folder is named, so
    a study whose arms are all finished does not redo its warm start)."""
    from warm_start.sft import check_warm_start, warm_start_inputs

    cfg = load_config(config, overrides)
    for line in prepare(cfg):
        say(f"[prepare] {line}")
    inputs = warm_start_inputs(cfg, cfg.model.path)
    folder = root / hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]
    if check_warm_start(folder, inputs):
        say(f"[warm start] present: {folder}")
        return folder
    if not make:
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
        if base.sft.enabled:  # named first; made only when the arm is trained (below)
            ws_overrides = arm_overrides if arm.own_warm_start else overrides
            if arm.own_warm_start:
                ws = warm_start(config, arm_overrides, warm_starts, say, make=False)
            else:
                shared = shared or warm_start(config, overrides, warm_starts, say, make=False)
                ws = shared
            arm_overrides += [f"model.path={ws}", "sft.enabled=false"]
        arm_overrides += [*common, f"run.name={arm.name}"]
        run = ArmRun(arm, out / arm.name, arm_overrides, warm_start=ws if base.sft.enabled else None)
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
            if base.sft.enabled:
                warm_start(config, ws_overrides, warm_starts, say)
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


def _finished_with(run_dir: Path, cfg: Config, config_file: str = "config.yaml",
                   done_file: str = "summary.json") -> bool:
    try:
        saved = yaml.safe_load((run_dir / config_file).read_text())
        return (run_dir / done_file).is_file() and saved == cfg.to_dict()
    except (OSError, ValueError):
        return False


def _clear(run_dir: Path) -> None:
    """A half-written run folder from an earlier attempt would add its lines to the new run's files."""
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
    done = [r for r in done if r.arm.name.removeprefix("eta").isdigit()]
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


# -------------------------------------------------------------------------------------------------------- learning
KINDS = {"all": "all questions", "world_single": "single-hop", "world_bridge": "bridge (two-hop)"}
SEED_KEYS = ("model.init.seed", "sft.seed", "data.seed", "rollout.seed", "learner.seed")


def seed_overrides(seed: int, world: Path) -> tuple[str, ...]:
    """One seed of the learning bench: its own world (``data.world.seed=seed``, generated into ``world``), its own
    tiny model (the BPE tokenizer is trained on that world's corpus) and its own training seeds."""
    return (
        f"data.world.seed={seed}", f"data.world_dir={world}", "data.make_world_if_missing=true",
        f"data.train_files={json.dumps([str(world / 'train.parquet')])}",
        f"data.test_files={json.dumps([str(world / 'test.parquet')])}", f"data.corpus_file={world / 'corpus.jsonl'}",
        f"model.path={world / 'model'}", "model.build_if_missing=true", *(f"{key}={seed}" for key in SEED_KEYS),
    )  # fmt: skip


def learning_arms(seeds: Sequence[int], out: Path) -> list[Arm]:
    """One RL arm per seed; each makes its own warm start (its world differs)."""
    return [Arm("learning", f"seed{s}-rl", f"seed {s}", seed_overrides(s, out / "worlds" / f"seed_{s}"),
                own_warm_start=True) for s in seeds]  # fmt: skip


def run_sft_only(config: str, rl: ArmRun, out: Path, force: bool = False, say=print) -> ArmRun:
    """The SFT-only arm of one seed: from the RL arm's own warm start, more SFT for as long as RL trained
    (``rl.result['train_s']``: the RL loop without its evaluations), in a child ``bench continue-sft``; then the
    held-out questions of RL's evaluations, greedy, in a child ``eval`` (``scores.json``). Reruns skip a finished
    one made with the same config, warm start and budget."""
    arm = Arm("learning", rl.arm.name.removesuffix("-rl") + "-sft", f"{rl.arm.label} SFT-only", rl.arm.overrides)
    run = ArmRun(arm, out / arm.name, rl.overrides, warm_start=rl.warm_start)
    cfg = load_config(config, rl.overrides)
    budget = rl.result["train_s"]
    log_file = out / f"{arm.name}.log"
    if not force and _finished_with(run.run_dir, cfg, "sft_config.yaml", "scores.json") and _same_budget(run, budget):
        run.reused = True
        say(f"[{arm.name}] finished run present in {run.run_dir}: reused")
    else:
        say(f"[{arm.name}] SFT for {budget:.0f} s from {rl.warm_start} -> {run.run_dir}")
        _clear(run.run_dir)
        limit = ["--limit", str(cfg.eval.num_questions)] if cfg.eval.num_questions else []
        steps = [
            ("continue-sft", [*_cli(), "bench", "continue-sft", "--config", config, "--warm-start", str(rl.warm_start),
                              "--seconds", repr(budget), "--out", str(run.run_dir), *rl.overrides]),
            ("eval", [*_cli(), "eval", "--config", config, "--checkpoint", str(run.run_dir),
                      "--out", str(run.run_dir / "scores.json"), *limit, *rl.overrides]),
        ]  # fmt: skip
        for name, cmd in steps:
            rc, s = _run(cmd, log_file)
            run.seconds += s
            if rc != 0:
                run.error = f"{name} exited with {rc}; log {log_file}"
                say(f"[{arm.name}] {run.error}\n{_tail(log_file)}")
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


def seed_row(seed: int, rl: ArmRun, sft: ArmRun) -> dict[str, Any]:
    """One seed's line of the learning report, from the RL run's ``eval.jsonl`` (its ``start`` evaluation: the warm
    start; its ``end`` one: after RL) and the SFT-only arm's scores."""
    evals = read_jsonl(rl.run_dir / "eval.jsonl")
    when = {e["when"]: e for e in evals}
    start, end, other = (_kind_numbers(e) for e in (when["start"], when["end"], sft.result["scores"]))
    kinds = {}
    for k in start:
        if k in end and k in other:
            x = {"n": start[k]["n"], "em_start": start[k]["em"], "em_rl": end[k]["em"], "em_sft": other[k]["em"],
                 "searches_start": start[k]["searches"], "searches_rl": end[k]["searches"],
                 "searches_sft": other[k]["searches"]}  # fmt: skip
            kinds[k] = {**x, "gain_rl": x["em_rl"] - x["em_start"], "gain_sft": x["em_sft"] - x["em_start"],
                        "rl_minus_sft": x["em_rl"] - x["em_sft"]}  # fmt: skip
    curve = [{"step": e["step"], **{k: e[k]["exact_match"] for k in KINDS if k in e}} for e in evals]
    return {"seed": seed, "rl_s": rl.result["train_s"], "rl_steps": rl.result["steps"], "sft_s": sft.result["sft_s"],
            "sft_steps": sft.result["steps"], "warm_start": str(rl.warm_start), "kinds": kinds, "curve": curve}


def mean_se(xs: Sequence[float]) -> dict[str, float]:
    """Mean and standard error (sample standard deviation / sqrt(n); NaN for fewer than two values)."""
    xs = list(xs)
    se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
    return {"mean": _mean(xs), "se": se, "n": len(xs)}


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


def _pm(m: dict[str, float], fmt: str) -> str:
    se = "n/a" if m["se"] != m["se"] else fmt.replace("+", "").format(m["se"])
    return f"{fmt.format(m['mean'])} ± {se}"


def learning_table(rows: Sequence[dict[str, Any]], summary: dict[str, Any], kind: str) -> str:
    """One kind's table: a line per seed and the mean ± s.e. over seeds; the ``all`` table has the times too."""
    cols = LEARNING_COLUMNS + (TIME_COLUMNS if kind == "all" else [])
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
        lines.append("| " + " | ".join(["**mean ± s.e.**", "", *(_pm(m[k], fmts[k]) for _, k in cols)]) + " |")
    return "\n".join(lines)


def plot_learning(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Held-out EM over RL steps, one line per seed and one panel per kind of question; the warm start (step 0)
    as a square, the SFT-only arm (same time) as a star at RL's last step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if not rows:
        return None
    fig, axes = plt.subplots(1, len(KINDS), figsize=(14, 4), sharey=True)
    for ax, (kind, title) in zip(axes, KINDS.items()):
        for i, r in enumerate(rows):
            if kind not in r["kinds"]:
                continue
            color = f"C{i % 10}"
            pts = [(c["step"], c[kind]) for c in r["curve"] if kind in c]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"seed {r['seed']} RL")
            ax.plot(pts[0][0], r["kinds"][kind]["em_start"], "s", color=color, markersize=9)
            ax.plot(pts[-1][0], r["kinds"][kind]["em_sft"], "*", color=color, markersize=14)
        ax.set_title(f"held-out EM (greedy): {title}")
        ax.set_xlabel("RL learner step")
        ax.set_ylim(-0.02, 1.02)
    handles, _ = axes[0].get_legend_handles_labels()
    handles += [Line2D([], [], marker="s", ls="", color="gray", label="warm start"),
                Line2D([], [], marker="*", ls="", color="gray", markersize=12, label="SFT-only, same time")]
    axes[0].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_learning_bars(summary: dict[str, Any], path: Path) -> Path | None:
    """Mean ± s.e. over seeds of held-out EM by arm, per kind of question."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if k in summary["kinds"]]
    if not kinds:
        return None
    arms = [("warm start", "em_start"), ("RL", "em_rl"), ("SFT-only (same time)", "em_sft")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(arms)
    for j, (label, key) in enumerate(arms):
        ms = [summary["kinds"][k][key] for k in kinds]
        ax.bar([i + (j - 1) * width for i in range(len(kinds))], [m["mean"] for m in ms], width,
               yerr=[0 if m["se"] != m["se"] else m["se"] for m in ms], capsize=4, label=label)
    ax.set_xticks(range(len(kinds)), [KINDS[k] for k in kinds])
    ax.set_ylabel("held-out exact match")
    ax.set_title(f"mean ± s.e. over {summary['rl_s']['n']} seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


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
    failed = [r for r in runs if r.error]
    if failed:
        lines += ["Failed arms (their seed is left out): " + "; ".join(f"`{r.arm.name}`: {r.error}" for r in failed),
                  ""]
    for kind, title in KINDS.items():
        if summary and kind in summary["kinds"]:
            lines += [f"## {title}", "", learning_table(rows, summary, kind), ""]
    for png in (plot_learning(rows, out / "learning_curves.png"),
                plot_learning_bars(summary, out / "learning_bars.png") if summary else None):
        if png is not None:
            lines += [f"![{png.stem}]({png.name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


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
        arms = staleness_arms(etas, ppo=args.seeds is not None)
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
    command = _command(args)
    if args.seeds is not None:
        return _cmd_bench_seeds(args, kind, arms, base, out, command)
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
    return _finish(report, runs)


def _cmd_bench_seeds(args: argparse.Namespace, kind: str, arms: list[Arm], base: Config, out: Path,
                     command: str) -> int:
    """``--seeds``: every arm per seed and a report over seeds (``driver.bench_seeds``). The staleness sweep gives
    every arm room for ``(max eta + 1)`` batches in flight (``rollout.max_concurrent_episodes``), so that the
    admission rule, not the episode slots, is what bounds how far generation runs ahead: each eta can be reached."""
    from driver import bench_seeds

    try:
        seeds = bench_seeds.parse_seeds(args.seeds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    overrides = list(args.overrides)
    if kind == "staleness":
        per_version = base.learner.batch_size * base.weight_sync.every_steps
        slots = -(-(max(int(a.overrides[0].split("=")[1]) for a in arms) + 1) * per_version
                  // base.rollout.num_actors)
        overrides.append(f"rollout.max_concurrent_episodes={max(slots, base.rollout.max_concurrent_episodes)}")
    reference = {"sync": lambda a: True, "staleness": lambda a: "ppo" not in a.name,
                 "ablations": lambda a: True}[kind]
    runs = bench_seeds.run_seeds(args.config, overrides, arms, out, seeds, args.steps, args.eval_every, args.force,
                                 Path(args.warm_starts) if args.warm_starts else None)
    report = bench_seeds.write_seeds_report(kind, arms, runs, out, command, reference)
    return _finish(report, [r for rs in runs.values() for r in rs])


def _finish(report: Path, runs: Sequence[ArmRun]) -> int:
    """Print the report; exit 1 naming the arms that failed, 0 when none did."""
    print(report.read_text())
    failed = [r.arm.name for r in runs if r.error]
    if failed:
        print(f"error: arms failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _command(args: argparse.Namespace) -> str:
    return " ".join(["async-agent-rl", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else str(args)


def cmd_learning(args: argparse.Namespace) -> int:
    """RL against more SFT for the same time, one world per seed (see ``run_sft_only`` and ``seed_overrides``)."""
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        print(f"error: --seeds must be comma-separated integers, not {args.seeds!r}", file=sys.stderr)
        return 2
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        print(f"error: --seeds needs distinct values >= 0, got {args.seeds!r}", file=sys.stderr)
        return 2
    out = Path(args.out or "runs/bench/learning")
    cfg = load_config(args.config, args.overrides)  # a bad config fails here, before any run
    if not (cfg.sft.enabled and cfg.eval.at_start and cfg.eval.at_end):
        print("error: bench learning compares RL with more SFT from one warm start, evaluated before and after: it "
              "needs sft.enabled, eval.at_start and eval.at_end true", file=sys.stderr)
        return 2
    arms = learning_arms(seeds, out)
    rl_runs = run_arms(args.config, list(args.overrides), arms, out, args.steps, args.eval_every, args.force,
                       warm_starts=Path(args.warm_starts) if args.warm_starts else None)
    runs, rows = list(rl_runs), []
    for seed, rl in zip(seeds, rl_runs):
        if rl.error:
            continue
        sft = run_sft_only(args.config, rl, out, args.force)
        runs.append(sft)
        if not sft.error:
            rows.append(seed_row(seed, rl, sft))
    report = write_learning_report(rows, runs, out, _command(args))
    return _finish(report, runs)


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


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="short trainings side by side: staleness sweep, ablations, async vs "
                                  "sync, RL against more SFT over several worlds")
    kinds = bench.add_subparsers(dest="kind", required=True)
    helps = {"staleness": "one training per max_staleness (eta): throughput and reward",
             "ablations": "one training per switch of the seeds' studies, against one baseline",
             "sync": "asynchronous against synchronous (lockstep, eta=0) training",
             "learning": "per seed (own world): RL from the warm start against more SFT for the same time"}
    for kind, text in helps.items():
        p = kinds.add_parser(kind, help=text)
        p.add_argument("--config", required=True, help="YAML config file (configs/*.yaml)")
        p.add_argument("--out", help=f"output folder (default runs/bench/{kind})")
        p.add_argument("--steps", type=int, help="learner steps per arm (default learner.total_steps)")
        p.add_argument("--eval-every", type=int, help="held-out evaluation every k steps (default steps/4)")
        p.add_argument("--force", action="store_true", help="rerun arms whose finished run folder is present")
        p.add_argument("--warm-starts", help="folder of the shared SFT warm starts (default OUT/../warm_start)")
        if kind != "learning":
            p.add_argument("--seeds", help="comma-separated seeds: every arm on each seed's own world, tiny model and "
                           "warm start, reported as mean and standard error (default: the config's world, once); "
                           "with it, bench staleness adds a standard-PPO arm at the largest eta")
        if kind == "staleness":
            p.add_argument("--etas", default="0,1,2,4,8", help="comma-separated max_staleness values")
        elif kind == "ablations":
            p.add_argument("--studies", default=",".join(DEFAULT_STUDIES),
                           help=f"comma-separated, from {', '.join(STUDIES)}")
        elif kind == "sync":
            p.add_argument("--eta", type=int, default=2, help="the asynchronous arm's max_staleness")
        else:
            p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds: a world and two arms each")
        p.add_argument("overrides", nargs="*", help="dotted overrides for every arm, e.g. learner.lr=3e-4")
        p.set_defaults(func=cmd_learning if kind == "learning" else cmd_bench)
    p = kinds.add_parser("continue-sft", help="(bench learning's SFT-only arm) more SFT from a warm start for a time "
                         "budget, on fresh demonstrations")
    p.add_argument("--config", required=True, help="the config the warm start was made with")
    p.add_argument("--warm-start", required=True, help="folder of a finished warm start (async-agent-rl sft)")
    p.add_argument("--seconds", type=float, required=True, help="wall-time budget")
    p.add_argument("--out", required=True, help="where the model, sft_metrics.jsonl and the summary go")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for the warm start")
    p.set_defaults(func=cmd_continue_sft)
