"""Bad input as one ``error: ...`` line: the project's input-error base class and the CLI's single mapping from a
failure to that line.

Every exception the project raises for bad input (a config key, a data file and row, a checkpoint, a corpus line)
derives from :class:`InputError`; its message names the file, row or key. ``error_line`` turns such an exception,
a missing or unreadable file, a port that is in use, and failures raised inside Ray actors (the actor's exception
is unwrapped and the component named) into the line the CLI prints before exiting with status 2.
"""

from __future__ import annotations

import errno
import os
import re
import sys


class InputError(ValueError):
    """Bad input: a file, row, key or argument the user can fix. The message names it."""


def _ray_failure(e: BaseException) -> tuple[str, BaseException | None] | None:
    """``(component, cause)`` for an exception raised through Ray, else None. ``cause`` is None when the actor
    process itself died (nothing to unwrap)."""
    exc = sys.modules.get("ray.exceptions")  # not imported: no Ray exception can exist
    if exc is None:
        return None
    if isinstance(e, exc.RayTaskError):
        # what ray.get raises is a copy that is also an instance of the cause's class: it keeps only the cause and
        # the text, whose first line names the remote function ("ray::RolloutActor.setup() (pid=...)")
        name = e.__dict__.get("function_name")
        if not name:
            found = re.search(r"ray::([\w.]+)\(", str(e))
            name = found.group(1) if found else "a Ray task"
        return name, e.__dict__["cause"]
    if isinstance(e, exc.RayActorError):  # its message names the actor's class on a line of its own
        text = (getattr(e, "error_msg", "") or str(e)).strip()
        first = text.splitlines()
        named = re.search(r"^\s*class_name: (\w+)", text, re.MULTILINE)
        who = f"the Ray actor {named.group(1)} died" if named else "a Ray actor died"
        return f"{who}: {first[0] if first else type(e).__name__}", None
    return None


def _file_in_the_way(e: OSError) -> str | None:
    """The file that stood where a folder was wanted (``mkdir`` of an existing file, a path through a file), or
    None when the error is of another kind."""
    if not isinstance(e, (FileExistsError, NotADirectoryError)) or not isinstance(e.filename, (str, os.PathLike)):
        return None
    path = os.fspath(e.filename)
    if isinstance(e, FileExistsError):
        return path if os.path.lexists(path) and not os.path.isdir(path) else None
    parent = os.path.dirname(path)
    while parent and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return parent if parent and not os.path.isdir(parent) else None


def error_line(e: BaseException) -> str | None:
    """The ``error: ...`` line for a known kind of failure; None for anything else (a bug: the CLI says so)."""
    where = ""
    ray_failure = _ray_failure(e)
    while ray_failure is not None:  # a task failure may wrap another actor's failure
        component, cause = ray_failure
        if cause is None:
            return f"error: {where}{component}"
        where += f"in {component}: "
        e = cause
        ray_failure = _ray_failure(e)
    if isinstance(e, InputError):
        return f"error: {where}{e}"
    if isinstance(e, OSError):
        if e.errno == errno.EADDRINUSE:
            return f"error: {where}{e.strerror or e}"
        if e.errno == errno.EADDRNOTAVAIL:  # a listen address no interface of this machine has
            return f"error: {where}{e.strerror or e} (no network interface of this machine has that address)"
        in_the_way = _file_in_the_way(e)
        if in_the_way is not None:
            if in_the_way == os.fspath(e.filename):
                return f"error: {where}{in_the_way}: a file, not a folder"
            return f"error: {where}{os.fspath(e.filename)}: {in_the_way} is a file, not a folder"
        if e.filename is not None:
            return f"error: {where}{e.filename}: {e.strerror or e}"
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return f"error: {where}{e}"
    if isinstance(e, UnicodeDecodeError):
        return f"error: {where}input is not UTF-8 text ({e.reason} at byte {e.start})"
    if where:  # anything raised inside an actor: name the component and the exception, not the remote traceback
        first = str(e).strip().splitlines()
        return f"error: {where}{type(e).__name__}: {first[0] if first else ''}".rstrip(": ")
    return None
