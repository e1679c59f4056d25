"""What a run says and writes as it goes: the console lines (``RunLog.say``), the JSON-lines files of the run folder
(``RunLog.write``), the per-step learning signals (``LearningSignals``) and the closing lines of a finished run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

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
