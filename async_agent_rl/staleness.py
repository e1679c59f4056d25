"""Staleness arithmetic and AReaL's admission rule (docs/ALGORITHMS.md section 4).

Staleness of a trajectory consumed by a learner at version ``v``::

    staleness = v - min(versions of its generated tokens)

A trajectory with no generated token has nothing off-policy in it: its staleness is 0. The one knob is
``max_staleness`` (eta); eta = 0 is synchronous, on-policy training.

Admission (AReaL's ``StalenessManager``). With ``B`` trajectories consumed per policy version, ``accepted`` the
finished episodes the buffer took and still counts (accepted minus evicted) and ``running`` the episodes in flight,
a new episode may start at policy version ``v`` only while::

    accepted + running < (eta + v + 1) * B        and        running < max_concurrent

so ``capacity(v) = max(0, min(max_concurrent - running, (eta + v + 1) * B - (accepted + running)))``.

Claim: if the learner consumes exactly ``B`` trajectories per version, in the order they were admitted, and an
episode admitted at version ``v`` generates with weights of version ``>= v``, no consumed trajectory has
staleness above eta. Proof: let trajectory ``s`` be admitted at version ``v``. Every trajectory consumed before
``s`` was admitted before it and neither rejected nor evicted, so it is counted in ``accepted + running`` at the
moment ``s`` starts; with ``s`` itself that count is at most ``(eta + v + 1) * B``, so ``s`` has rank
``r <= (eta + v + 1) * B - 1`` in the consumption order and is consumed at learner version ``floor(r / B) <= eta + v``.
Its staleness is at most ``eta + v - v = eta``.

With eta = 0 the order does not even matter: the learner at version ``v`` needs ``(v + 1) * B`` trajectories in
total, which is exactly the admission bound, so every trajectory started at ``v`` is consumed at ``v``.

Episodes finish out of order in practice, so a straggler can still be overtaken and go stale; the replay buffer
evicts (and counts) those at sampling time, which is why an eviction gives its admission slot back here.

Whole groups. Grants come in whole GRPO groups (``granule``), and a group that lost a member (rejected, its actor
died) frees less than a group. Rounding that room down would stop an eta = 0 run for good: the version's groups
then hold ``B - 1`` rows, nothing is stale, nothing is freed. So the staleness room is rounded UP to a whole group
(a replacement group at the same version; the concurrency cap is still rounded down): admission then runs at most
``granule - 1`` episodes over the bound, and whatever that overshoot makes stale (at eta = 0: the short group, once
the batch was filled from whole groups) is evicted and counted by the buffer. No consumed trajectory ever has
staleness above eta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from async_agent_rl.records import OBS_VERSION
from async_agent_rl.stats import AdmissionStats


class AdmissionError(ValueError):
    """The admission counters were driven inconsistently (more finished than started, ...)."""


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


def admission_capacity(
    version: int, *, max_staleness: int, batch_size: int, accepted: int, running: int, max_concurrent: int
) -> int:
    """Episodes that may start now at policy ``version``:
    ``max(0, min(max_concurrent - running, (max_staleness + version + 1) * batch_size - (accepted + running)))``.

    ``accepted`` counts finished episodes the buffer still accounts for (accepted minus evicted); ``batch_size`` is
    the number of trajectories the learner consumes per policy version.
    """
    by_staleness = (max_staleness + version + 1) * batch_size - (accepted + running)
    return max(0, min(max_concurrent - running, by_staleness))


@dataclass
class AdmissionState:
    """Counters behind the admission rule; the buffer actor owns one and the rollout actors consult it.

    All counters only grow. Derived: ``running = started - accepted - rejected`` (episodes in flight) and
    ``live = accepted - evicted`` (what the capacity rule calls accepted). Grants come in multiples of ``granule``
    (the GRPO group size), so a group is admitted whole or not at all.
    """

    max_staleness: int
    batch_size: int
    max_concurrent: int
    granule: int = 1
    started: int = 0
    accepted: int = 0
    rejected: int = 0
    evicted: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.batch_size < 1 or self.max_concurrent < 1 or self.granule < 1:
            raise ValueError(
                f"AdmissionState needs max_staleness >= 0, batch_size, max_concurrent and granule >= 1, got {self}"
            )

    @property
    def running(self) -> int:
        return self.started - self.accepted - self.rejected

    @property
    def live(self) -> int:
        return self.accepted - self.evicted

    def capacity(self, version: int) -> int:
        return admission_capacity(
            version,
            max_staleness=self.max_staleness,
            batch_size=self.batch_size,
            accepted=self.live,
            running=self.running,
            max_concurrent=self.max_concurrent,
        )

    def try_start(self, n: int, version: int) -> int:
        """Ask to start ``n`` episodes with weights of ``version``; returns how many may start (a multiple of
        ``granule``, possibly 0: wait for the learner to move on), the staleness room rounded up to a whole group
        (module docstring). The grant counts as running at once."""
        if n < 1:
            raise AdmissionError(f"try_start needs n >= 1, got {n}")
        g = self.granule
        by_staleness = (self.max_staleness + version + 1) * self.batch_size - (self.live + self.running)
        if by_staleness <= 0:
            return 0
        granted = max(0, min(n // g, (self.max_concurrent - self.running) // g, -(-by_staleness // g))) * g
        self.started += granted
        return granted

    def on_finished(self, n: int, accepted: bool) -> None:
        """``n`` running episodes ended: taken by the buffer (``accepted``) or thrown away (rejected)."""
        if n < 0 or n > self.running:
            raise AdmissionError(f"{n} episodes reported finished but only {self.running} are running")
        if accepted:
            self.accepted += n
        else:
            self.rejected += n

    def on_evicted(self, n: int) -> None:
        """The buffer evicted ``n`` accepted trajectories; their slots become free again."""
        if n < 0 or n > self.live:
            raise AdmissionError(f"{n} trajectories reported evicted but only {self.live} are accepted and live")
        self.evicted += n

    def stats(self) -> AdmissionStats:
        return AdmissionStats(**self.counters())

    def counters(self) -> dict[str, int]:
        return {
            "started": self.started,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "evicted": self.evicted,
            "running": self.running,
        }

    @classmethod
    def resumed(
        cls, counters: dict[str, int], *, max_staleness: int, batch_size: int, max_concurrent: int, granule: int = 1
    ) -> "AdmissionState":
        """Rebuild from ``counters()`` saved before a restart. Episodes that were running did not survive the
        restart: they are counted as rejected, so ``running`` starts at 0."""
        return cls(
            max_staleness=max_staleness,
            batch_size=batch_size,
            max_concurrent=max_concurrent,
            granule=granule,
            started=counters["started"],
            accepted=counters["accepted"],
            rejected=counters["rejected"] + counters["running"],
            evicted=counters["evicted"],
        )
