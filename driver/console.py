"""What a run says and writes as it goes: the console lines (``RunLog.say``; each in words, never a raw Python
structure), the JSON-lines files of the run folder (``RunLog.write``), the per-step learning signals
(``LearningSignals``), the start lines and the closing lines of a finished run; and where everything else goes
(``logs_to_file``: library, engine and Ray logs to the run's log file, the terminal keeping the run's own lines).
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from async_agent_rl.stats import BufferStats, LearnerStats, LearningStats, RolloutStats, RunTotals

LOG_FILE = "train.log"


class RunLog:
    """Appends JSON lines and prints one progress line per step."""

    def __init__(self, run_dir: Path, quiet: bool = False):
        self.run_dir = run_dir
        self.quiet = quiet
        run_dir.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, record: dict) -> None:
        with open(self.run_dir / name, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)


@contextmanager
def logs_to_file(path: Path) -> Iterator[None]:
    """For the run: library and engine logs (INFO and up) go to ``path``; the terminal keeps the run's own lines
    (``RunLog.say``) and warnings. Ray's driver-side logger (its own console handler, not propagated) goes to the
    file too and keeps only errors on the terminal. Progress bars of transformers are turned off. What the run says
    on the terminal itself (a ``[fault]`` or ``[warn]`` line) it logs at INFO, so the file has it and the terminal
    does not show it twice."""
    def consoles(logger: logging.Logger) -> list[tuple[logging.Handler, int]]:
        return [(h, h.level) for h in logger.handlers if isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)]

    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    handler, ray_handler = logging.FileHandler(path), logging.FileHandler(path)
    for h in (handler, ray_handler):
        h.setFormatter(fmt)
        h.setLevel(logging.DEBUG if root.level <= logging.DEBUG else logging.INFO)
    quieted = [(h, old, logging.WARNING) for h, old in consoles(root)]
    quieted += [(h, old, logging.ERROR) for h, old in consoles(ray_logger)]
    level = root.level
    for h, _, floor in quieted:
        h.setLevel(max(h.level, floor))
    root.addHandler(handler)
    ray_logger.addHandler(ray_handler)
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    progress_bars(False)
    try:
        yield
    finally:
        root.removeHandler(handler)
        ray_logger.removeHandler(ray_handler)
        handler.close()
        ray_handler.close()
        root.setLevel(level)
        for h, old, _ in quieted:
            h.setLevel(old)
        progress_bars(True)


def progress_bars(on: bool) -> None:
    """Turn the progress bars of Hugging Face's libraries on or off, without importing transformers (seconds of a
    run's start): it reads the hub's setting when it is imported, and its own switch is set if it was."""
    from huggingface_hub import utils as hub

    (hub.enable_progress_bars if on else hub.disable_progress_bars)()
    loaded = sys.modules.get("transformers.utils.logging")
    if loaded is not None:
        (loaded.enable_progress_bar if on else loaded.disable_progress_bar)()


def start_lines(num_ranks: int, rollout: Sequence[dict]) -> list[str]:
    """The ``[start]`` lines of the replay buffer, the learner and each rollout actor (``rollout``: what each
    actor's ``setup`` reported: its index, node, training questions and the rows and questions it skipped)."""
    lines = ["[start] replay buffer", f"[start] learner: {num_ranks} rank{'s' if num_ranks != 1 else ''}"]
    for info in rollout:
        where = f" on node {info['node']}" if info.get("node") else ""
        skipped = [f"{n:,} bad row{'s' if n != 1 else ''} skipped (data.on_bad_row)" for n in [info.get("skipped_rows", 0)] if n]
        skipped += [f"{n:,} question{'s' if n != 1 else ''} longer than data.max_prompt_length skipped"
                    for n in [info.get("skipped_too_long", 0)] if n]
        lines.append(f"[start] rollout actor {info['index']}{where}: {info['examples']:,} questions"
                     + "".join(f"; {s}" for s in skipped))
    return lines


def wait_line(seconds: float, buffer: BufferStats) -> str:
    """The line said once a minute while the learner gets no batch: why, in the buffer's and admission's counts."""
    a = buffer.admission
    oldest = f"the oldest open at version {a.oldest_open_version}" if a.groups_open else "none open"
    return (f"[wait] no batch for {seconds:.0f} s: buffer size {buffer.size}, ready groups {buffer.ready_groups}, "
            f"pending {buffer.pending_groups}, evicted {buffer.evicted}; admission: {a.started} episodes started "
            f"({a.accepted} accepted, {a.rejected} rejected, {a.evicted} evicted), {a.running} running; "
            f"{a.groups_started} groups started ({a.groups_consumed} consumed, {a.groups_dropped} dropped, "
            f"{a.groups_open} open, {oldest})")


def duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def eval_brief(rec: dict) -> dict:
    """Exact match and searches per question by question kind (``all`` included) of one evaluation record."""
    return {k: {"exact_match": v["exact_match"], "searches_per_question": v["searches_per_question"], "n": v["n"]}
            for k, v in rec.items() if isinstance(v, dict) and "exact_match" in v}


def closing_lines(summary: dict, start: dict | None, end: dict | None, plots: list[Path], run_dir: Path) -> list[str]:
    """The run's last lines on the terminal: held-out exact match from the start to the end, by question kind, and
    where the results are."""
    failed = f", {summary['search_errors']} failed" if summary.get("search_errors") else ""
    lines = [f"[done] {summary['steps']} RL steps in {duration(summary['train_seconds'])}; "
             f"{summary.get('searches', 0)} searches{failed}"]
    if start and end:
        for kind in [k for k in end if isinstance(end[k], dict) and "exact_match" in end[k]]:
            a, b = start.get(kind), end[kind]
            if not isinstance(a, dict):
                continue
            name = "held-out" if kind == "all" else f"  {kind}"
            lines.append(
                f"[done] {name:<14} exact match {a['exact_match']:.3f} -> {b['exact_match']:.3f} "
                f"({b['exact_match'] - a['exact_match']:+.3f})   searches/question {a['searches_per_question']:.2f} "
                f"-> {b['searches_per_question']:.2f}   (n={b['n']})")
    if summary.get("dropped_at_stop"):
        lines.append(f"[done] {summary['dropped_at_stop']} finished trajectories dropped at the stop: the buffer was "
                     "full and the learner done")
    lines.append(f"[done] results in {run_dir}: summary.json, metrics.jsonl, eval.jsonl, final/, {LOG_FILE}")
    if plots:
        lines.append(f"[done] plots: {', '.join(str(p) for p in plots)}")
    return lines


class LearningSignals:
    """Per-step learning signals from the components' running totals: the share of completed groups whose rewards
    were all equal (no GRPO signal), and the rollout reward, exact match and searches by question kind over the
    episodes finished since the previous step. Warns when nearly every group has had equal rewards for several
    steps in a row: the policy is then too sure of itself (or too weak) for group-relative advantages."""

    FLAT_SHARE = 0.9  # this share of equal-reward groups or more ...
    FLAT_STEPS = 5  # ... for this many steps in a row: warn
    KIND_TOTALS = {"reward": "reward_sum", "exact_match": "exact_match_sum", "searches": "searches"}

    def __init__(self) -> None:
        self._groups = (0, 0)  # (completed, zero variance) at the previous step
        self._kinds = RunTotals()  # per actor, {(kind, total): value}
        self._previous: dict = {}  # the run's totals by (kind, total) at the previous step
        self._flat_steps = 0
        self._pending: list[str] = []

    def resumed(self, buffer: BufferStats) -> None:
        """A resumed run: the restored buffer's group counts are the previous step's, so the first step after the
        resume counts only its own groups (it counted every group of the run before)."""
        self._groups = (buffer.groups_completed, buffer.groups_zero_variance)

    def update(self, rollout: Sequence[RolloutStats], buffer: BufferStats, learner: LearnerStats) -> LearningStats:
        completed, flat = buffer.groups_completed, buffer.groups_zero_variance
        d_completed, d_flat = completed - self._groups[0], flat - self._groups[1]
        self._groups = (completed, flat)
        share = d_flat / d_completed if d_completed > 0 else None
        for stats in rollout:
            self._kinds.report(f"actor{stats.index}", stats.incarnation,
                               {(kind, key): v for kind, c in stats.by_kind.items() for key, v in c.items()})
        totals, prev = self._kinds.run(), self._previous
        by_kind = {}
        for kind in sorted({kind for kind, _ in totals}):
            n = totals.get((kind, "finished"), 0.0) - prev.get((kind, "finished"), 0.0)
            if n > 0:
                by_kind[kind] = {"episodes": int(n), **{
                    name: (totals.get((kind, total), 0.0) - prev.get((kind, total), 0.0)) / n
                    for name, total in self.KIND_TOTALS.items()}}
        self._previous = totals
        if share is not None:
            self._flat_steps = self._flat_steps + 1 if share >= self.FLAT_SHARE else 0
            if self._flat_steps == self.FLAT_STEPS:
                self._pending.append(
                    f"{share:.0%} of the groups completed in each of the last {self.FLAT_STEPS} steps had equal "
                    "rewards, so group-relative advantages are zero and RL learns nothing from them. Raise "
                    "rollout.temperature (more varied answers) or rollout.group_size (more chances of a spread), or "
                    "change the warm start (too weak: all wrong; too strong: all right)")
        return LearningStats(zero_variance_share=share, entropy=learner.entropy, by_kind=by_kind)

    def warnings(self) -> list[str]:
        out, self._pending = self._pending, []
        return out
