"""The core nodes: those that hold the learner ranks and the replay buffer, which Ray does not restart elsewhere.

A machine gone from a multi-node cluster takes with it what it held. The rollout actors are the fleet's to restart
(``driver/fleet.py``); the learner and the buffer cannot be, so a failure of the RL loop that comes of such a loss
ends the run in one line naming the node, what it held and the checkpoint to resume from (``CoreNodes.watch``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import ray
from ray.exceptions import GetTimeoutError

from async_agent_rl.config import Config
from async_agent_rl.errors import InputError
from async_agent_rl.waits import bounded
from driver.checkpoints import latest_checkpoint
from driver.cluster import actor_node, node_gone
from driver.fleet import SETTLE_S
from driver.limits import REPORT_TIMEOUT_S, RunFailed, cause


class CoreNodes:
    """Where the learner ranks and the buffer run (``held``: node id -> what of them it holds), as placed at the
    first step (``note``), and what a failure of the loop says when one of those nodes was lost."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.held: dict[str, list[str]] = {}
        self.buffer: Any = None
        self.learner: Any = None

    def note(self, buffer: Any, learner: Any) -> None:
        """The nodes the learner ranks and the replay buffer run on (Ray's record), once."""
        if self.held:
            return
        self.buffer, self.learner = buffer, learner
        ranks = learner.actors
        for what, actor in [("the replay buffer", buffer),
                            *((f"learner rank {r}" if len(ranks) > 1 else "the learner", a) for r, a in enumerate(ranks))]:
            node = actor_node(actor)
            if node:
                self.held.setdefault(node, []).append(what)

    @contextmanager
    def watch(self, step: Callable[[], int]) -> Iterator[None]:
        """A failure of the RL loop that comes of a lost node holding the learner or the replay buffer ends the run in
        one line naming the node, what it held and the checkpoint to resume from; any other failure goes on as it
        is. ``step``: the learner's step now (the failed one is the next)."""
        try:
            yield
        except (ray.exceptions.RayError, InputError) as e:
            lost = self.lost()
            if not lost:
                raise
            try:
                ckpt, _ = latest_checkpoint(self.run_dir)
                resume = (f"resume from {ckpt} with `async-agent-rl train --resume {self.run_dir}` once nodes offer "
                          "what they ask")
            except InputError:
                resume = ("no intact checkpoint to resume from (learner.checkpoint_every="
                          f"{self.cfg.learner.checkpoint_every})")
            raise RunFailed(f"{'; '.join(lost)} at step {step() + 1} ({cause(e)}); {resume}") from None

    def lost(self) -> list[str]:
        """"the node ID8 at IP holding X was lost" for each lost node that held the learner or the buffer. When they
        do not all answer, Ray may have yet to declare their node dead (its health checks take about 15 s): waited
        for, up to ``SETTLE_S``. The driver's own node is never lost while the driver runs, so what it holds is not
        asked about (on one machine: nothing is, and a stopped learner's error line is not held back
        ``REPORT_TIMEOUT_S + SETTLE_S``)."""
        own = ray.get_runtime_context().get_node_id()
        held = {node: what for node, what in self.held.items() if node != own}
        if not held:
            return []
        probes = [self.buffer.stats.remote(), *(a.rank.remote() for a in self.learner.actors)]
        try:
            bounded(ray.get, probes, timeout_s=REPORT_TIMEOUT_S, what="the learner and the buffer")
            return []  # all there: the failure was something else
        except (ray.exceptions.RayError, GetTimeoutError):
            pass
        deadline = time.monotonic() + SETTLE_S
        while True:
            gone = {node: node_gone(node) for node in held}
            if any(gone.values()) or time.monotonic() > deadline:
                return [f"the {gone[node]} holding {' and '.join(what)} was lost" for node, what in held.items()
                        if gone[node]]
            time.sleep(0.5)
