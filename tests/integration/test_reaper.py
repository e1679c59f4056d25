"""The driver's reaper (``driver/reaper.py``) on real processes: a driver killed with SIGKILL leaves no child (a
stopped one included) and no ``/dev/shm`` file of its children behind; a driver that ends normally has its children
left alone (it shut them down itself). The whole training's version is in
tests/integration/test_train_stall_and_stop.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# a stand-in driver: its reaper, a child that sleeps, a grandchild that is stopped, a joblib-like semaphore file of
# the child's; prints the pids, then waits (or, with "exit", ends normally)
DRIVER = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    from pathlib import Path
    from driver.reaper import reaper

    with reaper():
        child = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys, time; g = subprocess.Popen(['sleep', '600']); print(g.pid, flush=True); "
            "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        os.kill(grandchild, signal.SIGSTOP)
        Path(f"/dev/shm/sem.loky-{child.pid}-aartest").write_bytes(b"x")
        time.sleep(2.5)  # the reaper has seen both
        print(child.pid, grandchild, flush=True)
        if sys.argv[1] == "exit":
            sys.exit(0)
        time.sleep(600)
''')


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start(mode: str) -> tuple[subprocess.Popen, int, int]:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, mode], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child, grandchild = map(int, driver.stdout.readline().split())
    return driver, child, grandchild


def test_a_killed_driver_leaves_no_process_and_no_shared_memory_file():
    driver, child, grandchild = start("wait")
    sem = Path(f"/dev/shm/sem.loky-{child}-aartest")
    try:
        assert sem.exists() and not gone(child) and not gone(grandchild)
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (gone(child) and gone(grandchild) and not sem.exists()):
            time.sleep(0.2)
        assert gone(child) and gone(grandchild), "the killed driver's children outlived it"
        assert not sem.exists(), "the dead child's semaphore file was left in /dev/shm"
    finally:
        for pid in (child, grandchild):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        sem.unlink(missing_ok=True)


def test_a_driver_that_ends_normally_has_nothing_killed():
    driver, child, grandchild = start("exit")
    try:
        assert driver.wait(20) == 0
        time.sleep(3)
        assert not gone(child) and not gone(grandchild)  # left alone: a normal end shut down what it meant to
    finally:
        for pid in (child, grandchild):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        Path(f"/dev/shm/sem.loky-{child}-aartest").unlink(missing_ok=True)
