"""Bad inputs (the unit half): weight folders left by a killed process are swept by the next engine, live
owners' folders are not touched. The real runs (normal end and killed) are checked in
tests/integration/test_bad_inputs_run.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.engine import WEIGHTS_PREFIX, sweep_orphaned_weights

pytestmark = pytest.mark.unit


def test_only_folders_of_dead_owners_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    orphan = tmp_path / f"{WEIGHTS_PREFIX}{dead_pid}_abc123"
    live = tmp_path / f"{WEIGHTS_PREFIX}{os.getpid()}_def456"
    legacy = tmp_path / f"{WEIGHTS_PREFIX}xk2j9a"  # no owner in the name: not ours to judge
    other = tmp_path / "something_else_1_2"
    for d in (orphan, live, legacy, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1024)
    assert sweep_orphaned_weights(tmp_path) == [orphan]
    assert not orphan.exists() and live.exists() and legacy.exists() and other.exists()
