"""Ray actor shell around ``RolloutWorker``: one vLLM engine per actor, episodes pushed to the buffer actor.

The shell only wires Ray to the plain classes: admission and pushes go to the buffer actor (batched), weights
arrive from the learner as a Ray object (zero-copy numpy arrays) and go to the engine's reload, or, on the
collective path, straight into the engine's workers by the learner's broadcast. Resources come
from ``cluster.rollout_actor_cpus`` / ``rollout_actor_gpus`` / ``rollout_resources`` where the actor is created
(``create_rollout_actors``).
"""

from __future__ import annotations

import os
import asyncio
import dataclasses
import logging
import time
from typing import Any, Mapping

import ray

from actors.engine import ENGINE_CLOSE_S, create_engine
from actors.rollout_worker import PromptSource, RolloutWorker, engine_dead, engine_silence_s, episodes_timeout_s
from actors.search_client import SearchClient
from async_agent_rl.config import Config
from async_agent_rl.data.search_r1 import read_qa_files
from async_agent_rl.episode import EpisodeRunner
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.errors import InputError
from async_agent_rl.records import Trajectory
from async_agent_rl.stats import RolloutStats, SearchStats, WeightUpdate
from async_agent_rl.waits import within
from buffer.actor import push_async

log = logging.getLogger(__name__)


class RolloutActor:
    """Its constructor takes plain values only (the config as a dict, strings, ints); the buffer actor's handle comes
    with ``setup``. Ray re-runs a restarted actor's ``__init__`` with the arguments it was created with, and an actor
    handle among them is a reference Ray must keep for that: it said so in an ``E`` line (``core_worker.cc: ... has
    constructor arguments in the object store and max_restarts > 0``) at every training start."""

    def __init__(self, cfg_dict: dict, index: int, retriever_url: str, model_path: str, version: int = 0):
        from async_agent_rl.config import build_config

        self.cfg: Config = build_config(cfg_dict, "rollout actor")
        self.index = index
        self.buffer: Any = None  # the buffer actor, given to setup()
        self.url = retriever_url
        self.model_path = model_path
        self.initial_version = version
        self.actor_id = f"actor{index}"
        self.worker: RolloutWorker | None = None
        self._task: asyncio.Task | None = None
        self._updates: list[WeightUpdate] = []
        self._pending: tuple[int, Mapping[str, Any]] | None = None  # weights that arrived before setup()

    async def setup(self, buffer: Any) -> dict:
        """Create the engine and the worker (async: the engine lives on this actor's event loop); ``buffer`` is the
        replay buffer actor its admission, pushes and lost episodes go to. Called again after a restart."""
        from transformers import AutoTokenizer

        cfg = self.cfg
        self.buffer = buffer
        examples, report = read_qa_files(cfg.data.train_files, cfg.data.on_bad_row)
        self.engine = await create_engine(cfg, self.model_path, self.initial_version)
        if self._pending is not None:
            await self.engine.update_weights(*self._pending, mode="pause")
            self._pending = None
        self.search = SearchClient(self.url, cfg.retriever.client, topk=cfg.retriever.topk)
        runner = EpisodeRunner(
            self.engine, self.search, AutoTokenizer.from_pretrained(self.model_path), EpisodeSettings.from_config(cfg)
        )
        prompts = PromptSource(examples, shard=self.index, num_shards=cfg.rollout.num_actors, seed=cfg.data.seed,
                               shuffle=cfg.data.shuffle)
        # over-long prompts are skipped once here (counted), not failed as an episode on every pass; a shard where
        # none fits would only ever fail episodes: that is an error now, not a hang
        prompts.examples, too_long = runner.split_by_prompt_length(prompts.examples)
        if not prompts.examples:
            raise InputError(f"none of the {len(too_long)} training prompts of rollout actor {self.index} fits "
                             f"data.max_prompt_length={cfg.data.max_prompt_length} tokens ({cfg.data.train_files})")
        self.prompts = prompts
        # every training prompt by id (any shard's: a group in flight at a checkpoint may come back to another actor)
        self.by_id = {ex.id: ex for ex in reversed(examples)}  # the first of a repeated id, as the stream has it
        self.worker = RolloutWorker(
            runner,
            prompts,
            self._push,
            group_size=cfg.rollout.group_size,
            max_concurrent=cfg.rollout.max_concurrent_episodes,
            push_batch_size=cfg.rollout.push_batch_size,
            admit=self._admit,
            on_lost=self._lost,
            actor_id=self.actor_id,
            seed=cfg.rollout.seed + self.index,
            mode=cfg.rollout.mode,
            engine_silence_s=engine_silence_s(cfg),
            episodes_timeout_s=episodes_timeout_s(cfg),
            last_push_s=cfg.cluster.actor_timeout_s,  # one push call's limit too (push_async)
        )
        # the metered engine from now on: a weight update through it pauses the health probe's clock (the engine's
        # requests wait for the update by design); everything else goes to the engine itself
        self.engine = self.worker.engine
        # the node (in a Ray actor; asked outside Ray, get_runtime_context() would start a local cluster unasked)
        node = ray.get_runtime_context().get_node_id()[:8] if ray.is_initialized() else None
        return {"index": self.index, "node": node,
                "examples": len(prompts.examples), "skipped_rows": report.skipped,
                "skipped_too_long": len(too_long)}

    # ------------------------------------------------------------------------------------------ buffer plumbing
    # every call to the buffer is answered within cluster.actor_timeout_s, or fails the worker (the driver then
    # restarts this actor, and ends the run when the buffer itself stopped answering)
    async def _admit(self, n: int, version: int, group_id: str, prompt: dict | None = None) -> int:
        return await within(self.buffer.try_start.remote(n, version, group_id, self.actor_id, prompt),
                            self.cfg.cluster.actor_timeout_s, "the buffer actor (try_start)")

    async def _push(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """One push; returns the trajectories a full buffer refused (the worker sends them again with its next push,
        never waits behind them: ``RolloutWorker``)."""
        blobs = [t.encode() for t in trajs]
        result = await push_async(self.buffer, blobs, call_timeout_s=self.cfg.cluster.actor_timeout_s)
        return result.rest(trajs)

    async def _lost(self, group_ids: list[str]) -> None:
        await within(self.buffer.reject.remote(group_ids), self.cfg.cluster.actor_timeout_s, "the buffer actor (reject)")

    # ------------------------------------------------------------------------------------------------ control
    async def start(self, num_groups: int | None = None) -> dict:
        """Start generating. First the buffer is asked what this actor left off (``BufferActor.claim``): its prompt
        stream continues from the position of the last group it had admitted, and the groups in flight at the
        checkpoint a resumed run restored are generated again before anything new (``RolloutWorker.resume``).
        Returns what was taken up: ``{"groups": [[group id, prompt id, members], ...], "cursor": position or None,
        "unknown": prompt ids not in the training data, "note": why the position was not used, or None}``."""
        assert self.worker is not None, "call setup() first"
        taken: dict = {"groups": [], "cursor": None, "unknown": [], "note": None}
        if getattr(self, "buffer", None) is not None:
            claim = await within(self.buffer.claim.remote(self.actor_id), self.cfg.cluster.actor_timeout_s,
                                 "the buffer actor (claim)")
            taken = await self._take_up(claim)
        self._task = asyncio.create_task(self.worker.run(num_groups))
        self._task.add_done_callback(self._ended)
        return taken

    async def _take_up(self, claim: dict) -> dict:
        """Apply a ``BufferActor.claim``: restore the prompt stream's position, hand the worker the groups to
        generate again. A position that does not fit this actor's prompts (the data or the shards changed) is not
        used (the stream starts from its beginning, said in ``note``); a group whose prompt is not in the data is
        reported lost to the buffer (its members are not waited for)."""
        cursor, note = claim.get("cursor"), None
        if cursor is not None:
            try:
                self.prompts.restore(cursor)
            except ValueError as e:
                note, cursor = str(e), None
                log.warning("rollout actor %d: prompt stream not continued: %s", self.index, e)
        groups, unknown = [], []
        for gid, pid, members in claim.get("groups", []):
            ex = self.by_id.get(pid)
            if ex is None:
                unknown.append(pid)
                await self._lost([gid] * int(members))
            else:
                groups.append((ex, gid, int(members)))
        self.worker.resume(groups)
        return {"groups": [[gid, ex.id, m] for ex, gid, m in groups], "cursor": cursor, "unknown": unknown,
                "note": note}

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # the worker logged it; the driver reads error()
            log.error("rollout actor %d stopped generating: %s", self.index, self.error())

    async def stop(self, timeout_s: float = 120.0) -> RolloutStats:
        """Stop starting groups, let in-flight episodes finish and be pushed (within ``timeout_s``); returns the
        worker's stats. What a full buffer still refuses then is dropped at once, counted in ``dropped_at_stop``."""
        if self.worker is not None:
            self.worker.stop()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout_s)
            except asyncio.TimeoutError:
                log.warning("rollout actor %d: in-flight episodes did not finish within %s s", self.index, timeout_s)
        return self.stats()

    async def update_weights(self, version: int, weights: Mapping[str, Any]) -> dict:
        """Reload ``weights`` (resolved from the object store by Ray) into the engine as ``version``. Before
        ``setup()`` (a restarted actor) they are kept and loaded when the engine exists."""
        t0 = time.perf_counter()
        if not hasattr(self, "engine"):
            self._pending = (version, weights)
            return {"version": version, "seconds": 0.0, "deferred": True}
        try:
            stats = await self.engine.update_weights(version, weights, self.cfg.rollout.weight_update_mode)
        except Exception as e:
            if not engine_dead(e):
                raise
            # the engine core died: its worker stops on the same error and supervision restarts this actor with the
            # current weights, saying so in one [fault] line; the publish is not a second fault of the same death
            log.warning("rollout actor %d: weights of version %d not applied, its engine is dead (%s: %s); the "
                        "restart gives it the current ones", self.index, version, type(e).__name__, e)
            return {"version": version, "seconds": 0.0, "deferred": True}
        return self._applied(t0, stats)

    def _applied(self, t0: float, stats: Any) -> dict:
        rec = WeightUpdate(stats.version, time.perf_counter() - t0, stats.pause_seconds, stats.bytes, stats.mode)
        self._updates.append(rec)
        return dataclasses.asdict(rec)

    # the collective path (driver.weight_sync.CollectivePublisher): the engine's workers join the learner's group
    async def join_weight_group(self, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float,
                                generation: int) -> list[int]:
        return await self.engine.join_weight_group(port, rank_offset, world_size, backend, timeout_s, generation)

    def check_weight_specs(self, specs: list) -> str | None:
        """None when this engine takes a publish of ``specs``; otherwise why not (nothing is changed)."""
        from actors.engine import WeightsError

        try:
            self.engine.check_weight_specs(specs)
        except WeightsError as e:
            return f"rollout actor {self.index}: {e}"
        return None

    async def update_weights_collective(self, version: int, specs: list) -> dict:
        """Receive the learner's broadcast of ``specs`` into the engine as ``version``."""
        t0 = time.perf_counter()
        mode = self.cfg.rollout.weight_update_mode
        return self._applied(t0, await self.engine.update_weights_collective(version, specs, mode))

    async def evaluate(self, files: list[str], limit: int = 0) -> dict:
        """Greedy episodes on held-out questions with this actor's engine (current weights); scores by source."""
        from actors.stack import run_greedy, score_episodes

        assert self.worker is not None, "call setup() first"
        examples, _ = read_qa_files(files, self.cfg.data.on_bad_row)
        examples = examples[:limit] if limit else examples
        fitting, too_long = self.worker.runner.split_by_prompt_length(examples)
        if not fitting:
            raise InputError(f"none of the {len(too_long)} evaluation prompts fits data.max_prompt_length="
                             f"{self.cfg.data.max_prompt_length} tokens ({files})")
        trajs = await run_greedy(self.worker.runner, fitting, self.cfg.rollout.max_concurrent_episodes,
                                 wave_s=episodes_timeout_s(self.cfg))
        return score_episodes(trajs, self.worker.runner.tokenizer, skipped_too_long=len(too_long))

    async def evaluate_weights(self, version: int, weights: Mapping[str, Any], files: list[str],
                               limit: int = 0) -> dict:
        """Load ``weights`` (tagged ``version``) into this actor's engine, then ``evaluate``: the evaluator's one
        call per evaluation beside training; the scores with ``seconds``, the whole call's time. The engine runs
        nothing else, so the whole evaluation sees one version; the reload is a paused one, which clears the prefix
        cache whatever ``rollout.weight_update_mode`` says."""
        t0 = time.perf_counter()
        self._applied(t0, await self.engine.update_weights(version, weights, "pause"))
        scores = await self.evaluate(files, limit)
        return {**scores, "seconds": time.perf_counter() - t0}

    def error(self) -> str | None:
        """Why this actor's rollouts ended (``stats().done``): the worker's exception in one line (a failed push,
        a failed report of a lost episode, admission failing), or that they ended; None while they run."""
        task = self._task
        if task is None or not task.done():
            return None
        if task.cancelled():
            return "its rollout task was cancelled"
        e = task.exception()
        return f"{type(e).__name__}: {e}" if e is not None else "its rollouts ended"

    def stats(self) -> RolloutStats:
        actor = dict(
            index=self.index,
            pid=os.getpid(),
            version=getattr(getattr(self, "engine", None), "version", self.initial_version),
            search=self.search.stats() if hasattr(self, "search") else SearchStats(),
            weight_updates=list(self._updates[-5:]),
            done=self._task.done() if self._task else False,
            ready=self.worker is not None,
        )
        return self.worker.stats.message(**actor) if self.worker else RolloutStats(**actor)

    async def close_engine(self, timeout_s: float = ENGINE_CLOSE_S) -> dict:
        """End this actor's engine, before the actor is killed for a restart (``driver.fleet``): the worker starts
        no more episodes, vLLM's shutdown gets ``timeout_s``, then the engine's processes still alive are SIGKILLed by
        pid and its ``/dev/shm`` files unlinked (``VLLMEngine.close``). Returns ``{"pids": the engine's processes,
        "killed": those that had to be killed, "left": those still alive after it all (none unless a kill failed)}``."""
        if self.worker is not None:
            self.worker.stop()
        engine = getattr(self, "engine", None)
        if engine is None:
            return {"pids": [], "killed": [], "left": []}
        pids = list(getattr(engine, "pids", []))
        killed = await engine.close(timeout_s)
        processes = getattr(engine, "processes", None)
        return {"pids": pids, "killed": list(killed or []), "left": processes.alive() if processes else []}

    async def shutdown(self) -> None:
        await self.stop(timeout_s=5.0)
        await self.search.close()
        await self.engine.close()


def _actor_class(cfg: Config, max_restarts: int) -> Any:
    """``RolloutActor`` as a Ray actor class with the resources and engine environment of the config."""
    from actors.engine import cpu_engine_env

    env = dict(cfg.cluster.env_vars)
    if cfg.run.device == "cpu":
        env = {**cpu_engine_env(cfg.rollout), **env}
    return ray.remote(
        num_cpus=cfg.cluster.rollout_actor_cpus,
        num_gpus=cfg.cluster.rollout_actor_gpus,
        resources=dict(cfg.cluster.rollout_resources),
        max_restarts=max_restarts,
        runtime_env={"env_vars": env},
    )(RolloutActor)


def create_rollout_actors(
    cfg: Config, retriever_url: str, model_path: str, version: int = 0, max_restarts: int = 0
) -> list[Any]:
    """Start ``rollout.num_actors`` actors with resources and engine environment from config; ``setup(buffer)`` on
    each makes it ready (``RolloutActor``: why the buffer is not a constructor argument)."""
    actor_cls = _actor_class(cfg, max_restarts)
    return [
        actor_cls.options(name=f"rollout-{i}").remote(cfg.to_dict(), i, retriever_url, model_path, version)
        for i in range(cfg.rollout.num_actors)
    ]


def create_evaluator(cfg: Config, retriever_url: str, model_path: str, version: int = 0) -> Any:
    """The engine of the evaluations beside training (``eval.beside``): a rollout actor asked for the same
    resources, named ``evaluator``, never started on training episodes (``setup`` then ``evaluate_weights`` only);
    not restarted by Ray (a lost evaluator ends the evaluations beside training, not the run)."""
    return _actor_class(cfg, 0).options(name="evaluator").remote(cfg.to_dict(), 0, retriever_url, model_path, version)
