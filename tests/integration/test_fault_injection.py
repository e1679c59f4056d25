"""Fault injection on a real short training, run as a user runs it (the command line, in a process session of its
own; real Ray, vLLM CPU engine, buffer actor, DeepSpeed learner, retrieval server): each component is killed
(SIGKILL) and, separately, stopped (SIGSTOP, a hang). The run must either recover (finish every step, the recovery
counted in ``summary.json``) or end with exactly one ``error:`` line within the watchdog's limit, and in both cases:
no traceback on the console, the last checkpoint intact, no process of the run and no temporary weights left behind.

``FAULTS`` is the table docs/OPERATIONS.md ("What each fault gets") and benchmarks/RESULTS.md report. The faults a
run recovers from are injected one after another into one training, each after the first checkpoint that follows
the previous recovery (a run per fault cost CI about 8 minutes more); each fault that ends a run gets a training of
its own, injected after the step-2 checkpoint. The metrics exporter is a thread of the driver, so it is "killed" by
shutting its server down under it; a stopped thread is not a fault a process can have. A full disk is a tmpfs
mounted over the run's ``checkpoints/`` and filled after the step-2 checkpoint (skipped where mounting is not
allowed). The run that recovers has ``rollout.multiprocess_engine=true``, so the vLLM engine core is a process of
its own, and its last two faults are the engine core's (``ENGINE_FAULTS``): killed, then stopped (a dead engine and
a hung one, as a real vLLM engine core dies or hangs); each is found (the worker's error, the engine health probe
``rollout.engine_silence_s``) and the actor restarted with a new engine (a run of their own cost CI 4 more minutes).

About 12 minutes on 2 cores."""

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
from driver.fleet import BLAMED, BUFFER, LEARNER
from learner.checkpoint import verify_manifest
from tests.helpers import Run, leaked_weight_dirs, shm_weight_dirs, world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
WATCHDOG_S = 60  # cluster.progress_timeout_s: a stall ends the run within this (plus the time to report it)
SMALL = [
    "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8",
    "rollout.group_size=4", "rollout.max_concurrent_episodes=16", "eval.at_start=false", "eval.at_end=false",
    "eval.every_steps=0",
    "sft.enabled=false", "buffer.group_filter=none", f"learner.total_steps={STEPS}", "learner.checkpoint_every=2",
    f"cluster.progress_timeout_s={WATCHDOG_S}", "cluster.actor_timeout_s=20", "monitoring.enabled=false",
]  # fmt: skip

# the command line; with AAR_TEST_EXPORTER_DIES=N set, the driver's metrics exporter dies after step N
FAULT_CLI = textwrap.dedent('''
    import os, sys
    import driver.train as train
    from driver.cli import main

    if os.environ.get("AAR_TEST_EXPORTER_DIES"):
        real_train_step = train.Trainer.train_step
        when = int(os.environ["AAR_TEST_EXPORTER_DIES"])

        def train_step(self, t0):
            if self.step == when and self.mon is not None and self.mon.exporter.serving:
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
    # the part the fault is blamed on: "recovered", the [fault] line (its start) that names it before the recovery;
    # "ended", words of which the error line has one, whichever of the run's waits noticed it first
    blamed: tuple[str, ...] = ()
    blocked: str = ""  # "ended": the part a stall report's "blocked:" clause must name, if the watchdog reports it


BUFFER_NAMES = ("the buffer actor", "the replay buffer", "BufferActor")  # an ask, a stall report, Ray's dead actor
LEARNER_NAMES = ("the learner", "LearnerActor")  # LearnerTimeout or a stall report, Ray's dead actor
FAULTS = {
    "rollout actor, killed": Fault("ray::RolloutActor", "kill", "recovered", "actor_restarts",
                                   ("[fault] rollout actor 0: ",)),
    "rollout actor, stopped": Fault("ray::RolloutActor", "stop", "recovered", "actor_restarts",
                                    ("[fault] rollout actor 0: ",)),
    "buffer actor, killed": Fault("ray::BufferActor", "kill", "ended", blamed=BUFFER_NAMES, blocked=BUFFER),
    "buffer actor, stopped": Fault("ray::BufferActor", "stop", "ended", blamed=BUFFER_NAMES, blocked=BUFFER),
    "learner, killed": Fault("ray::LearnerActor", "kill", "ended", blamed=LEARNER_NAMES, blocked=LEARNER),
    "learner, stopped": Fault("ray::LearnerActor", "stop", "ended", blamed=LEARNER_NAMES, blocked=LEARNER),
    "retrieval server, killed": Fault("-m retriever serve", "kill", "recovered", "retriever_restarts",
                                      ("[fault] retrieval server exited (signal 9)",)),
    "retrieval server, stopped": Fault("-m retriever serve", "stop", "recovered", "retriever_restarts",
                                       ("[fault] retrieval server did not answer /health",)),
    "metrics exporter, died": Fault("", "exporter", "recovered", "exporter_restarts"),
    "checkpoint disk, full": Fault("", "disk-full", "ended", blamed=("the checkpoint of step",)),
}
# with rollout.multiprocess_engine=true the vLLM engine core is a child process of the rollout actor
ENGINE_FAULTS = {
    "engine core, killed": Fault("VLLM::EngineCore", "kill", "recovered", "actor_restarts",
                                 ("[fault] rollout actor 0: ",)),
    "engine core, stopped": Fault("VLLM::EngineCore", "stop", "recovered", "actor_restarts",
                                  ("[fault] rollout actor 0: ",)),
}
ENGINE_SILENCE_S = 20  # rollout.engine_silence_s of the engine-fault run: a turn here takes well under a second
assert all(f.blamed for f in FAULTS.values() if f.how != "exporter"), "each fault names the part it is blamed on"


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


def fill(folder: Path) -> None:
    """Write a filler file into ``folder`` until its file system is full."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


def start(tmp_path: Path, world_dir: Path, tiny_model_dir: Path, *extra: str, exporter_dies_at: int = 0) -> Run:
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir), *extra])
    cfg_file = cfg.save(tmp_path / "cfg.yaml")
    env_extra = {"AAR_TEST_EXPORTER_DIES": str(exporter_dies_at)} if exporter_dies_at else {}
    os.environ.update(env_extra)
    try:
        return Run([sys.executable, "-c", FAULT_CLI, "train", "--config", str(cfg_file)])
    finally:
        for k in env_extra:
            os.environ.pop(k)


def inject(run: Run, fault: Fault, mounted: Path | None = None, spare: set[int] = frozenset()) -> psutil.Process | None:
    """The fault, on the first process of the run's tree that matches (``spare``: pids not to pick, a killed one)."""
    if fault.how in ("kill", "stop"):
        deadline = time.monotonic() + 60
        while True:
            hits = [p for p in tree(run.proc.pid) if fault.target in describe(p) and p.pid not in spare]
            if hits or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert hits, f"no process {fault.target!r} in the run's tree: {[describe(p) for p in tree(run.proc.pid)]}"
        hits[0].send_signal(signal.SIGKILL if fault.how == "kill" else signal.SIGSTOP)
        return hits[0]
    if fault.how == "disk-full":
        fill(mounted)
    return None


def count_lines(run: Run, prefix: str) -> int:
    return sum(x.startswith(prefix) for x in run.out)


def wait_for_count(run: Run, prefix: str, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while count_lines(run, prefix) < n:
        if run.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {n}th line {prefix!r} within {timeout_s} s:\n" + run.text())
        time.sleep(0.2)


def left_behind(seen: dict[int, str], grace_s: float = 15.0) -> list[str]:
    """The processes of ``seen`` still alive (not zombies) once the run's processes have had ``grace_s`` to go:
    polled, so the usual case (all gone in a few seconds) does not wait the whole grace."""
    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for pid, cmd in seen.items():
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {cmd}")
            except psutil.Error:  # gone
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def last_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


# the faults one training recovers from, one after another: every process fault of FAULTS that is recovered, then
# the engine core's (the run has rollout.multiprocess_engine=true, so the core is a process of its own)
RECOVERED = [name for name, f in FAULTS.items() if f.outcome == "recovered" and f.how != "exporter"] + list(ENGINE_FAULTS)
# the exporter's death is injected by the driver itself (FAULT_CLI), after step 2
assert {n for n, f in FAULTS.items() if f.outcome == "recovered"} - set(RECOVERED) == {"metrics exporter, died"}
RECOVERED_STEPS = 18
# what each recovery prints, counted: the k-th fault of a kind is recovered when its k-th line is out
RECOVERY_LINE = {"ray::RolloutActor": "[fault] rollout actor 0 restarted", "VLLM::EngineCore": "[fault] rollout actor 0 restarted",
                 "-m retriever serve": "[fault] retrieval server"}


@pytest.mark.timeout(1200)
def test_every_recoverable_fault_is_recovered_one_after_another_in_one_run(tmp_path, world_dir, tiny_model_dir):
    """Each fault after the first checkpoint that follows the previous recovery; the run finishes every step.

    The engine core's two faults (``ENGINE_FAULTS``), last: a dead engine and a hung one, as a real vLLM engine core
    dies or hangs, are each found (vLLM's error in the worker; the engine health probe, no request finished for
    ``rollout.engine_silence_s``) and the actor is restarted with a new engine and the current weights. Before the
    health probe a hung engine core left the actor alive and generating nothing until the watchdog ended the run
    blaming admission; before the worker stopped on a dead engine, every episode failed at once, hundreds of
    thousands of them, and the actor was never restarted."""
    run_dir = tmp_path / "run"
    shm_before = shm_weight_dirs()
    run = start(tmp_path, world_dir, tiny_model_dir, "monitoring.enabled=true", f"learner.total_steps={RECOVERED_STEPS}",
                "cluster.max_actor_restarts=5", "rollout.multiprocess_engine=true",
                f"rollout.engine_silence_s={ENGINE_SILENCE_S}", exporter_dies_at=2)
    all_faults = FAULTS | ENGINE_FAULTS
    seen: dict[int, str] = {}
    stopped: list[psutil.Process] = []
    injected: list[str] = []
    blamed: dict[str, list[str]] = {}  # fault -> the [fault] lines that named the part at fault before its recovery
    try:
        run.wait_for(f"[checkpoint] {run_dir / 'checkpoints' / 'step_000002'}", timeout_s=420)
        for name in RECOVERED:
            fault = all_faults[name]
            seen |= {p.pid: describe(p) for p in tree(run.proc.pid)}
            before = count_lines(run, RECOVERY_LINE[fault.target])
            blamed_before = count_lines(run, fault.blamed[0])
            target = inject(run, fault, spare={p.pid for p in stopped})
            injected.append(name)
            if fault.how == "stop":
                stopped.append(target)
            wait_for_count(run, RECOVERY_LINE[fault.target], before + 1, timeout_s=WATCHDOG_S + 180)
            blamed[name] = [x for x in run.out if x.startswith(fault.blamed[0])][blamed_before:]
            if name != RECOVERED[-1]:  # the next fault after the next checkpoint: progress since this recovery
                wait_for_count(run, "[checkpoint] ", count_lines(run, "[checkpoint] ") + 1, timeout_s=WATCHDOG_S + 180)
        seen |= {p.pid: describe(p) for p in tree(run.proc.pid)}
        rc = run.finish(timeout_s=WATCHDOG_S + 240)
        verify_manifest(last_checkpoint(run_dir))
        left = left_behind(seen)
    finally:
        run.kill()
        for target in stopped:  # the test's own clean-up, after the check above
            if target.is_running():
                target.send_signal(signal.SIGCONT)
                target.kill()
    console = run.text()
    assert injected == RECOVERED, console
    # each recovery followed a [fault] line that named the part at fault (and how it failed); the engine's name the
    # engine, not only the actor: dead (vLLM's own error), then hung (the health probe, or a weight publish into the
    # stopped engine that timed out, whichever came first)
    assert all(blamed.values()), (blamed, console)
    dead, hung = (" / ".join(blamed[name]) for name in ENGINE_FAULTS)
    assert "engine" in dead.lower(), dead
    assert "engine stopped answering" in hung or "publish" in hung, hung
    assert "Traceback" not in "\n".join(run.out + run.err), console
    assert rc == 0 and not [x for x in run.err + run.out if x.startswith("error:")], console
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == RECOVERED_STEPS, summary
    assert summary["actor_restarts"] == {"actor0": 4}, summary  # killed, stopped, its engine core killed, stopped
    assert summary["retriever_restarts"] == 2, summary  # killed, then stopped
    assert summary["exporter_restarts"] >= 1, summary
    assert any(x.startswith("[fault] ") and "exporter" in x for x in run.out), console
    failed = sum(x.startswith("[fault]") or "episode" in x and "failed" in x for x in run.out + run.err)
    assert failed < 60, f"{failed} lines about faults or failed episodes: a flood\n{console}"
    assert not left, "processes of the run left 15 s after it ended:\n" + "\n".join(left)
    assert not leaked_weight_dirs(shm_before, set(seen)), "temporary weights left in /dev/shm"


ENDED = [name for name, f in FAULTS.items() if f.outcome == "ended"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ENDED)
def test_a_fault_that_ends_the_run_ends_it_in_one_error_line(name, tmp_path, world_dir, tiny_model_dir):
    fault = FAULTS[name]
    run_dir = tmp_path / "run"
    mounted = None
    if fault.how == "disk-full":
        mounted = run_dir / "checkpoints"
        mounted.mkdir(parents=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mounted)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here to fill ({r.stderr.strip()})")
    shm_before = shm_weight_dirs()
    run = start(tmp_path, world_dir, tiny_model_dir)
    target = None
    seen: dict[int, str] = {}
    try:
        run.wait_for(f"[checkpoint] {run_dir / 'checkpoints' / 'step_000002'}", timeout_s=420)
        seen = {p.pid: describe(p) for p in tree(run.proc.pid)}
        injected = time.monotonic()
        target = inject(run, fault, mounted)
        rc = run.finish(timeout_s=WATCHDOG_S + 240)
        ended = time.monotonic() - injected
        verify_manifest(run_dir / "checkpoints" / "step_000002")  # the last good checkpoint is intact
        partial = [d.name for d in (run_dir / "checkpoints").iterdir() if d.name.endswith(".tmp")]
        left = left_behind(seen)
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
    assert rc not in (0, None) and len(errors) == 1, console
    line = errors[0]
    assert any(word in line for word in fault.blamed), f"{name}: the error line does not name {fault.blamed}: {line}"
    if "; blocked: " in line:  # the watchdog's report: it must blame the part at fault, not another
        clause = line.split("; blocked: ", 1)[1]
        named = max((part for part in BLAMED if clause.startswith(part)), key=len, default=None)
        assert named == fault.blocked, f"{name}: the stall report blames {named!r}, not {fault.blocked!r}: {line}"
    assert ended < WATCHDOG_S + 120, f"ended {ended:.0f} s after the fault (watchdog {WATCHDOG_S} s)"
    assert not partial, f"a partial checkpoint was left: {partial}"
    assert not left, "processes of the run left 15 s after it ended:\n" + "\n".join(left)
    assert not leaked_weight_dirs(shm_before, set(seen)), "temporary weights left in /dev/shm"
