"""How long the driver waits for anything, and what ends a run that waited too long.

Every wait of the driver on another component has a limit, and a component that does not answer within it ends the
run in one ``error:`` line naming it (``RunFailed``). ``ProgressWatchdog`` is the limit on the RL loop itself: no
learner step completed for ``cluster.progress_timeout_s``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError

from actors.rollout_worker import engine_silence_s
from async_agent_rl.config import Config
from async_agent_rl.errors import InputError, error_line
from async_agent_rl.waits import bounded
from driver.stops import StopRequested


class RunFailed(InputError):
    """A component failed for good (a rollout actor out of restarts, weight publishes that keep failing): the run
    ends with one ``error:`` line naming it and the cause (exit status 2, as the CLI maps ``InputError``)."""


def cause(e: BaseException) -> str:
    """An exception in one line: the component and the cause (unwrapped from Ray), else its type and first line."""
    line = error_line(e)
    if line is not None:
        return line.removeprefix("error: ")
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}".rstrip(": ")


def ask(ref: Any, limit: float, what: str, key: str = "cluster.actor_timeout_s") -> Any:
    """``ray.get(ref)`` (one reference or a list) bounded by ``limit`` seconds, the value of config key ``key`` (""
    for a limit the driver derives): a component that stopped (SIGSTOP, a hang) never answers, and the driver must
    not wait for it forever; ``what`` names it in the run's one error line."""
    try:
        return bounded(ray.get, ref, timeout_s=limit, what=what)
    except GetTimeoutError:
        within = f"{key}={limit:g} s" if key else f"{limit:.0f} s"
        raise RunFailed(f"{what} did not answer within {within} (hung or stopped)") from None


PROGRESS_FLOOR_S = 600.0  # cluster.progress_timeout_s unset: max(this, PROGRESS_STEPS x the slowest step so far)
PROGRESS_STEPS = 10
ENGINE_SILENCES = 2  # the watchdog's limit unset: at least this many times the engine health probe's limit
REPORT_TIMEOUT_S = 10.0  # a component that does not answer a stall report's question within this is "not answering"

# The slowest pace a healthy run is assumed to keep, for the limits a config implies before any step has been timed:
# each episode in flight generates at least this many tokens a second (vLLM decodes tens to hundreds per sequence)
# and each learner rank trains on at least this many tokens a second (a 3B model under ZeRO-3 on one GPU: thousands).
SLOWEST_EPISODE_TOKENS_PER_S = 10.0
SLOWEST_LEARNER_TOKENS_PER_S = 2000.0


def generation_s(cfg: Config, episodes: int, actors: int | None = None) -> float:
    """Seconds ``episodes`` episodes of the longest kind may take on ``actors`` actors (all of the run's) at the
    slowest pace assumed, ``max_concurrent_episodes`` at a time each."""
    at_once = (actors or cfg.rollout.num_actors) * cfg.rollout.max_concurrent_episodes
    waves = -(-episodes // at_once)
    return waves * cfg.rollout.max_response_length / SLOWEST_EPISODE_TOKENS_PER_S


def first_step_s(cfg: Config) -> float:
    """How long the first learner step may take with nothing timed yet: its batch generated and trained on at the
    slowest pace assumed, at least ``PROGRESS_FLOOR_S``. The watchdog's floor, so a large config's first step (the
    GPU config: 2,560 trajectories of up to 4,096 response tokens, a 3B model) is never reported as a stall. Also at
    least ``ENGINE_SILENCES`` x the engine health probe's limit (``engine_silence_s``): a hung engine's actor is
    restarted (which starts the watchdog's clock again) before the run could be declared stalled."""
    tokens = cfg.learner.batch_size * (cfg.data.max_prompt_length + cfg.rollout.max_response_length)
    learning = tokens / (SLOWEST_LEARNER_TOKENS_PER_S * cfg.learner.num_ranks)
    return max(PROGRESS_FLOOR_S, generation_s(cfg, cfg.learner.batch_size) + learning,
               ENGINE_SILENCES * engine_silence_s(cfg))


def test_questions(files: list[str]) -> int:
    """How many questions ``files`` hold (a parquet file's row count from its footer); 10,000 for a file that cannot
    be read this way (the evaluation then reports what is wrong with it)."""
    try:
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    except Exception:  # noqa: BLE001 - only an estimate for a limit
        return 10_000


def evaluation_s(cfg: Config, questions: int) -> float:
    """How long an evaluation of ``questions`` greedy episodes on one rollout actor may take (at least
    ``PROGRESS_FLOOR_S``)."""
    return max(PROGRESS_FLOOR_S, generation_s(cfg, questions, actors=1))


def eval_limit_s(cfg: Config) -> float:
    """How long one evaluation of the config's held-out questions (``eval.num_questions``, 0: every one) may take
    (``phase_limit``: ``cluster.progress_timeout_s`` set by the user bounds it too)."""
    return phase_limit(cfg, "evaluation", cfg.eval.num_questions or test_questions(cfg.data.test_files))[0]


# ------------------------------------------------------------------------------------------------ phases between steps
PHASES = ("checkpoint", "publish", "evaluation", "restore")
SLOWEST_DISK_BYTES_PER_S = 50e6  # a checkpoint written, or read back, at least this fast
SLOWEST_PUBLISH_BYTES_PER_S = 50e6  # the weights reach every rollout actor and are loaded at least this fast
CHECKPOINT_COPIES = 8  # bytes a checkpoint moves per byte of the policy's weights (fp32 master weights, Adam's moments)
SLICE_S = 1.0  # a phase's wait looks at the stop requests this often


def model_bytes(path: str | Path) -> int:
    """The bytes of the weight files in the policy folder ``path`` (0 when it is no folder here: a hub name)."""
    folder = Path(path)
    try:
        return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))
    except OSError:
        return 0


def phase_limit(cfg: Config, phase: str, size: float = 0) -> tuple[float, str]:
    """How long ``phase`` (one of ``PHASES``) may take, and how to say it in an error line: the one place the
    limits of the phases between learner steps are derived, from the config and the work's size (``size``: the
    policy's bytes for a checkpoint, a restore and a publish, the questions for an evaluation).

    - checkpoint, restore: ``CHECKPOINT_COPIES`` x the policy's bytes at ``SLOWEST_DISK_BYTES_PER_S``, at least
      ``cluster.actor_timeout_s``;
    - publish: the policy's bytes at ``SLOWEST_PUBLISH_BYTES_PER_S``, at least ``cluster.actor_timeout_s``; on the
      collective path ``weight_sync.timeout_s`` (each of its waits' own limit). It bounds every wait of a publish
      (``driver.weight_sync.create_publisher``): the rollout actors applying it, the collective group's waits, and
      the learner's ranks gathering the weights (``LearnerGroup.state_dict_ref``, ``prepare_publish``);
    - evaluation: ``evaluation_s`` of the questions on one rollout actor.

    ``cluster.progress_timeout_s`` set by the user (not None, not 0) bounds every one of them: no phase between steps
    keeps the run from its next step longer than the user allows one step to take."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}; known: {', '.join(PHASES)}")
    c = cfg.cluster
    if phase == "evaluation":
        limit, said = evaluation_s(cfg, int(size)), f"{evaluation_s(cfg, int(size)):.0f} s"
    elif phase == "publish" and cfg.weight_sync.method == "collective":
        limit, said = cfg.weight_sync.timeout_s, f"weight_sync.timeout_s={cfg.weight_sync.timeout_s:g} s"
    else:
        rate = SLOWEST_PUBLISH_BYTES_PER_S if phase == "publish" else SLOWEST_DISK_BYTES_PER_S / CHECKPOINT_COPIES
        limit = max(c.actor_timeout_s, size / rate)
        said = (f"cluster.actor_timeout_s={c.actor_timeout_s:g} s" if limit == c.actor_timeout_s else
                f"{limit:.0f} s for {size / 1e9:.1f} GB")
    if c.progress_timeout_s and c.progress_timeout_s < limit:
        return float(c.progress_timeout_s), f"cluster.progress_timeout_s={c.progress_timeout_s:g} s"
    return float(limit), said


class PhaseTimeout(RunFailed):
    """A phase's wait passed its limit; ``pending``: the positions of the references that did not answer."""

    def __init__(self, message: str, pending: list[int]):
        super().__init__(message)
        self.pending = pending


def wait_phase(refs: Sequence[Any], limit: float, what: str, said: str, stops: Any = None, stop_limit: float = 0.0,
               on_stop: str = "finish") -> list[Any]:
    """The values of ``refs`` (actor calls of a phase between steps), waited for at most ``limit`` seconds (``said``:
    how the error line names that limit) in ``SLICE_S`` slices; past it, ``PhaseTimeout`` naming ``what`` (one
    ``error:`` line). ``stops``: the run's ``StopRequests``, looked at between slices. Once a stop was asked for, a
    phase that is part of the stop (``on_stop="finish"``: a checkpoint) goes on for at most ``stop_limit`` seconds
    more, and one that is not (``"abandon"``: a publish, a start) ends at once with ``StopRequested``. A second signal
    ends the run at once (its handler raises ``Stopped``, at the latest when the slice ends)."""
    refs = list(refs)
    t0 = time.monotonic()
    pending = list(refs)
    while pending:
        end, within = t0 + limit, said
        if stops is not None and stops.signal is not None:
            if on_stop == "abandon":
                raise StopRequested()
            if stops.at + stop_limit < end:
                end, within = stops.at + stop_limit, f"{stop_limit:g} s of the stop request"
        now = time.monotonic()
        if now >= end:
            raise PhaseTimeout(f"{what} did not answer within {within} (hung or stopped)",
                               [i for i, r in enumerate(refs) if r in pending])
        _, pending = bounded(ray.wait, pending, num_returns=len(pending), timeout_s=min(SLICE_S, end - now),
                             what=what, fetch_local=False)
    try:  # every one is ready: this only fetches their answers
        return bounded(ray.get, refs, timeout_s=max(REPORT_TIMEOUT_S, limit), what=what)
    except GetTimeoutError:
        raise PhaseTimeout(f"{what} did not answer within {said} (hung or stopped)", list(range(len(refs)))) \
            from None


def stop_s(cfg: Config) -> float:
    """How long a rollout actor is given to finish and push its in-flight episodes when the run stops (at least
    ``cluster.actor_timeout_s``): one wave of the longest episodes at the slowest pace assumed. Also the stop limit
    of the phases between steps (``wait_phase``): a checkpoint under way when a stop is asked for gets this long."""
    return max(cfg.cluster.actor_timeout_s, cfg.rollout.max_response_length / SLOWEST_EPISODE_TOKENS_PER_S)


class ProgressWatchdog:
    """When did a learner step last complete, and is that too long ago? (``cluster.progress_timeout_s``)

    The clock runs while the driver waits for a step (a batch from the buffer, then the learner's computation), from
    the moment it asks for one; evaluations, publishes and checkpoints between steps are not counted (each has its
    own limit, ``phase_limit``, which a configured limit bounds too), and a rollout actor's restart starts the clock
    again (the restart has its own limit, ``cluster.actor_setup_timeout_s``). The
    limit is the configured one, or with none configured ``max(floor, PROGRESS_STEPS x the slowest step so far)``;
    0 turns the watchdog off. ``floor``: ``PROGRESS_FLOOR_S``, or more for a config whose first step is large."""

    def __init__(self, setting: float | None, clock: Callable[[], float] = time.monotonic,
                 floor: float = PROGRESS_FLOOR_S):
        self.setting, self.clock, self.floor = setting, clock, floor
        self.slowest = 0.0  # seconds, the slowest completed step (waiting included)
        self.since = clock()

    def limit(self) -> float | None:
        if self.setting == 0:
            return None
        if self.setting is not None:
            return float(self.setting)
        return max(self.floor, PROGRESS_STEPS * self.slowest)

    def waiting(self) -> None:
        """The driver starts waiting for the next step."""
        self.since = self.clock()

    def step_done(self) -> float:
        """A step completed; returns how long it took since ``waiting()``."""
        took = self.clock() - self.since
        self.slowest = max(self.slowest, took)
        self.since = self.clock()
        return took

    def waited(self) -> float:
        return self.clock() - self.since

    def expired(self) -> bool:
        limit = self.limit()
        return limit is not None and self.waited() > limit
