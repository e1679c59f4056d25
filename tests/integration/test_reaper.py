"""The driver's reaper (``driver/reaper.py``) on real processes: a driver killed with SIGKILL leaves no child (a
stopped one included) and no ``/dev/shm`` file of its children behind; a driver that ends normally and left a child
running (a stopped one) has it ended after the grace; a child older than the reaper is never touched. The whole
training's version is in tests/integration/test_train_stall_and_stop.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import gone

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# a stand-in driver: its reaper, a child that sleeps, a grandchild that is stopped, a joblib-like semaphore file of
# the child's; prints the pids, then waits (or, with "exit", ends normally)
DRIVER = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    from pathlib import Path
    from driver.reaper import reaper

    old = subprocess.Popen(["sleep", "600"])  # started before the reaper: not the run's
    time.sleep(0.5)
    with reaper():
        child = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys, time; g = subprocess.Popen(['sleep', '600']); print(g.pid, flush=True); "
            "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        os.kill(grandchild, signal.SIGSTOP)
        Path(f"/dev/shm/sem.loky-{child.pid}-aartest").write_bytes(b"x")
        time.sleep(2.5)  # the reaper has seen both
        print(child.pid, grandchild, old.pid, flush=True)
        if sys.argv[1] == "exit":
            sys.exit(0)
        time.sleep(600)
''')


def start(mode: str) -> tuple[subprocess.Popen, int, int, int]:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, mode], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child, grandchild, old = map(int, driver.stdout.readline().split())
    return driver, child, grandchild, old


def wait_gone(pids: list[int], path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (all(gone(p) for p in pids) and not path.exists()):
        time.sleep(0.2)


@pytest.mark.parametrize("mode", ["wait", "exit"])
def test_the_run_leaves_no_process_and_no_shared_memory_file(mode):
    """``wait``: the driver is killed with SIGKILL; ``exit``: it ends normally but left its child (and a stopped
    grandchild) running."""
    driver, child, grandchild, old = start(mode)
    sem = Path(f"/dev/shm/sem.loky-{child}-aartest")
    try:
        assert sem.exists() and not gone(child) and not gone(grandchild)
        if mode == "wait":
            driver.kill()
        assert driver.wait(30) in (0, -signal.SIGKILL)
        wait_gone([child, grandchild], sem, timeout_s=15)
        assert gone(child) and gone(grandchild), "the run's processes outlived it"
        assert not sem.exists(), "the dead child's semaphore file was left in /dev/shm"
        assert not gone(old), "a process older than the run was killed"
    finally:
        for pid in (child, grandchild, old):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        sem.unlink(missing_ok=True)
