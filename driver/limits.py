"""How long the driver waits for anything, and what ends a run that waited too long.

Every wait of the driver on another component has a limit, and a component that does not answer within it ends the
run in one ``error:`` line naming it (``RunFailed``). ``ProgressWatchdog`` is the limit on the RL loop itself: no
learner step completed for ``cluster.progress_timeout_s``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError

from actors.rollout_worker import engine_silence_s
from async_agent_rl.config import Config
from async_agent_rl.errors import InputError, error_line


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
        return ray.get(ref, timeout=limit)
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
    """How long one evaluation of the config's held-out questions (``eval.num_questions``, 0: every one) may take."""
    return evaluation_s(cfg, cfg.eval.num_questions or test_questions(cfg.data.test_files))


def stop_s(cfg: Config) -> float:
    """How long a rollout actor is given to finish and push its in-flight episodes when the run stops (at least
    ``cluster.actor_timeout_s``): one wave of the longest episodes at the slowest pace assumed."""
    return max(cfg.cluster.actor_timeout_s, cfg.rollout.max_response_length / SLOWEST_EPISODE_TOKENS_PER_S)


class ProgressWatchdog:
    """When did a learner step last complete, and is that too long ago? (``cluster.progress_timeout_s``)

    The clock runs while the driver waits for a step (a batch from the buffer, then the learner's computation), from
    the moment it asks for one; evaluations, publishes and checkpoints between steps are not counted, and a rollout
    actor's restart starts the clock again (the restart has its own limit, ``cluster.actor_setup_timeout_s``). The
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
