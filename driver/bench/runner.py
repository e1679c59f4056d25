"""Running arms: each a real ``async-agent-rl train`` in a child process, one after the other, from a shared SFT warm
start; a finished arm with the same resolved config is reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import yaml

from async_agent_rl.config import Config, build_config, load_config
from driver.bench.arms import Arm, ArmRun
from driver.bench.results import arm_result
from driver.prepare import prepare


def cli_command() -> list[str]:
    return [sys.executable, "-m", "driver.cli"]


def run_logged(cmd: list[str], log_file: Path) -> tuple[int, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(log_file, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env).returncode
    return rc, time.monotonic() - t0


def tail(path: Path, n: int = 15) -> str:
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
    rc, s = run_logged([*cli_command(), "sft", "--config", config, "--out", str(folder), *overrides],
                       folder.parent / f"{folder.name}.log")
    if rc != 0:
        raise RuntimeError(f"warm start failed (exit {rc}); log {folder.parent / (folder.name + '.log')}:\n"
                           f"{tail(folder.parent / (folder.name + '.log'))}")
    say(f"[warm start] done in {s:.0f} s")
    return folder


NOT_RUN = "not run yet (--report-only)"


def run_arms(config: str, overrides: list[str], arms: Sequence[Arm], out: Path, steps: int | None,
             eval_every: int | None, force: bool = False, say=print,
             warm_starts: Path | None = None, report_only: bool = False) -> list[ArmRun]:
    """Run every arm (see the module docstring) and read its results back; failures are recorded, not raised.
    ``report_only``: train nothing; an arm without a finished run is recorded as not run (a partial report)."""
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
            # a copy: arm_overrides grows below (model.path, run.name...), the warm start's inputs must not
            ws_overrides = list(arm_overrides) if arm.own_warm_start else overrides
            if arm.own_warm_start:
                ws = warm_start(config, arm_overrides, warm_starts, say, make=False)
            else:
                shared = shared or warm_start(config, overrides, warm_starts, say, make=False)
                ws = shared
            # trained from its own warm start: the config's sft.prebuilt plays no part (and an arm saved before that
            # setting existed stays reusable)
            arm_overrides += [f"model.path={ws}", "sft.enabled=false", "sft.prebuilt="]
        arm_overrides += [*common, f"run.name={arm.name}"]
        run = ArmRun(arm, out / arm.name, arm_overrides, warm_start=ws if base.sft.enabled else None)
        runs.append(run)
        try:
            cfg = load_config(config, arm_overrides)
        except Exception as e:  # noqa: BLE001 - a bad arm is reported with the others
            run.error = f"bad config: {e}"
            say(f"[{arm.name}] {run.error}")
            continue
        if not force and finished_with(run.run_dir, cfg):
            run.reused = True
            say(f"[{arm.name}] finished run present in {run.run_dir}: reused")
        elif report_only:
            run.error = NOT_RUN
            say(f"[{arm.name}] {run.error}")
            continue
        else:
            if base.sft.enabled:
                warm_start(config, ws_overrides, warm_starts, say)
            say(f"[{arm.name}] {arm.label}: train {' '.join(arm.overrides)} -> {run.run_dir}")
            clear_run(run.run_dir)
            rc, run.seconds = run_logged([*cli_command(), "train", "--config", config, *arm_overrides],
                                         out / f"{arm.name}.log")
            if rc != 0:
                run.error = f"train exited with {rc}; log {out / (arm.name + '.log')}"
                say(f"[{arm.name}] {run.error}\n{tail(out / (arm.name + '.log'))}")
                continue
        run.result = arm_result(run.run_dir)
        r = run.result
        say(f"[{arm.name}] held-out EM {r['em_start']:.3f} -> {r['em_end']:.3f}  reward {r['reward_last']:.3f}  "
            f"{r['samples_per_s']:.2f} samples/s  ({run.seconds:.0f} s)")
    return runs


def finished_with(run_dir: Path, cfg: Config, config_file: str = "config.yaml",
                   done_file: str = "summary.json") -> bool:
    """``run_dir`` holds a finished run (``done_file``) of the config ``cfg``. The saved config is read through
    today's schema, so a setting added since, at its default (which keeps the behaviour the run had), leaves a
    finished arm reusable: a long study resumes across such commits instead of running every arm again."""
    try:
        saved = yaml.safe_load((run_dir / config_file).read_text())
        if not (run_dir / done_file).is_file() or not isinstance(saved, dict):
            return False
        return saved == cfg.to_dict() or build_config(saved, str(run_dir / config_file)).to_dict() == cfg.to_dict()
    except (OSError, ValueError):  # ConfigError is a ValueError: a setting removed or renamed since
        return False


def clear_run(run_dir: Path) -> None:
    """A half-written run folder from an earlier attempt would add its lines to the new run's files."""
    if run_dir.exists():
        shutil.rmtree(run_dir)


def finish(report: Path, runs: Sequence[ArmRun]) -> int:
    """Print the report; exit 1 naming the arms that failed, 0 when none did (an arm ``--report-only`` did not run
    is not a failure)."""
    print(report.read_text())
    failed = [r.arm.name for r in runs if r.error and r.error != NOT_RUN]
    if failed:
        print(f"error: arms failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def command_line(args: argparse.Namespace) -> str:
    return " ".join(["async-agent-rl", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else str(args)
