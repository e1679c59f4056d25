"""Processes and ``/dev/shm`` files that must not outlive an engine, and the watcher that ends them when the engine's
owner dies without closing it. Standard library and psutil only: ``python -m actors.processes`` is the watcher
(``watch``), started by ``actors.engine.EngineProcesses`` with its owner's lines on stdin."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Iterable, Mapping, Sequence

import psutil

GONE_S = 5.0  # a SIGKILLed process is waited for this long (it cannot refuse; a zombie counts as gone)


def descendants() -> dict[int, float]:
    """pid -> start time of every live descendant of this process."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            out[p.pid] = p.create_time()
        except psutil.Error:
            pass
    return out


def alive(procs: Mapping[int, float]) -> list[int]:
    """The pids of ``procs`` still the process recorded (same start time), not zombies."""
    out = []
    for pid, started in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def kill_processes(procs: Mapping[int, float], gone_s: float = GONE_S) -> list[int]:
    """SIGKILL every process of ``procs`` (pid -> start time) that is still the one recorded, a stopped one too, and
    wait up to ``gone_s`` for them to be gone; returns the pids killed."""
    killed = []
    for pid in alive(procs):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    deadline = time.monotonic() + gone_s
    while alive({pid: procs[pid] for pid in killed}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def mapped_files(pids: Sequence[int], prefixes: Sequence[str]) -> set[str]:
    """The ``/dev/shm`` files whose names start with one of ``prefixes`` that the processes ``pids`` have mapped
    (``/proc/PID/maps``; a file already unlinked is not listed)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[5:]
                    if path and path[0].startswith("/dev/shm/") and not path[0].endswith(" (deleted)"):
                        if path[0][len("/dev/shm/"):].startswith(tuple(prefixes)):
                            out.add(path[0])
        except OSError:
            pass
    return out


def unlink_files(paths: Iterable[str]) -> list[str]:
    """Remove each of ``paths`` that still exists; returns those removed."""
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def watch(lines: Iterable[str]) -> None:
    """The watcher's work: ``pid PID START`` and ``file PATH`` lines as the owner learns them, ``done`` when the owner
    closed the engine itself; the end of ``lines`` without ``done`` means the owner died: the processes still alive
    are killed and the files unlinked."""
    procs: dict[int, float] = {}
    files: set[str] = set()
    for line in lines:
        kind, _, rest = line.strip().partition(" ")
        if kind == "done":
            return
        if kind == "pid":
            pid, started = rest.split()
            procs[int(pid)] = float(started)
        elif kind == "file":
            files.add(rest)
    kill_processes(procs)
    unlink_files(files)


if __name__ == "__main__":
    # Fork away from the parent first: Ray ends a worker's child processes with it, and the watcher must outlive its
    # owner by the moment it takes to clean up. The parent exits at once (its starter waits for that).
    if os.fork():
        os._exit(0)
    watch(sys.stdin)
