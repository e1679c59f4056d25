"""Every Prometheus metric of the system, defined once, each fed from one field of a typed stats message.

Names are stable and documented (``docs/METRICS.md`` is generated from ``SPECS``: ``python -m monitoring.metrics``).
All start with ``aar_``; a counter's constant is the sample name PromQL sees (``..._total``); a histogram's constant
is the family name (query ``_bucket``, ``_sum``, ``_count``). The retrieval server exports its own ``retriever_*``
metrics (``retriever.server.ServerMetrics``) and is scraped as a target of its own.

Components stay free of Prometheus: they report the messages of ``async_agent_rl.stats`` (plain monotonic totals
and gauges), and one updater per component turns a message into metrics, in whichever process holds the registry::

    registry = new_registry()                       # one per process
    rollout = RolloutMetrics(registry)              # label ``actor`` from RolloutStats.index
    rollout.update(ray.get(actor.stats.remote()))   # RolloutActor.stats() -> RolloutStats
    BufferMetrics(registry).update(ray.get(buffer.stats.remote()))       # BufferActor.stats() -> BufferStats
    LearnerMetrics(registry).update(learner_stats)                       # Learner.train_step -> LearnerStats
    DriverMetrics(registry).observe_publish(publish_stats)               # PublishStats
    EvalMetrics(registry).update(score_episodes(...), split="heldout")

By construction. Every spec names the message type and the field that feeds it (``MetricSpec.source`` and
``field``; ``_define`` refuses a field the message does not have), and each updater iterates over its component's
specs and reads those fields: a metric no message carries cannot be defined.

Counters from totals. A component reports totals since its process started; ``async_agent_rl.stats.RunTotals``
turns them into totals since the run began (a restarted rollout actor has a new ``incarnation`` and counts from
zero again: what the old one reported is kept), and a counter grows by what those run totals grew, so counters
only ever increase and ``rate()`` stays right. Calling ``update`` twice with the same message changes nothing.
Histograms of events (step time, weight updates, publishes) observe each event once, keyed by its step or version.

Gauges appear only once set: a quantity a configuration never computes (``kl`` without a KL term, importance weights
under plain PPO: None in ``LearnerStats``) is absent rather than a misleading 0.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from async_agent_rl.stats import (
    LEARNER_METRICS, AdmissionStats, BufferStats, DriverStats, EvalScore, IdleStats, LearnerStats, LearningStats,
    PublishStats, RolloutStats, RunTotals, SearchStats,
)

PREFIX = "aar_"
COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

# Buckets. Seconds of a weight reload or publish (ms to a minute), of a learner step (0.1 s to 10 min), and the
# integer staleness of consumed trajectories (le=0 holds the on-policy ones).
WEIGHT_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)


@dataclass(frozen=True)
class MetricSpec:
    """One metric, fed from ``source.field`` (a field or property of a stats message of ``async_agent_rl.stats``).
    A labelled counter or gauge beyond ``actor`` is fed from a mapping field, its keys the label values."""

    name: str
    kind: str  # COUNTER | GAUGE | HISTOGRAM
    help: str
    labels: tuple[str, ...]
    component: str
    source: type
    field: str
    buckets: Optional[tuple[float, ...]] = None


SPECS: dict[str, MetricSpec] = {}
COMPONENTS = ("rollout", "search", "buffer", "admission", "learner", "driver", "idle", "eval")
# the message each component's metrics are fed from (the driver's metrics name theirs)
SOURCES: dict[str, type] = {"rollout": RolloutStats, "search": SearchStats, "buffer": BufferStats,
                            "admission": AdmissionStats, "learner": LearnerStats, "idle": IdleStats, "eval": EvalScore}
# components the driver computes from several others' messages: their names follow the quantity (aar_learner_...,
# aar_rollout_...), not the component
DRIVER_SIDE = ("driver", "idle")


def _define(component: str, name: str, kind: str, help: str, labels: Sequence[str] = (),
            buckets: Optional[Sequence[float]] = None, *, field: str, source: Optional[type] = None) -> str:
    """Record one metric in ``SPECS`` and return its name (the module constant). ``field`` of ``source`` (by
    default the component's message) feeds it."""
    if not name.startswith(PREFIX) or (component not in DRIVER_SIDE and not name.startswith(f"{PREFIX}{component}_")):
        raise ValueError(f"{name}: a {component} metric must start with {PREFIX}{component}_")
    if name in SPECS:
        raise ValueError(f"metric {name} defined twice")
    if (kind == COUNTER) != name.endswith("_total"):
        raise ValueError(f"{name}: counters, and only counters, end in _total")
    if (kind == HISTOGRAM) != (buckets is not None):
        raise ValueError(f"{name}: histograms, and only histograms, have buckets")
    source = source or SOURCES[component]
    if field not in {f.name for f in dataclasses.fields(source)} and not isinstance(getattr(source, field, None),
                                                                                  property):
        raise ValueError(f"{name}: {source.__name__} has no field {field!r} to feed it")
    SPECS[name] = MetricSpec(name, kind, help, tuple(labels), component, source, field,
                             tuple(buckets) if buckets else None)
    return name


A = ("actor",)

# ------------------------------------------------------------------------------------------------------ rollout
ROLLOUT_EPISODES_STARTED = _define("rollout", "aar_rollout_episodes_started_total", COUNTER, "episodes started", A, field="started")
ROLLOUT_EPISODES_FINISHED = _define(
    "rollout", "aar_rollout_episodes_finished_total", COUNTER, "episodes finished with a trajectory", A, field="finished")
ROLLOUT_EPISODES_FAILED = _define(
    "rollout", "aar_rollout_episodes_failed_total", COUNTER, "episodes lost to an engine failure (no trajectory)", A, field="failed")
ROLLOUT_GROUPS_STARTED = _define("rollout", "aar_rollout_groups_started_total", COUNTER, "GRPO groups started", A, field="groups_started")
ROLLOUT_TRAJECTORIES_PUSHED = _define(
    "rollout", "aar_rollout_trajectories_pushed_total", COUNTER, "trajectories handed to the replay buffer", A, field="pushed")
ROLLOUT_DROPPED_AT_STOP = _define(
    "rollout", "aar_rollout_trajectories_dropped_at_stop_total", COUNTER,
    "finished trajectories a full buffer still refused when the actor stopped, dropped then", A, field="dropped_at_stop")
ROLLOUT_GENERATED_TOKENS = _define(
    "rollout", "aar_rollout_generated_tokens_total", COUNTER, "tokens sampled by the engine in finished episodes", A, field="generated_tokens")
ROLLOUT_OBSERVATION_TOKENS = _define(
    "rollout", "aar_rollout_observation_tokens_total", COUNTER,
    "observation (search result) tokens inserted into finished episodes", A, field="observation_tokens")
ROLLOUT_SEARCHES = _define("rollout", "aar_rollout_searches_total", COUNTER, "search calls in finished episodes", A, field="searches")
ROLLOUT_SEARCH_ERRORS = _define(
    "rollout", "aar_rollout_search_errors_total", COUNTER,
    "search calls of finished episodes that ended as an error observation", A, field="search_errors")
ROLLOUT_TURNS = _define(
    "rollout", "aar_rollout_turns_total", COUNTER,
    "model turns in finished episodes (turns per episode = rate(this) / rate(finished))", A, field="turns")
ROLLOUT_FINISH_REASONS = _define(
    "rollout", "aar_rollout_finish_reasons_total", COUNTER,
    "finished episodes by how they ended (answer, max_turns, response_budget, context_limit, aborted)",
    ("actor", "reason"), field="finish_reasons")
ROLLOUT_REWARD_MEAN = _define(
    "rollout", "aar_rollout_episode_reward_mean", GAUGE,
    "mean reward of the episodes finished since the previous update", A, field="reward_sum")
ROLLOUT_EXACT_MATCH_MEAN = _define(
    "rollout", "aar_rollout_episode_exact_match_mean", GAUGE,
    "mean exact match of the episodes finished since the previous update (the exact_match reward term)", A, field="exact_match_sum")
ROLLOUT_REWARD_COMPONENT_MEAN = _define(
    "rollout", "aar_rollout_episode_reward_component_mean", GAUGE,
    "mean unweighted score of each reward term over the episodes finished since the previous update",
    ("actor", "component"), field="reward_component_sums")
ROLLOUT_RUNNING_EPISODES = _define("rollout", "aar_rollout_running_episodes", GAUGE, "episodes in flight", A, field="running")
ROLLOUT_WEIGHT_VERSION = _define(
    "rollout", "aar_rollout_weight_version", GAUGE, "policy version of the weights the engine samples with", A, field="version")
ROLLOUT_WEIGHT_UPDATE_SECONDS = _define(
    "rollout", "aar_rollout_weight_update_seconds", HISTOGRAM,
    "one in-flight weight reload in the engine, call to return", A, WEIGHT_SECONDS_BUCKETS, field="weight_updates")
ROLLOUT_WEIGHT_UPDATE_PAUSE_SECONDS = _define(
    "rollout", "aar_rollout_weight_update_pause_seconds", HISTOGRAM,
    "generation paused during one weight reload", A, WEIGHT_SECONDS_BUCKETS, field="weight_updates")
ROLLOUT_ENGINE_IDLE_SECONDS = _define(
    "rollout", "aar_rollout_engine_idle_seconds_total", COUNTER,
    "seconds the engine had no request in flight (no episode generating); rate(this) = the engine's idle share", A,
    field="engine_idle_s")
ROLLOUT_EPISODE_SECONDS = _define(
    "rollout", "aar_rollout_episode_seconds_total", COUNTER,
    "episode-seconds: running episodes integrated over time (rate(this) = mean episodes running)", A, field="episode_s")
ROLLOUT_TOOL_WAIT_SECONDS = _define(
    "rollout", "aar_rollout_tool_wait_seconds_total", COUNTER,
    "episode-seconds spent awaiting the search tool (tool wait share = rate(this) / rate(episode seconds))", A,
    field="tool_wait_s")

# ------------------------------------------------------------------------------------- search client (per actor)
SEARCH_REQUESTS = _define("search", "aar_search_requests_total", COUNTER, "/retrieve calls made by the client", A, field="requests")
SEARCH_ATTEMPTS = _define("search", "aar_search_attempts_total", COUNTER, "HTTP attempts, retries included", A, field="attempts")
SEARCH_RETRIES = _define("search", "aar_search_retries_total", COUNTER, "attempts that were retries", A, field="retries")
SEARCH_FAILURES = _define(
    "search", "aar_search_failures_total", COUNTER, "calls that failed after all retries (error observation)", A, field="failures")
SEARCH_ERRORS = _define(
    "search", "aar_search_errors_total", COUNTER,
    "failed attempts by kind (timeout, connection, http_status, bad_reply)", ("actor", "kind"), field="errors")

# ------------------------------------------------------------------------------------------------------- buffer
BUFFER_TRAJECTORIES = _define("buffer", "aar_buffer_trajectories", GAUGE, "trajectories held (pending and ready)", field="size")
BUFFER_TOKENS = _define("buffer", "aar_buffer_tokens", GAUGE, "prompt + response tokens held", field="tokens")
BUFFER_BYTES = _define("buffer", "aar_buffer_bytes", GAUGE, "wire bytes held", field="bytes")
BUFFER_CAPACITY_TRAJECTORIES = _define(
    "buffer", "aar_buffer_capacity_trajectories", GAUGE, "capacity in trajectories (fill = trajectories / this)", field="capacity_trajectories")
BUFFER_CAPACITY_TOKENS = _define("buffer", "aar_buffer_capacity_tokens", GAUGE, "capacity in tokens", field="capacity_tokens")
BUFFER_READY_GROUPS = _define("buffer", "aar_buffer_ready_groups", GAUGE, "groups ready to be sampled", field="ready_groups")
BUFFER_PENDING_GROUPS = _define(
    "buffer", "aar_buffer_pending_groups", GAUGE, "groups with members still to arrive", field="pending_groups")
BUFFER_OLDEST_AGE = _define(
    "buffer", "aar_buffer_oldest_age_seconds", GAUGE, "age of the oldest held trajectory (0 when empty)", field="oldest_age_s")
BUFFER_LEARNER_VERSION = _define(
    "buffer", "aar_buffer_learner_version", GAUGE, "learner version given with the latest sample", field="learner_version")
BUFFER_PUSHED = _define("buffer", "aar_buffer_pushed_total", COUNTER, "trajectories accepted into the buffer", field="pushed")
BUFFER_SAMPLED = _define("buffer", "aar_buffer_sampled_total", COUNTER, "trajectories handed to the learner", field="sampled")
BUFFER_PUSH_REFUSED = _define(
    "buffer", "aar_buffer_push_refused_total", COUNTER, "trajectories refused for lack of room (pushed again later)", field="push_refused")
BUFFER_REJECTED = _define(
    "buffer", "aar_buffer_rejected_total", COUNTER, "group members reported rejected (will never arrive)", field="rejected")
BUFFER_GROUPS_RELEASED = _define(
    "buffer", "aar_buffer_groups_released_total", COUNTER,
    "groups released incomplete: how=short (members rejected) or partial (timed out, partial_groups=release)",
    ("how",), field="groups_released")
BUFFER_GROUPS_OVERDUE = _define(
    "buffer", "aar_buffer_groups_overdue_total", COUNTER, "groups past the partial-group timeout (wait mode)", field="groups_overdue")
BUFFER_EVICTED = _define(
    "buffer", "aar_buffer_evicted_total", COUNTER,
    "trajectories evicted unconsumed by reason (stale, partial_group_timeout, filtered_zero_variance)", ("reason",), field="evicted")
BUFFER_CONSUMED_STALENESS = _define(
    "buffer", "aar_buffer_consumed_staleness", HISTOGRAM,
    "staleness (learner version - oldest token version) of each trajectory when sampled", (), STALENESS_BUCKETS, field="staleness_histogram")

BUFFER_EPISODES_BY_LENGTH = _define(
    "buffer", "aar_buffer_episodes_by_length_total", COUNTER,
    "trajectories by response length in tokens (bucket), at each stage: generated (arrived), consumed (trained on), "
    "evicted; consumed and generated should have the same shape", ("stage", "tokens"), field="length_tokens")
BUFFER_EPISODES_BY_TURNS = _define(
    "buffer", "aar_buffer_episodes_by_turns_total", COUNTER,
    "trajectories by number of model turns, at each stage: generated, consumed, evicted", ("stage", "turns"),
    field="length_turns")

# --------------------------------------------------------------------------------- admission (in the buffer actor)
ADMISSION_STARTED = _define("admission", "aar_admission_started_total", COUNTER, "episodes admitted to start", field="started")
ADMISSION_ACCEPTED = _define("admission", "aar_admission_accepted_total", COUNTER, "episodes accepted into the buffer", field="accepted")
ADMISSION_REJECTED = _define(
    "admission", "aar_admission_rejected_total", COUNTER, "admitted episodes that ended without being accepted", field="rejected")
ADMISSION_EVICTED = _define(
    "admission", "aar_admission_evicted_total", COUNTER, "accepted episodes later evicted (their slots freed)", field="evicted")
ADMISSION_RUNNING = _define("admission", "aar_admission_running", GAUGE, "admitted episodes not yet ended", field="running")
ADMISSION_GROUPS_OPEN = _define(
    "admission", "aar_admission_groups_open", GAUGE, "admitted groups neither consumed nor dropped (the pacing rule's)",
    field="groups_open")
ADMISSION_OLDEST_OPEN_VERSION = _define(
    "admission", "aar_admission_oldest_open_version", GAUGE,
    "oldest admission version among open groups (-1: none); it holds back admission: learner version - this <= eta",
    field="oldest_open_version")

# ------------------------------------------------------------------------------------------------------ learner
# Declared once, in async_agent_rl.stats.LEARNER_METRICS (field, meaning, unit, name, kind): every row is defined
# here, and LearnerMetrics feeds them all. The constants are handles for code that names one.
for _m in LEARNER_METRICS:
    _define("learner", _m.metric, _m.kind, _m.help, buckets=STEP_SECONDS_BUCKETS if _m.kind == HISTOGRAM else None,
            field=_m.field)


def _learner(field: str, kind: str = GAUGE) -> str:
    """The name of the learner metric of ``kind`` that ``LearnerStats.field`` feeds."""
    (name,) = [m.metric for m in LEARNER_METRICS if m.field == field and m.kind == kind]
    return name


LEARNER_STEP = _learner("step")
LEARNER_VERSION = _learner("version")
LEARNER_STEPS = _learner("step", COUNTER)
LEARNER_TRAINED_TOKENS = _learner("trained_tokens", COUNTER)
LEARNER_LOSS_TOKENS = _learner("loss_tokens", COUNTER)
LEARNER_STEP_SECONDS = _learner("step_time_s", HISTOGRAM)
LEARNER_TOKENS_PER_SECOND = _learner("tokens_per_s")
LEARNER_POLICY_LOSS = _learner("policy_loss")
LEARNER_VALUE_LOSS = _learner("value_loss")
LEARNER_KL = _learner("kl")
LEARNER_APPROX_KL = _learner("approx_kl")
LEARNER_BEHAVIOR_KL = _learner("behavior_kl")
LEARNER_ENTROPY = _learner("entropy")
LEARNER_CLIP_FRACTION = _learner("clip_frac")
LEARNER_DUAL_CLIP_FRACTION = _learner("dual_clip_frac")
LEARNER_IW_MEAN = _learner("iw_mean")
LEARNER_IW_MAX = _learner("iw_max")
LEARNER_IW_CAPPED_FRACTION = _learner("iw_capped_frac")
LEARNER_IW_CAPPED_SEQUENCE_FRACTION = _learner("iw_capped_seq_frac")
LEARNER_ICEPOP_MASKED_FRACTION = _learner("icepop_masked_frac")
LEARNER_FLOOR_VETO_FRACTION = _learner("floor_veto_frac")
LEARNER_FLOOR_VETO_SEQUENCE_FRACTION = _learner("floor_veto_seq_frac")
LEARNER_MISMATCH_KL_FRESH = _learner("mismatch_kl_fresh")
LEARNER_MISMATCH_ABS_LOGPROB_FRESH = _learner("mismatch_abs_logprob_fresh")
LEARNER_MISMATCH_KL_STALE = _learner("mismatch_kl_stale")
LEARNER_MISMATCH_ABS_LOGPROB_STALE = _learner("mismatch_abs_logprob_stale")
LEARNER_SEQ_LOG_RATIO_MEAN = _learner("seq_log_ratio_mean")
LEARNER_SEQ_LOG_RATIO_MAX = _learner("seq_log_ratio_max")
LEARNER_FRESH_TOKEN_FRACTION = _learner("fresh_token_fraction")
LEARNER_PROXIMAL_PASS_SKIPPED = _learner("proximal_pass_skipped", COUNTER)
LEARNER_GRAD_NORM = _learner("grad_norm")
LEARNER_CRITIC_GRAD_NORM = _learner("critic_grad_norm")
LEARNER_LR = _learner("lr")
LEARNER_BATCH_STALENESS_MEAN = _learner("staleness_mean")
LEARNER_BATCH_STALENESS_MAX = _learner("staleness_max")
LEARNER_BATCH_REWARD_MEAN = _learner("reward_mean")
LEARNER_ADVANTAGE_MEAN = _learner("advantage_mean")

# ------------------------------------------------------------------------------------- driver and weight sync
DRIVER_POLICY_VERSION = _define(
    "driver", "aar_driver_policy_version", GAUGE, "latest policy version published to the rollout actors", field="version", source=PublishStats)
WEIGHT_PUBLISH_SECONDS = _define(
    "driver", "aar_weight_publish_seconds", HISTOGRAM,
    "one publish, start to every rollout actor having applied it", (), WEIGHT_SECONDS_BUCKETS, field="seconds", source=PublishStats)
WEIGHT_PUBLISH_PUT_SECONDS = _define(
    "driver", "aar_weight_publish_put_seconds", HISTOGRAM,
    "the object-store put (or, collective path, the learner's broadcast) of one publish", (), WEIGHT_SECONDS_BUCKETS, field="put_seconds", source=PublishStats)
WEIGHT_PUBLISH_BYTES = _define("driver", "aar_weight_publish_bytes", GAUGE, "bytes of the latest publish", field="bytes", source=PublishStats)
DRIVER_LOST_EPISODES = _define(
    "driver", "aar_driver_lost_episodes_total", COUNTER, "in-flight episodes lost to actor failures", field="lost_episodes", source=DriverStats)
DRIVER_ACTOR_RESTARTS = _define(
    "driver", "aar_driver_actor_restarts_total", COUNTER, "rollout actor restarts", A, field="actor_restarts", source=DriverStats)

# ---------------------------------------------------------------------------------- learning signals (driver)
LEARNING_ZERO_VARIANCE_SHARE = _define(
    "driver", "aar_learning_zero_variance_share", GAUGE,
    "share of the groups completed since the previous step whose rewards were all equal (no GRPO signal)", field="zero_variance_share", source=LearningStats)
LEARNING_REWARD_BY_KIND = _define(
    "driver", "aar_learning_rollout_reward", GAUGE,
    "mean reward of the rollout episodes finished since the previous step, by question kind (data source)",
    ("kind",), field="by_kind", source=LearningStats)
LEARNING_EXACT_MATCH_BY_KIND = _define(
    "driver", "aar_learning_rollout_exact_match", GAUGE,
    "mean exact match of the rollout episodes finished since the previous step, by question kind", ("kind",), field="by_kind", source=LearningStats)
LEARNING_SEARCHES_BY_KIND = _define(
    "driver", "aar_learning_rollout_searches", GAUGE,
    "searches per rollout episode finished since the previous step, by question kind", ("kind",), field="by_kind", source=LearningStats)

# ------------------------------------------------------------------------------------- idle time (driver, per step)
IDLE_LEARNER_BATCH_WAIT_SECONDS = _define(
    "idle", "aar_learner_batch_wait_seconds", GAUGE,
    "seconds the learner waited for its batch in the latest step (metrics.jsonl: sample_wait_s)", field="sample_wait_s")
IDLE_LEARNER_BATCH_WAIT_SHARE = _define(
    "idle", "aar_learner_batch_wait_share", GAUGE,
    "share of the latest step's wall time (previous step's record to this one) the learner waited for its batch",
    field="learner_batch_wait_share")
IDLE_ROLLOUT_ENGINE_IDLE_SHARE = _define(
    "idle", "aar_rollout_engine_idle_share", GAUGE,
    "share of the time since the previous step the rollout engines had no request in flight, over all actors",
    field="rollout_engine_idle_share")
IDLE_ROLLOUT_TOOL_WAIT_SHARE = _define(
    "idle", "aar_rollout_tool_wait_share", GAUGE,
    "share of the episode time since the previous step spent awaiting the search tool, over all actors",
    field="rollout_tool_wait_share")

# --------------------------------------------------------------------------------------------------------- eval
EVAL_LABELS = ("split", "source")
EVAL_EXACT_MATCH = _define(
    "eval", "aar_eval_exact_match", GAUGE, "greedy exact match of the latest evaluation (split=heldout: test set)",
    EVAL_LABELS, field="exact_match")
EVAL_F1 = _define("eval", "aar_eval_f1", GAUGE, "token F1 of the latest evaluation", EVAL_LABELS, field="f1")
EVAL_SEARCHES = _define(
    "eval", "aar_eval_searches_per_question", GAUGE, "searches per question, latest evaluation", EVAL_LABELS, field="searches_per_question")
EVAL_TURNS = _define("eval", "aar_eval_turns_per_question", GAUGE, "turns per question, latest evaluation", EVAL_LABELS, field="turns_per_question")
EVAL_QUESTIONS = _define("eval", "aar_eval_questions", GAUGE, "questions in the latest evaluation", EVAL_LABELS, field="n")
EVAL_STEP = _define("eval", "aar_eval_learner_step", GAUGE, "learner step of the latest evaluation", ("split",), field="step", source=LearnerStats)


# ============================================================================================ collectors
def new_registry() -> CollectorRegistry:
    """A fresh registry for this process (never the global default, so tests can hold several)."""
    return CollectorRegistry(auto_describe=True)


class _Gauges(Collector):
    """A gauge family whose children appear only once set (no misleading zeros for quantities never computed)."""

    def __init__(self, spec: MetricSpec, registry: CollectorRegistry):
        self.spec = spec
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def set(self, value: float, *labels: str) -> None:
        if len(labels) != len(self.spec.labels):
            raise ValueError(f"{self.spec.name} takes labels {self.spec.labels}, got {labels}")
        with self._lock:
            self._values[tuple(str(v) for v in labels)] = float(value)

    def get(self, *labels: str) -> Optional[float]:
        return self._values.get(tuple(str(v) for v in labels))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.spec.name, self.spec.help, labels=self.spec.labels)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(self.spec.name, self.spec.help, labels=self.spec.labels)
        with self._lock:
            for labels, value in self._values.items():
                fam.add_metric(list(labels), value)
        yield fam


class _CountHistogram(Collector):
    """A histogram fed with counts (``add(value, n)``: n observations of value), for sources that report a
    histogram of totals (the buffer's ``staleness_histogram``) rather than single events."""

    def __init__(self, spec: MetricSpec, registry: CollectorRegistry):
        assert spec.buckets is not None
        self.spec = spec
        self._counts = [0] * (len(spec.buckets) + 1)  # per bucket, not cumulative; last = above the top bound
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def add(self, value: float, n: int = 1) -> None:
        if n < 0:
            raise ValueError("a histogram only grows")
        i = next((i for i, b in enumerate(self.spec.buckets) if value <= b), len(self.spec.buckets))
        with self._lock:
            self._counts[i] += n
            self._sum += value * n

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.spec.name, self.spec.help)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total_sum = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, c in zip([*map(_le, self.spec.buckets), "+Inf"], counts):
            cumulative += c
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.spec.name, self.spec.help, buckets=buckets, sum_value=total_sum)


def _le(b: float) -> str:
    return str(float(b))


def _counter(registry: CollectorRegistry, name: str) -> Counter:
    s = SPECS[name]
    assert s.kind == COUNTER
    return Counter(s.name, s.help, s.labels, registry=registry)


def _histogram(registry: CollectorRegistry, name: str) -> Histogram:
    s = SPECS[name]
    assert s.kind == HISTOGRAM and s.buckets is not None
    return Histogram(s.name, s.help, s.labels, buckets=s.buckets, registry=registry)


def _gauges(registry: CollectorRegistry, name: str) -> _Gauges:
    s = SPECS[name]
    assert s.kind == GAUGE
    return _Gauges(s, registry)


def _num(x: Any) -> Optional[float]:
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _specs(*components: str, source: Optional[type] = None, kind: Optional[str] = None) -> list[MetricSpec]:
    return [s for s in SPECS.values() if s.component in components and (source is None or s.source is source)
            and (kind is None or s.kind == kind)]


def _values(spec: MetricSpec, message: Any, fixed: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], float]]:
    """``(labels, value)`` of ``spec`` from ``message``: the field under the ``fixed`` labels, or for a mapping field
    one per key (the last label). A quantity not computed (None) or not finite gives nothing."""
    value = getattr(message, spec.field)
    pairs = value.items() if isinstance(value, Mapping) else [(None, value)]
    out = []
    for key, v in pairs:
        labels = (*fixed, str(key)) if key is not None else fixed
        if isinstance(v, Mapping):  # a mapping of mappings: two labels (BufferStats.length_tokens: stage, bucket)
            out += [((*labels, str(k2)), n) for k2, v2 in v.items() if (n := _num(v2)) is not None]
            continue
        v = _num(v)
        if v is not None:
            out.append((labels, v))
    return out


class _CounterFeed:
    """Counters that follow a source's totals across its restarts (``RunTotals``): each report increments them by
    what the run's totals grew since the last report; the same report twice changes nothing."""

    def __init__(self) -> None:
        self.totals = RunTotals()
        self._exported: dict[tuple, float] = {}

    def feed(self, source: str, incarnation: str, items: Sequence[tuple[str, tuple[str, ...], float]]
             ) -> list[tuple[str, tuple[str, ...], float]]:
        """``(name, labels, delta)`` for ``[(name, labels, total), ...]`` of one report."""
        run = self.totals.report(source, incarnation, {(n, *labels): t for n, labels, t in items})
        out = []
        for name, labels, _ in items:
            key = (name, *labels)
            delta = run[key] - self._exported.get(key, 0.0)
            self._exported[key] = max(run[key], self._exported.get(key, 0.0))
            out.append((name, labels, delta))
        return out


def _inc(counter: Counter, labels: tuple[str, ...], delta: float) -> None:
    child = counter.labels(*labels) if labels else counter  # exported (as 0) from the first sight on
    if delta > 0:
        child.inc(delta)


# ============================================================================================ updaters
class RolloutMetrics:
    """Rollout actor and search client metrics, labelled ``actor``, from ``RolloutStats`` (``RolloutActor.stats()``):
    every metric of the ``rollout`` and ``search`` components reads the field its spec names. Counters follow the
    totals across actor restarts (a new ``incarnation``); the mean gauges cover the episodes finished since the
    previous update (``reward_sum`` and the reward term sums differenced, per ``finished``). One instance serves
    every actor whose stats pass through this process."""

    MEANS = (ROLLOUT_REWARD_MEAN, ROLLOUT_EXACT_MATCH_MEAN, ROLLOUT_REWARD_COMPONENT_MEAN)
    WEIGHT_UPDATES = {ROLLOUT_WEIGHT_UPDATE_SECONDS: "seconds", ROLLOUT_WEIGHT_UPDATE_PAUSE_SECONDS: "pause_seconds"}

    def __init__(self, registry: CollectorRegistry):
        specs = _specs("rollout", "search")
        self.counters = {s.name: _counter(registry, s.name) for s in specs if s.kind == COUNTER}
        self.gauges = {s.name: _gauges(registry, s.name) for s in specs if s.kind == GAUGE}
        self.histograms = {s.name: _histogram(registry, s.name) for s in specs if s.kind == HISTOGRAM}
        self._counts = _CounterFeed()
        self._sums: dict[str, tuple[str, float, dict[tuple, float]]] = {}  # actor -> incarnation, finished, sums
        self._last_update: dict[str, tuple[str, int]] = {}  # actor -> incarnation, latest weight version observed
        self._lock = threading.Lock()

    def update(self, stats: RolloutStats) -> None:
        with self._lock:
            self._update(stats, str(stats.index))

    def _update(self, s: RolloutStats, actor: str) -> None:
        def message(spec: MetricSpec) -> Any:
            return s.search if spec.source is SearchStats else s

        items = [(spec.name, labels, v) for spec in _specs("rollout", "search", kind=COUNTER)
                 for labels, v in _values(spec, message(spec), (actor,))]
        for name, labels, delta in self._counts.feed(actor, s.incarnation, items):
            _inc(self.counters[name], labels, delta)
        for spec in _specs("rollout", kind=GAUGE):
            if spec.name not in self.MEANS:
                for labels, v in _values(spec, s, (actor,)):
                    self.gauges[spec.name].set(v, *labels)
        self._means(s, actor)
        incarnation, last_v = self._last_update.get(actor, (s.incarnation, -1))
        if incarnation != s.incarnation:
            last_v = -1
        for rec in s.weight_updates:
            if rec.version > last_v:
                for name, attr in self.WEIGHT_UPDATES.items():
                    self.histograms[name].labels(actor).observe(getattr(rec, attr))
                last_v = rec.version
        self._last_update[actor] = (s.incarnation, last_v)

    def _means(self, s: RolloutStats, actor: str) -> None:
        """Means of the episodes finished since the last update. The sums are not counters (a reward may be
        negative), so they are differenced here, starting again with a new incarnation."""
        sums = {(spec.name, *labels): v for spec in (SPECS[n] for n in self.MEANS)
                for labels, v in _values(spec, s, (actor,))}
        incarnation, finished, last = self._sums.get(actor, (s.incarnation, 0.0, {}))
        if incarnation != s.incarnation:
            finished, last = 0.0, {}
        n = s.finished - finished
        if n > 0:
            for (name, *labels), total in sums.items():
                self.gauges[name].set((total - last.get((name, *labels), 0.0)) / n, *labels)
        if n > 0 or actor not in self._sums or incarnation != s.incarnation:
            self._sums[actor] = (s.incarnation, float(s.finished), sums)


class BufferMetrics:
    """Replay buffer and admission metrics from ``BufferStats`` (``BufferActor.stats()``; its ``admission``
    feeds the admission metrics): each metric reads the field its spec names."""

    def __init__(self, registry: CollectorRegistry):
        specs = _specs("buffer", "admission")
        self.counters = {s.name: _counter(registry, s.name) for s in specs if s.kind == COUNTER}
        self.gauges = {s.name: _gauges(registry, s.name) for s in specs if s.kind == GAUGE}
        self.staleness = _CountHistogram(SPECS[BUFFER_CONSUMED_STALENESS], registry)
        self._counts = _CounterFeed()
        self._lock = threading.Lock()

    def update(self, stats: BufferStats) -> None:
        with self._lock:
            self._update(stats)

    def _update(self, s: BufferStats) -> None:
        def message(spec: MetricSpec) -> Any:
            return s.admission if spec.source is AdmissionStats else s

        items = []
        for spec in _specs("buffer", "admission"):
            for labels, v in _values(spec, message(spec), ()):
                if spec.kind == GAUGE:
                    self.gauges[spec.name].set(v, *labels)
                else:
                    items.append((spec.name, labels, v))
        for name, labels, delta in self._counts.feed("buffer", s.incarnation, items):
            if name == BUFFER_CONSUMED_STALENESS:  # per staleness value, trajectories consumed so far
                if delta > 0:
                    self.staleness.add(int(labels[0]), int(delta))
            else:
                _inc(self.counters[name], labels, delta)


class LearnerMetrics:
    """Learner metrics from ``LearnerStats`` (``Learner.train_step``, rank 0's): gauges from the fields their specs
    name (absent while None); a step is counted once, and a report whose ``step`` is not past the last one seen
    only refreshes the gauges."""

    def __init__(self, registry: CollectorRegistry):
        self.gauges = {s.name: _gauges(registry, s.name) for s in _specs("learner", kind=GAUGE)}
        self.counters = {s.name: _counter(registry, s.name) for s in _specs("learner", kind=COUNTER)}
        self.histograms = {s.name: _histogram(registry, s.name) for s in _specs("learner", kind=HISTOGRAM)}
        self._last_step: Optional[int] = None
        self._lock = threading.Lock()

    def update(self, m: LearnerStats) -> None:
        with self._lock:
            for spec in _specs("learner", kind=GAUGE):
                for labels, v in _values(spec, m):
                    self.gauges[spec.name].set(v, *labels)
            if self._last_step is not None and m.step <= self._last_step:
                return  # seen already (or a restart replaying old steps): gauges refreshed, no event
            self._last_step = m.step
            for spec in _specs("learner", kind=COUNTER):
                if spec.name == LEARNER_STEPS:
                    self.counters[spec.name].inc()
                    continue
                for _, v in _values(spec, m):
                    if v >= 0:
                        self.counters[spec.name].inc(v)
            for spec in _specs("learner", kind=HISTOGRAM):
                for _, v in _values(spec, m):
                    self.histograms[spec.name].observe(v)


class DriverMetrics:
    """The driver's own metrics: publishes (``PublishStats``; the same version twice is observed once) and fault
    accounting (``DriverStats``)."""

    def __init__(self, registry: CollectorRegistry):
        self.gauges = {s.name: _gauges(registry, s.name) for s in _specs("driver", kind=GAUGE, source=PublishStats)}
        self.histograms = {s.name: _histogram(registry, s.name)
                           for s in _specs("driver", kind=HISTOGRAM, source=PublishStats)}
        self.counters = {s.name: _counter(registry, s.name) for s in _specs("driver", source=DriverStats)}
        self._counts = _CounterFeed()
        self._last_publish: Optional[int] = None
        self._lock = threading.Lock()

    def set_version(self, version: int) -> None:
        self.gauges[DRIVER_POLICY_VERSION].set(float(version))

    def observe_publish(self, p: PublishStats) -> None:
        with self._lock:
            if self._last_publish is not None and p.version <= self._last_publish:
                return
            self._last_publish = p.version
            for spec in _specs("driver", source=PublishStats):
                for labels, v in _values(spec, p):
                    if spec.kind == GAUGE:
                        self.gauges[spec.name].set(v, *labels)
                    else:
                        self.histograms[spec.name].observe(v)

    def update(self, d: DriverStats) -> None:
        with self._lock:
            items = [(spec.name, labels, v) for spec in _specs("driver", source=DriverStats)
                     for labels, v in _values(spec, d)]
            for name, labels, delta in self._counts.feed("driver", "", items):
                _inc(self.counters[name], labels, delta)


class EvalMetrics:
    """Evaluation results: ``update(score_episodes(...), split="heldout", step=learner_step)``; the score dict
    maps data source (and ``all``) to the fields of ``EvalScore``."""

    def __init__(self, registry: CollectorRegistry):
        self.gauges = {s.name: _gauges(registry, s.name) for s in _specs("eval", source=EvalScore)}
        self.step = _gauges(registry, EVAL_STEP)

    def update(self, scores: Mapping[str, Mapping[str, Any]], split: str = "heldout",
               step: Optional[int] = None) -> None:
        for source, summary in scores.items():
            for spec in _specs("eval", source=EvalScore):
                v = _num(summary.get(spec.field))
                if v is not None:
                    self.gauges[spec.name].set(v, split, str(source))
        if step is not None:
            self.step.set(float(step), split)


class LearningMetrics:
    """The driver's per-step learning signals (``LearningStats``): ``zero_variance_share`` and, per question kind,
    the mean ``reward``, ``exact_match`` and ``searches`` of the episodes finished since the last step."""

    KIND_KEYS = {LEARNING_REWARD_BY_KIND: "reward", LEARNING_EXACT_MATCH_BY_KIND: "exact_match",
                 LEARNING_SEARCHES_BY_KIND: "searches"}

    def __init__(self, registry: CollectorRegistry):
        self.gauges = {s.name: _gauges(registry, s.name) for s in _specs("driver", source=LearningStats)}

    def update(self, m: LearningStats) -> None:
        for spec in _specs("driver", source=LearningStats):
            if spec.name in self.KIND_KEYS:
                for kind, values in getattr(m, spec.field).items():
                    v = _num(values.get(self.KIND_KEYS[spec.name]))
                    if v is not None:
                        self.gauges[spec.name].set(v, str(kind))
            else:
                for labels, v in _values(spec, m):
                    self.gauges[spec.name].set(v, *labels)


class IdleMetrics:
    """Where time idled in the latest learner step (``IdleStats``, the driver's ``idle_stats``): one gauge per field
    its spec names (a share not computed, None, leaves its gauge as it was)."""

    def __init__(self, registry: CollectorRegistry):
        self.gauges = {s.name: _gauges(registry, s.name) for s in _specs("idle")}

    def update(self, m: IdleStats) -> None:
        for spec in _specs("idle"):
            for labels, v in _values(spec, m):
                self.gauges[spec.name].set(v, *labels)


UPDATERS = (RolloutMetrics, BufferMetrics, LearnerMetrics, DriverMetrics, EvalMetrics, LearningMetrics, IdleMetrics)


def register_all(registry: CollectorRegistry) -> dict[str, Any]:
    """Every updater on one registry (a driver that feeds all components' stats); keyed by component."""
    return {
        "rollout": RolloutMetrics(registry),
        "buffer": BufferMetrics(registry),
        "learner": LearnerMetrics(registry),
        "driver": DriverMetrics(registry),
        "eval": EvalMetrics(registry),
        "learning": LearningMetrics(registry),
        "idle": IdleMetrics(registry),
    }


# ============================================================================================ reference doc
def render_markdown(specs: Iterable[MetricSpec] = ()) -> str:
    """``docs/METRICS.md``: one table per component (name, type, labels, meaning)."""
    specs = list(specs) or list(SPECS.values())
    titles = {
        "rollout": "Rollout actors (`RolloutMetrics`, from `RolloutActor.stats()`: `RolloutStats`)",
        "search": "Search client in each rollout actor (`RolloutMetrics`, from `RolloutStats.search`)",
        "buffer": "Replay buffer (`BufferMetrics`, from `BufferActor.stats()`: `BufferStats`)",
        "admission": "Admission control in the buffer actor (`BufferMetrics`, from `BufferStats.admission`)",
        "learner": "Learner (`LearnerMetrics`, from `train_step`: `LearnerStats`)",
        "driver": "Driver, weight sync and learning signals (`DriverMetrics`, `LearningMetrics`)",
        "idle": "Idle time, per learner step (`IdleMetrics`, from the driver's `IdleStats`)",
        "eval": "Evaluation (`EvalMetrics`, from `score_episodes`)",
    }
    out = [
        "# Metrics reference",
        "",
        "Generated from `monitoring/metrics.py` by `python -m monitoring.metrics > docs/METRICS.md`; do not edit by",
        "hand. Every name is stable. Counters are listed by the sample name PromQL sees (`_total`); histograms by",
        "their family name (query `_bucket`, `_sum`, `_count`). Gauges appear once first set. Every target also",
        "exports the standard `process_*` metrics. The retrieval server exports its own `retriever_*` metrics",
        "(`retriever/server.py`, `ServerMetrics`): `retriever_requests_total{code}`,",
        "`retriever_queries_total`, `retriever_batch_queries`, `retriever_request_latency_seconds`,",
        "`retriever_backend_latency_seconds`, `retriever_errors_total{kind}`; for slow tools (`retriever.latency`,",
        "`retriever.tool_limits`, off by default): `retriever_tool_limit_waits_total` (queries that waited for a",
        "slot or a token), `retriever_tool_limit_wait_seconds` (one request's wait at the limits),",
        "`retriever_tool_inflight` (queries past the limits), `retriever_added_latency_seconds` (the latency",
        "model's delays) and `retriever_simulated_timeouts_total` (queries it made hang).",
        "",
        "Scrape targets are found through `file_sd_configs` (`monitoring/prometheus.yml`, `targets.json` written by",
        "`monitoring.exporter.write_sd_file`); the target group's `job` label names the component.",
        "",
        "## Exporting and watching",
        "",
        "Components report typed stats messages (`async_agent_rl/stats.py`); every metric is fed from one field of",
        "one message (the spec names it), and the updaters of `monitoring.metrics` turn the messages into metrics in",
        "whichever process holds the registry (one registry per process). The driver's side in one call:",
        "",
        "```python",
        "from monitoring.exporter import RunMonitoring",
        "mon = RunMonitoring.from_config(cfg.monitoring, run_dir)  # registry, exporter, run_dir/prometheus/",
        "mon.set_targets(\"retriever\", [\"127.0.0.1:PORT\"])       # the retrieval server's own /metrics",
        "mon.poll(lambda: mon.observe(rollout=[...each RolloutActor.stats()...],",
        "                             buffer=buffer_actor_stats), every_s=cfg.monitoring.log_every_s)",
        "mon.observe(learner=learner_stats, publish=publish_stats)  # each step",
        "mon.eval.update(scores, split=\"heldout\", step=step)      # score_episodes(...) of each evaluation",
        "mon.close()",
        "```",
        "",
        "Then `prometheus --config.file=RUN_DIR/prometheus/prometheus.yml --web.listen-address=127.0.0.1:9090`",
        "(Debian package; `scripts/install_prometheus.sh`) and import `monitoring/grafana_dashboard.json` into Grafana",
        "with that Prometheus as `DS_PROMETHEUS`. `monitoring.prom.check_dashboard` runs every panel's query through",
        "a Prometheus and lists those without data.",
        "",
        "Train exact match comes from `RolloutStats.reward_component_sums['exact_match']` (an `exact_match` reward",
        "term, as in the default config).",
        "",
        "Idle time. Each metrics.jsonl record has the step's `IdleStats` (`async_agent_rl/stats.py`, `idle_stats`)",
        "as top-level keys: `sample_wait_s` (the learner's wait for the step's batch), `learner_batch_wait_share`",
        "(that over the step's wall time, previous record to this one), `rollout_engine_idle_share` (seconds the",
        "rollout engines had no request in flight over the seconds that passed in them, all actors),",
        "`rollout_tool_wait_s` and `rollout_tool_wait_share` (episode-seconds awaiting the search tool, and their",
        "share of all episode-seconds), each since the previous record; a share is null when nothing passed. The",
        "engine's requests are counted where they are made (`actors.rollout_worker.MeteredEngine`), the tool wait",
        "around the search call of the episode loop (`async_agent_rl.episode.EpisodeTimers`); both as time-weighted",
        "totals (`stats.Occupancy`) that `RolloutStats` reports and the `aar_rollout_*_seconds_total` counters follow.",
    ]
    for comp in COMPONENTS:
        rows = [s for s in specs if s.component == comp]
        if not rows:
            continue
        out += ["", f"## {titles[comp]}", "", "| name | type | labels | fed from | meaning |", "|---|---|---|---|---|"]
        for s in rows:
            labels = ", ".join(f"`{label}`" for label in s.labels) or "-"
            out.append(f"| `{s.name}` | {s.kind} | {labels} | `{s.source.__name__}.{s.field}` | "
                       f"{s.help.replace('|', '/')} |")
    out += ["", "## Buckets", "",
            f"- weight reload and publish seconds: {list(WEIGHT_SECONDS_BUCKETS)}",
            f"- learner step seconds: {list(STEP_SECONDS_BUCKETS)}",
            f"- consumed staleness: {list(STALENESS_BUCKETS)}", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render_markdown(), end="")
