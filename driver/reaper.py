"""A training's reaper: the processes a run started, and their files in ``/dev/shm``, do not outlive a driver that
was killed (SIGKILL, the OOM killer, a lost terminal), which no handler of the driver's own can see.

``python -m driver.reaper PID`` runs in a session of its own beside the driver ``PID`` (``with reaper():`` in the
driver starts it). Every ``SNAPSHOT_S`` it records the driver's descendants (the local Ray cluster's GCS, raylet,
agents and workers, the engines, the retrieval server). Its stdin is a pipe from the driver:

- the driver writes ``done`` and closes it when it ended normally, after shutting everything down itself: what is
  still alive ``GRACE_S`` later (a Ray worker that was stopped, a server that ignored its SIGTERM) is killed;
- end of file without ``done`` means the driver is gone: every recorded process still alive is killed at once.

Only processes started after the reaper are recorded (a driver inside a test process has older children that are
not the run's), and a recorded process is killed only if it is still the same one (its start time is checked, so a
reused PID is never touched). Then the files are removed.

Files removed, of dead processes that were recorded or whose file appeared during the run (a process can start and
die between two snapshots): ``/dev/shm/aar_weights_<pid>_*`` (an engine's temporary copy of the weights) and
``/dev/shm/sem.loky-<pid>-*`` (joblib's semaphores, which a killed process never unlinks).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import psutil

SNAPSHOT_S = 1.0
GRACE_S = 5.0
SHM = Path("/dev/shm")


def descendants(root: psutil.Process, me: int, since: float) -> dict[int, float]:
    """pid -> start time of every descendant of ``root`` started at ``since`` or later, but this process."""
    out = {}
    for p in root.children(recursive=True):
        if p.pid != me:
            with contextlib.suppress(psutil.Error):
                started = p.create_time()
                if started >= since:
                    out[p.pid] = started
    return out


def alive(known: dict[int, float]) -> list[int]:
    out = []
    for pid, started in known.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def kill_recorded(known: dict[int, float]) -> list[int]:
    """SIGKILL every recorded process that is still the one recorded (a stopped one too); their pids."""
    killed = []
    for pid in alive(known):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
            killed.append(pid)
    deadline = time.monotonic() + 5.0  # SIGKILL is not refused; a zombie counts as gone (only not collected yet)
    while time.monotonic() < deadline and alive({pid: known[pid] for pid in killed}):
        time.sleep(0.1)
    return killed


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead: only its parent has not collected it
    except psutil.Error:
        return True


def remove_files(pids: set[int], since: float = float("inf"), shm: Path = SHM) -> list[Path]:
    """The ``/dev/shm`` entries of dead processes: weight copies (``aar_weights_<pid>_*``) and joblib semaphores
    (``sem.loky-<pid>-*``) of the recorded ``pids``, and of any process whose entry was made at ``since`` or later
    (one started and killed between two snapshots)."""
    removed = []
    for pattern, cut in (("aar_weights_*", len("aar_weights_")), ("sem.loky-*", len("sem.loky-"))):
        for path in shm.glob(pattern):
            owner = path.name[cut:].split("_" if pattern.startswith("aar") else "-", 1)[0]
            if not owner.isdigit():
                continue
            try:
                new = path.stat().st_ctime >= since
            except OSError:
                continue
            if (int(owner) in pids or new) and _dead(int(owner)):
                with contextlib.suppress(OSError):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                    removed.append(path)
    return removed


def watch(parent: int, stdin=None) -> None:
    stdin = stdin if stdin is not None else sys.stdin.buffer
    me = os.getpid()
    since = psutil.Process(me).create_time()  # processes of the run start after the reaper
    known: dict[int, float] = {}
    try:
        root = psutil.Process(parent)
    except psutil.Error:
        return
    sel = selectors.DefaultSelector()
    sel.register(stdin, selectors.EVENT_READ)
    said = b""
    while True:
        with contextlib.suppress(psutil.Error):
            known.update(descendants(root, me, since))
        if sel.select(timeout=SNAPSHOT_S):
            chunk = os.read(stdin.fileno(), 64)
            if chunk:
                said += chunk
                continue
            break  # end of file: the driver closed the pipe, or died
    if b"done" in said:  # a normal end: what the driver shut down has a moment to exit
        deadline = time.monotonic() + GRACE_S
        while alive(known) and time.monotonic() < deadline:
            time.sleep(0.2)
    kill_recorded(known)
    remove_files(set(known) | {parent}, since)


@contextlib.contextmanager
def reaper() -> Iterator[subprocess.Popen]:
    """The reaper of this process (see the module docstring); on a normal exit it is told ``done``."""
    proc = subprocess.Popen([sys.executable, "-m", "driver.reaper", str(os.getpid())], stdin=subprocess.PIPE,
                            start_new_session=True)  # its own session: a signal to the driver's group spares it
    try:
        yield proc
    finally:
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.write(b"done\n")
            proc.stdin.close()
        try:
            proc.wait(timeout=GRACE_S + 15)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the driver; the reaper ends with it
    watch(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
