"""What the run viewer reads from a run folder, as JSON-ready data: files only, during or after a run.

- ``metrics.jsonl`` (one record per learner step) and ``eval.jsonl`` (one per held-out evaluation) become the
  page's series (``RunFiles.series``): reward and exact match, held-out exact match (all questions and by question
  kind), throughput, staleness and tool latency.
- ``episodes/step_*.jsonl`` (``monitoring.episode_sample``) become the episode browser: summaries with filters
  (``RunFiles.episodes``) and one episode whole (``RunFiles.episode``).

A run writes while the page reads: every file is read afresh when its size or modification time changed, a last
line without its newline is taken as still being written (left for the next read), and a line that is not a JSON
object is skipped and counted (``skipped``, by file), never fatal. Nothing read is ever executed or evaluated;
``config.yaml`` is read with ``yaml.safe_load``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from monitoring.episode_sample import FOLDER as EPISODES

_STEP_FILE = re.compile(r"^step_(\d{6,})\.jsonl$")
MAX_EPISODES_PAGE = 500


class QueryError(ValueError):
    """A request's parameter is not one the viewer understands (the server answers 400 with this message)."""


@dataclass
class _Cached:
    key: tuple[int, int]
    rows: list[dict]
    bad: int
    partial: bool


@dataclass
class RunFiles:
    """Reads one run folder (see the module docstring)."""

    run_dir: Path
    _cache: dict[Path, _Cached] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)

    # ------------------------------------------------------------------------------------------- reading
    def rows(self, path: Path) -> list[dict]:
        """The JSON objects of a JSON-lines file ([] when it is missing), bad lines skipped and counted."""
        try:
            st = path.stat()
        except OSError:
            self._cache.pop(path, None)
            return []
        key = (st.st_size, st.st_mtime_ns)
        hit = self._cache.get(path)
        if hit is not None and hit.key == key:
            return hit.rows
        try:
            data = path.read_bytes()
        except OSError:
            return hit.rows if hit is not None else []
        partial = bool(data) and not data.endswith(b"\n")
        lines = data.split(b"\n")
        if partial:
            lines = lines[:-1]  # still being written: read again once it is whole
        rows, bad = [], 0
        for raw in lines:
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
        self._cache[path] = _Cached(key, rows, bad, partial)
        return rows

    def skipped(self) -> dict[str, int]:
        """Lines skipped as not JSON objects, by file (relative to the run folder), among the files read so far."""
        return {str(p.relative_to(self.run_dir)): c.bad for p, c in sorted(self._cache.items()) if c.bad}

    def step_files(self) -> dict[int, Path]:
        folder = self.run_dir / EPISODES
        out = {}
        try:
            for p in folder.iterdir():
                m = _STEP_FILE.match(p.name)
                if m:
                    out[int(m.group(1))] = p
        except OSError:
            pass
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        """The header: the run's name, its planned steps, the latest step, whether it finished."""
        config: dict = {}
        try:
            loaded = yaml.safe_load((self.run_dir / "config.yaml").read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            pass
        metrics = self.rows(self.run_dir / "metrics.jsonl")
        summary: Optional[dict] = None
        try:
            loaded = json.loads((self.run_dir / "summary.json").read_text(encoding="utf-8"))
            summary = loaded if isinstance(loaded, dict) else None
        except (OSError, UnicodeDecodeError, ValueError):
            pass

        def cfg(section: str, key: str) -> Any:
            part = config.get(section)
            return part.get(key) if isinstance(part, dict) else None

        return {
            "run_dir": str(self.run_dir),
            "name": self.run_dir.name,
            "total_steps": cfg("learner", "total_steps"),
            "algorithm": cfg("algorithm", "policy_loss"),
            "model": cfg("model", "path"),
            "step": _num(metrics[-1].get("step")) if metrics else None,
            "elapsed_s": _num(metrics[-1].get("elapsed_s")) if metrics else None,
            "finished": summary is not None,
            "summary": {k: summary.get(k) for k in ("steps", "episodes", "train_seconds", "exact_match_start",
                                                     "exact_match_end") if k in summary} if summary else None,
            "episode_steps": len(self.step_files()),
            "skipped": self.skipped(),
        }

    def series(self) -> dict[str, Any]:
        """Per-step series (``null`` where a record lacks the value) and the held-out evaluations."""
        rows = [r for r in self.rows(self.run_dir / "metrics.jsonl") if _num(r.get("step")) is not None]
        evals = self.rows(self.run_dir / "eval.jsonl")
        steps = [_num(r["step"]) for r in rows]
        learner = [r.get("learner") if isinstance(r.get("learner"), dict) else {} for r in rows]
        by_kind = [_get(r, "learning", "by_kind") or {} for r in rows]
        kinds = sorted({k for x in by_kind if isinstance(x, dict) for k in x}
                       | {k for e in evals for k, v in e.items() if isinstance(v, dict) and "exact_match" in v}
                       - {"all"})
        # The rollout actors' totals reach the driver at its polls, not at every step: a record whose totals did not
        # move has no rate of its own (null), and the next that moved gets the rate since the last that moved.
        episodes_rate, tool_latency = [], []
        prev: dict = {}
        moved: dict = {}
        for r in rows:
            d_eps = _delta(r, moved, "episodes_total")
            d_t = _delta(r, moved, "elapsed_s")
            episodes_rate.append(d_eps / d_t if d_eps and d_t else None)
            if d_eps:
                moved = r
            d_search = _delta(r, prev, "searches_total")
            wait = _num(r.get("rollout_tool_wait_s"))
            tool_latency.append(wait / d_search if wait is not None and d_search else None)
            prev = r
        last_hist = next((r["buffer_staleness_histogram"] for r in reversed(rows)
                          if isinstance(r.get("buffer_staleness_histogram"), dict)), {})
        histogram = sorted((int(k), int(v)) for k, v in last_hist.items()
                           if str(k).lstrip("-").isdigit() and _num(v) is not None)
        eval_points = []
        for e in evals:
            step = _num(e.get("step"))
            em = _num(_get(e, "all", "exact_match"))
            if step is None or em is None:
                continue
            eval_points.append({"step": step, "when": str(e.get("when", "")), "exact_match": em,
                                "by_kind": {k: _num(_get(e, k, "exact_match")) for k in kinds if isinstance(e.get(k), dict)}})
        return {
            "steps": steps,
            "kinds": kinds,
            "reward": {
                "batch_reward": [_num(r.get("batch_reward")) for r in rows],
                "rollout_exact_match": [_num(r.get("rollout_exact_match")) for r in rows],
            },
            "rollout_em_by_kind": {k: [_num(_get(x, k, "exact_match")) if isinstance(x, dict) else None
                                       for x in by_kind] for k in kinds},
            "eval": eval_points,
            "throughput": {
                "episodes_per_s": episodes_rate,
                "episodes_per_s_average": [_num(r.get("episodes_per_s")) for r in rows],
                "gen_tokens_per_s_average": [_num(r.get("gen_tokens_per_s")) for r in rows],
                "learner_tokens_per_s": [_num(x.get("tokens_per_s")) for x in learner],
            },
            "staleness": {
                "histogram": [{"staleness": k, "count": v} for k, v in histogram],
                "batch_mean": [_num(x.get("staleness_mean")) for x in learner],
                "batch_max": [_num(x.get("staleness_max")) for x in learner],
            },
            "tool": {
                "seconds_per_search": tool_latency,
                "wait_share": [_num(r.get("rollout_tool_wait_share")) for r in rows],
            },
            "skipped": self.skipped(),
        }

    # ------------------------------------------------------------------------------------------- episodes
    def episodes(self, kind: str = "", reward: str = "", step_min: str = "", step_max: str = "",
                 offset: str = "0", limit: str = "100") -> dict[str, Any]:
        """Episode summaries (no turns), newest step first, filtered: ``kind`` (a question kind, "" for all),
        ``reward`` ("" all, "positive" > 0, "zero" == 0 or below), ``step_min``/``step_max`` (inclusive); paged by
        ``offset`` and ``limit`` (at most ``MAX_EPISODES_PAGE``). ``QueryError`` on a malformed parameter."""
        lo, hi = _int_param("step_min", step_min), _int_param("step_max", step_max)
        first = _int_param("offset", offset) or 0
        size = _int_param("limit", limit)
        size = 100 if size is None else size
        if first < 0 or not 1 <= size <= MAX_EPISODES_PAGE:
            raise QueryError(f"offset must be >= 0 and limit between 1 and {MAX_EPISODES_PAGE}")
        if reward not in ("", "positive", "zero"):
            raise QueryError(f"reward={reward!r}: allowed '', 'positive', 'zero'")
        files = self.step_files()
        kinds: set[str] = set()
        matched = []
        for step in sorted(files, reverse=True):
            for i, ep in enumerate(self.rows(files[step])):
                ep_kind = str(ep.get("kind", ""))
                kinds.add(ep_kind)
                r = _num(ep.get("reward"))
                if (kind and ep_kind != kind) or (lo is not None and step < lo) or (hi is not None and step > hi):
                    continue
                if (reward == "positive" and not (r is not None and r > 0)) or (reward == "zero" and not (r is not None and r <= 0)):
                    continue
                matched.append(_summary(ep, step, i))
        return {
            "total": len(matched),
            "offset": first,
            "episodes": matched[first : first + size],
            "kinds": sorted(kinds),
            "steps": [min(files), max(files)] if files else None,
            "skipped": self.skipped(),
        }

    def episode(self, step: str, index: str) -> Optional[dict[str, Any]]:
        """One episode whole: the ``index``-th record of step ``step``'s file; None when there is none."""
        s, i = _int_param("step", step), _int_param("index", index)
        if s is None or i is None:
            raise QueryError("step and index are required")
        path = self.step_files().get(s)
        rows = self.rows(path) if path is not None else []
        if not 0 <= i < len(rows):
            return None
        return {**rows[i], "step": s, "index": i}


def _summary(ep: dict, step: int, index: int) -> dict[str, Any]:
    turns = ep.get("turns") if isinstance(ep.get("turns"), list) else []
    return {
        "step": step,
        "index": index,
        "kind": str(ep.get("kind", "")),
        "question": str(ep.get("question", "")),
        "reward": _num(ep.get("reward")),
        "exact_match": _num(ep.get("exact_match")),
        "finish": str(ep.get("finish", "")),
        "searches": sum(1 for t in turns if isinstance(t, dict) and t.get("kind") == "search"),
        "turns": sum(1 for t in turns if isinstance(t, dict) and t.get("kind") == "model"),
        "versions": [_num(ep.get("min_version")), _num(ep.get("max_version"))],
        "trajectory_id": str(ep.get("trajectory_id", "")),
    }


def _num(v: Any) -> Optional[float]:
    """``v`` as a finite number (ints stay ints), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    return v


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _delta(r: dict, prev: dict, key: str) -> Optional[float]:
    now = _num(r.get(key))
    if now is None:
        return None
    before = _num(prev.get(key)) if prev else 0
    return None if before is None else now - before


def _int_param(name: str, value: str) -> Optional[int]:
    if value in ("", None):
        return None
    try:
        return int(value)
    except ValueError:
        raise QueryError(f"{name}={value!r} is not an integer") from None
