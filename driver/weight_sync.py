"""Weight publishing: deliver the learner's new policy version to every rollout actor. One interface, two paths.

``WeightPublisher.publish(version, state) -> PublishStats``; ``state`` maps HF parameter names to full tensors
(``Learner.state_dict_for_publish()`` or ``dict(Learner.full_parameters())``). ``publish`` returns once every actor
has applied the weights, and ``PublishStats.seconds`` is that latency (export it as a metric).

``ObjectStorePublisher`` (``weight_sync.method = "object_store"``, CPU and GPU): the numpy state dict is put in Ray's
object store ONCE per publish and every rollout actor gets ``update_weights.remote(version, ref)``. Ray resolves the
reference before the call, so the actor receives the dict itself, its arrays read zero-copy (read-only) from shared
memory; the actor reloads them into vLLM (``actors.engine.VLLMEngine.update_weights``). An ``ObjectRef`` to such a
dict (e.g. the return value of a learner actor's ``state_dict_for_publish``) is forwarded as it is, so the weights
never pass through the driver.

``CollectivePublisher`` (``weight_sync.method = "collective"``): the peers' path (verl, OpenRLHF, vLLM's RLHF
example). The learner's rank 0 and every vLLM worker of every engine form one process group of their own
(``async_agent_rl.weight_group``: gloo on CPU, NCCL on GPU, ``weight_sync.backend``), made once at start and again
after a rollout actor restarts. A publish: every learner rank takes the weights (ZeRO-3 gathers), rank 0 returns
their ``(name, dtype, shape)`` specs, every engine checks them against its model (a missing, unknown or misshaped
tensor is refused here, with ``WeightsRefused``, before anything is sent), then each engine pauses and its workers
receive the broadcast and reload in place (``actors/vllm_worker.py``) while rank 0 sends; the version is stamped as
on the other path. The weights never pass through the driver, the object store or a file.

Rollout actor contract (methods on the actor handles given to a publisher; sync or async):

- object store: ``update_weights(version, weights: Mapping[str, np.ndarray])`` -> anything with ``seconds``
  (``WeightUpdateStats``) or a dict with ``"seconds"``, or None;
- collective: ``join_weight_group(port, rank_offset, world_size, backend, timeout_s, generation)``,
  ``check_weight_specs(specs) -> None | str`` (why not) and ``update_weights_collective(version, specs)`` (as
  ``update_weights``). The learner side is ``learner.actor.LearnerGroup``.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Protocol, Sequence, Union

import numpy as np
import ray
import torch

from async_agent_rl.stats import PublishStats
from driver.limits import PhaseTimeout, wait_phase
from learner.actor import LearnerTimeout

State = Mapping[str, Union[np.ndarray, torch.Tensor]]


class WeightPublisher(Protocol):
    def publish(self, version: int, state: Any) -> PublishStats: ...

    def member_restarted(self) -> None: ...

    def remove(self, actor: Any) -> None: ...

    def close(self) -> None: ...


def _without(actors: Sequence[Any], names: Sequence[str], actor: Any) -> tuple[list[Any], list[str]]:
    """``actors`` and their ``names`` without ``actor``."""
    kept = [(a, n) for a, n in zip(actors, names) if a._actor_id != actor._actor_id]
    return [a for a, _ in kept], [n for _, n in kept]


def _names(actors: Sequence[Any]) -> list[str]:
    """How an error line names each rollout actor (its number in the run, kept when another is removed)."""
    return [f"rollout actor {i}" for i in range(len(actors))]


def _nbytes(state: State) -> int:
    return sum(int(v.nbytes) if isinstance(v, np.ndarray) else v.numel() * v.element_size() for v in state.values())


def _reported_seconds(result: Any) -> float | None:
    if isinstance(result, Mapping):
        return result.get("seconds")
    return getattr(result, "seconds", None)


class PublishTimeout(TimeoutError):
    """Some actors did not apply a publish within the publisher's ``timeout_s`` (hung, stopped, or overloaded)."""


PUBLISH_TIMEOUT_S = 600.0  # a publisher made without a limit of its own (the driver gives the publish phase's)


class ObjectStorePublisher:
    """Publish through Ray's object store to ``actors`` (handles with ``update_weights``; see module docstring).
    ``timeout_s``: how long every actor has to apply a publish; one that does not is named in a ``PublishTimeout``
    instead of holding the driver forever (a stopped actor never answers). ``stops``: the run's ``StopRequests``,
    looked at every second of the wait: a stop request ends the publish at once (``StopRequested``)."""

    method = "object_store"

    def __init__(self, actors: Sequence[Any], timeout_s: float = PUBLISH_TIMEOUT_S, stops: Any = None):
        self.actors, self.names = list(actors), _names(actors)
        self.timeout_s, self.stops = timeout_s, stops

    def member_restarted(self) -> None:
        """Nothing to do: every publish reaches whoever holds a handle."""

    def remove(self, actor: Any) -> None:
        """``actor`` (given up by the run) gets no more publishes."""
        self.actors, self.names = _without(self.actors, self.names, actor)

    def close(self) -> None:
        """Nothing to release: the object store frees what no one refers to."""

    def publish(self, version: int, state: Union[Mapping[str, np.ndarray], "ray.ObjectRef"]) -> PublishStats:
        """Put ``state`` (numpy arrays, or a ref to such a dict) once and wait until every actor has applied it."""
        t0 = time.perf_counter()
        if isinstance(state, ray.ObjectRef):
            ref, size = state, -1  # its size is only known where it lives; -1 = not measured
        else:
            ref, size = ray.put(dict(state)), _nbytes(state)
        put_s = time.perf_counter() - t0
        calls = [a.update_weights.remote(version, ref) for a in self.actors]
        try:
            results = wait_phase(calls, self.timeout_s, f"the publish of version {version}", f"{self.timeout_s:g} s",
                                 self.stops, on_stop="abandon")
        except PhaseTimeout as e:
            raise PublishTimeout(f"{', '.join(self.names[i] for i in e.pending)} did not apply version {version} "
                                 f"within {self.timeout_s:g} s, the publish's limit (hung or stopped)") from None
        reported = [s for s in map(_reported_seconds, results) if s is not None]
        return PublishStats(version, self.method, time.perf_counter() - t0, put_s, size, len(self.actors), reported)


# ------------------------------------------------------------------------------------------------ collective
class WeightsRefused(ValueError):
    """An engine refused a publish's specs (missing, unknown or misshaped tensors): nothing was sent."""


class CollectivePublisher:
    """Broadcast from the learner's rank 0 (``learner``: a ``LearnerGroup``) into the workers of every engine in
    ``actors``. ``workers_per_engine``: vLLM workers per engine (its tensor-parallel size); ranks are the learner 0,
    then engine ``i``'s workers from ``1 + i * workers_per_engine``. ``timeout_s`` bounds each wait of a publish,
    the learner's part too (given to ``learner.publishing``), and is the group's own limit."""

    method = "collective"

    def __init__(self, actors: Sequence[Any], learner: Any, *, backend: str, timeout_s: float,
                 workers_per_engine: int = 1, stops: Any = None):
        self.actors, self.learner, self.stops = list(actors), learner, stops
        self.names = _names(actors)
        self.backend, self.timeout_s, self.workers_per_engine = backend, timeout_s, workers_per_engine
        self.generation = 0
        self.connected = False
        publishing = getattr(learner, "publishing", None)
        if publishing is not None:  # the learner's part of a publish (prepare_publish) gets the same limit
            publishing(timeout_s, stops)

    def connect(self) -> None:
        """Make the group (again): every member leaves the one before and joins the new one."""
        self.connected = False
        self.generation += 1
        world_size = 1 + len(self.actors) * self.workers_per_engine
        port = self.learner.open_weight_group()
        sender = self.learner.join_weight_group(world_size, self.backend, self.timeout_s, self.generation)
        joins = [a.join_weight_group.remote(port, 1 + i * self.workers_per_engine, world_size, self.backend,
                                            self.timeout_s, self.generation) for i, a in enumerate(self.actors)]
        self._get([sender, *joins], f"joining the weight group (generation {self.generation})",
                  ["the learner", *self.names])
        self.connected = True

    def _get(self, refs: list, what: str, members: Sequence[str] | None = None) -> list:
        """``refs``' values within ``timeout_s``; a member that does not answer (stopped, hung) ends the publish
        with ``PublishTimeout`` naming what waited and, given ``members`` (the name of each ref's member), the members
        that did not answer; a stop request (``stops``) ends it at once."""
        try:
            return wait_phase(refs, self.timeout_s, what, f"weight_sync.timeout_s={self.timeout_s:g} s", self.stops,
                              on_stop="abandon")
        except PhaseTimeout as e:
            who = "a member" if members is None else ", ".join(members[i] for i in e.pending)
            raise PublishTimeout(f"{what}: {who} did not answer within {self.timeout_s:g} s, the publish's limit "
                                 "(hung or stopped)") from None

    def member_restarted(self) -> None:
        """A rollout actor came back in a new process: the group is made again before the next publish."""
        self.connected = False

    def remove(self, actor: Any) -> None:
        """``actor`` (given up by the run) leaves: the group is made again, without it, before the next publish."""
        self.actors, self.names = _without(self.actors, self.names, actor)
        self.connected = False

    def publish(self, version: int, state: Any = None) -> PublishStats:
        """Broadcast the learner's current weights as ``version`` (``state`` is not used: the weights go from the
        learner's rank 0, not from the caller). Raises ``WeightsRefused`` when an engine refuses them."""
        if not self.connected:
            self.connect()
        t0 = time.perf_counter()
        specs = self.learner.prepare_publish()
        try:
            refusals = [r for r in self._get([a.check_weight_specs.remote(specs) for a in self.actors],
                                             f"checking the specs of version {version}", self.names) if r]
            if refusals:
                raise WeightsRefused("; ".join(refusals))
        except BaseException:
            self.learner.discard_prepared()  # rank 0 would keep a whole copy of the weights until the next publish
            raise
        try:
            pending = [a.update_weights_collective.remote(version, specs) for a in self.actors]
            sent = self.learner.broadcast_weights(specs)
            (size, send_s), *results = self._get([sent, *pending], f"the broadcast of version {version}",
                                                 ["the learner", *self.names])
        except BaseException:
            self.connected = False  # a member failed halfway: the group is made again before the next publish
            raise
        reported = [s for s in map(_reported_seconds, results) if s is not None]
        return PublishStats(version, self.method, time.perf_counter() - t0, send_s, int(size), len(self.actors),
                            reported)

    def close(self) -> None:
        """Release the learner's side of the group, connected or not (a broken group is released too); the engines'
        sides go with their actors."""
        self.connected = False
        if self.generation:
            try:
                self.learner.close_weight_group()
            except LearnerTimeout:  # a learner stopped or hung holds nothing the run's end needs: Ray's shutdown
                pass  # ends it, and the run's error line stays the one that named it


def create_publisher(method: str, actors: Sequence[Any], learner: Any = None,
                     actor_timeout_s: float = PUBLISH_TIMEOUT_S, stops: Any = None,
                     **collective: Any) -> WeightPublisher:
    """``weight_sync.method`` -> publisher. ``actor_timeout_s``: the publish phase's limit
    (``driver.limits.phase_limit``), which bounds every wait of a publish on either path: every actor applying it
    (object store), each wait of the collective path (its ``timeout_s``, the group's own limit too, is at most this),
    and the learner's ranks gathering the weights (given to ``learner``: ``LearnerGroup.publishing``). ``learner``
    and ``collective`` (``CollectivePublisher``'s keyword arguments): the collective path's. ``stops``: the run's
    ``StopRequests`` (a stop request ends a publish at once, the learner's part of it too)."""
    if method == "object_store":
        publishing = getattr(learner, "publishing", None)
        if publishing is not None:  # the learner's part of a publish (state_dict_ref) gets the same limit
            publishing(actor_timeout_s, stops)
        return ObjectStorePublisher(actors, actor_timeout_s, stops)  # the collective options: no part
    if method == "collective":
        if learner is None:
            raise ValueError("weight_sync.method collective needs the learner group (its rank 0 sends)")
        timeout_s = min(collective.pop("timeout_s", actor_timeout_s), actor_timeout_s)
        return CollectivePublisher(actors, learner, stops=stops, timeout_s=timeout_s, **collective)
    raise ValueError(f"weight_sync.method {method!r}; allowed: object_store, collective")
