"""The reaper's clean-up of ``/dev/shm`` (``driver.reaper.remove_files``), on a folder standing in for it: files of
dead processes go (recorded ones, and any made during the run), files of live processes and older files of
unrecorded ones stay."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from driver.reaper import remove_files

pytestmark = pytest.mark.unit


def test_only_files_of_dead_processes_of_the_run_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = os.getpid()
    old = tmp_path / f"sem.loky-{dead.pid + 100000}-old"  # an unrecorded dead owner's file from before the run
    old.write_bytes(b"")
    since = time.time() + 0.01
    time.sleep(0.05)
    files = {
        "recorded dead": tmp_path / f"sem.loky-{dead.pid}-abc",
        "new dead": tmp_path / f"sem.loky-{dead.pid + 100001}-new",
        "live": tmp_path / f"sem.loky-{me}-xyz",
        "weights dead": tmp_path / f"aar_weights_{dead.pid}_q1",
        "weights live": tmp_path / f"aar_weights_{me}_q2",
    }
    for name, path in files.items():
        path.mkdir() if name.startswith("weights") else path.write_bytes(b"")
    removed = remove_files({dead.pid}, since, shm=tmp_path)
    assert sorted(p.name for p in removed) == sorted(
        files[k].name for k in ("recorded dead", "new dead", "weights dead"))
    assert old.exists() and files["live"].exists() and files["weights live"].exists()
