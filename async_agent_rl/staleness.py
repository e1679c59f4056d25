"""Staleness arithmetic and the admission rule that paces generation (docs/ALGORITHMS.md section 4).

Staleness of a trajectory consumed by a learner at version ``v``::

    staleness = v - min(versions of its generated tokens)

A trajectory with no generated token has nothing off-policy in it: its staleness is 0. The one knob is
``max_staleness`` (eta); eta = 0 is synchronous, on-policy training.

Units: whole groups. The learner consumes ``N = B / G`` GRPO groups per policy version (``B`` trajectories, groups
of ``G``); a batch is always ``N`` whole groups, and a group that lost members (rejected, its actor died, released
partial) still fills one group's place (the batch then has fewer than ``B`` trajectories: the learner pads the rest
with rows that carry no loss). So counting in groups, not trajectories, is exact whatever is lost.

Admission (pacing). Let ``live`` be the groups ever admitted that were not dropped (dropped: evicted unconsumed,
or every member thrown away), consumed ones included, and ``v_old`` the oldest admission version among the groups
not yet consumed nor dropped (the *open* groups), or the asking engine's version ``v`` if older or none is open.
A new group may start only while::

    live + 1 <= (eta + v_old + 1) * N        and        running + G <= max_concurrent

Claim 1 (bounded staleness without discarding). If every token of a group admitted at version ``a`` is generated
with weights of version ``>= a``, no group is ever consumed with staleness above eta, in any completion order and
any serving order: finished work never goes stale. Proof: let ``s`` be open, admitted at ``a``. While ``s`` is open,
every admission saw ``v_old <= a``, and ``live`` only grows by admissions, so ``live <= (eta + a + 1) * N`` for as
long as ``s`` is open (groups admitted before ``s`` were counted when it was admitted). The learner at version ``u``
has consumed ``u * N`` groups; without ``s`` it can consume at most ``live - 1 <= (eta + a + 1) * N - 1`` of them,
so it reaches at most version ``eta + a`` before it consumes ``s``: staleness ``<= eta``. The price is pacing: the
oldest open group holds back admission, and at learner version ``eta + a`` the learner waits for it.

Claim 2 (no deadlock). Suppose the learner at version ``u`` waits (fewer than ``N`` ready groups: ``R < N``) and
nothing is running or pending. Every open group is ready and (claim 1) has ``v_old >= u - eta``; engines reload
every published version, so an asking engine has ``v >= u - eta`` too. Then ``live = u * N + R`` and
``(eta + v_old + 1) * N >= (u + 1) * N >= live + 1``: a group is admitted. Lost episodes cannot block this: a group
is one unit however many of its members arrive, and a group none of whose members arrive is dropped and frees its
unit. A full replay buffer cannot block it either: finished episodes refused for room wait in their actor's outbox
while the buffer takes every member of the groups it holds (room is promised to them), so those groups complete;
fewer than ``N`` ready groups then take less than a batch, and the buffer holds at least one, so a new group finds
room (``buffer.replay_buffer``, "Capacity and backpressure": each missing member is promised a slot and the longest
trajectory's tokens, and a config's capacities hold a batch of the longest, so this holds for tokens too).
``tests/unit/test_staleness.py`` checks both claims on a model of the whole system over random loss patterns, eta
0..8, group sizes 1..8 and buffer capacities from one batch up (``tests/unit/test_stalling_configs.py`` the token
capacity).

eta = 0 is synchronous: every group admitted at version ``v`` is consumed at ``v``.

The replay buffer still evicts a group found stale at sampling time (a safety net: a resumed run with a smaller
eta, an engine that mislabels its version); with pacing it never fires, and ``stats().evicted["stale"]`` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Iterable

from async_agent_rl.records import OBS_VERSION
from async_agent_rl.stats import AdmissionStats


class AdmissionError(ValueError):
    """The admission counters were driven inconsistently (more finished than started, an unknown group, ...)."""


def staleness(learner_version: int, traj_min_version: int) -> int:
    """``learner_version - traj_min_version``; 0 when the trajectory generated nothing (``OBS_VERSION``)."""
    if traj_min_version == OBS_VERSION:
        return 0
    return learner_version - traj_min_version


def is_stale(learner_version: int, traj_min_version: int, max_staleness: int) -> bool:
    """True when the trajectory must be evicted: ``staleness > max_staleness``."""
    return staleness(learner_version, traj_min_version) > max_staleness


def group_min_version(min_versions: Iterable[int]) -> int:
    """Oldest version over several trajectories, ignoring those that generated nothing (``OBS_VERSION`` if all)."""
    generated = [v for v in min_versions if v != OBS_VERSION]
    return min(generated) if generated else OBS_VERSION


def admission_room(version: int, *, max_staleness: int, groups_per_version: int, live_groups: int,
                   oldest_open_version: int | None) -> int:
    """Groups that may start now by the staleness bound (module docstring):
    ``max(0, (eta + v_old + 1) * N - live)`` with ``v_old = min(version, oldest_open_version)``."""
    v_old = version if oldest_open_version is None else min(version, oldest_open_version)
    return max(0, (max_staleness + v_old + 1) * groups_per_version - live_groups)


@dataclass
class _OpenGroup:
    version: int  # the engine version it was admitted at
    running: int  # members not yet ended
    kept: int = 0  # members accepted into the buffer


@dataclass
class AdmissionState:
    """Counters behind the admission rule; the buffer actor owns one and the rollout actors consult it.

    ``batch_size``: trajectories the learner consumes per policy version (a multiple of ``granule``, the group size).
    Trajectory counters (``started``, ``accepted``, ``rejected``, ``evicted``; ``running = started - accepted -
    rejected``) are for monitoring; the rule counts groups (``groups_started``, ``groups_dropped``,
    ``groups_consumed``, and the open groups with their admission versions).
    """

    max_staleness: int
    batch_size: int
    max_concurrent: int
    granule: int = 1
    started: int = 0
    accepted: int = 0
    rejected: int = 0
    evicted: int = 0
    groups_started: int = 0
    groups_dropped: int = 0
    groups_consumed: int = 0
    open: dict[str, _OpenGroup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.batch_size < 1 or self.max_concurrent < 1 or self.granule < 1:
            raise ValueError(
                f"AdmissionState needs max_staleness >= 0, batch_size, max_concurrent and granule >= 1, got "
                f"max_staleness={self.max_staleness}, batch_size={self.batch_size}, "
                f"max_concurrent={self.max_concurrent}, granule={self.granule}")
        if self.batch_size % self.granule:
            raise ValueError(f"the trajectories consumed per version ({self.batch_size}) must be a multiple of the "
                             f"group size ({self.granule}): batches are made of whole groups")
        if self.max_concurrent < self.granule:
            raise ValueError(f"max_concurrent ({self.max_concurrent}) is below the group size ({self.granule}): "
                             "no group could ever start")

    @property
    def groups_per_version(self) -> int:
        return self.batch_size // self.granule

    @property
    def running(self) -> int:
        return self.started - self.accepted - self.rejected

    @property
    def live(self) -> int:
        """Accepted trajectories not evicted (consumed ones included)."""
        return self.accepted - self.evicted

    @property
    def live_groups(self) -> int:
        return self.groups_started - self.groups_dropped

    @property
    def oldest_open_version(self) -> int | None:
        return min((g.version for g in self.open.values()), default=None)

    def room(self, version: int) -> int:
        """Groups the staleness bound lets start now at ``version`` (the concurrency cap aside)."""
        return admission_room(version, max_staleness=self.max_staleness, groups_per_version=self.groups_per_version,
                              live_groups=self.live_groups, oldest_open_version=self.oldest_open_version)

    def capacity(self, version: int) -> int:
        """Episodes that may start now at ``version``: whole groups, by both bounds."""
        by_concurrency = (self.max_concurrent - self.running) // self.granule
        return max(0, min(self.room(version), by_concurrency)) * self.granule

    def try_start(self, n: int, version: int, group_id: str) -> int:
        """Ask to start one group (``n`` must be the group size) with weights of ``version``; returns ``n`` if it
        may start (its members count as running at once) or 0 (wait for the learner or for running episodes)."""
        if n != self.granule:
            raise AdmissionError(f"try_start admits one group of {self.granule} episodes at a time, not {n}")
        if group_id in self.open:
            raise AdmissionError(f"group {group_id!r} was already admitted")
        if self.capacity(version) < n:
            return 0
        self.open[group_id] = _OpenGroup(version, running=n)
        self.groups_started += 1
        self.started += n
        return n

    def _group(self, group_id: str) -> _OpenGroup:
        group = self.open.get(group_id)
        if group is None:
            raise AdmissionError(f"group {group_id!r} is not open (never admitted, or already consumed or dropped)")
        return group

    def on_finished(self, group_id: str, n: int, accepted: bool) -> None:
        """``n`` running members of ``group_id`` ended: taken by the buffer (``accepted``) or thrown away. A group
        all of whose members were thrown away is dropped: its unit is free again."""
        group = self._group(group_id)
        if n < 0 or n > group.running:
            raise AdmissionError(f"{n} members of group {group_id!r} reported finished but only {group.running} "
                                 "are running")
        group.running -= n
        if accepted:
            group.kept += n
            self.accepted += n
        else:
            self.rejected += n
            if group.running == 0 and group.kept == 0:
                self._close(group_id, dropped=True)

    def on_evicted(self, group_id: str, n: int) -> None:
        """The buffer evicted group ``group_id`` (``n`` accepted members) unconsumed: dropped, its unit is free."""
        group = self._group(group_id)
        if n != group.kept:
            raise AdmissionError(f"{n} trajectories of group {group_id!r} reported evicted; {group.kept} were "
                                 "accepted")
        self.evicted += n
        if group.running:  # members still under way are thrown away when they arrive (the buffer refuses them)
            self.rejected += group.running
        self._close(group_id, dropped=True)

    def on_consumed(self, group_id: str) -> None:
        """The learner took group ``group_id`` in a batch: it leaves the open set (and still counts in ``live``)."""
        group = self._group(group_id)
        self.rejected += group.running  # released before they arrived (partial_groups=release): too late now
        self.groups_consumed += 1
        self._close(group_id, dropped=False)

    def _close(self, group_id: str, dropped: bool) -> None:
        del self.open[group_id]
        if dropped:
            self.groups_dropped += 1

    # ------------------------------------------------------------------------------------------- monitoring
    def stats(self) -> AdmissionStats:
        return AdmissionStats(**self.counters())

    def counters(self) -> dict[str, int]:
        oldest = self.oldest_open_version
        return {
            "started": self.started,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "evicted": self.evicted,
            "running": self.running,
            "groups_started": self.groups_started,
            "groups_dropped": self.groups_dropped,
            "groups_consumed": self.groups_consumed,
            "groups_open": len(self.open),
            "oldest_open_version": -1 if oldest is None else oldest,
        }

    # ----------------------------------------------------------------------------------------------- restart
    def state(self) -> dict[str, Any]:
        """Everything ``resumed`` needs (msgpack-able)."""
        return {**self.counters(), "open": {gid: [g.version, g.running, g.kept] for gid, g in self.open.items()}}

    @classmethod
    def resumed(cls, state: dict[str, Any], *, max_staleness: int, batch_size: int, max_concurrent: int,
                granule: int = 1, keep_running: Collection[str] = ()) -> "AdmissionState":
        """Rebuild from ``state()`` saved before a restart. The running members of the groups in ``keep_running``
        stay running, their groups open at their admission version: they are generated again (a resume issues
        their prompts first), so every counter is the saved one. Those of the other groups did not survive: they
        count as rejected (a group none of whose members had arrived is dropped)."""
        adm = cls(max_staleness=max_staleness, batch_size=batch_size, max_concurrent=max_concurrent,
                  granule=granule, started=int(state["started"]), accepted=int(state["accepted"]),
                  rejected=int(state["rejected"]), evicted=int(state["evicted"]),
                  groups_started=int(state.get("groups_started", 0)),
                  groups_dropped=int(state.get("groups_dropped", 0)),
                  groups_consumed=int(state.get("groups_consumed", 0)))
        adm.rejected += int(state["running"])
        for gid, (version, running, kept) in dict(state.get("open", {})).items():
            if str(gid) in keep_running and int(running) > 0:
                adm.rejected -= int(running)
                adm.open[str(gid)] = _OpenGroup(int(version), running=int(running), kept=int(kept))
            elif kept:
                adm.open[str(gid)] = _OpenGroup(int(version), running=0, kept=int(kept))
            else:
                adm.groups_dropped += 1
        return adm
