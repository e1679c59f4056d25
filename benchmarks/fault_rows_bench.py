"""Faults injected at one exact point of a real short training: a process SIGSTOPped right before a given driver call.

``tests/integration/test_fault_injection.py`` stops and kills components at whatever point a run has reached after
a checkpoint; some waits are only reached when a process stops at one exact moment (the learner between its step
and the checkpoint that follows, or between its step and the weight publish). From outside the run that moment is a
matter of luck, so here the driver itself sends the signal: the command line runs with the named driver method
wrapped, and at the given step, just before the real method runs, the real process (found by its Ray process
title among the run's processes) gets SIGSTOP. Everything after that is the run as a user runs it (real Ray, vLLM
CPU engine, DeepSpeed learner, retrieval server).

Rows (``--rows``):

- ``checkpoint``: the learner, before the step's checkpoint (``learner.checkpoint_every=1``);
- ``publish``: the learner, before the step's weight publish (object store);
- ``collective``: the rollout actor, before the step's weight publish (``weight_sync.method=collective``);
- ``full-buffer``: no signal: a replay buffer that holds exactly one batch (``buffer.capacity_trajectories`` =
  ``learner.batch_size``, the least a config may set), so it is full at run time and pushes wait for room;
- ``second-run``: no signal: the same command started again, on the same run folder, once the first run has done a
  step; the second must be refused in one line and the first must finish untouched.

For each: the exit status, the ``error:`` / ``[fault]`` lines, the seconds from the signal to the run's end (the
limit that should have applied is printed beside it), any traceback, a partial checkpoint copy left, processes of
the run still alive 15 s after it ended (the stopped one excepted: the script ends it), ``/dev/shm`` weight copies
left. Each row is one training of about 2-4 minutes on 2 cores; ``--out DIR`` writes the rows' numbers
(``result.json``), what was printed and how it ran (``benchmarks/record.py``)::

    python benchmarks/fault_rows_bench.py --out benchmarks/results/fault_rows/
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil

try:
    import record
except ImportError:  # imported as benchmarks.fault_rows_bench
    from benchmarks import record

REPO = Path(__file__).resolve().parents[1]
STEP = 2  # the step before whose call the process is stopped
ACTOR_TIMEOUT_S = 20
SETUP_TIMEOUT_S = 180  # also bounds the learner's checkpoint save; a rollout actor's engine sets up well within it
SYNC_TIMEOUT_S = 20
WATCHDOG_S = 240
SMALL = [
    "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8", "rollout.group_size=4",
    "rollout.max_concurrent_episodes=16", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
    "sft.enabled=false", "buffer.group_filter=none", "learner.total_steps=6", "monitoring.enabled=false",
    f"cluster.actor_timeout_s={ACTOR_TIMEOUT_S}", f"cluster.actor_setup_timeout_s={SETUP_TIMEOUT_S}",
    f"cluster.progress_timeout_s={WATCHDOG_S}", f"weight_sync.timeout_s={SYNC_TIMEOUT_S}",
]  # fmt: skip
# row -> (the driver call wrapped, the process stopped, overrides, the limit that should end the wait)
ROWS = {
    "checkpoint": ("driver.train:Trainer.checkpoint", "ray::LearnerActor", ["learner.checkpoint_every=1"],
                   f"cluster.actor_setup_timeout_s={SETUP_TIMEOUT_S}"),
    "publish": ("driver.versions:PolicyVersions.stepped", "ray::LearnerActor", ["learner.checkpoint_every=0"],
                f"cluster.actor_timeout_s={ACTOR_TIMEOUT_S} (bump_version), "
                f"cluster.actor_setup_timeout_s={SETUP_TIMEOUT_S} (the weights)"),
    "collective": ("driver.versions:PolicyVersions.stepped", "ray::RolloutActor",
                   ["learner.checkpoint_every=0", "weight_sync.method=collective"],
                   f"weight_sync.timeout_s={SYNC_TIMEOUT_S}"),
}
PLAIN_ROWS = {
    "full-buffer": ["learner.checkpoint_every=0", "buffer.capacity_trajectories=16"],
    "second-run": ["learner.checkpoint_every=0", "learner.total_steps=20"],  # busy while the second starts
}

# the command line, with one driver method wrapped: at step STEP, before the real call, SIGSTOP the process whose
# title holds TARGET among this driver's descendants (the local Ray cluster it started)
CLI = textwrap.dedent('''
    import importlib, os, signal, sys, time
    import psutil
    from driver.cli import main

    where, target, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    module, qualname = where.split(":")
    owner_name, method = qualname.split(".")
    owner = getattr(importlib.import_module(module), owner_name)
    real = getattr(owner, method)
    done = []

    def step_of(self, args):
        return args[0] if args and isinstance(args[0], int) else getattr(self, "step", None)

    def wrapped(self, *args, **kw):
        if not done and step_of(self, args) == step:
            hits = [p for p in psutil.Process().children(recursive=True)
                    if target in " ".join(p.cmdline() or [p.name()])]
            hits[0].send_signal(signal.SIGSTOP)
            done.append(hits[0].pid)
            print(f"[fault-row] SIGSTOP {target} (pid {hits[0].pid}) before {qualname} of step {step} "
                  f"at {time.time():.3f}", flush=True)
        return real(self, *args, **kw)

    setattr(owner, method, wrapped)
    sys.exit(main(sys.argv[4:]))
''')


def tree(pid: int) -> dict[int, str]:
    try:
        top = psutil.Process(pid)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            pass
    return out


def alive(pids: dict[int, str]) -> list[str]:
    left = []
    for pid, cmd in pids.items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {cmd[:80]}")
        except psutil.Error:
            pass
    return left


def shm_dirs() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("aar_weights_*")} if Path("/dev/shm").is_dir() else set()


class Proc:
    """A command in a session of its own, its stdout and stderr collected line by line."""

    def __init__(self, argv: list[str]):
        env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(s, d), daemon=True)
                        for s, d in ((self.proc.stdout, self.lines), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream, dest: list[str]) -> None:
        for x in stream:
            dest.append(x.rstrip("\n"))

    def finish(self) -> int:
        rc = self.proc.wait()
        for t in self.readers:
            t.join(timeout=30)
        return rc


def config_file(name: str, work: Path, extra: list[str]) -> tuple[Path, Path]:
    from async_agent_rl.config import load_config

    out_dir = work / name
    cfg = load_config(REPO / "configs/quickstart.yaml", [*SMALL, *extra, f"run.output_dir={out_dir}", "run.name=run"])
    return cfg.save(work / f"{name}.yaml"), out_dir


def steps_done(out_dir: Path) -> int:
    summary = out_dir / "run" / "summary.json"
    return json.loads(summary.read_text()).get("steps", 0) if summary.is_file() else 0


def run_plain_row(name: str, work: Path, timeout_s: float) -> dict:
    """A row with no signal: the buffer that fills, or a second run on a folder in use."""
    cfg_file, out_dir = config_file(name, work, PLAIN_ROWS[name])
    cmd = [sys.executable, "-m", "driver.cli", "train", "--config", str(cfg_file)]
    t0 = time.time()
    first = Proc(cmd)
    second = None
    second_rc = second_s = None
    t1 = 0.0
    out_of_order = False
    hung = False
    while first.proc.poll() is None or (second is not None and second.proc.poll() is None):
        if name == "second-run" and second is None and any(x.startswith("step ") for x in first.lines):
            t1 = time.time()
            second = Proc(cmd)
        if second is not None and second_rc is None and second.proc.poll() is not None:
            second_rc = second.finish()
            second_s = round(time.time() - t1, 1)
            # the second must have ended while the first still ran: else it may have found the folder free
            out_of_order = first.proc.poll() is not None
        if time.time() - t0 > timeout_s:
            hung = True
            for p in (first, second):
                if p is not None and p.proc.poll() is None:
                    os.killpg(p.proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    rc = first.finish()
    out = {"row": name, "overrides": PLAIN_ROWS[name], "rc": rc, "hung": hung, "seconds": round(time.time() - t0, 1),
           "steps": steps_done(out_dir), "traceback": any("Traceback" in x for x in first.lines + first.err),
           "error_lines": [x for x in first.lines + first.err if x.startswith("error:")],
           "fault_lines": [x for x in first.lines if x.startswith("[fault]")], "last_lines": first.lines[-8:]}
    if second is not None:
        if second_rc is None:
            second_rc, second_s, out_of_order = second.finish(), round(time.time() - t1, 1), True
        out["second"] = {"ended_while_the_first_ran": not out_of_order, "rc": second_rc, "seconds": second_s,
                         "error_lines": [x for x in second.lines + second.err if x.startswith("error:")],
                         "traceback": any("Traceback" in x for x in second.lines + second.err),
                         "lines": len(second.lines + second.err), "output": (second.lines + second.err)[-20:]}
    return out


def run_row(name: str, work: Path, timeout_s: float) -> dict:
    where, target, extra, limit = ROWS[name]
    cfg_file, out_dir = config_file(name, work, extra)
    shm_before = shm_dirs()
    t0 = time.time()
    p = Proc([sys.executable, "-c", CLI, where, target, str(STEP), "train", "--config", str(cfg_file)])
    proc, lines, err, readers = p.proc, p.lines, p.err, p.readers
    seen: dict[int, str] = {}
    stopped_pid = None
    hung = False
    while proc.poll() is None:
        seen |= tree(proc.pid)
        if time.time() - t0 > timeout_s:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.5)
    rc = proc.wait()
    ended = time.time()
    for t in readers:
        t.join(timeout=30)
    stop_line = next((x for x in lines if x.startswith("[fault-row] SIGSTOP")), "")
    stopped_at = float(stop_line.rsplit(" at ", 1)[1]) if stop_line else None
    if stop_line:
        stopped_pid = int(stop_line.split("(pid ", 1)[1].split(")", 1)[0])
    time.sleep(15)  # the run's processes get 15 s to go
    left = alive({p: c for p, c in seen.items() if p != stopped_pid})
    if stopped_pid is not None:  # the script's own clean-up
        try:
            p = psutil.Process(stopped_pid)
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.Error:
            pass
    ckpts = out_dir / "run" / "checkpoints"
    partial = sorted(p.name for p in ckpts.glob(".*.tmp")) if ckpts.is_dir() else []
    return {
        "row": name, "stopped": target, "before": where.split(":")[1], "step": STEP, "limit": limit,
        "rc": rc, "hung": hung, "stopped_at_s": round(stopped_at - t0, 1) if stopped_at else None,
        "ended_after_stop_s": round(ended - stopped_at, 1) if stopped_at else None,
        "error_lines": [x for x in lines + err if x.startswith("error:")],
        "fault_lines": [x for x in lines if x.startswith("[fault]")],
        "traceback": any("Traceback" in x for x in lines + err),
        "partial_checkpoints": partial,
        "complete_checkpoints": sorted(p.name for p in ckpts.glob("step_*")) if ckpts.is_dir() else [],
        "left_processes": left, "shm_left": sorted(shm_dirs() - shm_before),
        "last_lines": lines[-8:],
    }


def outcome(r: dict) -> str:
    return "HUNG" if r["hung"] else f"exit {r['rc']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    known = [*ROWS, *PLAIN_ROWS]
    ap.add_argument("--rows", default=",".join(known), help=f"comma-separated, of {', '.join(known)}")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a row may take before it counts as hung")
    record.add_out_argument(ap)
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in known]
    if bad:
        print(f"error: --rows: unknown {', '.join(bad)} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        results = []
        with tempfile.TemporaryDirectory(prefix="aar_fault_rows_") as work:
            for name in rows:
                if name in PLAIN_ROWS:
                    r = run_plain_row(name, Path(work), args.timeout)
                    results.append(r)
                    print(f"{name}: {outcome(r)} after {r['seconds']} s, "
                          f"{r['steps']} steps done; traceback {r['traceback']}", flush=True)
                    if "second" in r:
                        print(f"    the second run: exit {r['second']['rc']} after {r['second']['seconds']} s, "
                              f"{r['second']['lines']} lines, ended while the first ran: "
                              f"{r['second']['ended_while_the_first_ran']}", flush=True)
                        for x in r["second"]["error_lines"]:
                            print(f"        {x}", flush=True)
                    for x in r["fault_lines"] + r["error_lines"]:
                        print(f"    {x}", flush=True)
                    continue
                r = run_row(name, Path(work), args.timeout)
                results.append(r)
                print(f"{name}: SIGSTOP {r['stopped']} before {r['before']} of step {r['step']}: {outcome(r)}, "
                      f"{r['ended_after_stop_s']} s after the signal (limit {r['limit']}); "
                      f"traceback {r['traceback']}; partial checkpoint copies {r['partial_checkpoints'] or 'none'}; "
                      f"processes left {len(r['left_processes'])}; /dev/shm copies left {len(r['shm_left'])}",
                      flush=True)
                for x in r["fault_lines"] + r["error_lines"]:
                    print(f"    {x}", flush=True)
        rec.result = {"rows": results}
    return 0


if __name__ == "__main__":
    sys.exit(main())
