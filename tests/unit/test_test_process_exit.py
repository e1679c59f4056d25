"""The test process ends with pytest's own exit status (tests/conftest.py ends it right after the report, skipping
the native libraries' finalization): a failure stays a failure, a pass a pass, and threads left running are named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_case.py").write_text(
        "import threading, time\n\ndef test_case():\n"
        "    threading.Thread(target=time.sleep, args=(60,), name='left-behind', daemon=True).start()\n"
        f"    {body}\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "--rootdir", str(tmp_path), "-c", "/dev/null",
         str(tmp_path / "test_case.py")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("body, status", [("assert True", 0), ("assert False", 1)])
def test_exit_status_is_pytests_and_left_threads_are_named(tmp_path, body, status):
    r = _run(tmp_path, body)
    assert r.returncode == status, r.stdout + r.stderr
    assert "threads still running at the end: left-behind" in r.stdout, r.stdout
