"""A bounded sample of the training episodes, kept in the run folder as the run goes, for the run viewer.

Each learner step the driver makes one call::

    sample = EpisodeSample(run_dir, tokenizer, per_step=4)        # once, at start (tokenizer: object or folder)
    sample.record(step, buffer.latest_batch.remote(sample.per_step))  # each step, after the learner's step

``record`` takes the trajectories of the step (``Trajectory`` objects, their wire bytes, or a Ray object reference
to a list of either), keeps at most ``per_step`` of them, one group after another in turn (so a step's sample
spans questions, not the members of one group), decodes them with the policy's tokenizer and writes
``RUN_DIR/episodes/step_000012.jsonl`` (one JSON object per episode) in one atomic rename: a reader never sees a
half-written file, and a step recorded again (a resumed run redoing it) replaces its file. The folder thus holds at
most ``per_step`` episodes per step. It never raises into the training loop for what it is given: a reference that
does not resolve in ``timeout_s``, a malformed record or a failed write is logged once and counted
(``failures``, ``skipped``), and the step is left out.

Decoding happens here, on the driver's side, so the files are plain text and the viewer needs no tokenizer. One
episode's record (``SCHEMA`` 1)::

    {"schema": 1, "step": 12, "trajectory_id", "group_id", "question_id", "actor_id",
     "kind": data source (question kind), "question": the prompt's "Question: ..." line, "gold": [...],
     "reward", "reward_components": {...}, "exact_match": float or null, "finish", "num_searches",
     "num_turns", "min_version", "max_version", "prompt_tokens", "response_tokens", "generated_tokens",
     "turns": [{"kind": "prompt", "text", "tokens", "loss": false},
               {"kind": "model", "text", "tokens", "loss": true,
                "runs": [{"text", "version", "tokens"}, ...]},   # consecutive tokens of one policy version
               {"kind": "search", "text": the query},          # the model turn's <search> action
               {"kind": "information", "text", "tokens", "loss": false},  # retrieved passages (masked)
               {"kind": "observation", ...},                   # any other inserted text (invalid action note)
               {"kind": "answer", "text": the answer}, ...]}   # the model turn's <answer> action

``search`` and ``answer`` entries carry no tokens of their own: they restate the action of the model turn just
before them, parsed as the episode loop parses it (``async_agent_rl.episode.parse_action``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from async_agent_rl.episode import parse_action
from async_agent_rl.records import RecordError, Trajectory
from async_agent_rl.waits import bounded

log = logging.getLogger(__name__)

SCHEMA = 1
FOLDER = "episodes"
DEFAULT_PER_STEP = 4
_QUESTION = re.compile(r"Question:\s*(.+)")
T = TypeVar("T")


def step_file(run_dir: str | Path, step: int) -> Path:
    """Where the sample of ``step`` is kept."""
    return Path(run_dir) / FOLDER / f"step_{step:06d}.jsonl"


def spread(items: Sequence[T], n: int, group_of: Callable[[T], str]) -> list[T]:
    """At most ``n`` of ``items``: the first member of each group (in order of first appearance), then the second
    of each, and so on, so that a small sample covers as many groups as it can."""
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(group_of(item), []).append(item)
    out: list[T] = []
    rank = 0
    while len(out) < n and any(rank < len(g) for g in groups.values()):
        out += [g[rank] for g in groups.values() if rank < len(g)][: n - len(out)]
        rank += 1
    return out


def episode_record(t: Trajectory, tokenizer: Any, step: int) -> dict[str, Any]:
    """The viewer's record of one trajectory (module docstring), decoded with ``tokenizer``."""
    m = t.meta

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    prompt = decode(t.prompt_ids)
    questions = _QUESTION.findall(prompt)
    turns: list[dict[str, Any]] = [{"kind": "prompt", "text": prompt, "tokens": len(t.prompt_ids), "loss": False}]
    for span in t.turns:
        ids = t.response_ids[span.start : span.end]
        text = decode(ids)
        if span.kind == "model":
            runs = []
            start = span.start
            for j in range(span.start + 1, span.end + 1):
                if j == span.end or t.versions[j] != t.versions[start]:
                    runs.append({"text": decode(t.response_ids[start:j]), "version": int(t.versions[start]),
                                 "tokens": j - start})
                    start = j
            turns.append({"kind": "model", "text": text, "tokens": span.length, "loss": True, "runs": runs})
            action, content = parse_action(text)
            if action in ("search", "answer"):
                turns.append({"kind": action, "text": content})
        else:
            kind = "information" if "<information>" in text else "observation"
            turns.append({"kind": kind, "text": text, "tokens": span.length, "loss": False})
    em = t.reward_components.get("exact_match")
    return {
        "schema": SCHEMA,
        "step": int(step),
        "trajectory_id": m.trajectory_id,
        "group_id": m.group_id,
        "question_id": m.question_id,
        "actor_id": m.actor_id,
        "kind": m.data_source or "unknown",
        "question": questions[-1].strip() if questions else "",
        "gold": list(m.gold_answers),
        "reward": float(t.reward),
        "reward_components": {k: float(v) for k, v in t.reward_components.items()},
        "exact_match": None if em is None else float(em),
        "finish": m.finish_reason,
        "num_searches": m.num_searches,
        "num_turns": m.num_turns,
        "min_version": t.min_version,
        "max_version": t.max_version,
        "prompt_tokens": len(t.prompt_ids),
        "response_tokens": len(t.response_ids),
        "generated_tokens": t.num_generated_tokens,
        "turns": turns,
    }


class EpisodeSample:
    """Keeps at most ``per_step`` training episodes per learner step in ``run_dir/episodes/`` (module docstring).

    ``tokenizer``: anything with ``decode(ids, skip_special_tokens=False)``, or the folder to load one from with
    ``transformers.AutoTokenizer`` (at the first ``record``). ``timeout_s`` bounds the wait for an object reference.
    """

    def __init__(self, run_dir: str | Path, tokenizer: Any, per_step: int = DEFAULT_PER_STEP, timeout_s: float = 10.0):
        if per_step < 1:
            raise ValueError(f"per_step must be at least 1, got {per_step}")
        self.run_dir = Path(run_dir)
        self.per_step = per_step
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self.recorded = 0  # episodes written
        self.skipped = 0  # trajectories that were not well-formed records
        self.failures = 0  # steps left out (the reference did not resolve, or the write failed)

    @property
    def tokenizer(self) -> Any:
        if isinstance(self._tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self._tokenizer))
        return self._tokenizer

    def record(self, step: int, trajectories: Any) -> int:
        """Keep a sample of ``trajectories`` (a list of ``Trajectory`` or wire bytes, or a Ray object reference to
        one) as the episodes of ``step``; returns how many were written (0 when the step was left out)."""
        try:
            items = self._resolve(trajectories)
        except Exception as e:  # noqa: BLE001 - Ray's errors are many; the training goes on without this sample
            self.failures += 1
            log.warning("episode sample of step %s left out: the trajectories did not arrive (%s: %s)", step,
                        type(e).__name__, e)
            return 0
        trajs = []
        for item in items:
            try:
                trajs.append(Trajectory.decode(item) if isinstance(item, (bytes, bytearray)) else item.validate())
            except (RecordError, AttributeError) as e:
                self.skipped += 1
                log.warning("episode sample of step %s: a trajectory skipped (%s)", step, e)
        picked = spread(trajs, self.per_step, lambda t: t.meta.group_id)
        if not picked:
            return 0
        lines = "".join(json.dumps(episode_record(t, self.tokenizer, step)) + "\n" for t in picked)
        try:
            _write_atomic(step_file(self.run_dir, step), lines)
        except OSError as e:
            self.failures += 1
            log.warning("episode sample of step %s not written: %s", step, e)
            return 0
        self.recorded += len(picked)
        return len(picked)

    def _resolve(self, trajectories: Any) -> list:
        if isinstance(trajectories, (list, tuple)):
            return list(trajectories)
        if trajectories is None:
            return []
        import ray

        if not isinstance(trajectories, ray.ObjectRef):  # never ray.get anything else (it would start Ray)
            raise TypeError(f"expected a list of trajectories or a Ray object reference, got {type(trajectories).__name__}")
        got = bounded(ray.get, trajectories, timeout_s=self.timeout_s, what="the training episodes' sample")
        return list(got or [])


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
