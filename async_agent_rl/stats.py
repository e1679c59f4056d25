"""Typed statistics messages of the components, and the one place that keeps run totals over restarts.

Every component reports plain data (these dataclasses pickle across Ray as they are):

==================  ==============================================  ==========================================
message             produced by                                     consumed by
==================  ==============================================  ==========================================
``RolloutStats``    ``RolloutActor.stats()`` (``WorkerStats``)      the driver (supervision, metrics.jsonl),
                                                                    ``monitoring.metrics.RolloutMetrics``
``BufferStats``     ``ReplayBuffer.stats()``, ``BufferActor``       the driver, ``BufferMetrics``
``LearnerStats``    ``Learner.train_step``                          the driver, ``LearnerMetrics``
``DriverStats``     the driver (faults)                             ``DriverMetrics``
``PublishStats``    ``driver.weight_sync`` publishers              metrics.jsonl, ``DriverMetrics``
``LearningStats``   ``driver.train.LearningSignals``                metrics.jsonl, ``LearningMetrics``
``IdleStats``       the driver, per step (``idle_stats``)           metrics.jsonl, ``IdleMetrics``
``EvalScore``       (the keys of one ``score_episodes`` entry)      ``EvalMetrics``
==================  ==============================================  ==========================================

The learner's quantities are declared once, in ``LEARNER_METRICS`` (field, meaning, unit, Prometheus name and kind):
``monitoring.metrics`` defines its learner metrics from it, metrics.jsonl records every ``LearnerStats`` field, and
a field without a row is an error at import.

Unknown keys: ``LearnerStats.from_dict`` takes fields and the declared ``LEARNER_EXTRA_KEYS``; another key is an
error under strict keys (``AAR_STRICT_STATS_KEYS=1``, set for the whole test suite) and otherwise a warning line, once
per key per process, and dropped: a renamed metric cannot silently become None.

Totals are monotonic since the reporting process started. A restarted rollout actor (a new process, so a new
``incarnation``) or a rebuilt buffer starts again from zero; ``RunTotals`` turns such reports into totals since
the run began, for the driver's records and the Prometheus counters alike.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Mapping, Optional, Sequence


def new_incarnation() -> str:
    """An id for one life of a reporting process: its totals restart at zero when this changes."""
    return uuid.uuid4().hex


# ------------------------------------------------------------------------------------------------ unknown keys
log = logging.getLogger(__name__)

# Set to 1 (the test suite sets it for every test and every process it starts): an unknown key in a stats message is
# an error, so a renamed metric fails a test instead of turning into None.
STRICT_KEYS_ENV = "AAR_STRICT_STATS_KEYS"
_warned_keys: set[tuple[str, str]] = set()


class UnknownStatsKeyError(KeyError):
    """A stats message holds a key its class does not know (strict keys)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def strict_keys() -> bool:
    """Whether unknown stats keys are errors: ``AAR_STRICT_STATS_KEYS=1`` in the environment."""
    return os.environ.get(STRICT_KEYS_ENV, "") not in ("", "0")


def check_stats_keys(message: str, unknown: Sequence[str]) -> None:
    """Keys of a ``message`` (a stats class's name) that no field or declared extra holds: under strict keys
    ``UnknownStatsKeyError`` naming them all; otherwise one warning line per key name and message per process, and
    the caller drops them."""
    if not unknown:
        return
    if strict_keys():
        raise UnknownStatsKeyError(f"{message}: unknown key(s) {sorted(unknown)} (renamed metric? declare it as a "
                                   f"field, or as an extra key)")
    for key in unknown:
        if (message, key) not in _warned_keys:
            _warned_keys.add((message, key))
            log.warning("%s: unknown key %r dropped (renamed metric? it is not recorded)", message, key)


# ------------------------------------------------------------------------------------------------- occupancy
class Occupancy:
    """Time-weighted accounting of how many of something are in flight (engine requests, running episodes, episodes
    awaiting the search tool), from ``start`` (default: creation) on, by ``clock`` (default ``time.monotonic``):
    ``busy_s`` is the integral of the count over time (3 episodes for 2 s: 6 episode-seconds), ``idle_s`` the time
    with none in flight. Both are totals up to the moment they are read (the interval in progress included), so they
    only grow. ``held()`` counts one in flight for the ``with`` block, however it ends (exception, cancellation)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, start: Optional[float] = None):
        self._clock = clock
        self._t = clock() if start is None else start
        self._n = 0
        self._busy = self._idle = 0.0
        self._lock = threading.Lock()

    def _advance(self) -> None:
        now = self._clock()
        dt = max(0.0, now - self._t)
        self._t = max(self._t, now)
        if self._n:
            self._busy += self._n * dt
        else:
            self._idle += dt

    def enter(self) -> None:
        with self._lock:
            self._advance()
            self._n += 1

    def leave(self) -> None:
        with self._lock:
            if self._n <= 0:
                raise RuntimeError("Occupancy.leave() without a matching enter()")
            self._advance()
            self._n -= 1

    @contextmanager
    def held(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @property
    def in_flight(self) -> int:
        return self._n

    def totals(self) -> tuple[float, float]:
        """``(busy_s, idle_s)`` up to now."""
        with self._lock:
            self._advance()
            return self._busy, self._idle


# ----------------------------------------------------------------------------------------------------- rollout
@dataclass
class SearchStats:
    """The search client's monotonic counts: calls, HTTP attempts, retries, calls that failed after all retries,
    and failed attempts by kind (timeout, connection, http_status, bad_reply)."""

    requests: int = 0
    attempts: int = 0
    retries: int = 0
    failures: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class WeightUpdate:
    """One weight reload in a rollout actor's engine."""

    version: int
    seconds: float
    pause_seconds: float = 0.0
    bytes: int = 0
    mode: str = ""


@dataclass
class EpisodeCounters:
    """A rollout worker's totals over the episodes it ran (``actors.rollout_worker.WorkerStats`` keeps them as
    episodes end; ``RolloutStats`` reports them)."""

    started: int = 0
    finished: int = 0
    failed: int = 0
    groups_started: int = 0
    waves: int = 0  # mode="sync" only
    pushed: int = 0
    # finished, still refused by a full buffer when the worker stopped, and dropped then (never retried: nobody
    # drains the buffer at a run's end)
    dropped_at_stop: int = 0
    generated_tokens: int = 0
    observation_tokens: int = 0
    searches: int = 0
    search_errors: int = 0
    turns: int = 0  # model turns
    reward_sum: float = 0.0
    reward_component_sums: dict[str, float] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # per question kind (data source): finished, reward_sum, exact_match_sum, searches
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # failed episodes by exception type


@dataclass
class RolloutStats(EpisodeCounters):
    """One rollout actor: its worker's totals over finished episodes since ``incarnation`` began, and its state."""

    index: int = 0
    incarnation: str = ""
    ready: bool = False  # set up (a restarted actor is not until the driver calls setup())
    done: bool = False  # its worker's run ended
    version: int = 0  # policy version of the engine's weights
    elapsed_s: float = 0.0
    running: int = 0  # episodes in flight
    pid: int = 0  # the actor's process (a driver on the same machine ends a hung one by it)
    search: SearchStats = field(default_factory=SearchStats)
    weight_updates: list[WeightUpdate] = field(default_factory=list)  # the latest few
    # where time idles (``Occupancy`` totals since ``incarnation`` began, up to this report): seconds the engine had
    # no request in flight (no episode generating), episode-seconds of all episodes (running episodes integrated over
    # time) and the part of them spent awaiting the search tool
    engine_idle_s: float = 0.0
    episode_s: float = 0.0
    tool_wait_s: float = 0.0

    @property
    def exact_match_sum(self) -> Optional[float]:
        """Summed exact match of the finished episodes, when ``exact_match`` is a reward term."""
        return self.reward_component_sums.get("exact_match")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------------ buffer
@dataclass
class AdmissionStats:
    """``AdmissionState``'s counters: episode totals and ``running`` episodes in flight; the pacing rule's group
    counts (``groups_open``: admitted, neither consumed nor dropped; ``oldest_open_version``: the oldest admission
    version among them, -1 when none is open)."""

    started: int = 0
    accepted: int = 0
    rejected: int = 0
    evicted: int = 0
    running: int = 0
    groups_started: int = 0
    groups_dropped: int = 0
    groups_consumed: int = 0
    groups_open: int = 0
    oldest_open_version: int = -1


@dataclass
class BufferStats:
    """The replay buffer: what it holds now (gauges) and totals since it was built (restored counters included)."""

    size: int = 0
    tokens: int = 0
    bytes: int = 0
    ready_groups: int = 0
    pending_groups: int = 0
    oldest_age_s: float = 0.0
    learner_version: int = 0
    capacity_trajectories: int = 0
    capacity_tokens: int = 0
    pushed: int = 0
    sampled: int = 0
    push_refused: int = 0
    rejected: int = 0
    groups_released_short: int = 0
    groups_released_partial: int = 0
    groups_overdue: int = 0
    groups_completed: int = 0
    groups_zero_variance: int = 0
    zero_variance_kept: int = 0
    evicted: dict[str, int] = field(default_factory=dict)  # by reason
    filtered_groups: dict[str, int] = field(default_factory=dict)  # all_correct, all_wrong, all_equal
    staleness_histogram: dict[int, int] = field(default_factory=dict)  # consumed trajectories by staleness
    # trajectories by response-length bucket (tokens) and by turns, per stage: generated, consumed, evicted
    length_tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    length_turns: dict[str, dict[str, int]] = field(default_factory=dict)
    # the buffer actor's
    incarnation: str = ""
    admission: AdmissionStats = field(default_factory=AdmissionStats)
    lost_episodes: dict[str, int] = field(default_factory=dict)  # by rollout actor
    late_pushes: int = 0
    late_rejects: int = 0

    @property
    def evicted_total(self) -> int:
        return sum(self.evicted.values())

    @property
    def groups_released(self) -> dict[str, int]:
        """Groups released incomplete, by how: ``short`` (members rejected), ``partial`` (timed out)."""
        return {"short": self.groups_released_short, "partial": self.groups_released_partial}


# ----------------------------------------------------------------------------------------------------- learner
@dataclass
class LearnerStats:
    """One ``Learner.train_step`` (``learner.learner`` module docstring). Each quantity is declared, with its meaning,
    unit and metric, in ``LEARNER_METRICS`` below; a field without a row there is an error at import. Quantities a
    configuration does not compute (``kl`` without a KL term, the critic's without ``gae``, importance weights under
    plain PPO) are None; ``extra`` holds the declared keys without a field (``LEARNER_EXTRA_KEYS``);
    ``batch`` describes the step's batch (``TrainBatch.summary()``)."""

    step: int = 0
    version: int = 0
    lr: float = 0.0
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    loss_tokens: float = 0.0
    reward_mean: float = 0.0
    advantage_mean: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    policy_loss: Optional[float] = None
    entropy: Optional[float] = None
    kl: Optional[float] = None
    value_loss: Optional[float] = None
    approx_kl: Optional[float] = None
    behavior_kl: Optional[float] = None
    clip_frac: Optional[float] = None
    dual_clip_frac: Optional[float] = None
    iw_mean: Optional[float] = None
    iw_max: Optional[float] = None
    iw_capped_frac: Optional[float] = None
    iw_capped_seq_frac: Optional[float] = None
    icepop_masked_frac: Optional[float] = None
    floor_veto_frac: Optional[float] = None
    floor_veto_seq_frac: Optional[float] = None
    mismatch_kl_fresh: Optional[float] = None
    mismatch_abs_logprob_fresh: Optional[float] = None
    mismatch_kl_stale: Optional[float] = None
    mismatch_abs_logprob_stale: Optional[float] = None
    seq_log_ratio_mean: Optional[float] = None
    seq_log_ratio_max: Optional[float] = None
    fresh_token_fraction: Optional[float] = None
    proximal_pass_skipped: Optional[float] = None  # 1: no proximal forward pass this step (algorithm.proximal), else 0
    grad_norm: Optional[float] = None
    critic_grad_norm: Optional[float] = None
    extra: dict[str, float] = field(default_factory=dict)
    batch: dict[str, float] = field(default_factory=dict)  # TrainBatch.summary() of the step's batch

    @property
    def trained_tokens(self) -> float:
        """Non-padding tokens of the step's batch."""
        return self.tokens_per_s * self.step_time_s

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> "LearnerStats":
        """From a flat metrics dict (``as_dict``): fields by name, the keys of ``LEARNER_EXTRA_KEYS`` to ``extra``.
        Any other key is unknown (``check_stats_keys``): an error under strict keys, else warned of and dropped."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "batch"}
        check_stats_keys(cls.__name__, [k for k in d if k not in names and k not in LEARNER_EXTRA_KEYS])
        known = {k: v for k, v in d.items() if k in names}
        for k in ("step", "version"):
            if k in known:
                known[k] = int(known[k])
        return cls(**known, extra={k: float(v) for k, v in d.items() if k in LEARNER_EXTRA_KEYS})

    def as_dict(self) -> dict[str, float]:
        """Flat, without the quantities not computed (the ``learner`` entry of metrics.jsonl)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "batch")}
        d = {k: float(v) for k, v in d.items() if v is not None}
        return {**d, **self.extra}


@dataclass(frozen=True)
class LearnerMetric:
    """One learner metric: the ``LearnerStats`` field (or property) it reads, what it means, its unit ("" for a
    count, ratio or fraction with none), and its Prometheus name and kind. ``monitoring.metrics`` defines the metric
    from the row (help text: meaning and unit; ``docs/METRICS.md`` is generated from it), and metrics.jsonl's
    ``learner`` record has every field by name (``LearnerStats.as_dict``)."""

    field: str
    meaning: str
    unit: str
    metric: str
    kind: str = "gauge"  # "gauge": the latest step's value; "counter": summed over steps; "histogram": each step's

    @property
    def help(self) -> str:
        return f"{self.meaning} [{self.unit}]" if self.unit else self.meaning


# The one declaration of the learner's metrics. Over the whole batch on every rank, as one rank reports them; losses
# are the mini-batch aggregates averaged over the step's optimizer updates. Names are stable (dashboards use them).
LEARNER_METRICS: tuple[LearnerMetric, ...] = (
    LearnerMetric("step", "learner steps done", "", "aar_learner_step"),
    LearnerMetric("version", "learner policy version (published updates)", "", "aar_learner_policy_version"),
    LearnerMetric("step", "learner steps observed (each counted once)", "", "aar_learner_steps_total", "counter"),
    LearnerMetric("trained_tokens", "non-padding tokens trained on (tokens_per_s x step_time_s of each step)",
                  "tokens", "aar_learner_trained_tokens_total", "counter"),
    LearnerMetric("loss_tokens", "loss positions trained on (those of each step's batch)", "tokens",
                  "aar_learner_loss_tokens_total", "counter"),
    LearnerMetric("step_time_s", "wall time of one train_step", "s", "aar_learner_step_seconds", "histogram"),
    LearnerMetric("tokens_per_s", "non-padding tokens of the batch / step time, latest step", "tokens/s",
                  "aar_learner_tokens_per_second"),
    LearnerMetric("policy_loss", "policy loss (algorithm.policy_loss), latest step", "", "aar_learner_policy_loss"),
    LearnerMetric("value_loss", "clipped value loss of the critic, latest step (gae only)", "",
                  "aar_learner_value_loss"),
    LearnerMetric("kl", "KL to the reference policy (the behavior policy without one) by algorithm.kl_estimator, "
                  "latest step (only with algorithm.kl_coef > 0)", "nats", "aar_learner_kl"),
    LearnerMetric("approx_kl", "KL(anchor || live policy) by k3 over the updates, latest step; anchor: proximal "
                  "(decoupled_ppo) or behavior (ppo)", "nats", "aar_learner_approx_kl"),
    LearnerMetric("behavior_kl", "KL(behavior || proximal): staleness plus engine mismatch (decoupled_ppo)", "nats",
                  "aar_learner_behavior_kl"),
    LearnerMetric("entropy", "policy entropy of softmax(logits / T) over loss positions", "nats",
                  "aar_learner_entropy"),
    LearnerMetric("clip_frac", "fraction of loss tokens with the PPO clip active", "", "aar_learner_clip_fraction"),
    LearnerMetric("dual_clip_frac", "fraction of loss tokens with the dual clip active", "",
                  "aar_learner_dual_clip_fraction"),
    LearnerMetric("iw_mean", "mean behavior importance weight exp(proximal - behavior) before the cap "
                  "(decoupled_ppo)", "", "aar_learner_importance_weight_mean"),
    LearnerMetric("iw_max", "max behavior importance weight before the cap (decoupled_ppo)", "",
                  "aar_learner_importance_weight_max"),
    LearnerMetric("iw_capped_frac", "fraction of loss tokens whose importance weight was truncated or masked "
                  "(decoupled_ppo)", "", "aar_learner_importance_weight_capped_fraction"),
    LearnerMetric("iw_capped_seq_frac", "fraction of sequences with a loss token whose importance weight was "
                  "truncated or masked (decoupled_ppo)", "", "aar_learner_importance_weight_capped_sequence_fraction"),
    LearnerMetric("icepop_masked_frac", "fraction of loss tokens masked by the IcePop band (algorithm.icepop_band "
                  "set)", "", "aar_learner_icepop_masked_fraction"),
    LearnerMetric("floor_veto_frac", "fraction of loss tokens in sequences vetoed by the floor "
                  "(algorithm.behavior_weight_floor set)", "", "aar_learner_floor_veto_fraction"),
    LearnerMetric("floor_veto_seq_frac", "fraction of sequences vetoed by the floor (algorithm.behavior_weight_floor "
                  "set)", "", "aar_learner_floor_veto_sequence_fraction"),
    LearnerMetric("mismatch_kl_fresh", "KL(behavior || proximal) by k3 over fresh tokens (sampled by the weights the "
                  "learner holds): engine/trainer mismatch alone (absent without fresh tokens)", "nats",
                  "aar_learner_mismatch_kl_fresh"),
    LearnerMetric("mismatch_abs_logprob_fresh", "mean |proximal - behavior| log-prob over fresh tokens: engine/trainer "
                  "mismatch alone", "nats", "aar_learner_mismatch_abs_logprob_fresh"),
    LearnerMetric("mismatch_kl_stale", "KL(behavior || proximal) by k3 over stale tokens: staleness plus mismatch "
                  "(absent without stale tokens)", "nats", "aar_learner_mismatch_kl_stale"),
    LearnerMetric("mismatch_abs_logprob_stale", "mean |proximal - behavior| log-prob over stale tokens", "nats",
                  "aar_learner_mismatch_abs_logprob_stale"),
    LearnerMetric("seq_log_ratio_mean", "mean over sequences of sum(proximal - behavior) over their sampled tokens "
                  "(log of the sequence importance ratio)", "nats", "aar_learner_seq_log_ratio_mean"),
    LearnerMetric("seq_log_ratio_max", "largest |sequence log importance ratio| of the batch", "nats",
                  "aar_learner_seq_log_ratio_max"),
    LearnerMetric("fresh_token_fraction", "fraction of sampled tokens that are fresh (their version is the proximal "
                  "policy's)", "", "aar_learner_fresh_token_fraction"),
    LearnerMetric("proximal_pass_skipped", "learner steps whose proximal log-probs took no forward pass "
                  "(algorithm.proximal: an all-fresh batch under skip_fresh, every step under interpolate or behavior; "
                  "over aar_learner_steps_total: the skipped fraction)", "", "aar_learner_proximal_pass_skipped_total",
                  "counter"),
    LearnerMetric("grad_norm", "policy gradient norm before clipping, mean over the step's optimizer updates", "",
                  "aar_learner_grad_norm"),
    LearnerMetric("critic_grad_norm", "critic gradient norm before clipping (gae only)", "",
                  "aar_learner_critic_grad_norm"),
    LearnerMetric("lr", "policy learning rate of the step", "", "aar_learner_lr"),
    LearnerMetric("staleness_mean", "mean staleness (learner version - oldest token version) of the latest batch's "
                  "trajectories", "versions", "aar_learner_batch_staleness_mean"),
    LearnerMetric("staleness_max", "max staleness of the latest batch's trajectories", "versions",
                  "aar_learner_batch_staleness_max"),
    LearnerMetric("reward_mean", "mean episode reward of the latest batch", "", "aar_learner_batch_reward_mean"),
    LearnerMetric("advantage_mean", "mean advantage over loss positions, latest batch", "",
                  "aar_learner_advantage_mean"),
)


# Keys a learner step reports that no field holds (``extra``): the critic's clip fraction (gae), and the filler rows
# a batch of groups that lost members was padded with.
LEARNER_EXTRA_KEYS: frozenset[str] = frozenset({"vf_clip_frac", "filler_rows"})


def check_learner_metrics(stats: type = LearnerStats, rows: tuple[LearnerMetric, ...] = LEARNER_METRICS) -> None:
    """Every field of ``stats`` (but ``extra`` and ``batch``) has a row, every row reads a field or property, no
    metric is named twice; else ``TypeError`` naming them. Run at import."""
    fields = {f.name for f in dataclasses.fields(stats)} - {"extra", "batch"}
    read = {m.field for m in rows}
    unknown = {f for f in read - fields if not isinstance(getattr(stats, f, None), property)}
    if fields - read or unknown:
        raise TypeError(f"LEARNER_METRICS and {stats.__name__} disagree: fields without a row (declare each in "
                        f"LEARNER_METRICS) {sorted(fields - read)}, rows without a field {sorted(unknown)}")
    if len({m.metric for m in rows}) != len(rows):
        raise TypeError("LEARNER_METRICS names a metric twice")


check_learner_metrics()


# ------------------------------------------------------------------------------------------------------ driver
@dataclass
class DriverStats:
    """The driver's fault accounting: in-flight episodes lost to actor failures, restarts per rollout actor."""

    lost_episodes: int = 0
    actor_restarts: dict[str, int] = field(default_factory=dict)


@dataclass
class PublishStats:
    """``seconds``: publish call to every actor done (the publish latency); ``put_seconds``: ``ray.put`` (object
    store) or the learner's broadcast (collective); ``actor_seconds``: each actor's own reload time when it reports
    one."""

    version: int
    method: str
    seconds: float
    put_seconds: float
    bytes: int
    num_actors: int
    actor_seconds: list[float] = field(default_factory=list)

    def as_metrics(self) -> dict[str, float]:
        return {"publish_latency_s": self.seconds, "publish_put_s": self.put_seconds,
                "publish_bytes": float(self.bytes), "publish_version": float(self.version)}


@dataclass
class LearningStats:
    """Per-step learning signals: the share of the groups completed since the previous step whose rewards were all
    equal (None when none completed), the step's entropy, and by question kind the ``episodes``, mean ``reward``,
    ``exact_match`` and ``searches`` of the rollout episodes finished since the previous step."""

    zero_variance_share: Optional[float] = None
    entropy: Optional[float] = None
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class IdleStats:
    """Where time idled during one learner step, i.e. since the previous step's record (``idle_stats``):

    - ``sample_wait_s``: seconds the learner waited for the step's batch (the driver's wait, the learner's own step
      time taken out); ``learner_batch_wait_share``: that wait over the step's wall time (previous record to this
      one, evaluations and checkpoints between steps included);
    - ``rollout_engine_idle_share``: over the rollout actors, seconds their engines had no request in flight over the
      seconds that passed in them (one actor idle and one busy: 0.5);
    - ``rollout_tool_wait_s``: episode-seconds spent awaiting the search tool, summed over episodes and actors;
      ``rollout_tool_wait_share``: that over all episode-seconds (the share of episode time that was tool wait).

    A share is None when its denominator is 0 (no time passed, no episode ran)."""

    sample_wait_s: float = 0.0
    learner_batch_wait_share: Optional[float] = None
    rollout_engine_idle_share: Optional[float] = None
    rollout_tool_wait_s: float = 0.0
    rollout_tool_wait_share: Optional[float] = None


def idle_stats(wait_s: float, step_wall_s: float, rollout: Sequence[RolloutStats],
               previous: Mapping[int, RolloutStats]) -> IdleStats:
    """The step's ``IdleStats`` from the learner's wait, the step's wall time and every actor's stats now and at
    the previous record (``previous``, by actor index). An actor without a previous report in the same incarnation
    (the first step, a restarted actor) counts from its start."""
    wall = idle = episodes = tool = 0.0
    for r in rollout:
        p = previous.get(r.index)
        if p is None or p.incarnation != r.incarnation or r.elapsed_s < p.elapsed_s:
            p = RolloutStats()
        wall += max(0.0, r.elapsed_s - p.elapsed_s)
        idle += max(0.0, r.engine_idle_s - p.engine_idle_s)
        episodes += max(0.0, r.episode_s - p.episode_s)
        tool += max(0.0, r.tool_wait_s - p.tool_wait_s)
    return IdleStats(
        sample_wait_s=wait_s,
        learner_batch_wait_share=min(1.0, wait_s / step_wall_s) if step_wall_s > 0 else None,
        rollout_engine_idle_share=min(1.0, idle / wall) if wall > 0 else None,
        rollout_tool_wait_s=tool,
        rollout_tool_wait_share=min(1.0, tool / episodes) if episodes > 0 else None,
    )


@dataclass
class EvalScore:
    """One entry (a data source, or ``all``) of ``actors.stack.score_episodes``."""

    n: int = 0
    exact_match: float = 0.0
    f1: float = 0.0
    searches_per_question: float = 0.0
    turns_per_question: float = 0.0


# ------------------------------------------------------------------------------------------------------ totals
Key = Hashable


class RunTotals:
    """Totals since the run began, from sources whose own totals start again at zero when they restart.

    ``report(source, incarnation, totals)`` folds in one report of ``source`` (a rollout actor, the buffer) and
    returns that source's totals since the run began. The source restarted when its ``incarnation`` changed or
    any of its totals went down: what its previous life reported last is then retired, i.e. kept. ``base`` holds
    the totals of an earlier process of the same run (a resumed run); ``run()`` adds every source to it. Reporting
    the same totals twice changes nothing. Thread-safe (the metrics poller and the driver's loop)."""

    def __init__(self, base: Optional[Mapping[Key, float]] = None):
        self._base = dict(base or {})
        self._retired: dict[str, dict[Key, float]] = {}
        self._last: dict[str, tuple[str, dict[Key, float]]] = {}
        self._lock = threading.Lock()

    def report(self, source: str, incarnation: str, totals: Mapping[Key, float]) -> dict[Key, float]:
        with self._lock:
            previous = self._last.get(source)
            if previous is not None:
                old_incarnation, last = previous
                if old_incarnation != incarnation or any(t < last.get(k, 0.0) for k, t in totals.items()):
                    retired = self._retired.setdefault(source, {})
                    for k, v in last.items():
                        retired[k] = retired.get(k, 0.0) + v
            self._last[source] = (incarnation, dict(totals))
            return self._source(source)

    def source(self, source: str) -> dict[Key, float]:
        with self._lock:
            return self._source(source)

    def _source(self, source: str) -> dict[Key, float]:
        out = dict(self._retired.get(source, {}))
        for k, v in self._last.get(source, ("", {}))[1].items():
            out[k] = out.get(k, 0.0) + v
        return out

    def run(self) -> dict[Key, float]:
        """The base plus every source's totals since the run began."""
        with self._lock:
            out = dict(self._base)
            for source in self._last:
                for k, v in self._source(source).items():
                    out[k] = out.get(k, 0.0) + v
            return out
