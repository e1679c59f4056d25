"""The replay buffer as a Ray actor: a thin shell around ``ReplayBuffer`` and ``AdmissionState``.

Protocol for a rollout actor (every call carries a batch; an actor round trip costs ~0.5 ms):

1. ``n = try_start(k, version)`` with ``version`` the policy version of its engine's weights; start ``n`` episodes
   (whole groups; 0 means wait and ask again).
2. ``push_all(actor, blobs)`` / ``await push_all_async(actor, blobs)`` for the finished ones (wire bytes); these
   resend the refused rest while the buffer reports ``full``.
3. ``reject(group_ids)`` for episodes thrown away (one group id per episode), so the slot is freed and the group
   does not wait for them.

A push of an episode that was already counted lost (``actor_lost``: its actor was declared dead, perhaps while
its last push was still on the way) is dropped and counted in ``stats().late_pushes``: it was rejected once, and
taking it now would spend another actor's running slot (and raise ``AdmissionError`` in that actor's push).

The learner's batches: ``sample_batch(version, timeout_s)`` returns a packed ``TrainBatch`` of ``batch_size``
trajectories (padded with ``pad_id``; both fixed when the actor is created) as soon as the buffer can make one up at
learner ``version``, or None after ``timeout_s`` (the caller checks for faults and asks again). The driver hands the
reference straight to the learner (``learner.train_step.remote(buffer.sample_batch.remote(...))``), so the batch
goes from this actor to the learner ranks through the object store, never through the driver. The actor is async:
while ``sample_batch`` waits (on an event set by every push, rejection and lost actor, and at the next
partial-group timeout; no polling) the rollout actors' calls run. ``sample(batch_size, version)`` gives wire bytes.

Create the actor with ``create_buffer_actor(cfg, pad_id=...)``: its resources come from ``cluster.buffer_cpus``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Optional, Sequence

import ray

from async_agent_rl.batch import TrainBatch, pack_batch
from async_agent_rl.config import BufferConfig, Config
from async_agent_rl.records import Trajectory
from async_agent_rl.staleness import AdmissionError, AdmissionState
from async_agent_rl.stats import BufferStats, new_incarnation
from buffer.replay_buffer import PushResult, ReplayBuffer, SnapshotError, peek_group_id

SNAPSHOT_FILE = "replay_buffer.snapshot"


class BufferActor:
    """``consumed_per_version``: trajectories the learner consumes per policy version (``learner.batch_size *
    weight_sync.every_steps``); ``max_concurrent``: episodes in flight over all rollout actors."""

    def __init__(self, config: BufferConfig, *, group_size: int, consumed_per_version: int, max_concurrent: int,
                 batch_size: int, pad_id: int = 0):
        self.config = config
        self.group_size = group_size
        self.batch_size = batch_size
        self.pad_id = pad_id
        self._changed = asyncio.Event()  # set when a batch may have become possible (async actor: one event loop)
        self._admission_args = dict(
            max_staleness=config.max_staleness,
            batch_size=consumed_per_version,
            max_concurrent=max_concurrent,
            granule=group_size,
        )
        self.admission = AdmissionState(**self._admission_args)
        self.buffer = ReplayBuffer(config, group_size, on_evict=self._on_evict)
        self._samples = 0
        self.incarnation = new_incarnation()
        # episodes admitted but not yet pushed or rejected, per group, and the actor running them: when an actor
        # dies its in-flight episodes are counted lost (``actor_lost``) so admission slots and groups never leak
        self._inflight: dict[str, list] = {}  # group_id -> [actor_id, episodes in flight]
        self._lost: dict[str, int] = {}
        self._lost_groups: set[str] = set()  # groups with episodes counted lost: later pushes of them are late
        self._late_pushes = 0
        self._pushing = False
        self._evicted_in_push = 0

    def _wake(self) -> None:
        self._changed.set()

    def _on_evict(self, n: int) -> None:
        if self._pushing:  # a group completed by this push was filtered: its members are not counted accepted yet
            self._evicted_in_push += n
        else:
            self.admission.on_evicted(n)

    # ---------------------------------------------------------------------------------------- rollout actors
    def try_start(self, n: int, version: int, group_id: Optional[str] = None, actor_id: str = "") -> int:
        """Admission for ``n`` episodes at policy ``version``; with ``group_id`` the grant is tracked per actor so
        ``actor_lost`` can account for it."""
        granted = self.admission.try_start(n, version)
        if granted and group_id is not None:
            entry = self._inflight.setdefault(group_id, [actor_id, 0])
            entry[1] += granted
        return granted

    def push_many(self, blobs: Sequence[bytes]) -> PushResult:
        """Store ``blobs`` (``PushResult`` over this list: the first ``accepted`` are handled); late ones (module
        docstring) are dropped and counted."""
        late = {i for i, b in enumerate(blobs) if peek_group_id(b) in self._lost_groups} if self._lost_groups else ()
        if not late:
            return self._push(blobs)
        kept = [i for i in range(len(blobs)) if i not in late]
        result = self._push([blobs[i] for i in kept])
        handled = len(blobs) if result.accepted == len(kept) else kept[result.accepted]
        self._late_pushes += sum(1 for i in late if i < handled)  # a late one resent after a refusal counts once
        return PushResult(handled, result.full)

    def _push(self, blobs: Sequence[bytes]) -> PushResult:
        if len(blobs) > self.admission.running:
            raise AdmissionError(
                f"push of {len(blobs)} trajectories but only {self.admission.running} episodes were started "
                "(call try_start first)"
            )
        self._pushing, self._evicted_in_push = True, 0
        try:
            result = self.buffer.push(blobs)
        finally:
            self._pushing = False
        self.admission.on_finished(result.accepted, accepted=True)
        if self._evicted_in_push:
            self.admission.on_evicted(self._evicted_in_push)
        if self._inflight:
            for blob in blobs[: result.accepted]:
                self._done(peek_group_id(blob))
        if result.accepted:
            self._wake()
        return result

    def reject(self, group_ids: Sequence[str]) -> None:
        self.admission.on_finished(len(group_ids), accepted=False)
        self.buffer.reject(group_ids)
        for gid in group_ids:
            self._done(gid)
        self._wake()

    def _done(self, group_id: str) -> None:
        entry = self._inflight.get(group_id)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._inflight[group_id]

    def actor_lost(self, actor_id: str) -> int:
        """A rollout actor died: its in-flight episodes will never arrive. Each is rejected (admission slot
        freed, its group released short or dropped) and counted in ``stats().lost_episodes``; returns how many."""
        lost = [gid for gid, (actor, k) in self._inflight.items() if actor == actor_id for _ in range(k)]
        if lost:
            self.reject(lost)
            self._lost_groups.update(lost)
        self._lost[actor_id] = self._lost.get(actor_id, 0) + len(lost)
        return len(lost)

    # ------------------------------------------------------------------------------------------------ learner
    def sample(self, batch_size: int, learner_version: int) -> Optional[list[bytes]]:
        blobs = self.buffer.sample_wire(batch_size, learner_version)
        if blobs is not None:
            self._samples += 1
            every = self.config.snapshot_every_steps
            if self.config.snapshot_dir and every and self._samples % every == 0:
                self.snapshot()
        return blobs

    async def sample_batch(self, learner_version: int, timeout_s: float = 0.0) -> Optional[TrainBatch]:
        """A ``TrainBatch`` of ``batch_size`` trajectories for the learner at ``learner_version``, as soon as the
        buffer can make one up; None when it could not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._changed.clear()
            blobs = self.sample(self.batch_size, learner_version)
            if blobs is not None:
                return pack_batch([Trajectory.decode(b) for b in blobs], self.pad_id)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            expiry = self.buffer.partial_timeout_in()
            try:
                await asyncio.wait_for(self._changed.wait(), left if expiry is None else min(left, expiry + 0.01))
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------------------------------- monitoring, disk
    def stats(self) -> BufferStats:
        return dataclasses.replace(self.buffer.stats(), incarnation=self.incarnation, admission=self.admission.stats(),
                                   lost_episodes=dict(self._lost), late_pushes=self._late_pushes)

    def _path(self, path: Optional[str]) -> Path:
        if path is not None:
            return Path(path)
        if not self.config.snapshot_dir:
            raise SnapshotError("no snapshot path given and buffer.snapshot_dir is not set")
        return Path(self.config.snapshot_dir) / SNAPSHOT_FILE

    def snapshot(self, path: Optional[str] = None) -> str:
        """Write the buffer and the admission counters; returns the file written."""
        return str(self.buffer.snapshot(self._path(path), extra={"admission": self.admission.counters()}))

    def restore(self, path: Optional[str] = None) -> BufferStats:
        """Replace the state with a snapshot's (raises ``SnapshotError`` naming the file); returns ``stats()``.
        Episodes that were running when the snapshot was taken count as rejected."""
        buffer, extra = ReplayBuffer.restore(self._path(path), self.config, self.group_size, on_evict=self._on_evict)
        try:
            admission = AdmissionState.resumed(extra["admission"], **self._admission_args)
        except (KeyError, TypeError, ValueError) as e:
            raise SnapshotError(f"snapshot {self._path(path)} has no valid admission counters: {e!r}") from None
        self.buffer, self.admission = buffer, admission
        self.incarnation = new_incarnation()  # its totals are the snapshot's from here on
        self._wake()
        return self.stats()


def create_buffer_actor(cfg: Config, *, pad_id: int, name: Optional[str] = None) -> "ray.actor.ActorHandle":
    """Start the buffer actor with resources and sizes from ``cfg``; its batches are padded with ``pad_id``."""
    actor_cls = ray.remote(num_cpus=cfg.cluster.buffer_cpus)(BufferActor)
    if name is not None:
        actor_cls = actor_cls.options(name=name)
    return actor_cls.remote(
        cfg.buffer,
        group_size=cfg.rollout.group_size,
        consumed_per_version=cfg.learner.batch_size * cfg.weight_sync.every_steps,
        max_concurrent=cfg.rollout.num_actors * cfg.rollout.max_concurrent_episodes,
        batch_size=cfg.learner.batch_size,
        pad_id=pad_id,
    )


def push_all(
    actor: "ray.actor.ActorHandle", blobs: Sequence[bytes], *, poll_s: float = 0.02, timeout_s: Optional[float] = None
) -> int:
    """Push ``blobs`` through backpressure: while the buffer is full, wait ``poll_s`` and resend the refused rest.
    Returns how many times it waited; raises ``TimeoutError`` after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rest, waits = list(blobs), 0
    while rest:
        result: PushResult = ray.get(actor.push_many.remote(rest))
        rest = rest[result.accepted :]
        if rest:
            _check_deadline(deadline, len(rest), timeout_s)
            waits += 1
            time.sleep(poll_s)
    return waits


async def push_all_async(
    actor: "ray.actor.ActorHandle", blobs: Sequence[bytes], *, poll_s: float = 0.02, timeout_s: Optional[float] = None
) -> int:
    """``push_all`` for async callers (rollout actors running an event loop)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rest, waits = list(blobs), 0
    while rest:
        result: PushResult = await actor.push_many.remote(rest)
        rest = rest[result.accepted :]
        if rest:
            _check_deadline(deadline, len(rest), timeout_s)
            waits += 1
            await asyncio.sleep(poll_s)
    return waits


def _check_deadline(deadline: Optional[float], left: int, timeout_s: Optional[float]) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"replay buffer stayed full for {timeout_s} s; {left} trajectories not pushed")
