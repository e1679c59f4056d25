"""``async-agent-rl view RUN_DIR``: the run viewer, a page on 127.0.0.1 (the port printed), during or after a run.

It reads the run folder's files only (``monitoring.viewer``): learning curves, throughput, staleness and tool
latency from ``metrics.jsonl`` and ``eval.jsonl``, and the training episodes kept in ``episodes/``
(``monitoring.episode_sample``). Ctrl-C (or SIGTERM) stops it. docs/VIEWER.md.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import sys
from pathlib import Path

from async_agent_rl.errors import InputError

RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "summary.json", "episodes")


def check_run_dir(path: str) -> Path:
    """``path`` as a run folder: it exists and holds at least one of a run's files (``RUN_FILES``)."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise InputError(f"{path}: no such folder (give a run folder: run.output_dir/run.name)")
    if not run_dir.is_dir():
        raise InputError(f"{path}: not a folder (give a run folder: run.output_dir/run.name)")
    if not any((run_dir / name).exists() for name in RUN_FILES):
        raise InputError(f"{path}: not a run folder (none of {', '.join(RUN_FILES)} in it)")
    return run_dir


def cmd_view(args: argparse.Namespace) -> int:
    from monitoring.viewer.server import HOST, start

    run_dir = check_run_dir(args.run_dir)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port}: must be between 0 and 65535 (0: any free port)")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before the address is printed: whoever reads it may stop us
            loop.add_signal_handler(sig, stop.set)
        try:
            runner, port = await start(run_dir, args.port)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise InputError(f"--port {args.port}: in use on {HOST} (give another, or 0 for any free port)") from None
            raise
        print(f"viewer of {run_dir} on http://{HOST}:{port}/ (Ctrl-C to stop)", flush=True)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
    print("viewer stopped", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("view", help="serve a run's curves and training episodes as a page on 127.0.0.1")
    v.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (run.output_dir/run.name), during or after a run")
    v.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default 0: any free port, printed)")
    v.set_defaults(func=cmd_view)
