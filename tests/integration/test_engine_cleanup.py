"""The engine's processes and files do not outlive it: a short real training with ``rollout.multiprocess_engine=true``
(the vLLM engine core and its worker are processes of their own, talking through vLLM's shared-memory message
queues, ``/dev/shm/psm_*``, and multiprocessing's named semaphores, ``/dev/shm/sem.mp-*``) leaves no ``/dev/shm``
file that appeared while it ran; and a rollout actor's restart ends its old engine (the real engine core process is
gone after the restart).

About 3 minutes on 2 cores."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from actors.processes import mapped_files
from async_agent_rl.config import load_config
from tests.helpers import Run, world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
# the files vLLM's engine processes create there: shared-memory queues and multiprocessing's semaphores
ENGINE_FILES = ("psm_", "sem.mp-")
SHORT = [
    "learner.batch_size=8", "learner.mini_batch_size=8", "learner.micro_batch_size=8", "rollout.group_size=4",
    "rollout.max_concurrent_episodes=8", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
    "sft.enabled=false", "buffer.group_filter=none", "learner.total_steps=2", "learner.checkpoint_every=0",
    "monitoring.enabled=false", "rollout.multiprocess_engine=true",
]  # fmt: skip


def engine_files() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith(ENGINE_FILES)} if SHM.is_dir() else set()


class RunFiles:
    """The ``/dev/shm`` engine files (``ENGINE_FILES``) the processes of a run map, read every half second from
    their ``/proc/PID/maps`` while it runs: the run's own, whatever other processes of the machine make meanwhile."""

    def __init__(self, run: Run):
        self.run, self.files = run, set()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while self.run.proc.poll() is None:
            try:
                pids = [p.pid for p in psutil.Process(self.run.proc.pid).children(recursive=True)]
            except psutil.Error:
                pids = []
            self.files |= {Path(f).name for f in mapped_files(pids, ENGINE_FILES)}
            time.sleep(0.5)

    def left(self, grace_s: float) -> list[str]:
        """The run's files still in /dev/shm ``grace_s`` seconds from now (polled: none, at once)."""
        deadline = time.monotonic() + grace_s
        while True:
            left = sorted(f for f in self.files if (SHM / f).exists())
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm here")
@pytest.mark.timeout(600)
def test_a_run_with_the_engine_core_in_its_own_process_leaves_no_shared_memory_file(tmp_path, world_dir,
                                                                                    tiny_model_dir):
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SHORT, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir)])
    cfg_file = cfg.save(tmp_path / "cfg.yaml")
    before = engine_files()
    run = Run([sys.executable, "-m", "driver.cli", "train", "--config", str(cfg_file)])
    files = RunFiles(run)
    try:
        rc = run.finish(timeout_s=540)
    finally:
        run.kill()
    assert rc == 0, run.text()
    appeared = files.files - before
    assert appeared, "the run's engine processes mapped no /dev/shm file: is the engine core a process of its own?"
    left = files.left(grace_s=10.0)
    assert not left, f"/dev/shm files of the run left after it ended: {left} (the run made {sorted(appeared)})"
    assert os.path.isdir(tmp_path / "run"), run.text()


def engine_cores(root: int, spare: set[int] = frozenset()) -> list[psutil.Process]:
    """The ``VLLM::EngineCore`` processes in the process tree of ``root`` (but those in ``spare``)."""
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for p in procs:
        try:
            if "VLLM::EngineCore" in " ".join(p.cmdline()) + p.name() and p.pid not in spare:
                out.append(p)
        except psutil.Error:
            pass
    return out


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_until(run: Run, what, timeout_s: float, why: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hit = what()
        if hit:
            return hit
        if run.proc.poll() is not None:
            break
        time.sleep(0.2)
    pytest.fail(f"{why} within {timeout_s} s:\n{run.text()}")


RESTARTED = "[fault] rollout actor 0 restarted"


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm here")
@pytest.mark.timeout(900)
def test_an_engine_death_is_one_fault_line_and_a_restart_ends_the_old_engine(tmp_path, world_dir, tiny_model_dir):
    """The real engine core, killed (SIGKILL): one ``[fault]`` line names its death before the restart line, and
    Ray's own ``(raylet) A worker died ...`` line is not on the console. Then the new engine core, stopped (SIGSTOP,
    a hung engine): after the restart that follows, the old engine core and its worker process are gone (before,
    the stopped core stayed alive beside the new engine until the run ended). No ``/dev/shm`` file of the engines
    is left once the run ended."""
    steps = 8
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SHORT, f"learner.total_steps={steps}", "learner.checkpoint_every=1", "rollout.engine_silence_s=20",
        "cluster.max_actor_restarts=3", "cluster.actor_timeout_s=20", "cluster.progress_timeout_s=240",
        f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir)])
    cfg_file = cfg.save(tmp_path / "cfg.yaml")
    run = Run([sys.executable, "-m", "driver.cli", "train", "--config", str(cfg_file)])
    files = RunFiles(run)
    stopped: list[psutil.Process] = []
    try:
        run.wait_for("[checkpoint] ", timeout_s=420)
        core = wait_until(run, lambda: engine_cores(run.proc.pid), 60, "no VLLM::EngineCore in the run's tree")[0]
        said = len(run.out)
        core.kill()
        wait_until(run, lambda: any(x.startswith(RESTARTED) for x in run.out[said:]), 240, "no restart")
        after = run.out[said:]
        faults = [x for x in after[:next(k for k, x in enumerate(after) if x.startswith(RESTARTED))]
                  if x.startswith("[fault]")]
        assert len(faults) == 1 and "engine" in faults[0], f"the engine's death said in {faults}"

        checkpoints = sum(x.startswith("[checkpoint] ") for x in run.out)
        wait_until(run, lambda: sum(x.startswith("[checkpoint] ") for x in run.out) > checkpoints, 240,
                   "no checkpoint after the restart")
        hung = wait_until(run, lambda: engine_cores(run.proc.pid, {core.pid}), 60, "no new VLLM::EngineCore")[0]
        workers = hung.children(recursive=True)
        said = len(run.out)
        hung.suspend()
        stopped.append(hung)
        wait_until(run, lambda: any(x.startswith(RESTARTED) for x in run.out[said:]), 300, "no restart of a hung engine")
        assert gone(hung), f"the hung engine core {hung.pid} is still there after the restart:\n{run.text()}"
        assert all(gone(w) for w in workers), f"its worker processes {[w.pid for w in workers]} are still there"
        rc = run.finish(timeout_s=600)
    finally:
        run.kill()
        for p in stopped:  # the test's own clean-up, after the checks above
            if not gone(p):
                p.resume()
                p.kill()
    console = run.out + run.err
    assert rc == 0, run.text()
    assert not [x for x in console if "A worker died" in x or "(raylet)" in x], run.text()
    # the restart ended the hung engine itself before the actor was killed (Ray's ending of a dead worker's children
    # would end a stopped engine core too, later): the driver's log names its processes, the hung core among them
    log_text = (tmp_path / "run" / "train.log").read_text()
    ended = [x for x in log_text.splitlines() if "rollout actor 0: engine processes [" in x]
    assert any(str(hung.pid) in x for x in ended), f"the hung engine core {hung.pid} not ended by the restart: {ended}"
    assert any("A worker died or was killed" in x for x in log_text.splitlines()), "Ray's message not in the log file"
    assert files.files, "the run's engine processes mapped no /dev/shm file"
    left = files.left(grace_s=10.0)
    assert not left, f"/dev/shm files of the run's engines left after it ended: {left}"
