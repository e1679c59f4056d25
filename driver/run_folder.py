"""The run folder (``run.output_dir/run.name``) belongs to one run at a time, and a new run never mixes into an
earlier run's results.

- ``hold(run_dir)``: an exclusive ``fcntl`` lock on ``run_dir/.run.lock`` (holding the pid) for the whole run; a
  second run aimed at the folder while the first runs is refused in one ``error:`` line naming the other's pid. The
  lock goes with the process, however it ends.
- ``set_aside_earlier_run(run_dir)``: a fresh run in a folder that holds an earlier run's results (metrics,
  evaluations, checkpoints, the final policy) moves them to ``<run_dir>.previous`` (replacing what was there) and
  says so in one line, so running the same command twice keeps working and keeps the last run. A warm start the run
  made in the folder (``sft/``) stays: the next run reuses it.
- ``read_metrics_lines(path)``: the lines of a run's ``metrics.jsonl`` for a resume, one ``error:`` line naming the
  file, the line and the byte when it is not UTF-8 text.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from async_agent_rl.errors import InputError

LOCK_FILE = ".run.lock"
RESULTS = ("metrics.jsonl", "eval.jsonl", "summary.json", "checkpoints", "final")  # what makes a folder a run's
KEPT = (LOCK_FILE, "sft")  # never moved aside: the lock, and a warm start the next run reuses


@contextmanager
def hold(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for this process until the block ends (see the module docstring)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise InputError(f"{run_dir} is in use by another run (pid {pid}, lock {path}): wait for it to end, or give "
                         "this run another run.name") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield
    finally:
        f.close()  # releases the lock; the file stays (its pid is the last holder's)


def set_aside_earlier_run(run_dir: Path) -> str | None:
    """Move an earlier run's results out of ``run_dir`` (see the module docstring); the line to say, or None when
    there was none."""
    if not any(_holds_something(run_dir / name) for name in RESULTS):
        return None
    finished = (run_dir / "summary.json").is_file()
    aside = run_dir.with_name(run_dir.name + ".previous")
    if aside.is_symlink() or aside.is_file():
        aside.unlink()
    elif aside.exists():
        shutil.rmtree(aside)
    aside.mkdir(parents=True)
    for entry in run_dir.iterdir():
        if entry.name in KEPT or not _holds_something(entry):
            continue  # an empty folder made ahead of the run (a checkpoints folder on another disk) stays
        if os.path.ismount(entry):  # a file system mounted there cannot be renamed: its contents move
            (aside / entry.name).mkdir()
            for child in entry.iterdir():
                shutil.move(str(child), str(aside / entry.name / child.name))
        else:
            entry.rename(aside / entry.name)
    what = "a finished run" if finished else "an unfinished run (no summary.json)"
    return (f"{run_dir} held {what}: its results moved to {aside} (replacing what was there); this run starts "
            "afresh" + (", reusing the warm start in sft/" if (run_dir / "sft").is_dir() else ""))


def _holds_something(path: Path) -> bool:
    """A file, or a folder with anything in it (an empty folder is no earlier run's result)."""
    if path.is_dir() and not path.is_symlink():
        return any(path.iterdir())
    return path.exists() or path.is_symlink()


def read_metrics_lines(path: Path) -> list[str]:
    """The lines of ``path`` (a run's ``metrics.jsonl``; none when it is missing); ``InputError`` naming the file,
    the line and the byte when it is not UTF-8 text."""
    if not path.is_file():
        return []
    lines = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: line {number} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                             f"{e.start}); fix or remove that line to resume") from None
    return [line for line in lines if line.strip()]


def check_safetensors(path: Path) -> None:
    """``InputError`` naming ``path`` and what is wrong when it is not a whole safetensors file: its header length,
    JSON header and tensor offsets must fit the file, the tensors filling its data exactly (weights damaged and then
    resealed into the checkpoint's manifest pass the checksums; loading them failed deep inside an engine)."""
    import json
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path}: damaged safetensors file ({size} bytes, shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise InputError(f"{path}: damaged safetensors file (its header says {n} bytes of header, the file has "
                             f"{size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise InputError(f"{path}: damaged safetensors file (its header is not JSON: {e})") from None
    data = size - 8 - n
    ends = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise InputError(f"{path}: damaged safetensors file (tensor {name!r} has no data offsets)") from None
        if not 0 <= start <= end <= data:
            raise InputError(f"{path}: damaged safetensors file (tensor {name!r} lies at bytes {start}-{end} of "
                             f"{data} bytes of data)")
        ends.append(end)
    if max(ends, default=0) != data:
        raise InputError(f"{path}: damaged safetensors file ({data} bytes of data, its tensors end at byte "
                         f"{max(ends, default=0)})")
