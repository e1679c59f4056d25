"""Version-tagged replay buffer of GRPO groups (a plain class; ``buffer.actor`` is its Ray shell).

Trajectories are kept as their wire bytes (``Trajectory.encode``; ``records.peek`` reads what the index needs) and
grouped by ``meta.group_id``.

Groups. A group is *ready* when all ``group_size`` members arrived, or fewer when members were reported rejected
(``reject``); such a short group is released with what came, counted in ``groups_released_short``. A group still
incomplete ``partial_group_timeout_s`` after its first member arrived follows ``BufferConfig.partial_groups``:
``wait`` keeps waiting (counted once in ``groups_overdue``, with a log line), ``release`` makes it ready as it is
(``groups_released_partial``), ``drop`` evicts its members (reason ``partial_group_timeout``). A member of a group
already released (ready, not yet consumed), or dropped by the timeout check of the same push, is too late to join
it: ``push`` takes it and drops it (``PushResult.late``, counted in ``stats().late_pushes``, never stored nor counted
``pushed``), and a rejection for a released group is a no-op. Never a second group with the same id: one was made
before, a unit admission had closed when the first was consumed (so ``AdmissionError`` when it was), a slot held
until its own timeout.

Group filtering (``group_filter="zero_variance"``; rLLM's rejection sampling, DAPO's dynamic sampling). A group whose
members' rewards are all equal (within ``zero_variance_tol``) has zero GRPO advantage everywhere: it costs a learner
step's compute and teaches nothing. Such a group is evicted the moment it completes (reason
``filtered_zero_variance``; ``stats().filtered_groups`` splits the dropped groups into ``all_correct`` /
``all_wrong`` by the members' exact-match score, ``all_equal`` for the rest), so it never takes a batch slot: the
batch is filled from the groups that follow, and the freed admission slots let the actors generate replacements.
A policy that earns the same reward everywhere (a random model: always 0) would then never fill a batch; after
``group_filter_max_streak`` filtered groups in a row the filter stands aside (equal-reward groups are kept and
counted in ``zero_variance_kept``, with a warning) until a group with a reward spread arrives again.

Sampling. ``sample(batch_size, v)`` returns ``batch_size / group_size`` whole groups (members adjacent): exactly
``batch_size`` trajectories, fewer when a group lost members (the learner pads the batch), or None while fewer
groups are ready. Groups are served oldest first by version (the group's oldest token version), then by arrival
(``fifo``), or highest ``meta.extra["priority"]`` first (``priority``, a group's priority is its members' maximum,
ties as ``fifo``). Oldest-first by version, not by completion: a group with one long, multi-search member
completes last, and completion order would serve it last and evict it first. Before choosing, every ready group
with ``staleness(v, min token version of the group) > max_staleness`` is evicted (reason ``stale``): a group goes
whole. With the admission rule of ``async_agent_rl.staleness`` that never happens (finished work is not thrown
away); it is a safety net.

Length accounting. Every trajectory is counted by length bucket (response tokens, and turns) when it arrives
(``generated``), when a batch takes it (``consumed``) and when it is evicted (``evicted``):
``stats().length_tokens`` / ``length_turns``. Trained-on and generated distributions should agree; a system that
drops slow episodes shows it here first.

Capacity and backpressure. Memory is bounded by ``capacity_trajectories`` and ``capacity_tokens`` (prompt +
response tokens), never exceeded. The buffer is told the longest trajectory it may be given,
``max_trajectory_tokens`` (``Config.max_trajectory_tokens``: ``data.max_prompt_length +
rollout.max_response_length``, bounded by the context), and refuses a longer one (``CapacityError``). Room is
promised, never estimated: every missing member of a pending group is promised one slot and
``max_trajectory_tokens`` tokens, so *reserved* (stored plus promised) never exceeds the capacity. A trajectory
that opens a new group must find room for the whole group on top of what is reserved: ``group_size`` slots and
``group_size x max_trajectory_tokens`` tokens (at most ``capacity_tokens``). Members of a pending group only need
room for themselves, which their promise guarantees, so groups under way always complete, however full the buffer.
``push`` takes every trajectory that fits and reports the ones it refused (``PushResult.refused``): the producer
pushes those again later. Not a prefix: a push is in finishing order, so a new group's first member refused for
room would otherwise hold back the members behind it that complete the groups the buffer already holds, and with
``capacity_trajectories`` below what admission lets run (``(eta + 1) x`` a batch) no batch ever formed (eta 1,
groups of 2, batch 2, capacity 2: ``tests/unit/test_staleness.py``). Taking what fits, the pending groups complete,
the learner takes a batch and the refused member finds room.

No stall, at any capacity a config allows. With ``capacity_trajectories >= batch_size`` and ``capacity_tokens >=
batch_size x max_trajectory_tokens`` (the config's minimum, ``Config``'s validator: the same two numbers), a batch
always forms: pending groups complete (above), and while fewer than ``batch_size / group_size`` groups are ready
and none pending, the ready ones hold at most ``batch_size - group_size`` trajectories of at most
``max_trajectory_tokens`` each, so a new group finds its room. The earlier promise, a pending group's arrived members'
mean length, let short first members in more groups than the tokens could complete: at the least capacity
allowed, 24 groups with a 3-token first member each, and no batch ever formed
(``tests/unit/test_stalling_configs.py::test_token_promises_never_let_groups_in_that_cannot_all_complete``).

Accounting: ``pushed == sampled + sum(evicted.values()) + size`` at all times; nothing leaves silently.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

import msgpack

from async_agent_rl.config import BufferConfig
from async_agent_rl.errors import InputError
from async_agent_rl.records import OBS_VERSION, RecordError, Trajectory, peek
from async_agent_rl.staleness import group_min_version, is_stale, staleness
from async_agent_rl.stats import BufferStats

logger = logging.getLogger(__name__)
T = TypeVar("T")

EVICT_STALE = "stale"
EVICT_PARTIAL_TIMEOUT = "partial_group_timeout"
EVICT_ZERO_VARIANCE = "filtered_zero_variance"
EVICTION_REASONS = (EVICT_STALE, EVICT_PARTIAL_TIMEOUT, EVICT_ZERO_VARIANCE)
COUNTERS = ("pushed", "sampled", "push_refused", "rejected", "groups_released_short", "groups_released_partial",
            "groups_overdue", "groups_completed", "groups_zero_variance", "zero_variance_kept")


class CapacityError(ValueError):
    """A trajectory is longer than ``max_trajectory_tokens`` (the room promised to each member) or
    ``capacity_tokens``: the buffer's promises could not hold it."""


class SnapshotError(InputError):
    """A snapshot file is missing, truncated, corrupt or incompatible; the message names the file."""


@dataclass(frozen=True)
class PushResult:
    """Reply to a push of ``pushed`` trajectories: every one was taken but those at the indices ``refused``
    (ascending), for which the buffer had no room. Push them again later (the learner frees room by sampling), with
    whatever finished since: a refused trajectory never holds back the ones after it. Of the taken ones, those at
    ``late`` were dropped: their group no longer expected them (module docstring, "Groups")."""

    pushed: int
    refused: tuple[int, ...] = ()
    late: tuple[int, ...] = ()  # taken and dropped: their group was released (or is gone), too late to join it

    @property
    def accepted(self) -> int:
        """Trajectories taken (stored; for ``BufferActor.push_many`` also the late ones it dropped)."""
        return self.pushed - len(self.refused)

    @property
    def full(self) -> bool:
        """The buffer had no room for some of them."""
        return bool(self.refused)

    def rest(self, items: Sequence[T]) -> list[T]:
        """The refused ones of ``items`` (the list that was pushed, or anything in the same order): push them again."""
        return [items[i] for i in self.refused]

    def taken(self, items: Sequence[T]) -> list[T]:
        """The ones of ``items`` that were taken."""
        refused = set(self.refused)
        return [x for i, x in enumerate(items) if i not in refused]


@dataclass
class _Item:
    blob: bytes
    min_version: int
    tokens: int
    priority: float
    pushed_at: float
    reward: float = 0.0
    correct: Optional[float] = None  # reward_components["exact_match"] when scored
    response_tokens: int = 0
    turns: int = 0


@dataclass
class _Group:
    gid: str
    first_at: float
    items: list[_Item] = field(default_factory=list)
    rejected: int = 0
    overdue: bool = False

    @property
    def tokens(self) -> int:
        return sum(it.tokens for it in self.items)

    @property
    def min_version(self) -> int:
        return group_min_version(it.min_version for it in self.items)

    @property
    def priority(self) -> float:
        return max((it.priority for it in self.items), default=0.0)


def _peek(blob: bytes) -> tuple[str, _Item]:
    """Group id and index entry of one wire record (``records.peek``)."""
    r = peek(blob)
    return r.group_id, _Item(blob=blob, min_version=r.min_version, tokens=r.tokens, priority=r.priority,
                             pushed_at=0.0, reward=r.reward, correct=r.correct, response_tokens=r.response_tokens,
                             turns=r.turns)


LENGTH_STAGES = ("generated", "consumed", "evicted")


def tokens_bucket(n: int) -> str:
    """Response-length bucket: ``<32``, then powers of two (``32-63``, ``64-127``, ...)."""
    if n < 32:
        return "<32"
    lo = 1 << (n.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def turns_bucket(n: int) -> str:
    """Turn-count bucket: the count itself up to 8, then ``9-16``, ``17-32``, ..."""
    if n <= 8:
        return str(n)
    lo = 1 << ((n - 1).bit_length() - 1)
    return f"{lo + 1}-{2 * lo}"


def peek_group_id(blob: bytes) -> str:
    """``meta.group_id`` of a wire record (validated like a push)."""
    return peek(blob).group_id


class ReplayBuffer:
    """See the module docstring. ``on_evict(n, group_id)`` is told of every eviction and ``on_consume(group_id)`` of
    every group a batch takes (the admission state's pacing follows both); ``clock`` gives seconds (monotonic) for
    timeouts and ages. ``max_trajectory_tokens``: the longest trajectory it may be given
    (``Config.max_trajectory_tokens``), the room promised to every missing member of a pending group ("Capacity and
    backpressure")."""

    def __init__(
        self,
        config: BufferConfig,
        group_size: int,
        *,
        max_trajectory_tokens: int,
        on_evict: Optional[Callable[[int, str], None]] = None,
        on_consume: Optional[Callable[[str], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if group_size < 1 or group_size > config.capacity_trajectories:
            raise ValueError(
                f"group_size={group_size} must be in [1, capacity_trajectories={config.capacity_trajectories}]"
            )
        if max_trajectory_tokens < 1:
            raise ValueError(f"max_trajectory_tokens={max_trajectory_tokens} must be at least 1")
        self.config = config
        self.group_size = group_size
        self.max_trajectory_tokens = max_trajectory_tokens
        self._on_evict = on_evict
        self._on_consume = on_consume
        self._clock = clock
        self._pending: dict[str, _Group] = {}  # by group id, in order of first arrival
        self._ready: dict[int, _Group] = {}  # by release sequence number
        self._released: dict[str, int] = {}  # group id -> release sequence number, while ready (not consumed)
        self._order: list[tuple[float, int, int]] = []  # heap of (-priority or 0, version, seq); skips gone groups
        self._by_version: list[tuple[int, int]] = []  # heap of (group min version, seq) for stale eviction
        self._seq = 0
        self._size = 0
        self._tokens = 0
        self._bytes = 0
        self.learner_version = 0
        self.counters: Counter[str] = Counter()
        self.evicted: Counter[str] = Counter({r: 0 for r in EVICTION_REASONS})
        self.filtered_groups: Counter[str] = Counter({k: 0 for k in ("all_correct", "all_wrong", "all_equal")})
        self._filtered_streak = 0  # zero-variance groups in a row
        self.staleness_histogram: Counter[int] = Counter()
        self.length_tokens: dict[str, Counter[str]] = {k: Counter() for k in LENGTH_STAGES}
        self.length_turns: dict[str, Counter[str]] = {k: Counter() for k in LENGTH_STAGES}
        if config.group_filter != "none" and group_size < 2:
            raise ValueError(f"group_filter={config.group_filter!r} needs group_size >= 2 (got {group_size})")

    def __len__(self) -> int:
        return self._size

    # ------------------------------------------------------------------------------------------------------ push
    def push(self, blobs: Sequence[bytes]) -> PushResult:
        """Store every one of ``blobs`` that fits, in order; the reply names the ones refused for lack of room (a
        refused one does not stop the ones after it: module docstring). Raises (storing nothing) ``RecordError`` if
        a blob is not a valid record, ``CapacityError`` if one is longer than ``max_trajectory_tokens`` or
        ``capacity_tokens``. ``push_refused``
        in ``stats`` counts trajectories turned away for lack of room (a retried one each time)."""
        gone = self._expire_partial()  # dropped now: their members in this push come too late as well
        entries = [_peek(b) for b in blobs]
        for k, (gid, item) in enumerate(entries):
            if not gid and self.group_size > 1:
                raise RecordError(f"trajectory {k} of the push has no meta.group_id (group_size={self.group_size})")
            if item.tokens > self.config.capacity_tokens:
                raise CapacityError(
                    f"trajectory {k} of the push has {item.tokens} tokens, more than capacity_tokens="
                    f"{self.config.capacity_tokens}: it can never fit"
                )
            if item.tokens > self.max_trajectory_tokens:
                raise CapacityError(
                    f"trajectory {k} of the push has {item.tokens} tokens, more than the longest a trajectory may "
                    f"be (max_trajectory_tokens={self.max_trajectory_tokens}, data.max_prompt_length + "
                    "rollout.max_response_length): the room promised to its group's members cannot hold it"
                )
        now = self._clock()
        refused: list[int] = []
        late: list[int] = []
        for k, (gid, item) in enumerate(entries):
            if gid in self._released or gid in gone:  # released partial (a batch unit as it is), or dropped
                late.append(k)
                continue
            if not self._fits(gid, item):
                refused.append(k)
                continue
            item.pushed_at = now
            self._add(gid, item, now)
        self.counters["push_refused"] += len(refused)
        self.counters["late_pushes"] += len(late)
        if late:
            logger.info("replay buffer: dropped %d trajectories of groups already released", len(late))
        return PushResult(pushed=len(entries), refused=tuple(refused), late=tuple(late))

    def _fits(self, gid: str, item: _Item) -> bool:
        cfg = self.config
        group = self._pending.get(gid)
        if group is not None and group.items:
            return self._size + 1 <= cfg.capacity_trajectories and self._tokens + item.tokens <= cfg.capacity_tokens
        need = self.group_size - (group.rejected if group else 0)
        slots, tokens = self._reserved()
        # the whole group at the longest (item itself included); a group that could fill the buffer alone needs it
        # empty of promises, not more than its capacity (never with a config's capacities, module docstring)
        room = min(need * self.max_trajectory_tokens, cfg.capacity_tokens)
        return slots + need <= cfg.capacity_trajectories and tokens + room <= cfg.capacity_tokens

    def _reserved(self) -> tuple[int, int]:
        """Stored trajectories and tokens plus the room promised to the missing members of pending groups: a slot
        and ``max_trajectory_tokens`` each."""
        slots, tokens = self._size, self._tokens
        for g in self._pending.values():
            if g.items:
                missing = self.group_size - g.rejected - len(g.items)
                slots += missing
                tokens += missing * self.max_trajectory_tokens
        return slots, tokens

    def _add(self, gid: str, item: _Item, now: float) -> None:
        group = self._pending.get(gid)
        if group is None:
            group = self._pending[gid] = _Group(gid, first_at=now)
        elif not group.items:
            group.first_at = now  # only rejections so far: the timeout runs from the first arrival
        group.items.append(item)
        self._size += 1
        self._tokens += item.tokens
        self._bytes += len(item.blob)
        self.counters["pushed"] += 1
        self._count_lengths("generated", [item])
        self._maybe_complete(group)

    def reject(self, group_ids: Sequence[str]) -> None:
        """One member of each listed group was thrown away by its producer: do not wait for it (a group already
        released waits for nothing)."""
        now = self._clock()
        for gid in group_ids:
            if gid in self._released:
                self.counters["rejected"] += 1
                continue
            group = self._pending.get(gid)
            if group is None:
                group = self._pending[gid] = _Group(gid, first_at=now)
            group.rejected += 1
            self.counters["rejected"] += 1
            self._maybe_complete(group)

    def _maybe_complete(self, group: _Group) -> None:
        expected = self.group_size - group.rejected
        if len(group.items) < expected:
            return
        del self._pending[group.gid]
        if group.items:
            rewards = [it.reward for it in group.items]
            self.counters["groups_completed"] += 1  # the learning signal, filter or not: share with no spread
            self.counters["groups_zero_variance"] += max(rewards) - min(rewards) <= self.config.zero_variance_tol
            if expected < self.group_size:
                self.counters["groups_released_short"] += 1
            if not self._filtered(group):
                self._release(group)

    def _filtered(self, group: _Group) -> bool:
        """Apply ``group_filter`` to a completed group: evict it (True) or let it be released (False)."""
        if self.config.group_filter == "none":
            return False
        rewards = [it.reward for it in group.items]
        lo, hi = min(rewards), max(rewards)
        if hi - lo > self.config.zero_variance_tol:
            self._filtered_streak = 0
            return False
        if self._filtered_streak >= self.config.group_filter_max_streak:
            if self._filtered_streak == self.config.group_filter_max_streak:
                logger.warning("replay buffer: the last %d groups all had equal rewards (no GRPO signal); keeping such "
                               "groups until one with a reward spread arrives, so the run goes on",
                               self._filtered_streak)
            self._filtered_streak += 1
            self.counters["zero_variance_kept"] += 1
            return False
        self._filtered_streak += 1
        em = {it.correct for it in group.items}
        kind = "all_correct" if em == {1.0} else "all_wrong" if em == {0.0} else "all_equal"
        self.filtered_groups[kind] += 1
        self._evict(group, EVICT_ZERO_VARIANCE, f"every reward is {hi:g} ({kind})", quiet=True)
        return True

    def _count_lengths(self, stage: str, items: Sequence[_Item]) -> None:
        for it in items:
            self.length_tokens[stage][tokens_bucket(it.response_tokens)] += 1
            self.length_turns[stage][turns_bucket(it.turns)] += 1

    def _release(self, group: _Group) -> None:
        seq = self._seq
        self._seq += 1
        self._ready[seq] = group
        self._released[group.gid] = seq
        priority = -group.priority if self.config.sampling == "priority" else 0.0
        heapq.heappush(self._order, (priority, group.min_version, seq))
        if group.min_version != OBS_VERSION:
            heapq.heappush(self._by_version, (group.min_version, seq))

    # ---------------------------------------------------------------------------------------------------- sample
    def sample_wire(self, batch_size: int, learner_version: int) -> Optional[list[bytes]]:
        """``batch_size / group_size`` whole groups as wire bytes (``batch_size`` trajectories, fewer when groups
        are short), oldest version first, or None while fewer groups are ready."""
        if batch_size < 1 or batch_size % self.group_size:
            raise ValueError(f"batch_size={batch_size} must be a positive multiple of group_size={self.group_size}")
        self.learner_version = learner_version
        self._expire_partial()
        self._evict_stale(learner_version)
        want = batch_size // self.group_size
        if len(self._ready) < want:
            return None
        out: list[bytes] = []
        for _ in range(want):
            entry = heapq.heappop(self._order)
            while entry[-1] not in self._ready:  # evicted earlier
                entry = heapq.heappop(self._order)
            group = self._ready.pop(entry[-1])
            for it in group.items:
                self.staleness_histogram[staleness(learner_version, it.min_version)] += 1
                out.append(it.blob)
            self._forget(group)
            self._count_lengths("consumed", group.items)
            self.counters["sampled"] += len(group.items)
            if self._on_consume is not None:
                self._on_consume(group.gid)
        return out

    def sample(self, batch_size: int, learner_version: int) -> Optional[list[Trajectory]]:
        """Like ``sample_wire``, decoded."""
        blobs = self.sample_wire(batch_size, learner_version)
        return None if blobs is None else [Trajectory.decode(b) for b in blobs]

    def _evict_stale(self, learner_version: int) -> None:
        eta = self.config.max_staleness
        while self._by_version and is_stale(learner_version, self._by_version[0][0], eta):
            min_version, seq = heapq.heappop(self._by_version)
            group = self._ready.pop(seq, None)
            if group is not None:
                self._evict(
                    group,
                    EVICT_STALE,
                    f"staleness {staleness(learner_version, min_version)} > max_staleness {eta} "
                    f"at learner version {learner_version}",
                )

    def _expire_partial(self) -> set[str]:
        """Apply ``partial_groups`` to the groups past their timeout; returns the ids of those dropped."""
        now, cfg = self._clock(), self.config
        gone: set[str] = set()
        for group in list(self._pending.values()):
            if now - group.first_at < cfg.partial_group_timeout_s:
                continue
            if not group.items:
                # only rejections so far: its timeout runs from its first member's arrival (``_add``). Forgetting it
                # here lost its rejections, and the members still under way then waited for the rejected one for
                # ever (a group whose member failed early and whose others took longer than the timeout: with
                # partial_groups=wait the run stalled at the staleness bound). It goes once every member is
                # accounted for (``_maybe_complete``).
                continue
            if cfg.partial_groups == "release":
                del self._pending[group.gid]
                self.counters["groups_released_partial"] += 1
                if self._filtered(group):
                    gone.add(group.gid)
                else:
                    self._release(group)
            elif cfg.partial_groups == "drop":
                del self._pending[group.gid]
                gone.add(group.gid)
                self._evict(group, EVICT_PARTIAL_TIMEOUT, f"{len(group.items)}/{self.group_size} members arrived")
            elif not group.overdue:
                group.overdue = True
                self.counters["groups_overdue"] += 1
                logger.warning(
                    "replay buffer: group %r has %d/%d members after %.0f s; waiting (partial_groups=wait)",
                    group.gid, len(group.items), self.group_size, now - group.first_at,
                )
        return gone

    def partial_timeout_in(self) -> Optional[float]:
        """Seconds until the next pending group reaches ``partial_group_timeout_s`` (when it may be released or
        dropped), or None while no group waits for it. A sampler waiting for a batch wakes up then."""
        firsts = [g.first_at for g in self._pending.values() if g.items and not g.overdue]
        if not firsts:
            return None
        return max(0.0, min(firsts) + self.config.partial_group_timeout_s - self._clock())

    def _evict(self, group: _Group, reason: str, why: str, quiet: bool = False) -> None:
        n = len(group.items)
        self.evicted[reason] += n
        self._forget(group)
        self._count_lengths("evicted", group.items)
        (logger.debug if quiet else logger.warning)(
            "replay buffer: evicted %d trajectories of group %r (%s): %s", n, group.gid, reason, why)
        if self._on_evict is not None:
            self._on_evict(n, group.gid)

    def _forget(self, group: _Group) -> None:
        self._released.pop(group.gid, None)
        self._size -= len(group.items)
        self._tokens -= group.tokens
        self._bytes -= sum(len(it.blob) for it in group.items)

    # ----------------------------------------------------------------------------------------------------- stats
    def stats(self) -> BufferStats:
        """Monitoring view. ``staleness_histogram`` counts consumed trajectories by staleness."""
        self._expire_partial()
        now = self._clock()
        groups = list(self._pending.values()) + list(self._ready.values())
        oldest = min((it.pushed_at for g in groups for it in g.items[:1]), default=None)
        c = self.counters
        return BufferStats(
            size=self._size,
            tokens=self._tokens,
            bytes=self._bytes,
            ready_groups=len(self._ready),
            pending_groups=sum(1 for g in self._pending.values() if g.items),
            oldest_age_s=0.0 if oldest is None else now - oldest,
            learner_version=self.learner_version,
            capacity_trajectories=self.config.capacity_trajectories,
            capacity_tokens=self.config.capacity_tokens,
            **{name: c[name] for name in COUNTERS},
            late_pushes=c["late_pushes"],
            evicted=dict(self.evicted),
            filtered_groups=dict(self.filtered_groups),
            staleness_histogram=dict(sorted(self.staleness_histogram.items())),
            length_tokens={k: dict(v) for k, v in self.length_tokens.items()},
            length_turns={k: dict(v) for k, v in self.length_turns.items()},
        )

    # ------------------------------------------------------------------------------------------------- snapshot
    def snapshot(self, path: str | Path, extra: Optional[dict[str, Any]] = None) -> Path:
        """Write everything buffered (ready groups in sampling order, pending groups, counters) to ``path``
        atomically. ``extra`` (msgpack-able) is stored alongside and handed back by ``restore``."""
        now = self._clock()

        def group_state(g: _Group) -> dict[str, Any]:
            return {
                "gid": g.gid,
                "age_s": now - g.first_at,
                "rejected": g.rejected,
                "overdue": g.overdue,
                "items": [[it.blob, now - it.pushed_at] for it in g.items],
            }

        payload = msgpack.packb(
            {
                "group_size": self.group_size,
                "learner_version": self.learner_version,
                "counters": dict(self.counters),
                "evicted": dict(self.evicted),
                "filtered_groups": dict(self.filtered_groups),
                "zero_variance_kept": self.counters["zero_variance_kept"],
                "filtered_streak": self._filtered_streak,
                "staleness_histogram": [[k, v] for k, v in self.staleness_histogram.items()],
                "length_tokens": {k: dict(v) for k, v in self.length_tokens.items()},
                "length_turns": {k: dict(v) for k, v in self.length_turns.items()},
                "ready": [group_state(self._ready[s]) for s in sorted(self._ready)],
                "pending": [group_state(g) for g in self._pending.values()],
                "extra": extra or {},
            },
            use_bin_type=True,
        )
        return _write_snapshot(Path(path), payload)

    @classmethod
    def restore(
        cls,
        path: str | Path,
        config: BufferConfig,
        group_size: int,
        *,
        max_trajectory_tokens: int,
        on_evict: Optional[Callable[[int, str], None]] = None,
        on_consume: Optional[Callable[[str], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> tuple["ReplayBuffer", dict[str, Any]]:
        """Rebuild a buffer from ``snapshot``; returns it and the snapshot's ``extra``. Raises ``SnapshotError``
        naming ``path`` if the file is missing, truncated, corrupt, or does not match ``group_size``/capacity."""
        path = Path(path)
        state = _read_snapshot(path)
        try:
            if state["group_size"] != group_size:
                raise SnapshotError(
                    f"snapshot {path} was taken with group_size={state['group_size']}, this run has {group_size}"
                )
            buf = cls(config, group_size, max_trajectory_tokens=max_trajectory_tokens, on_evict=on_evict,
                      on_consume=on_consume, clock=clock)
            now = clock()
            buf.learner_version = int(state["learner_version"])
            buf.counters.update(state["counters"])
            buf.evicted.update(state["evicted"])
            buf.filtered_groups.update(state.get("filtered_groups", {}))
            buf._filtered_streak = int(state.get("filtered_streak", 0))  # older snapshots: none recorded
            buf.staleness_histogram.update({int(k): int(v) for k, v in state["staleness_histogram"]})
            for name in ("length_tokens", "length_turns"):
                for stage, counts in dict(state.get(name) or {}).items():
                    if stage in LENGTH_STAGES:
                        getattr(buf, name)[stage].update({str(b): int(c) for b, c in dict(counts).items()})
            for gs in state["ready"]:
                buf._release(buf._restored_group(gs, now))
            for gs in state["pending"]:
                group = buf._restored_group(gs, now)
                buf._pending[group.gid] = group
            extra = dict(state["extra"])
        except SnapshotError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise SnapshotError(f"snapshot {path} is corrupt: {e!r}") from None
        if buf._size > config.capacity_trajectories or buf._tokens > config.capacity_tokens:
            raise SnapshotError(
                f"snapshot {path} holds {buf._size} trajectories / {buf._tokens} tokens, more than this run's "
                f"capacity_trajectories={config.capacity_trajectories} / capacity_tokens={config.capacity_tokens}"
            )
        return buf, extra


    def _restored_group(self, gs: dict[str, Any], now: float) -> _Group:
        group = _Group(gs["gid"], first_at=now - gs["age_s"], rejected=gs["rejected"], overdue=gs["overdue"])
        for blob, age in gs["items"]:
            _, item = _peek(blob)
            item.pushed_at = now - age
            group.items.append(item)
            self._size += 1
            self._tokens += item.tokens
            self._bytes += len(blob)
        return group


# -------------------------------------------------------------------------------------------------- snapshot file
# Layout: MAGIC | uint16 format version | uint64 payload length | msgpack payload | sha256(payload)
_MAGIC = b"AARL-REPLAY\n"
_FORMAT = 1
_HEADER = struct.Struct(">HQ")
_DIGEST = 32


def _write_snapshot(path: Path, payload: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_MAGIC + _HEADER.pack(_FORMAT, len(payload)))
        f.write(payload)
        f.write(hashlib.sha256(payload).digest())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _read_snapshot(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SnapshotError(f"cannot read replay buffer snapshot {path}: {e.strerror}") from None
    head = len(_MAGIC) + _HEADER.size
    if not data.startswith(_MAGIC):
        raise SnapshotError(f"{path} is not a replay buffer snapshot (bad magic bytes)")
    if len(data) < head:
        raise SnapshotError(f"replay buffer snapshot {path} is truncated: {len(data)} bytes, header alone is {head}")
    fmt, length = _HEADER.unpack_from(data, len(_MAGIC))
    if fmt != _FORMAT:
        raise SnapshotError(f"replay buffer snapshot {path} has format {fmt}, this build reads format {_FORMAT}")
    if len(data) != head + length + _DIGEST:
        expected = head + length + _DIGEST
        raise SnapshotError(f"replay buffer snapshot {path} is truncated or padded: {len(data)} bytes, not {expected}")
    payload = data[head : head + length]
    if hashlib.sha256(payload).digest() != data[head + length :]:
        raise SnapshotError(f"replay buffer snapshot {path} is corrupt: checksum mismatch")
    try:
        state = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise SnapshotError(f"replay buffer snapshot {path} is corrupt: {e}") from None
    if not isinstance(state, dict):
        raise SnapshotError(f"replay buffer snapshot {path} is corrupt: top level is {type(state).__name__}")
    return state
