"""The rollout worker: one inference engine, up to K concurrent episodes, no batch-level barrier.

Every episode is its own asyncio task; it moves on the moment its own generation or search returns. A GRPO group
is ``group_size`` independent episodes of the same prompt sharing a group id (they are not synchronised either:
the buffer assembles the group). New groups start only when

- the admission callback grants them (the buffer's staleness-aware capacity rule, ``async_agent_rl.staleness``),
  so the worker never generates what the staleness bound would throw away, and
- an episode slot is free (``max_concurrent_episodes``).

``mode="sync"`` is the batch-synchronous baseline instead (``actors.lockstep``): admitted groups run as one wave,
turn by turn in lockstep, and the next wave starts when the whole wave is done.

Finished trajectories go to an async ``sink`` in batches of ``push_batch_size`` (or sooner when no more arrive for
``flush_after_s``): everything that crosses an actor boundary is batched. The sink returns the trajectories a full
buffer refused; they are held and sent again with the next push (after ``push_retry_s``, or with the next batch),
never waited on: the episodes that finish meanwhile go out alongside them, so a refused member of a new group never
holds back the members that complete the groups the buffer already holds (that stalled a run for ever:
``buffer.replay_buffer``, "Capacity and backpressure").

At a stop (``stop()``, or the worker failing), once the last episode has ended, everything unsent goes out in one last
push and what the buffer still refuses is dropped at once and counted (``dropped_at_stop``): the learner has stopped,
nobody drains the buffer, and retrying until the caller's stop timeout held every worker of a run with a full buffer
for minutes. Every wait of the worker has a limit (``async_agent_rl.waits``): its episodes in flight at the end of a
wave or of its last group (``episodes_timeout_s``), its last push (``last_push_s``), its cancelled tasks
(``cancel_grace_s``).

Where time idles, reported with the totals (``RolloutStats``): the worker wraps its runner's engine in a
``MeteredEngine``, which counts the engine's requests in flight over time (``engine_idle_s``: the seconds with none,
no episode generating), and reads the runner's ``EpisodeTimers`` (``episode_s``, ``tool_wait_s``: episode-seconds in
all, and awaiting the search tool).

The engine health probe: the ``MeteredEngine`` also knows when the engine last answered (a ``generate`` request
finished, the oldest request in flight started, or a weight update let generation resume). A hung engine core leaves
requests in flight that never finish while this event loop still answers ``stats()``; with ``engine_silence_s`` set,
a periodic check in the worker's own loop stops the worker (``EngineSilent``) once requests have been in flight with
none finishing for longer than that, so ``stats.done`` is set and supervision restarts the actor. A weight update's
pause is no silence, nor is a worker with nothing in flight. The limit a run uses: ``engine_silence_s(cfg)``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Awaitable, Callable, Iterator, Sequence

from actors.lockstep import LockstepEngine, TurnBarrier
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode import EpisodeRunner, PromptTooLongError
from async_agent_rl.records import Trajectory
from async_agent_rl.stats import EpisodeCounters, Occupancy, RolloutStats, new_incarnation
from async_agent_rl.waits import WaitTimeout, all_within, within

log = logging.getLogger(__name__)

# takes a batch of finished trajectories; returns those a full buffer refused (None or empty: all taken)
Sink = Callable[[list[Trajectory]], Awaitable[Sequence[Trajectory] | None]]
# (episodes wanted, policy version, group id, the prompt: ``{"id": example id, "cursor": its PromptSource's state
# after drawing it, or None}``) -> granted. The buffer keeps both: a resume issues the prompt again if its episodes
# were in flight, and continues the stream from the cursor of the last group admitted (``RolloutWorker.resume``).
Admit = Callable[[int, int, str, dict], Awaitable[int]]
Lost = Callable[[list[str]], Awaitable[None]]  # group id of each episode that was started and will never arrive


class PromptSource:
    """Endless passes over a shard of the dataset (shard ``index`` of ``count``), reshuffled each epoch.

    An iterator with a position that survives a restart: ``state()`` is where the stream stands (``{"epoch": e,
    "index": i, "last": id}``: the next prompt is the ``i``-th of pass ``e``, ``last`` the id of the one drawn before
    it) and ``restore(state)`` puts a fresh source (same examples, shard and seed) there. The shuffle RNG is not
    stored: it is seeded from ``(seed, shard)`` and draws one shuffle per pass, so replaying ``e + 1`` shuffles
    rebuilds both pass ``e``'s order and the RNG state exactly (a few ms per hundred passes of a large shard). A state
    that does not fit these examples (another dataset, shard count or length filter: its ``last`` is not where it
    says) is refused with ``ValueError`` and the source stays at its beginning."""

    def __init__(
        self, examples: Sequence[QAExample], shard: int = 0, num_shards: int = 1, seed: int = 0, shuffle: bool = True
    ):
        self.examples = [ex for i, ex in enumerate(examples) if i % num_shards == shard]
        if not self.examples:
            raise ValueError(f"dataset shard {shard}/{num_shards} is empty ({len(examples)} examples in total)")
        self._seed = seed * 7919 + shard
        self._rng = random.Random(self._seed)
        self.shuffle = shuffle
        self.epoch = 0
        self._order: list[QAExample] | None = None  # this pass's order, drawn at its first prompt
        self._index = 0  # the next prompt's place in it

    def __iter__(self) -> "PromptSource":
        return self

    def __next__(self) -> QAExample:
        if self._order is not None and self._index >= len(self._order):
            self.epoch += 1
            self._order = None
        if self._order is None:
            self._order = self._new_order()
            self._index = 0
        ex = self._order[self._index]
        self._index += 1
        return ex

    def _new_order(self) -> list[QAExample]:
        order = list(self.examples)
        if self.shuffle:
            self._rng.shuffle(order)
        return order

    def state(self) -> dict[str, Any]:
        """Where the stream stands (msgpack- and JSON-able); ``restore`` continues from here."""
        last = self._order[self._index - 1].id if self._order is not None and self._index else None
        return {"epoch": self.epoch, "index": self._index, "last": last}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state()`` of a source over the same examples (class docstring); ``ValueError`` when it
        does not fit them (the source is left at its beginning)."""
        try:
            epoch, index, last = int(state["epoch"]), int(state["index"]), state.get("last")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a prompt stream position: {state!r} ({e!r})") from None
        if epoch < 0 or not 0 <= index <= len(self.examples):
            raise ValueError(f"prompt stream position {state!r} is outside a pass of {len(self.examples)} prompts")
        rng = random.Random(self._seed)
        order = None
        for _ in range(epoch + 1 if index else epoch):  # the shuffles drawn so far (none yet for an unstarted pass)
            order = list(self.examples)
            if self.shuffle:
                rng.shuffle(order)
        if index and (order is None or order[index - 1].id != last):
            raise ValueError(f"prompt stream position {state!r} does not fit these {len(self.examples)} prompts "
                             f"(the prompt before it is {order[index - 1].id if order else None!r}, not {last!r})")
        self._rng, self.epoch, self._order, self._index = rng, epoch, order if index else None, index


class MeteredEngine:
    """An engine whose ``generate`` requests in flight are counted over time (``requests``, an ``Occupancy``): its
    idle seconds are the time with no request in flight. It also knows when the engine last answered (``silence()``,
    the health probe's reading): a request finished (with its turn or with an error), the oldest request in flight
    started, or a weight update (``update_weights``, ``update_weights_collective``, through this wrapper) ended.
    While an update runs, generation is paused on purpose: silence counts from the update's start, not from the last
    answer, so a pause is never added to the requests' wait, but an update that itself never ends (a hung engine
    core holds the update too) is silence once it has run for the limit. Everything else is the wrapped engine's."""

    def __init__(self, engine: Any, requests: Occupancy | None = None, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.requests = requests or Occupancy()
        self._clock = clock
        self._answered = clock()  # the last answer (see above); silence counts from here
        self._updating = 0  # weight updates under way
        self._update_started = 0.0  # when the first of the updates under way started

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, req: Any) -> Any:
        if self.requests.in_flight == 0:  # the first request of a busy spell: silence counts from its start
            self._answered = self._clock()
        with self.requests.held():
            try:
                out = await self.engine.generate(req)
            except Exception:  # an error is an answer (failures in a row count those); a cancellation is none
                self._answered = self._clock()
                raise
            self._answered = self._clock()
            return out

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A weight update: the engine's requests wait for it by design; generation resumes when it ends."""
        if self._updating == 0:
            self._update_started = self._clock()
        self._updating += 1
        try:
            yield
        finally:
            self._updating -= 1
            self._answered = self._clock()

    async def update_weights(self, *args: Any, **kwargs: Any) -> Any:
        with self.paused():
            return await self.engine.update_weights(*args, **kwargs)

    async def update_weights_collective(self, *args: Any, **kwargs: Any) -> Any:
        with self.paused():
            return await self.engine.update_weights_collective(*args, **kwargs)

    def silence(self) -> tuple[int, float]:
        """``(requests in flight, seconds since the engine last answered)``: 0 s with none in flight; while a weight
        update runs, seconds since it started."""
        n = self.requests.in_flight
        if n == 0:
            return n, 0.0
        since = self._update_started if self._updating else self._answered
        return n, max(0.0, self._clock() - since)

    def __getattr__(self, name: str) -> Any:  # close, join_weight_group, ...: the engine's own
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)


# The engine health probe's limit a run derives (rollout.engine_silence_s: 0): several times the longest one turn
# (rollout.max_tokens_per_turn tokens) takes at the slowest pace a healthy engine keeps per request in flight (the
# pace driver.limits assumes per episode), at least ENGINE_SILENCE_FLOOR_S, and at most half the progress watchdog's
# configured limit, so the actor is restarted before the run is declared stalled (with the watchdog's limit unset,
# driver.limits.first_step_s keeps it at twice this and more).
ENGINE_SILENCE_FLOOR_S = 180.0
ENGINE_SILENCE_TURNS = 10
SLOWEST_REQUEST_TOKENS_PER_S = 10.0
ENGINE_PROBE_EVERY_S = 5.0  # the probe looks this often (or at a tenth of a smaller limit)
IDLE_WAKE_S = 1.0  # the flush task, with nothing to send, looks at its outbox again after this long at most


def episodes_timeout_s(cfg: Any) -> float:
    """How long a worker of config ``cfg`` waits for its episodes in flight to end (a wave in ``mode="sync"``, the last
    ones after its last group): twice the longest of one episode of ``rollout.max_response_length`` tokens at the
    slowest pace assumed, the engine health probe's limit (a hung engine is then reported as such first) and
    ``cluster.actor_timeout_s``."""
    episode = cfg.rollout.max_response_length / SLOWEST_REQUEST_TOKENS_PER_S
    return 2 * max(episode, engine_silence_s(cfg), cfg.cluster.actor_timeout_s)


def engine_silence_s(cfg: Any) -> float:
    """The health probe's limit for config ``cfg``: ``rollout.engine_silence_s``, or with 0 the derived one above
    (``max(ENGINE_SILENCE_FLOOR_S, ENGINE_SILENCE_TURNS x max_tokens_per_turn / SLOWEST_REQUEST_TOKENS_PER_S)``, at
    most ``cluster.progress_timeout_s / 2`` when that is set and not 0)."""
    r = cfg.rollout
    if r.engine_silence_s > 0:
        return float(r.engine_silence_s)
    turn_s = r.max_tokens_per_turn / SLOWEST_REQUEST_TOKENS_PER_S
    derived = max(ENGINE_SILENCE_FLOOR_S, ENGINE_SILENCE_TURNS * turn_s)
    watchdog = cfg.cluster.progress_timeout_s
    return min(derived, watchdog / 2) if watchdog else derived


async def admit_all(n: int, version: int, group_id: str, prompt: dict | None = None) -> int:
    """Admission that always grants (standalone rollouts, no staleness bound)."""
    return n


async def ignore_lost(group_ids: list[str]) -> None:
    return None


@dataclass
class WorkerStats(EpisodeCounters):
    """The worker's running totals (mutated as episodes end); ``message()`` is the ``RolloutStats`` it reports."""

    reward_component_sums: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    by_kind: dict = field(default_factory=dict)  # kind -> Counter
    failures: Counter = field(default_factory=Counter)
    started_at: float = field(default_factory=time.monotonic)
    incarnation: str = field(default_factory=new_incarnation)
    # set by the worker: its engine's requests in flight, its runner's episode timers (``EpisodeTimers``)
    engine_requests: Occupancy | None = field(default=None, repr=False, compare=False)
    timers: Any = field(default=None, repr=False, compare=False)

    def add_finished(self, traj: Trajectory) -> None:
        self.finished += 1
        self.generated_tokens += traj.num_generated_tokens
        self.observation_tokens += len(traj.response_ids) - traj.num_generated_tokens
        self.searches += traj.meta.num_searches
        self.search_errors += traj.meta.num_search_errors
        self.turns += traj.meta.num_turns
        self.reward_sum += traj.reward
        self.reward_component_sums.update(traj.reward_components)
        self.finish_reasons[traj.meta.finish_reason] += 1
        k = self.by_kind.setdefault(traj.meta.data_source or "unknown", Counter())
        k.update(finished=1, reward_sum=traj.reward, searches=traj.meta.num_searches,
                 exact_match_sum=traj.reward_components.get("exact_match", 0.0))

    def message(self, **actor: Any) -> RolloutStats:
        """These totals as a ``RolloutStats``; ``actor`` sets the actor's own fields (index, version, search, ...)."""
        totals = {f.name: getattr(self, f.name) for f in fields(EpisodeCounters)}
        idle = {}
        if self.engine_requests is not None:
            idle["engine_idle_s"] = self.engine_requests.totals()[1]
        if self.timers is not None:
            idle["episode_s"], idle["tool_wait_s"] = self.timers.totals()
        return RolloutStats(
            **{**totals, "reward_component_sums": dict(self.reward_component_sums),
               "finish_reasons": dict(self.finish_reasons), "failures": dict(self.failures),
               "by_kind": {kind: dict(c) for kind, c in self.by_kind.items()}},
            incarnation=self.incarnation,
            elapsed_s=time.monotonic() - self.started_at,
            running=self.started - self.finished - self.failed,
            **idle,
            **actor,
        )


class RolloutFailure(RuntimeError):
    """The worker stopped because pushing its episodes, or an episode task's reporting, failed, or its engine
    failed every episode for a long run of episodes in a row (cause chained)."""


class EngineSilent(RuntimeError):
    """The engine's requests have been in flight with none finishing for longer than the health probe's limit
    (``engine_silence_s``): a hung engine core, which fails no episode and would hold them for ever."""


class EngineFailing(RuntimeError):
    """The engine said it is dead (vLLM's ``EngineDeadError``: a killed engine core process fails every request at
    once), or ``failures_in_a_row`` episodes failed one after the other with no episode finishing between them: the
    engine is dead or not answering."""


def engine_dead(e: BaseException) -> bool:
    """Whether ``e`` says the engine itself is dead (vLLM's ``EngineDeadError``: its engine core process is gone),
    not only this request failed; it or an exception it was raised from. By name: this module does not import vLLM."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if any(c.__name__ == "EngineDeadError" for c in type(e).__mro__):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _seconds(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.2g}"


def failures_in_a_row_limit(max_concurrent: int) -> int:
    """Episodes failing in a row that mean the engine failed, not the episodes: every episode in flight and as many
    again (a dead engine fails each of them at once; one bad prompt fails one)."""
    return max(8, 2 * max_concurrent)


class RolloutWorker:
    def __init__(
        self,
        runner: EpisodeRunner,
        prompts: Iterator[QAExample],
        sink: Sink,
        *,
        group_size: int,
        max_concurrent: int,
        push_batch_size: int = 8,
        admit: Admit = admit_all,
        on_lost: Lost = ignore_lost,
        actor_id: str = "",
        seed: int | None = None,
        flush_after_s: float = 0.2,
        push_retry_s: float = 0.02,
        admission_poll_s: float = 0.05,
        mode: str = "async",
        engine_silence_s: float = 0.0,
        cancel_grace_s: float = 10.0,
        episodes_timeout_s: float = 3600.0,
        last_push_s: float = 60.0,
    ):
        if mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', not {mode!r}")
        self.runner = runner
        self.prompts = iter(prompts)
        self.sink = sink
        self.group_size = group_size
        self.push_batch_size = push_batch_size
        self.admit = admit
        self.on_lost = on_lost
        self.actor_id = actor_id or uuid.uuid4().hex[:8]
        self.seed = seed
        self.flush_after_s = flush_after_s
        self.push_retry_s = push_retry_s
        self.admission_poll_s = admission_poll_s
        self.mode = mode
        self.max_concurrent = max_concurrent
        self.stats = WorkerStats()
        if not isinstance(runner.engine, MeteredEngine):  # the engine's idle time, counted from the worker's start
            runner.engine = MeteredEngine(runner.engine, Occupancy(start=self.stats.started_at))
        self.engine: MeteredEngine = runner.engine
        self.stats.engine_requests = runner.engine.requests
        # the health probe's limit (0: no probe): requests in flight with none finished for longer stop the worker
        self.engine_silence_s = engine_silence_s
        self.cancel_grace_s = cancel_grace_s  # after a failure, how long cancelled episode tasks are waited for
        # how long the episodes in flight at the end of a wave or of the last group are waited for (past it the worker
        # fails with WaitTimeout: its actor is restarted), and the last push after the last episode (past it what is
        # unsent is dropped and counted in dropped_at_stop)
        self.episodes_timeout_s = episodes_timeout_s
        self.last_push_s = last_push_s
        self.stats.timers = getattr(runner, "timers", None)
        self._slots = asyncio.Semaphore(max_concurrent)
        self._outbox: asyncio.Queue[Trajectory | None] = asyncio.Queue()
        # the flush task's trajectories: finished and not sent yet, sent and refused (held), in the push under way
        self._batch: list[Trajectory] = []
        self._held: list[Trajectory] = []
        self._sending: list[Trajectory] = []
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._failed = asyncio.Event()
        self.failure: tuple[str, BaseException] | None = None  # (what failed, the exception) once the worker failed
        self._episode_counter = 0
        self._redo: list[tuple[QAExample, str, int]] = []  # (prompt, group id, members) to start first: ``resume``
        self._drawn: tuple[QAExample, dict] | None = None  # a prompt drawn and not admitted yet, with its tag
        self.failures_in_a_row = 0  # episodes failed since the last one that finished
        self.failures_in_a_row_limit = failures_in_a_row_limit(max_concurrent)

    # ------------------------------------------------------------------------------------------------ control
    def resume(self, groups: Sequence[tuple[QAExample, str, int]]) -> None:
        """Groups that were in flight when the run's checkpoint was taken, as ``(prompt, group id, members)``: ``run``
        starts ``members`` episodes of each under its own group id before it draws a new prompt, asking no admission
        (their admission survived the restart: the buffer kept them open, their members counted as running).

        Only the missing members are generated again; the members that arrived before the checkpoint stay in the
        buffer and the group completes with the new ones. Dropping the arrived members and generating the whole
        group again would throw away finished work and change the counts a resume keeps (accepted, evicted); it
        would not make the group more consistent: its members are independent samples of the same prompt either
        way (GRPO's group statistics need nothing more), each carrying its own behavior log-probabilities and
        token versions (the decoupled loss corrects each for its own lag). Staleness stays bounded: the group keeps
        the admission version it had, and the new members are generated with weights no older than the
        checkpoint's, which are at least that version (``async_agent_rl.staleness``, claim 1)."""
        self._redo.extend(groups)

    def stop(self) -> None:
        """Start no new groups; in-flight episodes finish and are pushed, once: what a full buffer still refuses then
        is dropped and counted (``stats.dropped_at_stop``)."""
        self._stop.set()

    async def run(self, num_groups: int | None = None) -> WorkerStats:
        """Run until ``num_groups`` groups were started (None: until ``stop()``), then drain and flush.

        A failure of the background push (``sink``) or of an episode task outside its episode (reporting a lost
        episode to ``on_lost``) stops the worker at once: no new group starts, the episodes in flight are cancelled
        (they have nowhere to go) and ``run`` raises ``RolloutFailure`` naming it, the cause chained. Before, the
        flush task died alone and the worker generated on forever; the error surfaced only at ``stop()``. So does an
        engine whose requests stay in flight with none finishing for ``engine_silence_s`` (the health probe,
        ``_probe_engine``). The cancelled episodes are waited for ``cancel_grace_s`` at most (a hung engine may not
        even let its requests be aborted). The last push is waited for ``last_push_s`` at most (module docstring)."""
        flusher = asyncio.create_task(self._flush_loop())
        flusher.add_done_callback(lambda t: self._task_ended("pushing finished episodes", t))
        body = asyncio.create_task(self._generate(num_groups))
        failed = asyncio.create_task(self._failed.wait())
        probe = asyncio.create_task(self._probe_engine()) if self.engine_silence_s > 0 else None
        try:
            done, _ = await asyncio.wait({body, failed}, return_when=asyncio.FIRST_COMPLETED)
            if body in done:
                body.result()  # its own exception (e.g. admission failing), as before
        finally:
            failed.cancel()
            if not body.done():  # a failure: stop generating now
                body.cancel()
            in_flight = [body, *([probe] if probe else []), *self._tasks]
            for t in in_flight:
                t.cancel()
            ended, stuck = await asyncio.wait(in_flight, timeout=self.cancel_grace_s)
            for t in ended:  # retrieved (gather(return_exceptions=True) did that before)
                if not t.cancelled():
                    t.exception()
            if stuck:
                log.warning("rollout worker %s: %d task(s) did not end within %g s of being cancelled (a hung "
                            "engine?); left behind", self.actor_id, len(stuck), self.cancel_grace_s)
            await self._outbox.put(None)
            await self._last_push(flusher)
        if self.failure is not None:
            what, e = self.failure
            raise RolloutFailure(f"rollout worker {self.actor_id}: {what} failed: {type(e).__name__}: {e}") from e
        return self.stats

    async def _generate(self, num_groups: int | None) -> None:
        if self.mode == "sync":
            await self._run_waves(num_groups)
            return
        while self._redo and not self._stop.is_set():  # admitted before a restart: first, unasked (``resume``)
            ex, gid, members = self._redo.pop(0)
            await self._start_group(ex, gid, members=members)
        group_id = self._new_group_id()
        while not self._stop.is_set() and (num_groups is None or self.stats.groups_started < num_groups):
            # the buffer grants whole groups (multiples of group_size) or nothing; ask with the ENGINE's
            # version (the weights that will generate), not the learner's
            ex, tag = self._draw()
            if await self.admit(self.group_size, self.runner.engine.version, group_id, tag) < self.group_size:
                await self._wait(self.admission_poll_s)
                continue
            self._drawn = None
            await self._start_group(ex, group_id)
            group_id = self._new_group_id()
        await self._episodes_ended()

    async def _episodes_ended(self) -> None:
        """Wait for the episodes in flight to end (their errors are theirs: counted, reported lost), for
        ``episodes_timeout_s`` at most: past it the worker fails with ``WaitTimeout`` (the episodes are cancelled)."""
        if self._tasks:
            await all_within(list(self._tasks), self.episodes_timeout_s,
                             f"rollout worker {self.actor_id}: its {len(self._tasks)} episode(s) in flight",
                             return_exceptions=True)

    def _task_ended(self, what: str, task: asyncio.Task) -> None:
        """Done callback of the flush task and of every episode task: an exception that escaped one stops the
        worker (the first one is kept; gather(return_exceptions=True) would otherwise swallow it)."""
        if task.cancelled() or task.exception() is None or self.failure is not None:
            return
        e = task.exception()
        self.failure = (what, e)
        log.error("rollout worker %s: %s failed, stopping: %s: %s", self.actor_id, what, type(e).__name__, e,
                  exc_info=e)
        self._stop.set()
        self._failed.set()

    async def _probe_engine(self) -> None:
        """The engine health probe: every ``ENGINE_PROBE_EVERY_S`` (a tenth of a smaller limit) it reads the
        engine's silence; requests in flight with none finished for longer than ``engine_silence_s`` (a weight
        update's pause counted from its own start) stop the worker with ``EngineSilent`` (cancelled when ``run`` ends)."""
        every = min(ENGINE_PROBE_EVERY_S, self.engine_silence_s / 10)
        while self.failure is None:
            await asyncio.sleep(every)
            n, silent = self.engine.silence()
            if silent > self.engine_silence_s and self.failure is None:
                self.failure = ("the engine", EngineSilent(
                    f"engine stopped answering: {n} request(s) in flight, none finished for {_seconds(silent)} s "
                    f"(limit {self.engine_silence_s:g} s, rollout.engine_silence_s)"))
                log.error("rollout worker %s: %d engine request(s) in flight, none finished for %s s; the engine is "
                          "hung", self.actor_id, n, _seconds(silent))
                self._stop.set()
                self._failed.set()

    async def _run_waves(self, num_groups: int | None) -> None:
        """``mode="sync"``: admit as many groups as the buffer grants (up to ``max_concurrent`` episodes), run them
        as one wave in lockstep (``actors.lockstep``), and admit the next wave only when the whole wave is done."""
        wave_groups = max(1, self.max_concurrent // self.group_size)

        def more(n: int) -> bool:
            return not self._stop.is_set() and (num_groups is None or self.stats.groups_started + n < num_groups)

        while more(0):
            wave: list[tuple[QAExample, str, int]] = []
            # groups admitted before a restart (``resume``) make up the first waves, as many episodes as may run
            while self._redo and (not wave or sum(m for *_, m in wave) + self._redo[0][2] <= self.max_concurrent):
                wave.append(self._redo.pop(0))
            group_id = self._new_group_id()
            while not self._redo and len(wave) < wave_groups and more(len(wave)):
                ex, tag = self._draw()
                if await self.admit(self.group_size, self.runner.engine.version, group_id, tag) < self.group_size:
                    break
                self._drawn = None
                wave.append((ex, group_id, self.group_size))
                group_id = self._new_group_id()
            if not wave:
                await self._wait(self.admission_poll_s)
                continue
            barrier = TurnBarrier(sum(m for *_, m in wave))
            r = self.runner
            # the engine stays metered (a wave waiting at the barrier is engine idle time), the timers are shared
            lockstep = EpisodeRunner(LockstepEngine(r.engine, barrier), r.search, r.tokenizer, r.s, r.timers)
            for ex, gid, members in wave:
                await self._start_group(ex, gid, lockstep, barrier, members=members)
            await self._episodes_ended()
            self.stats.waves += 1

    async def _wait(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    # ------------------------------------------------------------------------------------------------ episodes
    def _new_group_id(self) -> str:
        return f"{self.actor_id}-{uuid.uuid4().hex[:12]}"

    def _draw(self) -> tuple[QAExample, dict]:
        """The next group's prompt and its tag for admission (``Admit``): the one drawn before if it was not
        admitted yet (it is asked for again, never skipped), else the stream's next."""
        if self._drawn is None:
            ex = next(self.prompts)
            state = getattr(self.prompts, "state", None)  # a PromptSource's position after it; a plain iterator: none
            self._drawn = (ex, {"id": ex.id, "cursor": state() if state is not None else None})
        return self._drawn

    async def _start_group(self, ex: QAExample, group_id: str, runner: EpisodeRunner | None = None,
                           barrier: TurnBarrier | None = None, members: int | None = None) -> None:
        self.stats.groups_started += 1
        for _ in range(self.group_size if members is None else members):
            await self._slots.acquire()
            self._episode_counter += 1
            seed = None if self.seed is None else self.seed * 1_000_003 + self._episode_counter
            task = asyncio.create_task(self._episode(ex, group_id, seed, runner or self.runner, barrier))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda t: self._task_ended("an episode task (reporting its episode)", t))

    async def _episode(self, ex: QAExample, group_id: str, seed: int | None, runner: EpisodeRunner,
                       barrier: TurnBarrier | None) -> None:
        self.stats.started += 1
        try:
            traj = await runner.run(ex, group_id=group_id, seed=seed)
        except Exception as e:  # an engine failure loses this episode, not the worker; counted, logged, reported
            self.stats.failed += 1
            if not isinstance(e, PromptTooLongError):  # the prompt's fault, not the engine's
                self.failures_in_a_row += 1
            self._log_failure(e, ex)
            dead = engine_dead(e)
            if (dead or self.failures_in_a_row >= self.failures_in_a_row_limit) and self.failure is None:
                # a dead engine fails every episode at once: the worker stops at its first failure when the engine
                # says it is dead (vLLM's EngineDeadError), or after a long run of failures in a row, and its actor is
                # restarted, instead of admitting and failing groups in a tight loop
                self.failure = ("the engine", EngineFailing(
                    f"its engine died ({type(e).__name__}: {e})" if dead else
                    f"{self.failures_in_a_row} episodes failed in a row, the last with {type(e).__name__}: {e}"))
                log.error("rollout worker %s: %s; the engine is dead or not answering", self.actor_id,
                          "its engine died" if dead else f"{self.failures_in_a_row} episodes failed in a row")
                self._stop.set()
                self._failed.set()
            await self.on_lost([group_id])
            return
        finally:
            self._slots.release()
            if barrier is not None:
                await barrier.leave()  # the rest of the wave stops waiting for this episode
        traj.meta.actor_id = self.actor_id
        self.failures_in_a_row = 0
        self.stats.add_finished(traj)
        await self._outbox.put(traj)

    def _log_failure(self, e: Exception, ex: QAExample) -> None:
        """Count the failure by kind; log the 1st, 2nd, 4th, 8th, ... of each kind (one traceback, the first):
        a failure that repeats every episode gives a few lines with counts, not a flood."""
        kind = type(e).__name__
        self.stats.failures[kind] += 1
        n = self.stats.failures[kind]
        if n & (n - 1) == 0:
            log.warning("%d episode(s) failed with %s so far (latest: question %s: %s)", n, kind, ex.id, e,
                        exc_info=e if n == 1 else None)  # fmt: skip

    # ------------------------------------------------------------------------------------------------ pushing
    async def _flush_loop(self) -> None:
        """Send finished trajectories in batches; hold the ones the sink refused (a full buffer) and send them again
        with the next batch or after ``push_retry_s``, whichever comes first (module docstring). After the last
        episode, one last push of everything unsent: at a stop (``stop()``, a failure) what the buffer still refuses
        is dropped at once and counted in ``stats.dropped_at_stop``; without one (``run(num_groups)`` ran out of
        groups) the refused ones are sent again every ``push_retry_s`` until taken or ``stop()`` (``run`` waits
        ``last_push_s`` at most)."""
        batch, held = self._batch, self._held  # finished, not sent yet; sent and refused: sent again, never waited on
        while True:
            waits = ([self.flush_after_s] if batch else []) + ([self.push_retry_s] if held else [])
            try:
                item = await asyncio.wait_for(self._outbox.get(), min(waits) if waits else IDLE_WAKE_S)
            except asyncio.TimeoutError:
                item = ...
            if item is None:  # the last episode has ended
                break
            if item is not ...:
                batch.append(item)
            if (batch or held) and (item is ... or len(batch) >= self.push_batch_size):
                await self._push_now()
        while batch or held:
            stopping = self._stop.is_set()
            await self._push_now()
            if stopping or not held:
                break
            await asyncio.sleep(self.push_retry_s)
        self._drop("the buffer still refused them at stop")

    async def _push_now(self) -> None:
        """One push of the held trajectories and the batch; the refused ones are held."""
        send = [*self._held, *self._batch]
        self._held.clear()
        self._batch.clear()
        self._sending = send
        refused = list(await self.sink(send) or ())
        self._sending = []
        self._held.extend(refused)
        self.stats.pushed += len(send) - len(refused)

    async def _last_push(self, flusher: asyncio.Task) -> None:
        """Wait for the flush task's last push, ``last_push_s`` at most; past it the push is cancelled and what was
        not taken is dropped and counted (``stats.dropped_at_stop``). A failure of the flush task is ``self.failure``
        (its done callback), raised by ``run``."""
        try:
            await within(flusher, self.last_push_s, f"rollout worker {self.actor_id}: its last push")
        except WaitTimeout:
            self._drop(f"not taken within last_push_s={self.last_push_s:g} s of the last episode")
        except Exception:  # noqa: BLE001 - the flush task's failure: self.failure has it
            pass

    def _drop(self, why: str) -> None:
        """Drop every trajectory not taken by the buffer (unsent, refused, in a push cut off), counted and said."""
        dropped = [*self._sending, *self._held, *self._batch]
        self._sending, self._held[:], self._batch[:] = [], [], []
        if dropped:
            self.stats.dropped_at_stop += len(dropped)
            log.warning("rollout worker %s: %d finished trajectories dropped at stop (%s)", self.actor_id,
                        len(dropped), why)
