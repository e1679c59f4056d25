"""A training that loses two rollout nodes, as a timeline: when each loss is seen, when the lost actor is back, and
the steps around it.

    python benchmarks/node_loss_bench.py                                  # ~5 minutes on 2 cores
    python benchmarks/node_loss_bench.py --steps 10
    python benchmarks/node_loss_bench.py --out benchmarks/results/node_loss/

The scenario of ``tests/integration/test_multinode.py::test_a_rollout_node_lost_mid_run``, timed. A multi-node Ray
cluster on this machine (``tests/multinode.py``: one raylet per node, all on 127.0.0.1, token authentication on):
the head node offers ``trainer`` (the test's ``TRAINER``), three rollout nodes ``{"num_cpus": 1, "resources":
{"rollout": 1}}`` each. A short training runs from the command line (``python -m driver.cli train --config CFG``):
``configs/quickstart.yaml`` with the test's ``SMALL`` overrides, 2 rollout actors placed by
``cluster.rollout_resources={rollout: 1}`` (one node each, the third node spare), the learner and the replay buffer
by ``{trainer: 1}``, ``weight_sync.method=object_store``, ``buffer.max_staleness`` ``--eta`` (1), ``--steps`` RL
steps (9). Its tiny world and model are built by the train command's prepare step into a temporary folder, which
also holds the run's output and is removed on every exit.

After step 2 the node of rollout actor 0 is removed (its raylet, object store and workers killed, as a machine that
is lost): Ray restarts the actor on the spare node. At the first step after the ``[fault] rollout actor 0
restarted`` line the node of rollout actor 1 is removed: no node is left with room, and the run goes on with one
actor. Every console line of the run (stdout and stderr) is read with its wall-clock time as it arrives, and
``metrics.jsonl``'s rows at the end.

Reported, in seconds from the first removal: the removal, the first ``[fault]`` line naming the lost node, the
``restarted`` line, each step's line, the second removal, the ``no live node has room`` line, the end of the run;
then the detection delay (removal to the first ``[fault]`` line), the restart delay (removal to ``restarted``),
steps/s before the first loss, between the losses and after the second (one actor), the lost episodes, the largest
staleness of each step's batch (at most ``--eta``) and the run's exit code.

``--out DIR`` also writes DIR/result.json (the timeline and the numbers, as printed, and the run's stdout with times),
DIR/output.txt (what was printed) and DIR/run.json (command, commit, versions, cores, load average):
``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # python benchmarks/node_loss_bench.py: the repository's packages and tests/
    sys.path.insert(1, str(REPO))

if __package__:  # imported as benchmarks.node_loss_bench
    from benchmarks import record
else:  # run as python benchmarks/node_loss_bench.py: this folder is sys.path[0]
    import record

from tests.integration.test_multinode import SMALL, TRAINER  # noqa: E402  (the scenario the test checks)
from tests.multinode import LocalNodes  # noqa: E402

ROLLOUT_NODE = {"num_cpus": 1, "resources": {"rollout": 1}}
ROLLOUT_NODES = ("r1", "r2", "r3")
STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s")
RUN_TIMEOUT_S = 1500.0  # the whole run, from its start to its exit
WAIT_S = {"step 2": 900.0, "actor 0's restart": 400.0, "a step after the restart": 300.0}


class Console:
    """The run's stdout and stderr, each line with the wall-clock time it arrived (``time.time()``), read by a
    thread per stream as the lines come."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[tuple[float, str, str]] = []  # (time, "out" or "err", line)
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(s, name), daemon=True)
                         for s, name in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for t in self._readers:
            t.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            with self._cond:
                self.lines.append((time.time(), name, line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def out(self) -> list[tuple[float, str]]:
        with self._cond:
            return [(t, x) for t, s, x in self.lines if s == "out"]

    def wait_for(self, match, what: str, timeout_s: float) -> tuple[float, str]:
        """The first stdout line for which ``match(line, its time)`` holds: (its time, the line); an error if the
        run ends or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for t, s, x in self.lines:
                    if s == "out" and match(x, t):
                        return t, x
                if self.proc.poll() is not None and not any(r.is_alive() for r in self._readers):
                    raise RuntimeError(f"{what}: the run ended first (exit {self.proc.returncode}):\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{what}: not within {timeout_s:g} s:\n{self.tail()}")
                self._cond.wait(min(left, 1.0))

    def join(self, timeout_s: float = 30.0) -> None:
        for t in self._readers:
            t.join(timeout_s)

    def tail(self, n: int = 40) -> str:
        return "\n".join(f"[{s}] {x}" for _, s, x in self.lines[-n:])


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_DEAD = "(raylet) The node with node id: "  # Ray's own line when its health check declares a node dead


def run_line(line: str) -> str | None:
    """The line as kept in the result: the run's own lines, and Ray's line declaring a node dead (its colour codes
    taken out); None for what Ray forwards from the workers' logs (engine logs, raylet state dumps). A line of the
    run's onto which a forwarded line was written (the driver's print and Ray's log thread share stdout) is kept up
    to the forwarded part."""
    plain = ANSI.sub("", line)
    if plain.startswith(RAY_DEAD):
        return plain[:160]
    if not line.strip() or line[0] in " \t(\x1b":
        return None
    return line.split("\x1b", 1)[0].rstrip()


def step_of(line: str) -> int | None:
    m = STEP_LINE.match(line)
    return int(m.group(1)) if m else None


def write_config(tmp: Path, address: str, steps: int, eta: int) -> Path:
    """The run's config: the quickstart's with the test's overrides, every input and output in ``tmp``."""
    from async_agent_rl.config import load_config

    world = tmp / "world"
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SMALL, f"run.output_dir={tmp / 'runs'}", "run.name=run",
        f"model.path={tmp / 'model'}", "model.build_if_missing=true",
        f"data.world_dir={world}", "data.make_world_if_missing=true",
        f"data.train_files={json.dumps([str(world / 'train.parquet')])}",
        f"data.test_files={json.dumps([str(world / 'test.parquet')])}",
        f"data.corpus_file={world / 'corpus.jsonl'}",
        "rollout.num_actors=2", f"buffer.max_staleness={eta}", f"learner.total_steps={steps}",
        "cluster.rollout_resources={rollout: 1}", "cluster.learner_resources={trainer: 1}",
        "cluster.buffer_resources={trainer: 1}", "weight_sync.method=object_store",
        f"cluster.ray_address={address}"])  # fmt: skip
    return cfg.save(tmp / "cfg.yaml")


def rollout_nodes(nodes: LocalNodes) -> dict[int, str]:
    """Rollout actor index -> the node Ray has it on (its live incarnation), by Ray's actor table."""
    out: dict[int, str] = {}
    for a in sorted(nodes.actors(), key=lambda a: a["state"] == "DEAD"):
        m = re.fullmatch(r"rollout-(\d+)", a["name"] or "")
        if m and a["state"] != "DEAD":
            out.setdefault(int(m.group(1)), a["node"])
    return out


def run_scenario(tmp: Path, steps: int, eta: int) -> dict:
    """The training with its two node losses; the raw times (wall clock), the console and the run's files."""
    events: dict[str, float] = {}
    with LocalNodes(TRAINER, {name: ROLLOUT_NODE for name in ROLLOUT_NODES}) as nodes:
        cfg = write_config(tmp, nodes.address, steps, eta)
        events["start"] = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "driver.cli", "train", "--config", str(cfg)], cwd=REPO,
                                env=nodes.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        console = Console(proc)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            events["step 2"], _ = console.wait_for(lambda x, t: (step_of(x) or 0) >= 2, "step 2", WAIT_S["step 2"])
            placed = rollout_nodes(nodes)
            first, second = placed.get(0), placed.get(1)
            assert first in ROLLOUT_NODES and second in ROLLOUT_NODES and first != second, placed
            lost_ids = {0: nodes.node_ids[first], 1: nodes.node_ids[second]}
            events["remove 1"] = time.time()
            nodes.remove(first)
            events["removed 1"] = time.time()
            restarted, _ = console.wait_for(lambda x, t: x.startswith("[fault] rollout actor 0 restarted"),
                                            "actor 0's restart", WAIT_S["actor 0's restart"])
            events["step after restart"], _ = console.wait_for(
                lambda x, t: step_of(x) is not None and t >= restarted, "a step after the restart",
                WAIT_S["a step after the restart"])
            placed_after = rollout_nodes(nodes)
            events["remove 2"] = time.time()
            nodes.remove(second)
            events["removed 2"] = time.time()
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            events["exit"] = time.time()
        finally:
            if proc.poll() is None:  # this benchmark's own run, in a session of its own
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            console.join()
    run_dir = tmp / "runs" / "run"
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    return {"events": events, "rc": rc, "console": console.lines, "rows": rows, "summary": summary,
            "placed": {"before": placed, "after_restart": placed_after, "spare": sorted(set(ROLLOUT_NODES) - {first, second})},
            "lost_ids": lost_ids}


def rate(times: list[float], start: float, end: float) -> dict:
    """The steps whose line came in ``(start, end]``: their number, per second of the window (stalls included), and
    the pace between consecutive ones inside it (steps per second of the intervals between their lines)."""
    inside = sorted(t for t in times if start < t <= end)
    ends = sorted(t for t in times if start <= t <= end)  # a step line at the window's start opens an interval
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return {"steps": len(inside), "window_s": round(end - start, 1),
            "steps_per_s": round(len(inside) / (end - start), 3) if end > start else None,
            "intervals": len(gaps), "pace_steps_per_s": round(len(gaps) / sum(gaps), 3) if gaps else None}


def timeline(raw: dict, eta: int) -> dict:
    """The run's events in seconds from the first removal, and the numbers of the module docstring."""
    ev, lines = raw["events"], raw["console"]
    t0 = ev["remove 1"]
    out_lines = [(t, x) for t, s, x in lines if s == "out"]
    rel = lambda t: round(t - t0, 1) if t is not None else None  # noqa: E731

    def first(match) -> tuple[float | None, str | None]:
        return next(((t, x) for t, x in out_lines if match(x)), (None, None))

    lost0, lost1 = raw["lost_ids"][0][:8], raw["lost_ids"][1][:8]
    detect_t, detect_line = first(lambda x: x.startswith("[fault]") and lost0 in x)
    restart_t, restart_line = first(lambda x: x.startswith("[fault] rollout actor 0 restarted"))
    detect2_t, detect2_line = first(lambda x: x.startswith("[fault]") and lost1 in x)
    any_fault_t, any_fault_line = first(lambda x: x.startswith("[fault]"))
    dead = {k: first(lambda x, i=raw["lost_ids"][k]: RAY_DEAD in ANSI.sub("", x) and i in x)[0] for k in (0, 1)}
    retire_t, retire_line = first(lambda x: x.startswith("[fault] rollout actor 1: no live node has room"))
    step_times: dict[int, float] = {}
    for t, x in out_lines:
        n = step_of(x)
        if n is not None:
            step_times.setdefault(n, t)
    end_t = ev.get("exit") or (lines[-1][0] if lines else None)

    events = [(ev["remove 1"], "node of rollout actor 0 removed", None)]
    events += [(any_fault_t, "first [fault] line", any_fault_line) if any_fault_t != detect_t else (None, "", None),
               (dead[0], "Ray marks the node dead (its health check)", None),
               (dead[1], "Ray marks the second node dead", None),
               (detect_t, "first [fault] line naming the lost node", detect_line),
               (restart_t, "[fault] rollout actor 0 restarted", restart_line),
               (ev["remove 2"], "node of rollout actor 1 removed", None),
               (detect2_t, "first [fault] line naming the second lost node", detect2_line),
               (retire_t, "[fault] rollout actor 1: no live node has room", retire_line),
               (end_t, f"run ended (exit {raw['rc']})", None)]
    rows = {r["step"]: r for r in raw["rows"]}
    for n, t in step_times.items():
        r = rows.get(n, {})
        events.append((t, f"step {n}", f"staleness max {r.get('learner', {}).get('staleness_max')}, episodes "
                                       f"{r.get('episodes_total')}, lost {r.get('lost_episodes')}, evicted "
                                       f"{r.get('buffer_evicted')}, batch wait {r.get('sample_wait_s', 0):.1f} s"))
    events = sorted((e for e in events if e[0] is not None), key=lambda e: e[0])

    times = list(step_times.values())
    first_step = step_times.get(1, ev["start"])
    last_step = max(times) if times else ev["remove 2"]
    staleness = {n: rows[n]["learner"]["staleness_max"] for n in sorted(rows)}
    return {
        "timeline": [{"t_s": rel(t), "event": what, **({"detail": d} if d else {})} for t, what, d in events],
        "run_start_s": rel(ev["start"]),
        "first_fault_line_s": rel(any_fault_t),
        "ray_marks_dead_s": [rel(dead[0]), round(dead[1] - ev["remove 2"], 1) if dead[1] else None],
        "detection_delay_s": rel(detect_t),
        "restart_delay_s": rel(restart_t),
        "restart_after_detection_s": round(restart_t - detect_t, 1) if restart_t and detect_t else None,
        "second_detection_delay_s": round(detect2_t - ev["remove 2"], 1) if detect2_t else None,
        "give_up_delay_s": round(retire_t - ev["remove 2"], 1) if retire_t else None,
        "steps_per_s": {
            "before_first_loss": rate(times, first_step, ev["remove 1"]),  # the steps after step 1, from its line
            "between_losses": rate(times, ev["remove 1"], ev["remove 2"]),
            "after_second_loss": rate(times, ev["remove 2"], last_step),
            "after_give_up_one_actor": rate(times, retire_t, last_step) if retire_t else None,
        },
        "step_1_after_start_s": round(first_step - ev["start"], 1) if 1 in step_times else None,
        "lost_episodes": raw["summary"].get("lost_episodes", raw["rows"][-1]["lost_episodes"] if raw["rows"] else None),
        "actor_restarts": raw["summary"].get("actor_restarts"),
        "staleness_max_by_step": staleness,
        "staleness_within_eta": bool(staleness) and all(v <= eta for v in staleness.values()),
        "eta": eta,
        "steps_done": len(raw["rows"]),
        "steps_asked": None,
        "exit_code": raw["rc"],
        "placement": raw["placed"],
        "stdout": [[rel(t), kept] for t, x in out_lines if (kept := run_line(x)) is not None],
        "stdout_lines_forwarded_by_ray": sum(1 for _, x in out_lines if run_line(x) is None),
        "stderr_lines": sum(1 for _, s, _ in lines if s == "err"),
        "stderr_tail": [x for _, s, x in lines if s == "err"][-20:],
    }


def show(res: dict) -> None:
    print(f"\ntimeline (seconds from the first node removal; the run started at {res['run_start_s']} s):")
    print("| t (s) | event | detail |\n|---:|---|---|")
    for e in res["timeline"]:
        print(f"| {e['t_s']:+.1f} | {e['event']} | {e.get('detail', '')} |")
    print(f"\nRay marks the nodes dead {res['ray_marks_dead_s'][0]} s and {res['ray_marks_dead_s'][1]} s after their "
          f"removal; detection delay {res['detection_delay_s']} s, restart delay {res['restart_delay_s']} s "
          f"({res['restart_after_detection_s']} s after detection); second loss seen after "
          f"{res['second_detection_delay_s']} s, actor 1 given up after {res['give_up_delay_s']} s")
    print("steps/s (the steps whose line came in the window / its length; the pace: intervals between consecutive "
          "step lines inside it / their sum):")
    for k, v in res["steps_per_s"].items():
        if v:
            print(f"  {k:24s} {v['steps']} steps in {v['window_s']} s: {v['steps_per_s']} steps/s; pace "
                  f"{v['pace_steps_per_s']} steps/s over {v['intervals']} interval(s)")
    print(f"lost episodes {res['lost_episodes']}, restarts {res['actor_restarts']}, steps {res['steps_done']}/"
          f"{res['steps_asked']}, staleness max by step {list(res['staleness_max_by_step'].values())} (eta "
          f"{res['eta']}: {'held' if res['staleness_within_eta'] else 'EXCEEDED'}), exit code {res['exit_code']}")


def bench(steps: int, eta: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="aar_nodeloss_", ignore_cleanup_errors=True) as tmp:
        raw = run_scenario(Path(tmp), steps, eta)
        res = timeline(raw, eta)
    res["steps_asked"] = steps
    res["load_average"] = record.load_average()
    show(res)
    if raw["rc"] != 0:
        print("the run's last stderr lines:\n" + "\n".join(res["stderr_tail"]))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=9, help="learner.total_steps (at least 5: two losses happen by step 4)")
    p.add_argument("--eta", type=int, default=1, help="buffer.max_staleness")
    record.add_out_argument(p)
    a = p.parse_args(argv)
    if a.steps < 5 or a.eta < 0:
        print(f"error: --steps must be at least 5 and --eta at least 0, got {a.steps} and {a.eta}", file=sys.stderr)
        return 2
    with record.Recording(a.out, __file__, argv, vars(a)) as rec:
        rec.result = bench(a.steps, a.eta)
    return 0 if rec.result and rec.result["exit_code"] == 0 else 1


def _interrupted(signum, frame):  # SIGTERM unwinds like Ctrl-C: the run, the cluster and the temp folder are ended
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    signal.signal(signal.SIGTERM, _interrupted)
    sys.exit(main())
