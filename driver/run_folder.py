"""The run folder (``run.output_dir/run.name``) belongs to one run at a time, and a new run never mixes into an
earlier run's results.

- ``hold(run_dir)``: an exclusive ``fcntl`` lock on ``run_dir/.run.lock`` (holding the pid) for the whole run; a
  second run aimed at the folder while the first runs is refused in one ``error:`` line naming the other's pid. The
  lock goes with the process, however it ends.
- ``set_aside_earlier_run(run_dir)``: a fresh run in a folder that holds an earlier run's results (metrics,
  evaluations, checkpoints, the final policy) moves them to the next free numbered folder beside it,
  ``<run_dir>.1``, ``<run_dir>.2``, ... (the highest number is the latest run; nothing there is ever replaced) and
  says so in one line, so running the same command again and again keeps working and keeps every run. Deleting
  them instead is the user's explicit choice (``delete=True``: ``run.delete_earlier_run``). A warm start the run
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
from learner.checkpoint import weights_problems

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


def set_aside_earlier_run(run_dir: Path, delete: bool = False) -> str | None:
    """Move an earlier run's results out of ``run_dir`` into the next free ``<run_dir>.N`` (or delete them, when
    ``delete``: ``run.delete_earlier_run``; see the module docstring); the line to say, or None when there was
    none."""
    if not any(_holds_something(run_dir / name) for name in RESULTS):
        return None
    finished = (run_dir / "summary.json").is_file()
    what = "a finished run" if finished else "an unfinished run (no summary.json)"
    warm = ", reusing the warm start in sft/" if (run_dir / "sft").is_dir() else ""
    entries = [e for e in run_dir.iterdir() if e.name not in KEPT and _holds_something(e)]
    # (an empty folder made ahead of the run, a checkpoints folder on another disk, stays)
    if delete:
        for entry in entries:  # a mounted file system stays where it is: its contents go
            for target in (list(entry.iterdir()) if os.path.ismount(entry) else [entry]):
                _remove(target)
        return (f"{run_dir} held {what}: its results were deleted (run.delete_earlier_run); this run starts "
                f"afresh{warm}")
    aside = _next_free(run_dir)
    for entry in entries:
        if os.path.ismount(entry):  # a file system mounted there cannot be renamed: its contents move
            (aside / entry.name).mkdir()
            for child in entry.iterdir():
                shutil.move(str(child), str(aside / entry.name / child.name))
        else:
            entry.rename(aside / entry.name)
    return (f"{run_dir} held {what}: its results moved to {aside} (kept; run.delete_earlier_run=true deletes them "
            f"instead); this run starts afresh{warm}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def earlier_runs(run_dir: Path) -> list[Path]:
    """The folders ``set_aside_earlier_run`` moved earlier runs of ``run_dir`` to, oldest first."""
    numbered = [(int(p.name[len(run_dir.name) + 1:]), p) for p in run_dir.parent.glob(f"{run_dir.name}.*")
                if p.name[len(run_dir.name) + 1:].isdigit() and p.is_dir()]  # fmt: skip
    return [p for _, p in sorted(numbered)]


def _next_free(run_dir: Path) -> Path:
    """A new empty ``<run_dir>.N``, N one above the highest there (made here: two callers never get the same)."""
    n = max((int(p.name[len(run_dir.name) + 1:]) for p in earlier_runs(run_dir)), default=0) + 1
    while True:
        aside = run_dir.with_name(f"{run_dir.name}.{n}")
        try:
            aside.mkdir()
            return aside
        except FileExistsError:  # a file of that name, or a folder made meanwhile
            n += 1


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
    """``InputError`` naming the damaged or missing file when the weights of the folder holding ``path`` (a
    checkpoint's ``policy/model.safetensors``) are not whole: ``path`` and every other ``*.safetensors`` file there
    whole, every shard its ``model.safetensors.index.json`` lists present. The one check of weights
    (``learner.checkpoint.weights_problems``), which ``eval --checkpoint`` and the choice of the checkpoint to resume
    from (``newest_intact``) run too: weights damaged and then resealed into a checkpoint's manifest pass its
    checksums, and loading them failed deep inside an engine, naming no file."""
    problems = ([] if path.is_file() else [f"{path}: missing"]) + weights_problems(path.parent, required=True)
    if problems:
        more = f" (and {len(problems) - 1} more damaged file(s))" if len(problems) > 1 else ""
        raise InputError(problems[0] + more)
