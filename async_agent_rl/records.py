"""Typed trajectory records and their msgpack wire format.

A trajectory is one episode exactly as the model saw it:

    prompt_ids | response_ids
                 [model turn][observation][model turn][observation][model turn]

Every array named ``*_per_token`` below is aligned with ``response_ids`` (same length):

- ``loss_mask``           1 on model-generated tokens, 0 on observation tokens. Prompt tokens carry no loss and
                          are not part of the array (``full_loss_mask`` prepends the zeros).
- ``behavior_logprobs``   log-prob of each generated token under the policy that sampled it (the inference
                          engine's value); 0.0 on observation tokens.
- ``versions``            policy version that produced each generated token; ``OBS_VERSION`` (-1) on observation
                          tokens. A weight update in the middle of a turn gives later tokens the new version.

``turns`` lists the spans ``[start, end)`` of ``response_ids`` with their kind, in order, covering the response.
An episode always ends on a model turn (docs/ALGORITHMS.md section 2).

Wire format: a msgpack map with ``schema`` = ``SCHEMA_VERSION``; token arrays travel as little-endian raw bytes
(int32 ids and versions, uint8 mask, float32 log-probs), so a 2k-token record encodes in microseconds. Decoding
checks the schema version and that every per-token array has the length of ``response_ids``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np

SCHEMA_VERSION = 1
OBS_VERSION = -1

TurnKind = Literal["model", "observation"]
TURN_KINDS = ("model", "observation")

FinishReason = Literal[  # how an episode ended (``async_agent_rl.episode``; a demonstration always ends on "answer")
    "answer",  # the model gave an <answer>
    "max_turns",  # the turn limit was reached without an answer
    "response_budget",  # the total response token budget ran out
    "context_limit",  # the next turn would not fit in the model's context
    "aborted",  # the engine aborted the request (shutdown, weight update in abort mode)
]


class RecordError(ValueError):
    """A trajectory record (or its encoded bytes) is malformed."""


@dataclass(frozen=True)
class TurnSpan:
    """A half-open span ``[start, end)`` of ``response_ids``."""

    kind: TurnKind
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class EpisodeMeta:
    data_source: str = ""
    question_id: str = ""
    group_id: str = ""
    gold_answers: list[str] = field(default_factory=list)
    num_searches: int = 0
    num_search_errors: int = 0
    num_turns: int = 0
    finish_reason: FinishReason = "answer"
    trajectory_id: str = ""
    actor_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    turns: list[TurnSpan]
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    meta: EpisodeMeta = field(default_factory=EpisodeMeta)

    # ------------------------------------------------------------------ derived views
    @property
    def num_generated_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def min_version(self) -> int:
        """Oldest policy version among generated tokens (staleness is measured from it)."""
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(gen) if gen else OBS_VERSION

    @property
    def max_version(self) -> int:
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return max(gen) if gen else OBS_VERSION

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def full_loss_mask(self) -> list[int]:
        return [0] * len(self.prompt_ids) + list(self.loss_mask)

    # ------------------------------------------------------------------ checks
    def validate(self) -> "Trajectory":
        """Raise ``RecordError`` naming the first inconsistency; return self when well formed."""
        n = len(self.response_ids)
        for name in ("loss_mask", "behavior_logprobs", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise RecordError(f"trajectory {self.meta.trajectory_id!r}: {name} has {got} entries, response_ids has {n}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise RecordError(f"trajectory {self.meta.trajectory_id!r}: loss_mask must hold only 0 and 1")
        pos = 0
        for i, span in enumerate(self.turns):
            if span.kind not in TURN_KINDS:
                raise RecordError(f"trajectory {self.meta.trajectory_id!r}: turns[{i}].kind={span.kind!r}, allowed {TURN_KINDS}")
            if span.start != pos or span.end < span.start:
                raise RecordError(
                    f"trajectory {self.meta.trajectory_id!r}: turns[{i}] = [{span.start}, {span.end}) does not continue at {pos}"
                )
            want = 1 if span.kind == "model" else 0
            if any(m != want for m in self.loss_mask[span.start : span.end]):
                raise RecordError(
                    f"trajectory {self.meta.trajectory_id!r}: loss_mask inside {span.kind} turn {i} must be {want}"
                )
            pos = span.end
        if pos != n:
            raise RecordError(f"trajectory {self.meta.trajectory_id!r}: turns cover {pos} tokens, response has {n}")
        return self

    # ------------------------------------------------------------------ wire format
    def to_wire(self) -> dict[str, Any]:
        m = self.meta
        return {
            "schema": SCHEMA_VERSION,
            "prompt_ids": np.asarray(self.prompt_ids, dtype="<i4").tobytes(),
            "response_ids": np.asarray(self.response_ids, dtype="<i4").tobytes(),
            "loss_mask": np.asarray(self.loss_mask, dtype="u1").tobytes(),
            "behavior_logprobs": np.asarray(self.behavior_logprobs, dtype="<f4").tobytes(),
            "versions": np.asarray(self.versions, dtype="<i4").tobytes(),
            "turns": [[0 if t.kind == "model" else 1, t.start, t.end] for t in self.turns],
            "reward": float(self.reward),
            "reward_components": {k: float(v) for k, v in self.reward_components.items()},
            "meta": dataclasses.asdict(m),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Trajectory":
        if not isinstance(d, dict):
            raise RecordError(f"trajectory record must be a map, got {type(d).__name__}")
        schema = d.get("schema")
        if schema != SCHEMA_VERSION:
            raise RecordError(f"unknown trajectory schema version {schema!r} (this build reads version {SCHEMA_VERSION})")
        try:
            arrays = {
                "prompt_ids": _from_bytes(d["prompt_ids"], "<i4", "prompt_ids"),
                "response_ids": _from_bytes(d["response_ids"], "<i4", "response_ids"),
                "loss_mask": _from_bytes(d["loss_mask"], "u1", "loss_mask"),
                "behavior_logprobs": _from_bytes(d["behavior_logprobs"], "<f4", "behavior_logprobs"),
                "versions": _from_bytes(d["versions"], "<i4", "versions"),
            }
            turns = [TurnSpan(TURN_KINDS[k], int(s), int(e)) for k, s, e in d["turns"]]
            meta_fields = {f.name for f in dataclasses.fields(EpisodeMeta)}
            raw_meta = d.get("meta") or {}
            unknown = set(raw_meta) - meta_fields
            if unknown:
                raise RecordError(f"trajectory meta has unknown fields {sorted(unknown)}")
            meta = EpisodeMeta(**raw_meta)
        except KeyError as e:
            raise RecordError(f"trajectory record is missing field {e.args[0]!r}") from None
        except (IndexError, TypeError, ValueError) as e:
            if isinstance(e, RecordError):
                raise
            raise RecordError(f"trajectory record is malformed: {e}") from None
        traj = cls(
            prompt_ids=arrays["prompt_ids"].tolist(),
            response_ids=arrays["response_ids"].tolist(),
            loss_mask=arrays["loss_mask"].tolist(),
            behavior_logprobs=arrays["behavior_logprobs"].tolist(),
            versions=arrays["versions"].tolist(),
            turns=turns,
            reward=float(d.get("reward", 0.0)),
            reward_components=dict(d.get("reward_components") or {}),
            meta=meta,
        )
        return traj.validate()

    def encode(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> "Trajectory":
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise RecordError(f"not a msgpack trajectory record: {e}") from None
        return cls.from_wire(obj)

    # ------------------------------------------------------------------ human-readable form (jsonl)
    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["schema"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Trajectory":
        if d.get("schema") != SCHEMA_VERSION:
            raise RecordError(f"unknown trajectory schema version {d.get('schema')!r} (this build reads version {SCHEMA_VERSION})")
        d = dict(d)
        d.pop("schema")
        d["turns"] = [TurnSpan(**t) for t in d["turns"]]
        d["meta"] = EpisodeMeta(**d["meta"])
        return cls(**d).validate()


@dataclass(frozen=True)
class RecordSummary:
    """What the replay buffer indexes a wire record by, read without decoding its token arrays (``peek``)."""

    group_id: str
    min_version: int  # oldest version among generated tokens, ``OBS_VERSION`` when none was generated
    tokens: int  # prompt + response tokens
    priority: float  # ``meta.extra["priority"]``, 0 when absent
    reward: float
    correct: float | None  # ``reward_components["exact_match"]`` when scored
    response_tokens: int = 0  # model + observation tokens
    turns: int = 0  # ``meta.num_turns``


def peek(blob: bytes) -> RecordSummary:
    """The ``RecordSummary`` of one wire record (``Trajectory.encode``), without decoding the token arrays into lists
    (about 7 us for 2k tokens, against ~190 us for ``Trajectory.decode``). Checks the schema and that the per-token
    arrays agree; raises ``RecordError`` otherwise."""
    try:
        d = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise RecordError(f"not a msgpack trajectory record: {e}") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA_VERSION:
        got = d.get("schema") if isinstance(d, dict) else type(d).__name__
        raise RecordError(f"not a trajectory record of schema version {SCHEMA_VERSION} (got {got!r})")
    try:
        n = len(d["response_ids"]) // 4
        mask = np.frombuffer(d["loss_mask"], dtype="u1")
        versions = np.frombuffer(d["versions"], dtype="<i4")
        if len(mask) != n or len(versions) != n or len(d["behavior_logprobs"]) != 4 * n:
            raise RecordError("per-token arrays differ in length from response_ids")
        generated = versions[mask.astype(bool)]
        meta = d["meta"]
        return RecordSummary(
            group_id=str(meta["group_id"]),
            min_version=int(generated.min()) if generated.size else OBS_VERSION,
            tokens=len(d["prompt_ids"]) // 4 + n,
            priority=float((meta.get("extra") or {}).get("priority", 0.0)),
            reward=float(d.get("reward", 0.0)),
            correct=(d.get("reward_components") or {}).get("exact_match"),
            response_tokens=n,
            turns=int(meta.get("num_turns") or 0),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, RecordError):
            raise
        raise RecordError(f"malformed trajectory record: {e!r}") from None


def _from_bytes(buf: Any, dtype: str, name: str) -> np.ndarray:
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise RecordError(f"trajectory field {name!r} must be bytes, got {type(buf).__name__}")
    size = np.dtype(dtype).itemsize
    if len(buf) % size:
        raise RecordError(f"trajectory field {name!r} has {len(buf)} bytes, not a multiple of {size}")
    return np.frombuffer(buf, dtype=dtype)
