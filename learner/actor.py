"""The learner as Ray actors: one ``LearnerActor`` per rank, a thin shell around ``Learner``.

``create_learner_group(cfg)`` starts ``learner.num_ranks`` actors with resources from ``cluster.learner_cpus`` /
``cluster.learner_gpus`` and the torch.distributed environment of their rank (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT), so DeepSpeed joins them with gloo on CPU (NCCL on GPU). All ranks run on the
node of the driver's loopback address: a multi-node learner needs rank 0's routable address as MASTER_ADDR.

Every collective method (``train_step``, ``state_dict_for_publish`` under ZeRO-3, checkpoints) must be called on all
ranks together; ``LearnerGroup`` does that and returns rank 0's answer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import ray
from ray.exceptions import GetTimeoutError

from async_agent_rl.batch import TrainBatch
from async_agent_rl.config import Config
from async_agent_rl.errors import InputError
from async_agent_rl.net import free_port
from async_agent_rl.stats import LearnerStats
from async_agent_rl.waits import bounded
from async_agent_rl.weight_group import WeightGroup, listen_socket, weight_specs
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.learner import Learner

SLICE_S = 1.0  # a publish's wait on the ranks looks at the run's stop requests this often


class LearnerActor:
    """One learner rank (the environment of its rank is set by ``create_learner_group``)."""

    def __init__(self, cfg: Config):
        self.learner = Learner(cfg)

    def rank(self) -> int:
        return self.learner.rank

    def train_step(self, batch: Optional[TrainBatch]) -> Optional[LearnerStats]:
        """One step on ``batch``; None when there is none (the buffer's ``sample_batch`` timed out)."""
        return None if batch is None else self.learner.train_step(batch)

    def bump_version(self) -> int:
        return self.learner.bump_version()

    def state_dict_for_publish(self) -> Optional[dict[str, np.ndarray]]:
        """Rank 0: the numpy state dict; other ranks: None (they take part in the ZeRO-3 gather only)."""
        state = self.learner.state_dict_for_publish()
        return state if self.learner.rank == 0 else None

    # the collective weight path (driver.weight_sync.CollectivePublisher): rank 0 is the group's sender
    def open_weight_group(self) -> int:
        """Rank 0: bind the group's rendezvous socket on loopback; returns its port."""
        self.close_weight_group()
        self._listen = listen_socket()
        return int(self._listen.getsockname()[1])

    def join_weight_group(self, world_size: int, backend: str, timeout_s: float, generation: int) -> None:
        """Rank 0: make the group as its rank 0; returns when every engine worker has joined."""
        if self.learner.rank == 0:
            listen, self._listen = self._listen, None
            self._group = WeightGroup(int(listen.getsockname()[1]), 0, world_size, backend, timeout_s, listen,
                                      generation)

    def prepare_publish(self) -> Optional[list]:
        """Every rank (ZeRO-3 gathers): take the weights to publish; rank 0 keeps them and returns their specs."""
        state = self.learner.state_dict_for_publish()
        if self.learner.rank != 0:
            return None
        self._prepared = state
        return weight_specs(state)

    def broadcast_weights(self, specs: list) -> tuple[int, float]:
        """Rank 0: broadcast the prepared weights (their ``specs`` agreed by every receiver); returns the bytes
        sent and the seconds it took."""
        state, self._prepared = self._prepared, None
        if state is None:
            raise RuntimeError("broadcast_weights without prepare_publish")
        t0 = time.perf_counter()
        return self._group.send(state, specs), time.perf_counter() - t0

    def discard_prepared(self) -> None:
        self._prepared = None

    def close_weight_group(self) -> None:
        for attr in ("_group", "_listen"):
            member = getattr(self, attr, None)
            if member is not None:
                member.close()
            setattr(self, attr, None)

    def save_checkpoint(self, directory: str) -> str:
        return str(save_checkpoint(self.learner, directory))

    def load_checkpoint(self, directory: str) -> tuple[int, int]:
        """Load ``directory``; returns the learner's (step, version) from it."""
        load_checkpoint(self.learner, directory)
        return self.learner.step, self.learner.version


def rank_env(rank: int, world_size: int, master_port: int, device: str) -> dict[str, str]:
    # LOCAL_RANK 0: Ray gives each GPU actor its own GPU as cuda:0 (CUDA_VISIBLE_DEVICES)
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def create_learner_actors(cfg: Config) -> list[Any]:
    """Start the ``learner.num_ranks`` rank actors (not waiting for them to be ready)."""
    world_size, port = cfg.learner.num_ranks, free_port()
    actor_cls = ray.remote(num_cpus=cfg.cluster.learner_cpus, num_gpus=cfg.cluster.learner_gpus,
                           resources=dict(cfg.cluster.learner_resources))(LearnerActor)
    return [
        actor_cls.options(runtime_env={"env_vars": {**cfg.cluster.env_vars,
                                                    **rank_env(rank, world_size, port, cfg.run.device)}}).remote(cfg)
        for rank in range(world_size)
    ]


class LearnerTimeout(InputError):
    """A learner rank did not answer a call within its limit (stopped, hung): one ``error:`` line naming the call
    and the config key of the limit."""


class LearnerGroup:
    """Drives all rank actors together; returns rank 0's results. Every call is bounded: ``timeout_s``
    (``cluster.actor_timeout_s``) for quick ones, ``long_timeout_s`` (``cluster.actor_setup_timeout_s``: as long as
    loading a model may take) for those that move the whole model (checkpoints, a step), and the publish's limit
    (``publishing``: the driver's publish phase limit) for gathering the weights to publish (``state_dict_ref``,
    ``prepare_publish``); a rank that does not answer in time raises ``LearnerTimeout``."""

    def __init__(self, actors: list[Any], timeout_s: float = 120.0, long_timeout_s: float = 900.0):
        self.actors = actors
        self.timeout_s, self.long_timeout_s = timeout_s, long_timeout_s
        self.publish_timeout_s = long_timeout_s  # until the driver gives the publish phase's (``publishing``)
        self.stops: Any = None

    def publishing(self, timeout_s: float, stops: Any = None) -> None:
        """The limit of a publish's waits on the ranks (the driver's publish phase limit,
        ``driver.limits.phase_limit``, passed in: this layer does not import the driver) and the run's stop
        requests (anything with ``check()``, which raises to end a wait: ``driver.stops.StopRequests``), looked at
        every ``SLICE_S`` of such a wait."""
        self.publish_timeout_s, self.stops = timeout_s, stops

    def _publish_wait(self, refs: Sequence[Any], what: str, timeout_s: float | None, stops: Any) -> None:
        """Until every one of ``refs`` (the ranks' calls of a publish) is ready, not fetching them here, within
        ``timeout_s`` (None: ``publish_timeout_s``), in ``SLICE_S`` slices with ``stops.check()`` between: a stop
        request ends a publish at once, a rank stopped (SIGSTOP) or hung is named in ``LearnerTimeout``."""
        limit = self.publish_timeout_s if timeout_s is None else timeout_s
        stops = self.stops if stops is None else stops
        deadline = time.monotonic() + limit
        pending = list(refs)
        while True:
            if stops is not None:
                stops.check()
            _, pending = bounded(ray.wait, pending, num_returns=len(pending), fetch_local=False,
                                 timeout_s=max(0.0, min(SLICE_S, deadline - time.monotonic())),
                                 what=f"the learner ({what})")
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise LearnerTimeout(f"the learner ({what}, a weight publish) did not answer within {limit:g} s, the "
                                     "publish's limit (hung or stopped)")

    def _get(self, refs: Any, what: str, long: bool = False, limit: float | None = None) -> Any:
        """``ray.get(refs)`` within the call's limit (``limit``, else the group's quick or long one)."""
        if limit is None:
            bound = self.long_timeout_s if long else self.timeout_s
            within = f"{'cluster.actor_setup_timeout_s' if long else 'cluster.actor_timeout_s'}={bound:g} s"
        else:
            bound, within = limit, f"{limit:g} s"
        try:
            return bounded(ray.get, refs, timeout_s=bound, what=f"the learner ({what})")
        except GetTimeoutError:
            raise LearnerTimeout(f"the learner ({what}) did not answer within {within} (hung or stopped)") from None

    def ready(self, timeout_s: float | None = None) -> list[int]:
        """Every rank's number once all are started; ``GetTimeoutError`` after ``timeout_s`` (None: the group's
        long limit; a rank Ray cannot place, one whose start hangs, is waited for no longer)."""
        bound = self.long_timeout_s if timeout_s is None else timeout_s
        return bounded(ray.get, [a.rank.remote() for a in self.actors], timeout_s=bound, what="the learner (rank)")

    def _all(self, method: str, *args: Any, long: bool = False, limit: float | None = None) -> list[Any]:
        return self._get([getattr(a, method).remote(*args) for a in self.actors], method, long, limit)

    def train_step(self, batch: "TrainBatch | ray.ObjectRef", timeout_s: float | None = None
                   ) -> Optional[LearnerStats]:
        """One step on every rank, within ``timeout_s`` (None: the group's long limit). Best given the reference
        ``buffer.sample_batch.remote(...)`` returned: the batch then goes from the buffer to the ranks, never
        through the caller. None when that found no batch."""
        ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)  # one copy for all ranks
        return self._all("train_step", ref, long=True, limit=timeout_s)[0]

    def bump_version(self) -> int:
        return self._all("bump_version")[0]

    def state_dict_ref(self, timeout_s: float | None = None, stops: Any = None) -> "ray.ObjectRef":
        """A reference to rank 0's numpy state dict, for ``ObjectStorePublisher.publish`` (no driver copy), once
        every rank has answered within the publish's limit (``timeout_s``, None: the group's ``publishing`` one)."""
        refs = [a.state_dict_for_publish.remote() for a in self.actors]
        self._publish_wait(refs, "state_dict_for_publish", timeout_s, stops)
        return refs[0]

    # the collective weight path: see LearnerActor and driver.weight_sync.CollectivePublisher
    def open_weight_group(self) -> int:
        return self._get(self.actors[0].open_weight_group.remote(), "open_weight_group")

    def join_weight_group(self, world_size: int, backend: str, timeout_s: float, generation: int) -> "ray.ObjectRef":
        """Rank 0's join, not waited for (it returns once the engines have joined too)."""
        return self.actors[0].join_weight_group.remote(world_size, backend, timeout_s, generation)

    def prepare_publish(self, timeout_s: float | None = None, stops: Any = None) -> list:
        """Every rank takes the weights to publish (``LearnerActor.prepare_publish``) within the publish's limit
        (``timeout_s``, None: the group's ``publishing`` one); rank 0's specs."""
        refs = [a.prepare_publish.remote() for a in self.actors]
        self._publish_wait(refs, "prepare_publish", timeout_s, stops)
        return self._get(refs, "prepare_publish")[0]  # every one is ready: this only fetches the specs

    def broadcast_weights(self, specs: list) -> "ray.ObjectRef":
        """Rank 0's broadcast, not waited for (it returns once every receiver has taken every tensor)."""
        return self.actors[0].broadcast_weights.remote(specs)

    def discard_prepared(self) -> None:
        self._get(self.actors[0].discard_prepared.remote(), "discard_prepared")

    def close_weight_group(self) -> None:
        self._get(self.actors[0].close_weight_group.remote(), "close_weight_group")

    def save_checkpoint(self, directory: str | Path) -> str:
        return self._all("save_checkpoint", str(directory), long=True)[0]

    def load_checkpoint(self, directory: str | Path) -> tuple[int, int]:
        """Load ``directory`` on every rank; returns the learner's (step, version) from it."""
        step, version = self._all("load_checkpoint", str(directory), long=True)[0]
        return step, version


def create_learner_group(cfg: Config) -> LearnerGroup:
    """The ``learner.num_ranks`` rank actors, started; ``GetTimeoutError`` when they are not within
    ``cluster.actor_setup_timeout_s`` (the ranks then are killed)."""
    group = LearnerGroup(create_learner_actors(cfg), cfg.cluster.actor_timeout_s, cfg.cluster.actor_setup_timeout_s)
    try:
        group.ready(cfg.cluster.actor_setup_timeout_s)
    except BaseException:
        for actor in group.actors:
            ray.kill(actor)
        raise
    return group
