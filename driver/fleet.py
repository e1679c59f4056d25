"""The fleet supervisor: the rollout actors (and their engines), the retrieval server the run started, the episodes
lost with a dead actor, restarts, and the report of a stalled run.

``Fleet.supervise()`` is called once per RL step and every few seconds while the learner waits for a batch. It
asks every rollout actor at once and waits for their answers within one limit (``cluster.actor_timeout_s`` in all,
not per actor), reads every rollout actor's stats and restarts an actor that died, stopped answering, or is alive but stopped
generating; a restarted actor's in-flight episodes are counted lost (the buffer frees their admission) and it gets
the current policy version from ``PolicyVersions.catch_up`` before it runs again. Once ``cluster.max_actor_restarts``
restarts of an actor are used up, the next problem ends the run in one ``error:`` line. The retrieval server the
run started is restarted on its port when it exits or stops answering ``/health``.

A rollout actor whose node was lost (a machine gone from a multi-node cluster) is restarted by Ray wherever the
cluster has room for what it asks (``cluster.rollout_*``); when the live nodes cannot hold all the run's rollout
actors for ``NO_ROOM_S``, it is given up (``retire``) and the run goes on with the others, said in one ``[fault]``
line; the publisher stops sending to it. With none left, the run ends in one ``error:`` line.

``Fleet.stop`` stops the rollouts at the end of a run. ``Fleet.stall_report`` is the one line a stalled run ends with (``stall_message``): which component is blocked
(``blocked_component``, one of ``BLAMED``) and the state of every component.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable, Sequence

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.engine import ENGINE_CLOSE_S
from actors.processes import GONE_S, kill_processes
from async_agent_rl.config import Config
from async_agent_rl.stats import BufferStats, DriverStats, RolloutStats, RunTotals
from async_agent_rl.waits import bounded
from driver.cluster import actor_node, actor_record, capacity, node_gone
from driver.limits import PROGRESS_FLOOR_S, PROGRESS_STEPS, REPORT_TIMEOUT_S, RunFailed, ask, cause
from driver.versions import PolicyVersions

log = logging.getLogger(__name__)

RETRIEVER_HEALTH_TIMEOUT_S = 10.0  # the run's retrieval server must answer GET /health within this, or is restarted
NOT_SET_UP = "restarted by Ray, not set up"
NO_ROOM_S = 10.0  # a restarting rollout actor for which no live node has room this long is given up
# an actor whose calls fail while Ray's record still has it alive: Ray has yet to see its process or node die (a lost
# node is declared dead by the GCS's health checks, about 15 s with Ray's defaults); waited for this long at most
SETTLE_S = 60.0
WAITING = ("RESTARTING", "PENDING_CREATION")  # Ray's states of an actor it has yet to place


def run_totals(stats: RolloutStats) -> dict[str, float]:
    """The rollout totals metrics.jsonl keeps per actor and for the run (``episodes_total``, ``em_sum_total``, ...)."""
    return {"finished": stats.finished, "em_sum": stats.exact_match_sum or 0.0,
            "generated_tokens": stats.generated_tokens, "searches": stats.searches,
            "search_errors": stats.search_errors}


class Fleet:
    """The run's rollout actors (Ray handles, restartable ``cluster.max_actor_restarts`` times), the buffer they
    feed (told of lost episodes), the retrieval server the run started (None: the user's URL) and the policy
    versions (a restarted actor catches up). ``on_restart``: called after each restart (the monitor's counters);
    ``local_cluster``: the run started its own Ray on this machine (a hung actor's process may be SIGKILLed)."""

    def __init__(self, cfg: Config, say: Callable[[str], None], buffer: Any, actors: Sequence[Any],
                 versions: PolicyVersions, retriever: Any = None, local_cluster: bool = False,
                 on_restart: Callable[[], None] | None = None):
        self.cfg, self.say, self.buffer, self.actors = cfg, say, buffer, list(actors)
        self.versions, self.retriever, self.local_cluster, self.on_restart = versions, retriever, local_cluster, on_restart
        self.restarts: dict[str, int] = {}  # the run's restarts per actor (a resume's included)
        self.lost_episodes = 0
        self.totals = RunTotals()  # the run's rollout totals (run_totals), restarted actors and a resume included
        self._ray_restarts: dict[int, int] = {}  # restarts of the actors this process made (a resume's start from 0)
        self._pids: dict[int, int] = {}  # each rollout actor's process, as it last reported
        self._pushes: dict[int, tuple[str, int, float | None]] = {}  # actor -> (incarnation, pushed, when it rose)
        self.last_stats: list[RolloutStats] = []  # every actor's stats at the last supervise()
        self.retired: dict[int, str] = {}  # actors given up (their node lost, no room left for them) -> why
        self.nodes: dict[int, str | None] = {}  # the node each actor runs on, as Ray last placed it

    @property
    def active(self) -> list[tuple[int, Any]]:
        """(index, handle) of every rollout actor the run still has (not retired)."""
        return [(i, a) for i, a in enumerate(self.actors) if i not in self.retired]

    def driver_stats(self) -> DriverStats:
        restarts = {f"actor{i}": self.restarts.get(f"actor{i}", 0) for i in range(len(self.actors))}
        return DriverStats(self.lost_episodes, restarts)

    # ------------------------------------------------------------------------------------------------ supervision
    def supervise(self) -> list[RolloutStats]:
        """Every rollout actor's stats (folded into the run's totals); an actor that died (or stopped answering) is
        restarted, its in-flight episodes counted lost, and it gets the current weights before it runs again. One
        that stopped answering may still be alive: it is killed first (Ray restarts it), so ``setup()`` never builds
        a second engine in a live incarnation and it generates nothing more; a push it sent before dying is dropped
        by the buffer as late.

        One that is alive but stopped generating (``stats.done``: its push to the buffer failed, or its report of a
        lost episode, or admission) is killed and restarted the same way, its cause on the console. Once
        ``cluster.max_actor_restarts`` restarts of an actor are used up, the next problem ends the run with
        ``RunFailed`` naming the actor and the cause (one ``error:`` line), instead of a run that waits forever."""
        self.supervise_retriever()
        out = []
        limit = self.cfg.cluster.actor_timeout_s
        active = self.active
        answers = self.ask_all([a for _, a in active], limit)
        for (i, actor), answer in zip(active, answers):
            kill = False
            if isinstance(answer, tuple):
                stats, why = answer
                problem = None if stats.ready else NOT_SET_UP
                if stats.ready and stats.done:  # alive, but generates nothing more: the run would wait forever
                    problem, kill = f"stopped generating: {why}", True
            else:
                problem = type(answer).__name__
                kill = isinstance(answer, GetTimeoutError)  # silent, perhaps only slow: stop this incarnation first
                if isinstance(answer, RayActorError):
                    settle(actor)
            if problem:
                by_ray = problem == NOT_SET_UP  # Ray restarted it (its restart was counted when it died)
                lost = node_gone(self.nodes.get(i))  # Ray may have placed it elsewhere already (not set up)
                if lost:
                    problem, kill = f"its {lost} was lost ({problem})", False
                used, allowed = self._ray_restarts.get(i, 0), self.cfg.cluster.max_actor_restarts
                if used >= allowed and not by_ray:
                    raise RunFailed(f"rollout actor {i}: {problem} (restarted {used} time(s) already, "
                                    f"cluster.max_actor_restarts={allowed})")
                self.say(f"[fault] rollout actor {i}: {problem}; restarting it")
                if kill:
                    self._end_engine(i, actor, answering=not isinstance(answer, GetTimeoutError))
                    self._end_hung_process(i)
                    ray.kill(actor, no_restart=False)
                if not self.restart(i):
                    continue  # given up: no live node has room for it
                stats = ask(actor.stats.remote(), limit, f"rollout actor {i}, just restarted,")
            if problem or i not in self.nodes:
                self.nodes[i] = actor_node(actor)
            self.totals.report(f"actor{stats.index}", stats.incarnation, run_totals(stats))
            self.note_pushes(i, stats)
            out.append(stats)
        self.last_stats = out
        return out

    def ask_all(self, actors: Sequence[Any], limit: float) -> list[Any]:
        """Every actor's ``(stats, why)`` (``why``: its ``error()`` when it is set up and done, else None), asked of
        all at once and waited for within ``limit`` seconds in all: the answer of one that did not answer in time is
        a ``GetTimeoutError``, of one that died a ``RayActorError``."""
        deadline = time.monotonic() + limit
        answers: list[Any] = self._answers([a.stats.remote() for a in actors], deadline, "stats()")
        done = [k for k, a in enumerate(answers) if not isinstance(a, Exception) and a.ready and a.done]
        whys = self._answers([actors[k].error.remote() for k in done], deadline, "error()")
        out = [a if isinstance(a, Exception) else (a, None) for a in answers]
        for k, why in zip(done, whys):
            out[k] = (answers[k], why) if not isinstance(why, Exception) else why
        return out

    @staticmethod
    def _answers(refs: list[Any], deadline: float, what: str) -> list[Any]:
        """Each reference's value, waited for together until ``deadline``: ``GetTimeoutError`` for one not ready by
        then, ``RayActorError`` for one whose actor died."""
        if not refs:
            return []
        ready, _ = bounded(ray.wait, refs, num_returns=len(refs), timeout_s=max(0.0, deadline - time.monotonic()),
                           what=f"the rollout actors' {what}", fetch_local=False)
        out: list[Any] = []
        for ref in refs:
            if ref not in ready:
                out.append(GetTimeoutError(f"{what} not answered"))
                continue
            try:
                out.append(bounded(ray.get, ref, timeout_s=REPORT_TIMEOUT_S, what=f"a rollout actor's {what}"))
            except (RayActorError, GetTimeoutError) as e:
                out.append(e)
        return out

    def restart(self, i: int) -> bool:
        """Rollout actor ``i``, whose process Ray restarts: its in-flight episodes are counted lost, it is set up
        again within ``cluster.actor_setup_timeout_s``, catches up with the policy version and runs again (True).
        While Ray has yet to place it and the live nodes, by their total resources, cannot hold every rollout actor
        the run has (its node was lost and the others are full), for ``NO_ROOM_S``, it is given up instead
        (``retire``; False). Resources other work holds are not counted: an actor kept waiting by those ends the run
        after ``cluster.actor_setup_timeout_s``, as before."""
        actor, actor_id = self.actors[i], f"actor{i}"
        lost = ask(self.buffer.actor_lost.remote(actor_id), self.cfg.cluster.actor_timeout_s, "the buffer actor")
        self.lost_episodes += lost
        self.restarts[actor_id] = self.restarts.get(actor_id, 0) + 1
        self._ray_restarts[i] = self._ray_restarts.get(i, 0) + 1
        limit = self.cfg.cluster.actor_setup_timeout_s
        deadline = time.monotonic() + limit
        no_room_since: float | None = None
        why = "not answering"
        # Ray re-runs __init__ in a new process (max_restarts); wait until it answers and is set up. The call waits
        # in Ray's queue while Ray has not placed the actor: it is watched, not waited on, meanwhile
        setup = actor.setup.remote(self.buffer)
        while True:
            if bounded(ray.wait, [setup], timeout_s=1.0, what=f"rollout actor {i}'s setup", fetch_local=False)[0]:
                try:
                    bounded(ray.get, setup, timeout_s=REPORT_TIMEOUT_S, what=f"rollout actor {i}'s setup")
                    break
                except (RayActorError, GetTimeoutError) as e:  # this incarnation died too: ask the next one
                    why = type(e).__name__
                    time.sleep(1.0)
                    setup = actor.setup.remote(self.buffer)
            if time.monotonic() >= deadline:
                raise RunFailed(f"rollout actor {i} was not set up again within cluster.actor_setup_timeout_s="
                                f"{limit:g} s after a restart ({why})")
            if actor_record(actor).get("State") in WAITING and capacity(self.asks) < len(self.active):
                no_room_since = no_room_since or time.monotonic()
                if time.monotonic() - no_room_since >= NO_ROOM_S:
                    self.retire(i, lost)
                    return False
            else:
                no_room_since = None
        self.versions.catch_up(actor, i)
        ask(actor.start.remote(), self.cfg.cluster.actor_timeout_s, f"rollout actor {i}, just restarted,")
        node = actor_node(actor) or "?"
        self.say(f"[fault] rollout actor {i} restarted at version {self.versions.version} on node {node[:8]}; "
                 f"{lost} in-flight episodes lost")
        if self.on_restart is not None:
            self.on_restart()
        return True

    @property
    def asks(self) -> dict[str, float]:
        """What one rollout actor asks Ray for (CPU, GPU, ``cluster.rollout_resources``)."""
        return next(asks for which, _, asks in self.cfg.placement() if which == "rollout actors")

    def retire(self, i: int, lost: int) -> None:
        """Give up rollout actor ``i`` (Ray found no node for it): it is killed for good, the publisher stops
        sending to it, and the run goes on with the others (one ``[fault]`` line); with none left the run ends."""
        ray.kill(self.actors[i], no_restart=True)
        self.retired[i] = f"no live node has room for it ({', '.join(f'{k} {v:g}' for k, v in self.asks.items())})"
        self.versions.retired(self.actors[i])
        left = len(self.active)
        if not left:
            raise RunFailed(f"no rollout actor left: rollout actor {i}'s node was lost and {self.retired[i]}")
        self.say(f"[fault] rollout actor {i}: {self.retired[i]} for {NO_ROOM_S:.0f} s; the run goes on with {left} "
                 f"rollout actor(s) of {len(self.actors)}; {lost} in-flight episodes lost")
        if self.on_restart is not None:
            self.on_restart()

    def supervise_retriever(self) -> None:
        """The retrieval server the run started is restarted on its port (the actors' URL stays valid) when it
        exited or stopped answering ``/health`` (hung, SIGSTOP); a restart that fails ends the run in one error line.
        Searches made meanwhile failed and were counted (error observations), as in any outage."""
        if self.retriever is None:
            return
        problem = self.retriever.healthy(RETRIEVER_HEALTH_TIMEOUT_S)
        if problem is None:
            return
        try:
            url = self.retriever.restart()
        except Exception as e:  # noqa: BLE001 - reported as the run's end
            raise RunFailed(f"retrieval server {problem} and could not be restarted: {cause(e)}") from None
        self.say(f"[fault] retrieval server {problem}; restarted on {url} ({self.retriever.restarts} restart(s))")

    def _end_engine(self, i: int, actor: Any, answering: bool) -> None:
        """Rollout actor ``i``'s engine ended before the actor is killed for a restart (its engine core and workers
        are processes of their own, and on a GPU hold its memory): an actor that answers closes it itself
        (``RolloutActor.close_engine``: vLLM's shutdown within ``ENGINE_CLOSE_S``, then SIGKILL by pid); on a local
        cluster, whatever of the actor's process tree is still alive then (or all of it, for an actor that does not
        answer) is SIGKILLed by pid."""
        if answering:
            try:
                ended = bounded(ray.get, actor.close_engine.remote(ENGINE_CLOSE_S),
                                timeout_s=ENGINE_CLOSE_S + GONE_S + self.cfg.cluster.actor_timeout_s,
                                what=f"rollout actor {i}'s close_engine()")
                log.info("rollout actor %d: engine processes %s ended (%s killed after vLLM's shutdown)", i,
                         ended["pids"], ended["killed"] or "none")
            except ray.exceptions.RayError as e:
                log.info("rollout actor %d did not close its engine (%s); its processes are killed", i, cause(e))
        pid = self._pids.get(i)
        if pid and self.local_cluster:
            try:
                tree = {p.pid: p.create_time() for p in psutil.Process(pid).children(recursive=True)}
            except psutil.Error:
                return
            killed = kill_processes(tree)
            if killed:
                log.info("rollout actor %d: its processes %s killed before the actor", i, killed)

    def _end_hung_process(self, i: int) -> None:
        """SIGKILL rollout actor ``i``'s process when it runs on this machine (a local cluster): a stopped or hung
        process never acts on ``ray.kill``'s request, and Ray would not restart it."""
        pid = self._pids.get(i)
        if pid and self.local_cluster:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def note_pushes(self, i: int, stats: RolloutStats) -> None:
        if stats.pid:
            self._pids[i] = stats.pid
        prev = self._pushes.get(i)
        if prev is None or prev[0] != stats.incarnation or stats.pushed > prev[1]:
            when = time.monotonic() if stats.pushed > 0 else (prev[2] if prev else None)
            self._pushes[i] = (stats.incarnation, stats.pushed, when)

    def stop(self, limit: float) -> list[RolloutStats]:
        """Every rollout actor stops starting episodes and finishes and pushes its in-flight ones within ``limit``
        seconds (``driver.limits.stop_s``); one that takes longer is left to Ray's shutdown (its in-flight episodes
        are dropped, said in one line) and its last stats stand for it: a run whose steps are done never ends in
        error because stopping took long."""
        active = self.active
        refs = [a.stop.remote(limit) for _, a in active]
        ready, _ = bounded(ray.wait, refs, num_returns=len(refs), timeout_s=limit + self.cfg.cluster.actor_timeout_s,
                           what="the rollout actors' stop()")
        out = []
        for (i, _), ref in zip(active, refs):
            try:
                out.append(bounded(ray.get, ref, timeout_s=REPORT_TIMEOUT_S, what=f"rollout actor {i}'s stop()")
                           if ref in ready else None)
            except ray.exceptions.RayError as e:
                self.say(f"[warn] rollout actor {i} failed while stopping ({cause(e)}); its last stats stand")
                out.append(None)
                continue
            if out[-1] is None:
                self.say(f"[warn] rollout actor {i} did not stop within {limit:.0f} s; its in-flight episodes "
                         "are dropped and its last stats stand")
        last = {s.index: s for s in self.last_stats}
        return [s if s is not None else last[i] for (i, _), s in zip(active, out) if s is not None or i in last]

    # ------------------------------------------------------------------------------------------------ stall report
    def stall_report(self, *, step: int, waited: float, limit: float, learner: str, checkpoint: Callable[[], str] | None,
                     floor: float = PROGRESS_FLOOR_S) -> RunFailed:
        """What ends a run in which no step completed within the watchdog's limit: the state of every component in
        one line. ``checkpoint``: saves one and returns what to say of it (called only when the buffer answers);
        None when the learner or the buffer is busy."""
        timeout = REPORT_TIMEOUT_S
        buffer: BufferStats | str
        try:
            buffer = bounded(ray.get, self.buffer.stats.remote(), timeout_s=timeout, what="the buffer actor")
        except GetTimeoutError:
            buffer = f"not answering (stats() took more than {timeout:.0f} s)"
        except ray.exceptions.RayError as e:
            buffer = f"failed: {cause(e)}"
        actors: list[RolloutStats | str] = []
        indices = [i for i, _ in self.active]
        refs = [actor.stats.remote() for _, actor in self.active]  # asked at once, answered within one limit
        ready, _ = bounded(ray.wait, refs, num_returns=len(refs), timeout_s=timeout, what="the rollout actors' stats()",
                           fetch_local=False) if refs else ([], [])
        for i, ref in zip(indices, refs):
            try:
                if ref not in ready:
                    raise GetTimeoutError()
                stats = bounded(ray.get, ref, timeout_s=timeout, what=f"rollout actor {i}'s stats()")
                self.note_pushes(i, stats)
                actors.append(stats)
            except GetTimeoutError:
                actors.append(f"not answering (stats() took more than {timeout:.0f} s)")
            except ray.exceptions.RayError as e:
                actors.append(f"failed: {cause(e)}")
        now = time.monotonic()
        pushes = [now - p[2] if (p := self._pushes.get(i)) and p[2] is not None else None for i in indices]
        last = self.versions.last_publish
        publish = None if last is None else (last[0], now - last[1])
        if checkpoint is not None and not isinstance(buffer, str):
            try:
                saved = checkpoint()
            except Exception as e:  # noqa: BLE001 - the stall is what the line reports; the save is a bonus
                saved = f"checkpoint failed: {cause(e)}"
        else:
            saved = "no checkpoint (the learner or the buffer is busy)"
        return RunFailed(stall_message(
            step=step, waited=waited, limit=limit, configured=self.cfg.cluster.progress_timeout_s is not None,
            learner=learner, buffer=buffer, actors=actors, last_push_s=pushes, last_publish=publish,
            checkpoint=saved, batch_groups=self.cfg.learner.batch_size // self.cfg.rollout.group_size, floor=floor,
            indices=indices))


def settle(actor: Any, limit_s: float = SETTLE_S) -> None:
    """Wait (at most ``limit_s``) until Ray's record of ``actor``, whose calls failed, no longer has it alive."""
    deadline = time.monotonic() + limit_s
    while actor_record(actor).get("State") == "ALIVE" and time.monotonic() < deadline:
        time.sleep(0.5)


LEARNER, BUFFER, ACTORS_SILENT, PUSHES, ADMISSION, GENERATION = (
    "the learner", "the replay buffer", "rollout actor", "the rollout actors' pushes", "admission",
    "the rollout actors")
BLAMED = (LEARNER, BUFFER, ACTORS_SILENT, PUSHES, ADMISSION, GENERATION)  # what a stall report may name as blocked


def blocked_component(*, learner: str, buffer: BufferStats | str, actors: Sequence[RolloutStats | str],
                      batch_groups: int, indices: Sequence[int] | None = None) -> str:
    """The part of a stalled run that is blocked, with why, for the report's ``blocked:`` clause; it starts with one
    of ``BLAMED``. The first that holds, in the order a batch travels backwards from the learner:

    - the learner: it computes a step that does not end, or does not answer after the buffer's "no batch";
    - the replay buffer: the learner waits for its answer to ``sample_batch``, or its ``stats()`` fail or go
      unanswered, or it holds ``batch_groups`` ready groups (a batch) while the idle learner got none;
    - rollout actors that do not answer ``stats()``;
    - the actors' pushes: no episode runs but finished ones were not pushed;
    - admission: no episode runs and nothing waits to be pushed, so admission grants no group;
    - the rollout actors: episodes run and no batch completes.

    ``indices``: the actors' numbers (default 0, 1, ...; a run that gave some up has gaps)."""
    names = list(range(len(actors))) if indices is None else list(indices)
    running = [a.running for a in actors if isinstance(a, RolloutStats)]
    silent = [names[i] for i, a in enumerate(actors) if isinstance(a, str)]
    if learner.startswith(("computing", "not answering")):
        return f"{LEARNER} ({learner})"
    if "the buffer's answer" in learner:  # asked for a batch, the buffer never answered
        if isinstance(buffer, str):
            return f"{BUFFER} ({buffer}; no answer to sample_batch either)"
        return f"{BUFFER} (no answer to sample_batch, though it answers stats())"
    if isinstance(buffer, str):
        return f"{BUFFER} ({buffer})"
    if buffer.ready_groups >= batch_groups:
        return (f"{BUFFER} ({buffer.ready_groups} ready groups, a batch needs {batch_groups}, yet sample_batch "
                "handed none)")
    if silent:
        return f"{ACTORS_SILENT}{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} (not answering)"
    unpushed = sum(max(0, a.finished - a.pushed) for a in actors if isinstance(a, RolloutStats))
    if sum(running) == 0 and unpushed:
        return f"{PUSHES} ({unpushed} finished episodes not pushed to the buffer)"
    if sum(running) == 0:
        return (f"{ADMISSION} (no episode running: {buffer.admission.groups_open} groups open, the oldest admitted "
                f"at version {buffer.admission.oldest_open_version}, learner version {buffer.learner_version})")
    return f"{GENERATION} ({sum(running)} episodes running, no batch completed)"


def stall_message(*, step: int, waited: float, limit: float, configured: bool, learner: str,
                  buffer: BufferStats | str, actors: Sequence[RolloutStats | str], last_push_s: Sequence[float | None],
                  last_publish: tuple[int, float] | None, checkpoint: str, batch_groups: int,
                  floor: float = PROGRESS_FLOOR_S, indices: Sequence[int] | None = None) -> str:
    """The one line a stalled run ends with: how long nothing happened, which component is blocked
    (``blocked_component``), and the state of every component (``learner``: what the learner does;
    ``buffer``/``actors``: their stats, or why there are none; ``last_push_s``: seconds since each actor's pushed
    count last rose, None: never; ``last_publish``: (version, seconds ago); ``batch_groups``: groups in a batch;
    ``floor``: the watchdog's floor when the limit is not configured)."""
    names = list(range(len(actors))) if indices is None else list(indices)
    blocked = blocked_component(learner=learner, buffer=buffer, actors=actors, batch_groups=batch_groups,
                                indices=names)
    unset = f" unset: max({floor:.0f}, {PROGRESS_STEPS} x the slowest step)"
    parts = [f"no learner step completed for {waited:.0f} s (step {step + 1}; limit {limit:.0f} s, "
             f"cluster.progress_timeout_s{'' if configured else unset})",
             f"blocked: {blocked}", f"learner: {learner}"]
    if isinstance(buffer, str):
        parts.append(f"buffer: {buffer}")
    else:
        a = buffer.admission
        parts.append(f"buffer: {buffer.size} rows, {buffer.ready_groups} ready groups, {buffer.pending_groups} "
                     f"pending groups; admission: {a.running} running, {a.groups_open} groups open, oldest open "
                     f"version {a.oldest_open_version}")
    for i, stats, ago in zip(names, actors, last_push_s):
        if isinstance(stats, str):
            parts.append(f"actor{i}: {stats}")
            continue
        pushed = "never pushed" if ago is None else f"last push {ago:.0f} s ago"
        state = "done (error)" if stats.done else ("running" if stats.ready else "not set up")
        parts.append(f"actor{i}: {state}, {stats.running} episodes running, {stats.pushed} pushed, {pushed}, "
                     f"{stats.failed} failed")
    parts.append("last publish: none" if last_publish is None else
                 f"last publish: version {last_publish[0]}, {last_publish[1]:.0f} s ago")
    parts.append(checkpoint)
    return "; ".join(parts)
