"""The replay buffer as a Ray actor: a thin shell around ``ReplayBuffer`` and ``AdmissionState``.

Protocol for a rollout actor (every call carries a batch; an actor round trip costs ~0.5 ms):

1. ``n = try_start(group_size, version, group_id, actor_id)`` with ``version`` the policy version of its engine's
   weights; start the group's ``n`` episodes (0 means wait and ask again: the pacing rule of
   ``async_agent_rl.staleness``).
2. ``await push_async(actor, blobs)`` for the finished ones (wire bytes); the buffer takes every one that fits and
   the reply names the ones refused for lack of room (``PushResult.refused``). Send those again, together with the
   episodes that finished meanwhile, never wait behind them (``RolloutWorker``'s outbox does this): a refused
   member of a new group must not hold back the members that complete the groups the buffer already holds
   (``buffer.replay_buffer``, "Capacity and backpressure"). ``push_all`` / ``push_all_async`` resend the refused
   ones of a fixed list until all are taken, for callers that produce nothing meanwhile.
3. ``reject(group_ids)`` for episodes thrown away (one group id per episode), so the slot is freed and the group
   does not wait for them.

A push of an episode its group no longer expects (``actor_lost``: its actor was declared dead, perhaps while its
last push was still on the way; or the group was already consumed or dropped) is dropped and counted in
``stats().late_pushes``: it was rejected once. A rejection of one is ignored and counted in ``late_rejects``. So
is a member of a group released partial (``buffer.partial_groups=release``) but not yet consumed: the buffer drops
it (``PushResult.late``) and it counts as thrown away for admission, never as a second group with the same id.

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
from async_agent_rl.staleness import AdmissionState
from async_agent_rl.stats import BufferStats, new_incarnation
from async_agent_rl.waits import WaitTimeout, bounded, within
from buffer.replay_buffer import PushResult, ReplayBuffer, SnapshotError, peek_group_id

SNAPSHOT_FILE = "replay_buffer.snapshot"


class BufferActor:
    """``consumed_per_version``: trajectories the learner consumes per policy version (``learner.batch_size *
    weight_sync.every_steps``); ``max_concurrent``: episodes in flight over all rollout actors;
    ``max_trajectory_tokens``: the longest trajectory (``Config.max_trajectory_tokens``), the room the buffer promises
    each member of a group under way (``buffer.replay_buffer``, "Capacity and backpressure")."""

    def __init__(self, config: BufferConfig, *, group_size: int, consumed_per_version: int, max_concurrent: int,
                 batch_size: int, max_trajectory_tokens: int, pad_id: int = 0):
        self.config = config
        self.group_size = group_size
        self.max_trajectory_tokens = max_trajectory_tokens
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
        self.buffer = self._new_buffer()
        self._samples = 0
        self.incarnation = new_incarnation()
        self._owner: dict[str, str] = {}  # group id -> the rollout actor running it (while it is open)
        self._prompts: dict[str, str] = {}  # group id -> its prompt's id, as admitted (while it is open)
        self._cursors: dict[str, dict] = {}  # actor id -> its prompt stream's position after its last admitted group
        self._redo: dict[str, str] = {}  # restored groups in flight at the snapshot, not claimed yet -> prompt id
        self.resumed: dict = {}  # what the last restore kept (``restore``)
        self._lost: dict[str, int] = {}
        self._late_pushes = 0
        self._late_rejects = 0
        self._deferred: Optional[list[tuple[int, str]]] = None  # evictions seen inside a push
        self._latest: list[bytes] = []  # the latest batch handed to the learner (``latest_batch``)

    def _new_buffer(self) -> ReplayBuffer:
        return ReplayBuffer(self.config, self.group_size, max_trajectory_tokens=self.max_trajectory_tokens,
                            on_evict=self._on_evict, on_consume=self._on_consume)

    def _wake(self) -> None:
        self._changed.set()

    def _on_evict(self, n: int, group_id: str) -> None:
        if self._deferred is not None:  # a group completed by this push was filtered: its members are not counted yet
            self._deferred.append((n, group_id))
        else:
            self._closed(group_id)
            self.admission.on_evicted(group_id, n)

    def _on_consume(self, group_id: str) -> None:
        self._closed(group_id)
        self.admission.on_consumed(group_id)

    def _closed(self, group_id: str) -> None:
        self._owner.pop(group_id, None)
        self._prompts.pop(group_id, None)
        self._redo.pop(group_id, None)

    def _running(self, group_id: str) -> int:
        group = self.admission.open.get(group_id)
        return 0 if group is None else group.running

    # ---------------------------------------------------------------------------------------- rollout actors
    def try_start(self, n: int, version: int, group_id: str, actor_id: str = "", prompt: Optional[dict] = None) -> int:
        """Admission for one group of ``n`` (= group size) episodes at policy ``version``; returns ``n`` or 0. The
        grant is tracked per actor so ``actor_lost`` can account for it. ``prompt`` (``RolloutWorker``'s ``Admit``):
        ``{"id": the prompt's example id, "cursor": the actor's prompt stream position after it}``; a granted one is
        kept with the group and the actor (``snapshot``: a resume generates the group again if it is in flight and
        continues the actor's stream from there; ``claim``)."""
        granted = self.admission.try_start(n, version, group_id)
        if granted:
            self._owner[group_id] = actor_id
            if prompt:
                if prompt.get("id") is not None:
                    self._prompts[group_id] = str(prompt["id"])
                if prompt.get("cursor") is not None:
                    self._cursors[actor_id] = prompt["cursor"]
        return granted

    def claim(self, actor_id: str) -> dict:
        """What rollout actor ``actor_id`` takes up when it starts (``RolloutActor.start``): ``{"groups": [[group
        id, prompt id, members to generate], ...], "cursor": its prompt stream's position, or None}``. The groups are
        those a restored snapshot had in flight and gave to this actor (``restore``), each handed out once; their
        members count as running until they arrive or are rejected. The position is the one after the last group
        it had admitted (a restarted actor continues its stream too)."""
        groups = []
        for gid in [g for g in self._redo if self._owner.get(g) == actor_id]:
            prompt = self._redo.pop(gid)
            if self._running(gid) > 0:
                groups.append([gid, prompt, self._running(gid)])
        return {"groups": groups, "cursor": self._cursors.get(actor_id)}

    def push_many(self, blobs: Sequence[bytes]) -> PushResult:
        """Store ``blobs``: every one is taken but those in ``PushResult.refused`` (no room; push them again). A
        member of a group that is no longer expecting it (module docstring: its actor was counted lost, or the group
        was already consumed or dropped) is taken and dropped, counted in ``late_pushes``."""
        expecting: dict[str, int] = {}
        kept: list[int] = []
        for i, b in enumerate(blobs):
            gid = peek_group_id(b)
            left = expecting.setdefault(gid, self._running(gid))
            if left > 0:
                expecting[gid] = left - 1
                kept.append(i)
        if len(kept) == len(blobs):
            return self._push(blobs)
        result = self._push([blobs[i] for i in kept])
        self._late_pushes += len(blobs) - len(kept)  # never refused, so never resent: each counts once
        dropped = sorted((set(range(len(blobs))) - set(kept)) | {kept[i] for i in result.late})
        return PushResult(len(blobs), tuple(kept[i] for i in result.refused), tuple(dropped))

    def _push(self, blobs: Sequence[bytes]) -> PushResult:
        if not blobs:
            return PushResult(0)
        self._deferred = []
        try:
            result = self.buffer.push(blobs)
        finally:
            deferred, self._deferred = self._deferred, None
        late = set(result.late)  # their group was released before they came (partial_groups=release): thrown away
        for i, blob in enumerate(blobs):
            if i in late:
                self.admission.on_finished(peek_group_id(blob), 1, accepted=False)
            elif i not in result.refused:
                self.admission.on_finished(peek_group_id(blob), 1, accepted=True)
        self._late_pushes += len(late)
        for n, gid in deferred:
            self._on_evict(n, gid)
        if result.accepted:
            self._wake()
        return result

    def reject(self, group_ids: Sequence[str]) -> None:
        """One member of each listed group was thrown away. A rejection for a group no longer expecting members
        (its actor was already counted lost) is ignored and counted in ``late_rejects``."""
        taken = []
        for gid in group_ids:
            if self._running(gid) > 0:
                self.admission.on_finished(gid, 1, accepted=False)
                taken.append(gid)
                if gid not in self.admission.open:
                    self._closed(gid)
            else:
                self._late_rejects += 1
        if taken:
            self.buffer.reject(taken)
        self._wake()

    def actor_lost(self, actor_id: str) -> int:
        """A rollout actor died: its in-flight episodes will never arrive. Each is rejected (its group released
        short, or dropped and its admission unit freed) and counted in ``stats().lost_episodes``; returns how
        many. A push of them arriving later is dropped and counted in ``late_pushes``."""
        lost = [gid for gid, actor in list(self._owner.items()) if actor == actor_id
                for _ in range(self._running(gid))]
        if lost:
            self.reject(lost)
        for gid in [g for g in self._redo if self._owner.get(g) == actor_id]:  # restored, never claimed: lost too
            del self._redo[gid]
        self._lost[actor_id] = self._lost.get(actor_id, 0) + len(lost)
        return len(lost)

    # ------------------------------------------------------------------------------------------------ learner
    def sample(self, batch_size: int, learner_version: int) -> Optional[list[bytes]]:
        blobs = self.buffer.sample_wire(batch_size, learner_version)
        if blobs is not None:
            self._latest = blobs
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
                return pack_batch([Trajectory.decode(b) for b in blobs], self.pad_id, rows=self.batch_size)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            expiry = self.buffer.partial_timeout_in()
            try:
                await asyncio.wait_for(self._changed.wait(), left if expiry is None else min(left, expiry + 0.01))
            except asyncio.TimeoutError:
                pass

    def latest_batch(self, n: int) -> list[bytes]:
        """Up to ``n`` trajectories (wire bytes) of the latest batch handed to the learner, the first member of each
        group, then the second, ...: the run's sample of training episodes (``monitoring.episode_sample``)."""
        groups: dict[str, list[bytes]] = {}
        for blob in self._latest:
            groups.setdefault(peek_group_id(blob), []).append(blob)
        ranked = sorted(((rank, i) for i, g in enumerate(groups.values()) for rank in range(len(g))))
        members = list(groups.values())
        return [members[i][rank] for rank, i in ranked[: max(0, n)]]

    # ---------------------------------------------------------------------------------------- monitoring, disk
    def stats(self) -> BufferStats:
        return dataclasses.replace(self.buffer.stats(), incarnation=self.incarnation, admission=self.admission.stats(),
                                   lost_episodes=dict(self._lost), late_pushes=self._late_pushes,
                                   late_rejects=self._late_rejects)

    def _path(self, path: Optional[str]) -> Path:
        if path is not None:
            return Path(path)
        if not self.config.snapshot_dir:
            raise SnapshotError("no snapshot path given and buffer.snapshot_dir is not set")
        return Path(self.config.snapshot_dir) / SNAPSHOT_FILE

    def snapshot(self, path: Optional[str] = None) -> str:
        """Write the buffer, the admission counters, the groups in flight (``in_flight``: group id -> ``{"prompt":
        its prompt id or None, "actor": the actor running it}``, every open group with members running) and each
        actor's prompt stream position (``cursors``); returns the file written."""
        in_flight = {gid: {"prompt": self._prompts.get(gid), "actor": self._owner.get(gid, "")}
                     for gid, g in self.admission.open.items() if g.running > 0}
        extra = {"admission": self.admission.state(), "in_flight": in_flight, "cursors": dict(self._cursors)}
        return str(self.buffer.snapshot(self._path(path), extra=extra))

    def restore(self, path: Optional[str] = None, actors: Optional[Sequence[str]] = None) -> BufferStats:
        """Replace the state with a snapshot's (raises ``SnapshotError`` naming the file); returns ``stats()``.

        What a resume keeps: every counter (buffer, admission, staleness histogram) as it was at the snapshot, the
        ready and pending groups, and the groups in flight: their members still count as running and their prompts
        are handed out again (``claim``) to the actor that ran them, or, when ``actors`` (the run's actor ids) no
        longer has it, to one of ``actors`` in turn; each actor's prompt stream position is handed back to it. A
        group in flight whose prompt was not recorded (a snapshot of an older version, or a producer that gave
        none) cannot be generated again: its running members count as rejected, as before (its group is released
        short or, with no member arrived, dropped). ``self.resumed`` says what was kept: ``{"groups": groups to
        generate again, "episodes": their members, "rejected": episodes counted rejected instead, "cursors": prompt
        stream positions kept, "recorded": whether the snapshot recorded the groups in flight (False: an older
        version's), "cursors_recorded": the same for the positions}``."""
        buffer, extra = ReplayBuffer.restore(self._path(path), self.config, self.group_size,
                                             max_trajectory_tokens=self.max_trajectory_tokens,
                                             on_evict=self._on_evict, on_consume=self._on_consume)
        try:
            state = extra["admission"]
            running = {str(gid): int(g[1]) for gid, g in dict(state.get("open", {})).items()}
            recorded = extra.get("in_flight")  # None: an older version's snapshot recorded nothing
            in_flight = {str(gid): dict(g) for gid, g in dict(recorded or {}).items()}
            redo = {gid: str(in_flight[gid]["prompt"]) for gid, n in running.items()
                    if n > 0 and in_flight.get(gid, {}).get("prompt") is not None}
            admission = AdmissionState.resumed(state, **self._admission_args, keep_running=set(redo))
            cursors = {str(a): dict(c) for a, c in dict(extra.get("cursors") or {}).items()}
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise SnapshotError(f"snapshot {self._path(path)} has no valid admission counters: {e!r}") from None
        self.buffer, self.admission, self._cursors = buffer, admission, cursors
        self._owner, self._prompts, self._redo = {}, dict(redo), dict(redo)
        spare = list(actors or [])
        for k, gid in enumerate(redo):
            owner = str(in_flight[gid].get("actor") or "")
            self._owner[gid] = owner if not spare or owner in spare else spare[k % len(spare)]
        # the members running in the other groups did not survive the restart: their groups stop waiting for them
        rejected = [gid for gid, n in running.items() if gid not in redo for _ in range(n)]
        self.buffer.reject(rejected)
        self.resumed = {"groups": len(redo), "episodes": sum(running[g] for g in redo), "rejected": len(rejected),
                        "cursors": len(cursors), "recorded": recorded is not None,
                        "cursors_recorded": extra.get("cursors") is not None}
        self.incarnation = new_incarnation()  # its totals are the snapshot's from here on
        self._wake()
        return self.stats()

    def resume_report(self) -> dict:
        """``self.resumed``: what the last ``restore`` kept."""
        return dict(self.resumed)


def create_buffer_actor(cfg: Config, *, pad_id: int, name: Optional[str] = None) -> "ray.actor.ActorHandle":
    """Start the buffer actor with resources and sizes from ``cfg``; its batches are padded with ``pad_id``."""
    actor_cls = ray.remote(num_cpus=cfg.cluster.buffer_cpus, resources=dict(cfg.cluster.buffer_resources))(BufferActor)
    if name is not None:
        actor_cls = actor_cls.options(name=name)
    return actor_cls.remote(
        cfg.buffer,
        group_size=cfg.rollout.group_size,
        consumed_per_version=cfg.learner.batch_size * cfg.weight_sync.every_steps,
        max_concurrent=cfg.rollout.num_actors * cfg.rollout.max_concurrent_episodes,
        batch_size=cfg.learner.batch_size,
        max_trajectory_tokens=cfg.max_trajectory_tokens,
        pad_id=pad_id,
    )


CALL_TIMEOUT_S = 120.0  # one push_many call must be answered within this (cluster.actor_timeout_s's default)


async def push_async(
    actor: "ray.actor.ActorHandle", blobs: Sequence[bytes], *, call_timeout_s: float = CALL_TIMEOUT_S
) -> PushResult:
    """One ``push_many`` call: the buffer takes what fits and names the rest (module docstring, step 2). Raises
    ``TimeoutError`` when it is not answered within ``call_timeout_s`` (a buffer stopped or hung)."""
    try:
        return await within(actor.push_many.remote(list(blobs)), call_timeout_s, "the replay buffer (push_many)")
    except WaitTimeout:
        raise TimeoutError(_silent(call_timeout_s, len(blobs))) from None


def push_all(
    actor: "ray.actor.ActorHandle", blobs: Sequence[bytes], *, poll_s: float = 0.02, timeout_s: Optional[float] = None,
    call_timeout_s: float = CALL_TIMEOUT_S,
) -> int:
    """Push ``blobs`` through backpressure: while the buffer is full, wait ``poll_s`` and resend the refused ones.
    Returns how many times it waited; raises ``TimeoutError`` after ``timeout_s`` (None: as long as the buffer
    answers and stays full), and when one call is not answered within ``call_timeout_s`` (a buffer stopped or hung).
    For a caller that produces nothing while it waits; a producer that does sends its new trajectories along with
    the refused ones (module docstring, step 2)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rest, waits = list(blobs), 0
    while rest:
        try:
            result: PushResult = bounded(ray.get, actor.push_many.remote(rest), timeout_s=call_timeout_s,
                                         what="the replay buffer (push_many)")
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(_silent(call_timeout_s, len(rest))) from None
        rest = result.rest(rest)
        if rest:
            _check_deadline(deadline, len(rest), timeout_s)
            waits += 1
            time.sleep(poll_s)
    return waits


async def push_all_async(
    actor: "ray.actor.ActorHandle", blobs: Sequence[bytes], *, poll_s: float = 0.02, timeout_s: Optional[float] = None,
    call_timeout_s: float = CALL_TIMEOUT_S,
) -> int:
    """``push_all`` for async callers (rollout actors running an event loop)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rest, waits = list(blobs), 0
    while rest:
        result = await push_async(actor, rest, call_timeout_s=call_timeout_s)
        rest = result.rest(rest)
        if rest:
            _check_deadline(deadline, len(rest), timeout_s)
            waits += 1
            await asyncio.sleep(poll_s)
    return waits


def _silent(call_timeout_s: float, left: int) -> str:
    return f"the replay buffer did not answer push_many within {call_timeout_s:g} s; {left} trajectories not pushed"


def _check_deadline(deadline: Optional[float], left: int, timeout_s: Optional[float]) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"replay buffer stayed full for {timeout_s} s; {left} trajectories not pushed")
