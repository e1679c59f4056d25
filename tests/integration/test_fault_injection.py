"""Fault injection on a real short training, run as a user runs it (the command line, in a process session of its
own; real Ray, vLLM CPU engine, buffer actor, DeepSpeed learner, retrieval server): each component is killed
(SIGKILL) and, separately, stopped (SIGSTOP, a hang) after the step-2 checkpoint. The run must either recover
(finish every step, the recovery counted in ``summary.json``) or end with exactly one ``error:`` line within the
watchdog's limit, and in both cases: no traceback on the console, the step-2 checkpoint intact, no process of the
run and no temporary weights left behind.

``FAULTS`` is the table docs/OPERATIONS.md ("What each fault gets") and benchmarks/RESULTS.md report. The metrics
exporter is a thread of the driver, so it is "killed" by shutting its server down under it; a stopped thread is not
a fault a process can have. A full disk is a tmpfs mounted over the run's ``checkpoints/`` and filled after the
step-2 checkpoint (skipped where mounting is not allowed).

About 20 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from async_agent_rl.config import load_config
from learner.checkpoint import verify_manifest
from tests.helpers import Run, leaked_weight_dirs, shm_weight_dirs, world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
WATCHDOG_S = 60  # cluster.progress_timeout_s: a stall ends the run within this (plus the time to report it)
SMALL = [
    "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8",
    "rollout.group_size=4", "rollout.max_concurrent_episodes=16", "eval.at_start=false", "eval.at_end=false",
    "sft.enabled=false", "buffer.group_filter=none", f"learner.total_steps={STEPS}", "learner.checkpoint_every=2",
    f"cluster.progress_timeout_s={WATCHDOG_S}", "cluster.actor_timeout_s=20", "monitoring.enabled=false",
]  # fmt: skip

# the command line; with AAR_TEST_EXPORTER_DIES set, the driver's metrics exporter dies after the step-2 checkpoint
FAULT_CLI = textwrap.dedent('''
    import os, sys
    import driver.train as train
    from driver.cli import main

    if os.environ.get("AAR_TEST_EXPORTER_DIES"):
        real_train_step = train.Trainer.train_step

        def train_step(self, t0):
            if self.step == 2 and self.mon is not None and self.mon.exporter.serving:
                self.mon.exporter._server.shutdown()  # its serving thread ends, as an exception in it would
                print("[test] the exporter's thread died", flush=True)
            return real_train_step(self, t0)

        train.Trainer.train_step = train_step
    sys.exit(main(sys.argv[1:]))
''')


@dataclass(frozen=True)
class Fault:
    target: str  # what to find in the run's process tree (a process title or command line)
    how: str  # "kill", "stop", "exporter" (in-driver), "disk-full"
    outcome: str  # "recovered" (every step done, counted) or "ended" (one error: line)
    counted: str = ""  # the summary.json key that counts the recovery


FAULTS = {
    "rollout actor, killed": Fault("ray::RolloutActor", "kill", "recovered", "actor_restarts"),
    "rollout actor, stopped": Fault("ray::RolloutActor", "stop", "recovered", "actor_restarts"),
    "buffer actor, killed": Fault("ray::BufferActor", "kill", "ended"),
    "buffer actor, stopped": Fault("ray::BufferActor", "stop", "ended"),
    "learner, killed": Fault("ray::LearnerActor", "kill", "ended"),
    "learner, stopped": Fault("ray::LearnerActor", "stop", "ended"),
    "retrieval server, killed": Fault("-m retriever serve", "kill", "recovered", "retriever_restarts"),
    "retrieval server, stopped": Fault("-m retriever serve", "stop", "recovered", "retriever_restarts"),
    "metrics exporter, died": Fault("", "exporter", "recovered", "exporter_restarts"),
    "checkpoint disk, full": Fault("", "disk-full", "ended"),
}


def tree(pid: int) -> list[psutil.Process]:
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def describe(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:
        return ""


def find(pid: int, target: str, timeout_s: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hits = [p for p in tree(pid) if target in describe(p)]
        if hits:
            return hits[0]
        time.sleep(0.5)
    raise AssertionError(f"no process {target!r} in the run's tree: {[describe(p) for p in tree(pid)]}")


def fill(folder: Path) -> None:
    """Write a filler file into ``folder`` until its file system is full."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_is_recovered_or_ends_the_run_in_one_error_line(name, tmp_path, world_dir, tiny_model_dir):
    fault = FAULTS[name]
    run_dir = tmp_path / "run"
    extra = ["monitoring.enabled=true"] if fault.how == "exporter" else []
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir), *extra])
    cfg_file = cfg.save(tmp_path / "cfg.yaml")
    mounted = None
    if fault.how == "disk-full":
        mounted = run_dir / "checkpoints"
        mounted.mkdir(parents=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mounted)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here to fill ({r.stderr.strip()})")
    env_extra = {"AAR_TEST_EXPORTER_DIES": "1"} if fault.how == "exporter" else {}
    shm_before = shm_weight_dirs()
    os.environ.update(env_extra)
    try:
        run = Run([sys.executable, "-c", FAULT_CLI, "train", "--config", str(cfg_file)])
    finally:
        for k in env_extra:
            os.environ.pop(k)
    target = None
    seen: dict[int, str] = {}
    try:
        run.wait_for(f"[checkpoint] {run_dir / 'checkpoints' / 'step_000002'}", timeout_s=420)
        seen = {p.pid: describe(p) for p in tree(run.proc.pid)}
        injected = time.monotonic()
        if fault.how in ("kill", "stop"):
            target = find(run.proc.pid, fault.target)
            target.send_signal(signal.SIGKILL if fault.how == "kill" else signal.SIGSTOP)
        elif fault.how == "disk-full":
            fill(mounted)
        rc = run.finish(timeout_s=WATCHDOG_S + 240)
        ended = time.monotonic() - injected
        verify_manifest(run_dir / "checkpoints" / "step_000002")  # the last good checkpoint is intact
        partial = [d.name for d in (run_dir / "checkpoints").iterdir() if d.name.endswith(".tmp")]
        time.sleep(15)  # the run's processes have a few seconds to go
        left = [f"{pid} {cmd}" for pid, cmd in seen.items() if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    finally:
        run.kill()
        if target is not None and target.is_running():  # the test's own clean-up, after the check above
            target.send_signal(signal.SIGCONT)
            target.kill()
        if mounted is not None:
            subprocess.run(["umount", "-l", str(mounted)], capture_output=True)
    console = run.text()
    assert "Traceback" not in "\n".join(run.out + run.err), console
    errors = [x for x in run.err + run.out if x.startswith("error:")]
    if fault.outcome == "recovered":
        assert rc == 0 and not errors, console
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS, summary
        count = summary[fault.counted]
        assert (sum(count.values()) if isinstance(count, dict) else count) >= 1, (fault.counted, count)
        assert any(x.startswith("[fault] ") for x in run.out), console
    else:
        assert rc not in (0, None) and len(errors) == 1, console
        assert ended < WATCHDOG_S + 120, f"ended {ended:.0f} s after the fault (watchdog {WATCHDOG_S} s)"
    assert not partial, f"a partial checkpoint was left: {partial}"
    assert not left, "processes of the run left 15 s after it ended:\n" + "\n".join(left)
    assert not leaked_weight_dirs(shm_before, set(seen)), "temporary weights left in /dev/shm"
