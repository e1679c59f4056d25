"""The engine's watcher: when the process that owns an engine is killed without closing it (a rollout actor SIGKILLed
mid-episode), the processes the engine started and the ``/dev/shm`` files they map are ended and removed by the
watcher process ``EngineProcesses`` started with it. A real owner process, a real child mapping a real file, a real
SIGKILL; no engine (the watcher sees only pids and paths)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import gone

pytestmark = pytest.mark.unit

SHM = Path("/dev/shm")

# An engine process's stand-in: maps a file named as vLLM's queues are (psm_*), then waits.
CHILD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
print("mapped", flush=True)
time.sleep(600)
"""

# The engine's owner: starts the child, records it as its engine's processes, says what it recorded, then waits.
OWNER = """
import subprocess, sys, time
import psutil
from actors.engine import EngineProcesses
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "mapped"
procs = EngineProcesses({child.pid: psutil.Process(child.pid).create_time()})
print(child.pid, " ".join(sorted(procs.files)), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_a_killed_owner_leaves_no_engine_process_and_no_engine_file():
    path = SHM / f"psm_aar_test_{uuid.uuid4().hex[:8]}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        pid, _, files = owner.stdout.readline().strip().partition(" ")
        child = int(pid)
        assert files.split() == [str(path)], "the owner recorded the file its engine process maps"
        assert not gone(child) and path.exists()
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 15
        while not (gone(child) and not path.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(child), "the watcher killed the engine's process once its owner was gone"
        assert not path.exists(), "the watcher removed the engine's file"
    finally:
        if owner.poll() is None:
            owner.kill()
        if child is not None and not gone(child):
            os.kill(child, signal.SIGKILL)
        path.unlink(missing_ok=True)
