"""The policy version's one holder: which version the rollout engines run, from which learner step, and with which
weights.

``PolicyVersions`` is the only place the driver keeps the policy version. It holds the version last published (the
one the buffer is asked to sample for), the learner step whose weights that version is, the reference to those
weights on the object-store path, and the publisher. Everything that changes the version goes through it:

- ``stepped(step)``: the learner finished ``step``; every ``weight_sync.every_steps`` steps the learner bumps its
  version and the new weights are published to every rollout actor (``publish``);
- ``catch_up(actor, i)``: a rollout actor restarted in a new process gets the current version's weights before it
  runs again (on the collective path, where no copy of the published weights is kept, the learner's own weights if
  it has not stepped since the last publish, else a new version published to every actor);
- ``restored(step, version)``: a resumed run starts from its checkpoint's step and version;
- ``retired(actor)``: a rollout actor the run gave up gets no more publishes.

The learner's newest step is ``learner_step``: the driver keeps no other copy of it.

A publish that fails is reported on the console; ``PUBLISH_FAILURES_FATAL`` failures in a row end the run.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import ray

from async_agent_rl.config import Config
from async_agent_rl.stats import PublishStats
from driver.limits import RunFailed, ask, cause
from driver.weight_sync import WeightsRefused

log = logging.getLogger(__name__)

PUBLISH_FAILURES_FATAL = 3  # weight publishes failing in a row that end the run


class PolicyVersions:
    """The version, the step it was published at and its weights (see the module docstring). ``learner``: the
    learner group (``bump_version``, ``state_dict_ref``); ``publisher``: a ``driver.weight_sync`` publisher;
    ``say``: the run's console."""

    def __init__(self, cfg: Config, learner: Any, publisher: Any, say: Callable[[str], None]):
        self.cfg, self.learner, self.publisher, self.say = cfg, learner, publisher, say
        self.version = 0  # the version last published: what the engines run and the buffer samples for
        self.learner_step = 0  # the learner's newest step
        self.published_step = 0  # the learner step whose weights are version ``self.version``
        self.weights_ref = None  # object-store path: the last published weights (a restarted actor gets them)
        self.publish_failures = 0  # weight publishes failed in a row
        self.last_publish: tuple[int, float] | None = None  # (version, monotonic time) of the last good publish

    def restored(self, step: int, version: int) -> None:
        """A resumed run: the learner is at ``step`` and the actors start from its checkpoint's policy, ``version``."""
        self.learner_step = self.published_step = step
        self.version = version

    def stepped(self, step: int) -> PublishStats | None:
        """The learner finished ``step``. On a publishing step (every ``weight_sync.every_steps``) the learner bumps
        its version and the weights are published; returns the publish's stats (None: no publish, or it failed)."""
        self.learner_step = step
        if step % self.cfg.weight_sync.every_steps:
            return None
        self._bump()
        return self.publish()

    def _bump(self) -> None:
        self.version = self.learner.bump_version()
        self.published_step = self.learner_step
        # the object-store path keeps the weights it published (a restarted actor gets them); the collective path
        # sends them from the learner and takes them again for a restarted actor only
        self.weights_ref = self.learner.state_dict_ref() if self.cfg.weight_sync.method == "object_store" else None

    def publish(self) -> PublishStats | None:
        """Publish the learner's weights as ``self.version`` (both paths); None when the publish failed.

        A failure (an engine's WeightsError, no room in /dev/shm for the fp32 copy, a refusal of the specs, a
        non-finite tensor, a dead actor) is printed with its cause; a dead or restarted actor is then restarted by
        the fleet's supervision with the newest weights. The engines that missed it stay on older weights while the
        learner's version climbs, so ``PUBLISH_FAILURES_FATAL`` failures in a row end the run with ``RunFailed``
        naming the cause instead of training on ever staler episodes (the buffer's staleness bound would stall it)."""
        try:
            stats = self.publisher.publish(self.version, self.weights_ref)
        except (ray.exceptions.RayError, WeightsRefused, OSError) as e:
            self.publish_failures += 1
            why = cause(e)
            msg = f"weight publish of version {self.version} failed ({self.publish_failures} in a row): {why}"
            log.info(msg)  # the log file's copy: the terminal has the [fault] line
            self.say(f"[fault] {msg}")
            if self.publish_failures >= PUBLISH_FAILURES_FATAL:
                raise RunFailed(f"weight publish failed {self.publish_failures} times in a row (the engines keep older "
                                f"weights while the learner moves on); the last: {why}") from None
            return None
        self.publish_failures = 0
        self.last_publish = (self.version, time.monotonic())
        return stats

    def close(self) -> None:
        """The learner's side of the collective path's group, released before Ray shuts down (a learner that is
        already gone has nothing left to release)."""
        try:
            self.publisher.close()
        except ray.exceptions.RayError:
            pass

    def retired(self, actor: Any) -> None:
        """A rollout actor the run gave up (``Fleet.retire``): no publish goes to it any more."""
        self.publisher.remove(actor)

    def catch_up(self, actor: Any, index: int) -> None:
        """Rollout actor ``index``, just set up again in a new process, gets the current version's weights; the
        publisher is told (the collective path makes its group again before the next publish)."""
        weights, republish = self.weights_ref, False
        if weights is None and self.version > 0:  # the collective path keeps no copy of what it published
            if self.learner_step == self.published_step:  # the learner's weights are still those of self.version
                weights = self.learner.state_dict_ref()
            else:  # it stepped since (weight_sync.every_steps > 1): they are no published version, publish them
                republish = True
        if weights is not None:
            ask(actor.update_weights.remote(self.version, weights), self.cfg.cluster.actor_timeout_s,
                f"rollout actor {index}, just restarted,")
            # the actor a failed publish missed runs the current weights now: that failure is mended, and a later
            # one (another actor lost a step after) starts a count of its own. Before, two rollout nodes lost one
            # step apart were two publish failures "in a row", and a third loss would have ended the run.
            self.publish_failures = 0
        self.publisher.member_restarted()
        if republish:
            self._bump()
            self.publish()  # every actor, the restarted one included
