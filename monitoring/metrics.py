"""Every Prometheus metric of the system, defined once, and the updaters that feed them from plain stats dicts.

Names are stable and documented (``docs/METRICS.md`` is generated from ``SPECS``: ``python -m monitoring.metrics``).
All start with ``aar_``; a counter's constant is the sample name PromQL sees (``..._total``); a histogram's constant
is the family name (query ``_bucket``, ``_sum``, ``_count``). The retrieval server exports its own ``retriever_*``
metrics (``retriever.server.ServerMetrics``) and is scraped as a target of its own.

Components stay free of Prometheus: they keep plain monotonic totals and gauges in the dicts they already return,
and one updater per component turns a dict into metrics, in whichever process holds the registry::

    registry = new_registry()                       # one per process
    rollout = RolloutMetrics(registry)              # label ``actor`` from stats["index"]
    rollout.update(ray.get(actor.stats.remote()))   # RolloutActor.stats(): WorkerStats.as_dict() + search + weights
    BufferMetrics(registry).update(ray.get(buffer.stats.remote()))       # BufferActor.stats()
    LearnerMetrics(registry).update(learner_metrics)                     # the dict train_step returns
    DriverMetrics(registry).observe_publish(publish_stats.as_metrics())  # PublishStats.as_metrics()
    EvalMetrics(registry).update(score_episodes(...), split="heldout")

Counters from totals. A component reports totals since it started; an updater increments its counter by the change
since the totals it saw last (the first sight counts the whole total). A total that went down means the source
restarted (a restarted rollout actor, a buffer rebuilt without its snapshot): the new total is counted as fresh
increments, so counters only ever increase and ``rate()`` stays right. A rollout actor whose ``elapsed_s`` went down
restarted too, even if its totals already grew past the old ones. Calling ``update`` twice with the same dict changes
nothing. Histograms of events (step time, weight updates, publishes) observe each event once, keyed by its step or
version.

Gauges appear only once set: a quantity a configuration never computes (``kl`` without a KL term, importance weights
under plain PPO) is absent rather than a misleading 0. Keys missing from a stats dict are skipped, so the updaters
accept older and newer dicts alike.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

PREFIX = "aar_"
COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

# Buckets. Seconds of a weight reload or publish (ms to a minute), of a learner step (0.1 s to 10 min), and the
# integer staleness of consumed trajectories (le=0 holds the on-policy ones).
WEIGHT_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # COUNTER | GAUGE | HISTOGRAM
    help: str
    labels: tuple[str, ...]
    component: str
    buckets: Optional[tuple[float, ...]] = None


SPECS: dict[str, MetricSpec] = {}
COMPONENTS = ("rollout", "search", "buffer", "admission", "learner", "driver", "eval")


def _define(component: str, name: str, kind: str, help: str, labels: Sequence[str] = (),
            buckets: Optional[Sequence[float]] = None) -> str:
    """Record one metric in ``SPECS`` and return its name (the module constant)."""
    if not name.startswith(PREFIX) or (component != "driver" and not name.startswith(f"{PREFIX}{component}_")):
        raise ValueError(f"{name}: a {component} metric must start with {PREFIX}{component}_")
    if name in SPECS:
        raise ValueError(f"metric {name} defined twice")
    if (kind == COUNTER) != name.endswith("_total"):
        raise ValueError(f"{name}: counters, and only counters, end in _total")
    if (kind == HISTOGRAM) != (buckets is not None):
        raise ValueError(f"{name}: histograms, and only histograms, have buckets")
    SPECS[name] = MetricSpec(name, kind, help, tuple(labels), component, tuple(buckets) if buckets else None)
    return name


A = ("actor",)

# ------------------------------------------------------------------------------------------------------ rollout
ROLLOUT_EPISODES_STARTED = _define("rollout", "aar_rollout_episodes_started_total", COUNTER, "episodes started", A)
ROLLOUT_EPISODES_FINISHED = _define(
    "rollout", "aar_rollout_episodes_finished_total", COUNTER, "episodes finished with a trajectory", A)
ROLLOUT_EPISODES_FAILED = _define(
    "rollout", "aar_rollout_episodes_failed_total", COUNTER, "episodes lost to an engine failure (no trajectory)", A)
ROLLOUT_GROUPS_STARTED = _define("rollout", "aar_rollout_groups_started_total", COUNTER, "GRPO groups started", A)
ROLLOUT_TRAJECTORIES_PUSHED = _define(
    "rollout", "aar_rollout_trajectories_pushed_total", COUNTER, "trajectories handed to the replay buffer", A)
ROLLOUT_GENERATED_TOKENS = _define(
    "rollout", "aar_rollout_generated_tokens_total", COUNTER, "tokens sampled by the engine in finished episodes", A)
ROLLOUT_OBSERVATION_TOKENS = _define(
    "rollout", "aar_rollout_observation_tokens_total", COUNTER,
    "observation (search result) tokens inserted into finished episodes", A)
ROLLOUT_SEARCHES = _define("rollout", "aar_rollout_searches_total", COUNTER, "search calls in finished episodes", A)
ROLLOUT_SEARCH_ERRORS = _define(
    "rollout", "aar_rollout_search_errors_total", COUNTER,
    "search calls of finished episodes that ended as an error observation", A)
ROLLOUT_TURNS = _define(
    "rollout", "aar_rollout_turns_total", COUNTER,
    "model turns in finished episodes (stats key 'turns'; turns per episode = rate(this) / rate(finished))", A)
ROLLOUT_FINISH_REASONS = _define(
    "rollout", "aar_rollout_finish_reasons_total", COUNTER,
    "finished episodes by how they ended (answer, max_turns, response_budget, context_limit, aborted)",
    ("actor", "reason"))
ROLLOUT_REWARD_MEAN = _define(
    "rollout", "aar_rollout_episode_reward_mean", GAUGE,
    "mean reward of the episodes finished since the previous update", A)
ROLLOUT_EXACT_MATCH_MEAN = _define(
    "rollout", "aar_rollout_episode_exact_match_mean", GAUGE,
    "mean exact match of the episodes finished since the previous update "
    "(stats reward_component_sums['exact_match'], or exact_match_sum)", A)
ROLLOUT_REWARD_COMPONENT_MEAN = _define(
    "rollout", "aar_rollout_episode_reward_component_mean", GAUGE,
    "mean unweighted score of each reward term over the episodes finished since the previous update",
    ("actor", "component"))
ROLLOUT_RUNNING_EPISODES = _define("rollout", "aar_rollout_running_episodes", GAUGE, "episodes in flight", A)
ROLLOUT_WEIGHT_VERSION = _define(
    "rollout", "aar_rollout_weight_version", GAUGE, "policy version of the weights the engine samples with", A)
ROLLOUT_WEIGHT_UPDATE_SECONDS = _define(
    "rollout", "aar_rollout_weight_update_seconds", HISTOGRAM,
    "one in-flight weight reload in the engine, call to return", A, WEIGHT_SECONDS_BUCKETS)
ROLLOUT_WEIGHT_UPDATE_PAUSE_SECONDS = _define(
    "rollout", "aar_rollout_weight_update_pause_seconds", HISTOGRAM,
    "generation paused during one weight reload", A, WEIGHT_SECONDS_BUCKETS)

# ------------------------------------------------------------------------------------- search client (per actor)
SEARCH_REQUESTS = _define("search", "aar_search_requests_total", COUNTER, "/retrieve calls made by the client", A)
SEARCH_ATTEMPTS = _define("search", "aar_search_attempts_total", COUNTER, "HTTP attempts, retries included", A)
SEARCH_RETRIES = _define("search", "aar_search_retries_total", COUNTER, "attempts that were retries", A)
SEARCH_FAILURES = _define(
    "search", "aar_search_failures_total", COUNTER, "calls that failed after all retries (error observation)", A)
SEARCH_ERRORS = _define(
    "search", "aar_search_errors_total", COUNTER,
    "failed attempts by kind (timeout, connection, http_status, bad_reply)", ("actor", "kind"))

# ------------------------------------------------------------------------------------------------------- buffer
BUFFER_TRAJECTORIES = _define("buffer", "aar_buffer_trajectories", GAUGE, "trajectories held (pending and ready)")
BUFFER_TOKENS = _define("buffer", "aar_buffer_tokens", GAUGE, "prompt + response tokens held")
BUFFER_BYTES = _define("buffer", "aar_buffer_bytes", GAUGE, "wire bytes held")
BUFFER_CAPACITY_TRAJECTORIES = _define(
    "buffer", "aar_buffer_capacity_trajectories", GAUGE, "capacity in trajectories (fill = trajectories / this)")
BUFFER_CAPACITY_TOKENS = _define("buffer", "aar_buffer_capacity_tokens", GAUGE, "capacity in tokens")
BUFFER_READY_GROUPS = _define("buffer", "aar_buffer_ready_groups", GAUGE, "groups ready to be sampled")
BUFFER_PENDING_GROUPS = _define(
    "buffer", "aar_buffer_pending_groups", GAUGE, "groups with members still to arrive")
BUFFER_OLDEST_AGE = _define(
    "buffer", "aar_buffer_oldest_age_seconds", GAUGE, "age of the oldest held trajectory (0 when empty)")
BUFFER_LEARNER_VERSION = _define(
    "buffer", "aar_buffer_learner_version", GAUGE, "learner version given with the latest sample")
BUFFER_PUSHED = _define("buffer", "aar_buffer_pushed_total", COUNTER, "trajectories accepted into the buffer")
BUFFER_SAMPLED = _define("buffer", "aar_buffer_sampled_total", COUNTER, "trajectories handed to the learner")
BUFFER_PUSH_REFUSED = _define(
    "buffer", "aar_buffer_push_refused_total", COUNTER, "trajectories refused for lack of room (pushed again later)")
BUFFER_REJECTED = _define(
    "buffer", "aar_buffer_rejected_total", COUNTER, "group members reported rejected (will never arrive)")
BUFFER_GROUPS_RELEASED = _define(
    "buffer", "aar_buffer_groups_released_total", COUNTER,
    "groups released incomplete: how=short (members rejected) or partial (timed out, partial_groups=release)",
    ("how",))
BUFFER_GROUPS_OVERDUE = _define(
    "buffer", "aar_buffer_groups_overdue_total", COUNTER, "groups past the partial-group timeout (wait mode)")
BUFFER_EVICTED = _define(
    "buffer", "aar_buffer_evicted_total", COUNTER,
    "trajectories evicted unconsumed by reason (stale, partial_group_timeout, filtered_zero_variance)", ("reason",))
BUFFER_CONSUMED_STALENESS = _define(
    "buffer", "aar_buffer_consumed_staleness", HISTOGRAM,
    "staleness (learner version - oldest token version) of each trajectory when sampled", (), STALENESS_BUCKETS)

# --------------------------------------------------------------------------------- admission (in the buffer actor)
ADMISSION_STARTED = _define("admission", "aar_admission_started_total", COUNTER, "episodes admitted to start")
ADMISSION_ACCEPTED = _define("admission", "aar_admission_accepted_total", COUNTER, "episodes accepted into the buffer")
ADMISSION_REJECTED = _define(
    "admission", "aar_admission_rejected_total", COUNTER, "admitted episodes that ended without being accepted")
ADMISSION_EVICTED = _define(
    "admission", "aar_admission_evicted_total", COUNTER, "accepted episodes later evicted (their slots freed)")
ADMISSION_RUNNING = _define("admission", "aar_admission_running", GAUGE, "admitted episodes not yet ended")

# ------------------------------------------------------------------------------------------------------ learner
LEARNER_STEP = _define("learner", "aar_learner_step", GAUGE, "learner steps done")
LEARNER_VERSION = _define("learner", "aar_learner_policy_version", GAUGE, "learner policy version (published updates)")
LEARNER_STEPS = _define("learner", "aar_learner_steps_total", COUNTER, "learner steps observed")
LEARNER_TRAINED_TOKENS = _define(
    "learner", "aar_learner_trained_tokens_total", COUNTER, "non-padding tokens trained on")
LEARNER_LOSS_TOKENS = _define("learner", "aar_learner_loss_tokens_total", COUNTER, "loss positions trained on")
LEARNER_STEP_SECONDS = _define(
    "learner", "aar_learner_step_seconds", HISTOGRAM, "wall time of one train_step", (), STEP_SECONDS_BUCKETS)
LEARNER_TOKENS_PER_SECOND = _define(
    "learner", "aar_learner_tokens_per_second", GAUGE, "non-padding tokens / step time, latest step")
LEARNER_POLICY_LOSS = _define("learner", "aar_learner_policy_loss", GAUGE, "policy loss, latest step")
LEARNER_VALUE_LOSS = _define("learner", "aar_learner_value_loss", GAUGE, "critic value loss, latest step (gae)")
LEARNER_KL = _define("learner", "aar_learner_kl", GAUGE, "KL to the reference policy, latest step")
LEARNER_APPROX_KL = _define(
    "learner", "aar_learner_approx_kl", GAUGE, "KL(anchor || live policy) by k3 over the updates, latest step")
LEARNER_BEHAVIOR_KL = _define(
    "learner", "aar_learner_behavior_kl", GAUGE, "KL(behavior || proximal): staleness plus engine mismatch")
LEARNER_ENTROPY = _define("learner", "aar_learner_entropy", GAUGE, "policy entropy over loss positions")
LEARNER_CLIP_FRACTION = _define(
    "learner", "aar_learner_clip_fraction", GAUGE, "fraction of loss tokens with the PPO clip active")
LEARNER_DUAL_CLIP_FRACTION = _define(
    "learner", "aar_learner_dual_clip_fraction", GAUGE, "fraction of loss tokens with the dual clip active")
LEARNER_IW_MEAN = _define(
    "learner", "aar_learner_importance_weight_mean", GAUGE, "mean behavior importance weight before the cap")
LEARNER_IW_MAX = _define(
    "learner", "aar_learner_importance_weight_max", GAUGE, "max behavior importance weight before the cap")
LEARNER_IW_CAPPED_FRACTION = _define(
    "learner", "aar_learner_importance_weight_capped_fraction", GAUGE,
    "fraction of loss tokens whose importance weight was truncated or masked")
LEARNER_GRAD_NORM = _define("learner", "aar_learner_grad_norm", GAUGE, "policy gradient norm before clipping")
LEARNER_CRITIC_GRAD_NORM = _define("learner", "aar_learner_critic_grad_norm", GAUGE, "critic gradient norm (gae)")
LEARNER_LR = _define("learner", "aar_learner_lr", GAUGE, "policy learning rate")
LEARNER_BATCH_STALENESS_MEAN = _define(
    "learner", "aar_learner_batch_staleness_mean", GAUGE, "mean staleness of the latest batch's trajectories")
LEARNER_BATCH_STALENESS_MAX = _define(
    "learner", "aar_learner_batch_staleness_max", GAUGE, "max staleness of the latest batch's trajectories")
LEARNER_BATCH_REWARD_MEAN = _define(
    "learner", "aar_learner_batch_reward_mean", GAUGE, "mean episode reward of the latest batch")
LEARNER_ADVANTAGE_MEAN = _define(
    "learner", "aar_learner_advantage_mean", GAUGE, "mean advantage over loss positions, latest batch")

# ------------------------------------------------------------------------------------- driver and weight sync
DRIVER_POLICY_VERSION = _define(
    "driver", "aar_driver_policy_version", GAUGE, "latest policy version published to the rollout actors")
WEIGHT_PUBLISH_SECONDS = _define(
    "driver", "aar_weight_publish_seconds", HISTOGRAM,
    "one publish, start to every rollout actor having applied it", (), WEIGHT_SECONDS_BUCKETS)
WEIGHT_PUBLISH_PUT_SECONDS = _define(
    "driver", "aar_weight_publish_put_seconds", HISTOGRAM,
    "the object-store put (or NCCL broadcasts) of one publish", (), WEIGHT_SECONDS_BUCKETS)
WEIGHT_PUBLISH_BYTES = _define("driver", "aar_weight_publish_bytes", GAUGE, "bytes of the latest publish")
DRIVER_LOST_EPISODES = _define(
    "driver", "aar_driver_lost_episodes_total", COUNTER, "in-flight episodes lost to actor failures")
DRIVER_ACTOR_RESTARTS = _define(
    "driver", "aar_driver_actor_restarts_total", COUNTER, "rollout actor restarts", A)

# ---------------------------------------------------------------------------------- learning signals (driver)
LEARNING_ZERO_VARIANCE_SHARE = _define(
    "driver", "aar_learning_zero_variance_share", GAUGE,
    "share of the groups completed since the previous step whose rewards were all equal (no GRPO signal)")
LEARNING_REWARD_BY_KIND = _define(
    "driver", "aar_learning_rollout_reward", GAUGE,
    "mean reward of the rollout episodes finished since the previous step, by question kind (data source)",
    ("kind",))
LEARNING_EXACT_MATCH_BY_KIND = _define(
    "driver", "aar_learning_rollout_exact_match", GAUGE,
    "mean exact match of the rollout episodes finished since the previous step, by question kind", ("kind",))
LEARNING_SEARCHES_BY_KIND = _define(
    "driver", "aar_learning_rollout_searches", GAUGE,
    "searches per rollout episode finished since the previous step, by question kind", ("kind",))

# --------------------------------------------------------------------------------------------------------- eval
EVAL_LABELS = ("split", "source")
EVAL_EXACT_MATCH = _define(
    "eval", "aar_eval_exact_match", GAUGE, "greedy exact match of the latest evaluation (split=heldout: test set)",
    EVAL_LABELS)
EVAL_F1 = _define("eval", "aar_eval_f1", GAUGE, "token F1 of the latest evaluation", EVAL_LABELS)
EVAL_SEARCHES = _define(
    "eval", "aar_eval_searches_per_question", GAUGE, "searches per question, latest evaluation", EVAL_LABELS)
EVAL_TURNS = _define("eval", "aar_eval_turns_per_question", GAUGE, "turns per question, latest evaluation", EVAL_LABELS)
EVAL_QUESTIONS = _define("eval", "aar_eval_questions", GAUGE, "questions in the latest evaluation", EVAL_LABELS)
EVAL_STEP = _define("eval", "aar_eval_learner_step", GAUGE, "learner step of the latest evaluation", ("split",))


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


class _Totals:
    """The last monotonic totals seen from each source (an actor, the buffer): turns totals into increments."""

    def __init__(self) -> None:
        self._last: dict[str, dict[tuple, float]] = {}

    def advance(self, source: str, items: Sequence[tuple[tuple, float]]) -> tuple[list[float], bool]:
        """The increments for ``[(key, total), ...]`` of one report of ``source``, and whether it restarted.
        A total that went down means the source started again from zero: then every total of this report is new
        (the first sight of a key likewise counts its whole total)."""
        last = self._last.setdefault(source, {})
        restarted = any(k in last and t < last[k] for k, t in items)
        if restarted:
            last.clear()
        out = []
        for k, t in items:
            out.append(t - last.get(k, 0.0))
            last[k] = t
        return out, restarted

    def forget(self, source: str) -> None:
        """A source known to have restarted: its next totals are all new."""
        self._last.pop(source, None)


def _num(x: Any) -> Optional[float]:
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# ============================================================================================ updaters
class RolloutMetrics:
    """Rollout actor and search client metrics, labelled ``actor``. ``update(stats)`` takes ``RolloutActor.stats()``:
    the ``WorkerStats.as_dict()`` totals, ``index``, ``version``, ``search`` (``SearchClient.counters()``) and
    ``weight_updates`` (recent ``{"version", "seconds", "pause_seconds"}`` records). ``reward_component_sums``
    (per reward term, summed over finished episodes) gives the per-term means, and exact match when ``exact_match``
    is a term. Optional keys ``turns`` and ``exact_match_sum`` (totals over finished episodes) feed the turn and
    exact-match metrics when present.
    One instance serves every actor whose stats pass through this process."""

    # stats key -> counter (all monotonic totals of WorkerStats)
    TOTALS = {
        "started": ROLLOUT_EPISODES_STARTED,
        "finished": ROLLOUT_EPISODES_FINISHED,
        "failed": ROLLOUT_EPISODES_FAILED,
        "groups_started": ROLLOUT_GROUPS_STARTED,
        "pushed": ROLLOUT_TRAJECTORIES_PUSHED,
        "generated_tokens": ROLLOUT_GENERATED_TOKENS,
        "observation_tokens": ROLLOUT_OBSERVATION_TOKENS,
        "searches": ROLLOUT_SEARCHES,
        "search_errors": ROLLOUT_SEARCH_ERRORS,
        "turns": ROLLOUT_TURNS,
    }
    SEARCH_TOTALS = {
        "requests": SEARCH_REQUESTS,
        "attempts": SEARCH_ATTEMPTS,
        "retries": SEARCH_RETRIES,
        "failures": SEARCH_FAILURES,
    }

    def __init__(self, registry: CollectorRegistry):
        self.counters = {n: _counter(registry, n) for n in
                         [*self.TOTALS.values(), ROLLOUT_FINISH_REASONS, *self.SEARCH_TOTALS.values(), SEARCH_ERRORS]}
        self.reward_mean = _gauges(registry, ROLLOUT_REWARD_MEAN)
        self.exact_match_mean = _gauges(registry, ROLLOUT_EXACT_MATCH_MEAN)
        self.component_mean = _gauges(registry, ROLLOUT_REWARD_COMPONENT_MEAN)
        self.running = _gauges(registry, ROLLOUT_RUNNING_EPISODES)
        self.version = _gauges(registry, ROLLOUT_WEIGHT_VERSION)
        self.update_seconds = _histogram(registry, ROLLOUT_WEIGHT_UPDATE_SECONDS)
        self.pause_seconds = _histogram(registry, ROLLOUT_WEIGHT_UPDATE_PAUSE_SECONDS)
        self._totals = _Totals()
        self._elapsed: dict[str, float] = {}
        self._sums: dict[str, dict[str, Optional[float]]] = {}
        self._last_update_version: dict[str, int] = {}
        self._lock = threading.Lock()

    def update(self, stats: Mapping[str, Any], actor: Optional[str] = None) -> None:
        """Fold one stats dict in; ``actor`` defaults to ``stats["index"]``."""
        if actor is None:
            if "index" not in stats:
                raise ValueError("rollout stats carry no 'index'; pass actor=")
            actor = str(stats["index"])
        with self._lock:
            self._update(stats, str(actor))

    def _update(self, s: Mapping[str, Any], actor: str) -> None:
        elapsed = _num(s.get("elapsed_s"))
        restarted = elapsed is not None and elapsed < self._elapsed.get(actor, -1.0)
        if elapsed is not None:
            self._elapsed[actor] = elapsed
        if restarted:  # the worker started again (even if its totals already grew past the old ones)
            self._totals.forget(actor)
        search = s.get("search") or {}
        items: list[tuple[str, tuple[str, ...], Any]] = [
            *((name, (actor,), s.get(key)) for key, name in self.TOTALS.items()),
            *((ROLLOUT_FINISH_REASONS, (actor, str(r)), t) for r, t in (s.get("finish_reasons") or {}).items()),
            *((name, (actor,), search.get(key)) for key, name in self.SEARCH_TOTALS.items()),
            *((SEARCH_ERRORS, (actor, k[len("errors_"):]), t) for k, t in search.items() if k.startswith("errors_")),
        ]
        items = [(n, labels, _num(t)) for n, labels, t in items if _num(t) is not None]
        deltas, went_down = self._totals.advance(actor, [((n, *labels), t) for n, labels, t in items])
        for (name, labels, _), d in zip(items, deltas):
            child = self.counters[name].labels(*labels)  # exported (as 0) from the first sight on
            if d > 0:
                child.inc(d)
        if restarted or went_down:
            self._sums.pop(actor, None)
            self._last_update_version.pop(actor, None)
        self._means(s, actor)
        if _num(s.get("running")) is not None:
            self.running.set(float(s["running"]), actor)
        if _num(s.get("version")) is not None:
            self.version.set(float(s["version"]), actor)
        last_v = self._last_update_version.get(actor)
        for rec in s.get("weight_updates") or ():
            v = _num(rec.get("version"))
            if v is None or (last_v is not None and v <= last_v):
                continue
            if _num(rec.get("seconds")) is not None:
                self.update_seconds.labels(actor).observe(float(rec["seconds"]))
            if _num(rec.get("pause_seconds")) is not None:
                self.pause_seconds.labels(actor).observe(float(rec["pause_seconds"]))
            last_v = int(v)
        if last_v is not None:
            self._last_update_version[actor] = last_v

    def _means(self, s: Mapping[str, Any], actor: str) -> None:
        """Means of the episodes finished since the last update: reward, exact match, each reward term. The sums
        are not counters (a reward may be negative), so they are differenced here, restarting with ``finished``."""
        finished = _num(s.get("finished"))
        if finished is None:
            return
        components = {str(k): _num(v) for k, v in (s.get("reward_component_sums") or {}).items()}
        em = _num(s.get("exact_match_sum"))
        sums = {"reward": _num(s.get("reward_sum")),
                "exact_match": em if em is not None else components.get("exact_match"),
                **{f"component:{k}": v for k, v in components.items()}}
        last = self._sums.get(actor) or {"finished": 0.0}
        n = finished - (last["finished"] or 0.0)
        if n > 0:
            for key, total in sums.items():
                if total is None:
                    continue
                mean = (total - (last.get(key) or 0.0)) / n
                if key == "reward":
                    self.reward_mean.set(mean, actor)
                elif key == "exact_match":
                    self.exact_match_mean.set(mean, actor)
                else:
                    self.component_mean.set(mean, actor, key[len("component:"):])
        if n > 0 or actor not in self._sums:
            self._sums[actor] = {"finished": finished, **sums}


class BufferMetrics:
    """Replay buffer and admission metrics from ``BufferActor.stats()`` (``ReplayBuffer.stats()`` plus
    ``admission``: ``AdmissionState.counters()``)."""

    GAUGES = {
        "size": BUFFER_TRAJECTORIES,
        "tokens": BUFFER_TOKENS,
        "bytes": BUFFER_BYTES,
        "capacity_trajectories": BUFFER_CAPACITY_TRAJECTORIES,
        "capacity_tokens": BUFFER_CAPACITY_TOKENS,
        "ready_groups": BUFFER_READY_GROUPS,
        "pending_groups": BUFFER_PENDING_GROUPS,
        "oldest_age_s": BUFFER_OLDEST_AGE,
        "learner_version": BUFFER_LEARNER_VERSION,
    }
    TOTALS = {
        "pushed": (BUFFER_PUSHED, ()),
        "sampled": (BUFFER_SAMPLED, ()),
        "push_refused": (BUFFER_PUSH_REFUSED, ()),
        "rejected": (BUFFER_REJECTED, ()),
        "groups_released_short": (BUFFER_GROUPS_RELEASED, ("short",)),
        "groups_released_partial": (BUFFER_GROUPS_RELEASED, ("partial",)),
        "groups_overdue": (BUFFER_GROUPS_OVERDUE, ()),
    }
    ADMISSION_TOTALS = {
        "started": ADMISSION_STARTED,
        "accepted": ADMISSION_ACCEPTED,
        "rejected": ADMISSION_REJECTED,
        "evicted": ADMISSION_EVICTED,
    }

    def __init__(self, registry: CollectorRegistry):
        names = {n for n, _ in self.TOTALS.values()} | {BUFFER_EVICTED, *self.ADMISSION_TOTALS.values()}
        self.counters = {n: _counter(registry, n) for n in sorted(names)}
        self.gauges = {n: _gauges(registry, n) for n in [*self.GAUGES.values(), ADMISSION_RUNNING]}
        self.staleness = _CountHistogram(SPECS[BUFFER_CONSUMED_STALENESS], registry)
        self._totals = _Totals()
        self._lock = threading.Lock()

    def update(self, stats: Mapping[str, Any]) -> None:
        with self._lock:
            self._update(stats)

    def _update(self, s: Mapping[str, Any]) -> None:
        for key, name in self.GAUGES.items():
            v = _num(s.get(key))
            if v is not None:
                self.gauges[name].set(v)
        adm = s.get("admission") or {}
        items: list[tuple[str, tuple[str, ...], Any]] = [
            *((name, labels, s.get(key)) for key, (name, labels) in self.TOTALS.items()),
            *((BUFFER_EVICTED, (str(r),), t) for r, t in (s.get("evicted") or {}).items()),
            *((name, (), adm.get(key)) for key, name in self.ADMISSION_TOTALS.items()),
            # the staleness histogram: per staleness value, trajectories consumed so far
            *((BUFFER_CONSUMED_STALENESS, (str(int(k)),), t) for k, t in (s.get("staleness_histogram") or {}).items()),
        ]
        items = [(n, labels, _num(t)) for n, labels, t in items if _num(t) is not None]
        deltas, _ = self._totals.advance("buffer", [((n, *labels), t) for n, labels, t in items])
        for (name, labels, _), d in zip(items, deltas):
            if name == BUFFER_CONSUMED_STALENESS:
                if d > 0:
                    self.staleness.add(int(labels[0]), int(d))
                continue
            child = self.counters[name].labels(*labels) if labels else self.counters[name]
            if d > 0:
                child.inc(d)
        if _num(adm.get("running")) is not None:
            self.gauges[ADMISSION_RUNNING].set(float(adm["running"]))


class LearnerMetrics:
    """Learner metrics from the dict ``Learner.train_step`` returns (one rank's, typically rank 0's). A step is
    counted once: a dict whose ``step`` is not past the last one seen only refreshes the gauges."""

    GAUGES = {
        "step": LEARNER_STEP,
        "version": LEARNER_VERSION,
        "tokens_per_s": LEARNER_TOKENS_PER_SECOND,
        "policy_loss": LEARNER_POLICY_LOSS,
        "value_loss": LEARNER_VALUE_LOSS,
        "kl": LEARNER_KL,
        "approx_kl": LEARNER_APPROX_KL,
        "behavior_kl": LEARNER_BEHAVIOR_KL,
        "entropy": LEARNER_ENTROPY,
        "clip_frac": LEARNER_CLIP_FRACTION,
        "dual_clip_frac": LEARNER_DUAL_CLIP_FRACTION,
        "iw_mean": LEARNER_IW_MEAN,
        "iw_max": LEARNER_IW_MAX,
        "iw_capped_frac": LEARNER_IW_CAPPED_FRACTION,
        "grad_norm": LEARNER_GRAD_NORM,
        "critic_grad_norm": LEARNER_CRITIC_GRAD_NORM,
        "lr": LEARNER_LR,
        "staleness_mean": LEARNER_BATCH_STALENESS_MEAN,
        "staleness_max": LEARNER_BATCH_STALENESS_MAX,
        "reward_mean": LEARNER_BATCH_REWARD_MEAN,
        "advantage_mean": LEARNER_ADVANTAGE_MEAN,
    }

    def __init__(self, registry: CollectorRegistry):
        self.gauges = {n: _gauges(registry, n) for n in self.GAUGES.values()}
        self.steps = _counter(registry, LEARNER_STEPS)
        self.trained_tokens = _counter(registry, LEARNER_TRAINED_TOKENS)
        self.loss_tokens = _counter(registry, LEARNER_LOSS_TOKENS)
        self.step_seconds = _histogram(registry, LEARNER_STEP_SECONDS)
        self._last_step: Optional[float] = None
        self._lock = threading.Lock()

    def update(self, m: Mapping[str, Any]) -> None:
        with self._lock:
            for key, name in self.GAUGES.items():
                v = _num(m.get(key))
                if v is not None:
                    self.gauges[name].set(v)
            step = _num(m.get("step"))
            if step is not None and self._last_step is not None and step <= self._last_step:
                return  # seen already (or a restart replaying old steps): gauges refreshed, no event
            if step is not None:
                self._last_step = step
            self.steps.inc()
            t, tps, lt = _num(m.get("step_time_s")), _num(m.get("tokens_per_s")), _num(m.get("loss_tokens"))
            if t is not None:
                self.step_seconds.observe(t)
                if tps is not None and tps >= 0:
                    self.trained_tokens.inc(tps * t)
            if lt is not None and lt >= 0:
                self.loss_tokens.inc(lt)


class DriverMetrics:
    """The driver's own metrics: publishes (``PublishStats.as_metrics()``), the policy version, and fault
    accounting (``update({"lost_episodes": total, "actor_restarts": {actor: total}})``)."""

    def __init__(self, registry: CollectorRegistry):
        self.version = _gauges(registry, DRIVER_POLICY_VERSION)
        self.publish_seconds = _histogram(registry, WEIGHT_PUBLISH_SECONDS)
        self.publish_put_seconds = _histogram(registry, WEIGHT_PUBLISH_PUT_SECONDS)
        self.publish_bytes = _gauges(registry, WEIGHT_PUBLISH_BYTES)
        self.lost = _counter(registry, DRIVER_LOST_EPISODES)
        self.restarts = _counter(registry, DRIVER_ACTOR_RESTARTS)
        self._totals = _Totals()
        self._last_publish: Optional[float] = None
        self._lock = threading.Lock()

    def set_version(self, version: int) -> None:
        self.version.set(float(version))

    def observe_publish(self, m: Mapping[str, Any]) -> None:
        """One publish: keys ``publish_latency_s``, ``publish_put_s``, ``publish_bytes``, ``publish_version``
        (``PublishStats.as_metrics()``). The same version twice is observed once."""
        with self._lock:
            v = _num(m.get("publish_version"))
            if v is not None:
                if self._last_publish is not None and v <= self._last_publish:
                    return
                self._last_publish = v
                self.version.set(v)
            if _num(m.get("publish_latency_s")) is not None:
                self.publish_seconds.observe(float(m["publish_latency_s"]))
            if _num(m.get("publish_put_s")) is not None:
                self.publish_put_seconds.observe(float(m["publish_put_s"]))
            if _num(m.get("publish_bytes")) is not None:
                self.publish_bytes.set(float(m["publish_bytes"]))

    def update(self, m: Mapping[str, Any]) -> None:
        with self._lock:
            if _num(m.get("policy_version")) is not None:
                self.version.set(float(m["policy_version"]))
            items = [((DRIVER_LOST_EPISODES,), _num(m.get("lost_episodes")))]
            items += [((DRIVER_ACTOR_RESTARTS, str(a)), _num(t)) for a, t in (m.get("actor_restarts") or {}).items()]
            items = [(k, t) for k, t in items if t is not None]
            deltas, _ = self._totals.advance("driver", items)
            for (key, _), d in zip(items, deltas):
                child = self.lost if key[0] == DRIVER_LOST_EPISODES else self.restarts.labels(key[1])
                if d > 0:
                    child.inc(d)


class EvalMetrics:
    """Evaluation results: ``update(score_episodes(...), split="heldout", step=learner_step)``; the score dict
    maps data source (and ``all``) to ``{"n", "exact_match", "f1", "searches_per_question", "turns_per_question"}``.
    """

    KEYS = {
        "exact_match": EVAL_EXACT_MATCH,
        "f1": EVAL_F1,
        "searches_per_question": EVAL_SEARCHES,
        "turns_per_question": EVAL_TURNS,
        "n": EVAL_QUESTIONS,
    }

    def __init__(self, registry: CollectorRegistry):
        self.gauges = {n: _gauges(registry, n) for n in self.KEYS.values()}
        self.step = _gauges(registry, EVAL_STEP)

    def update(self, scores: Mapping[str, Mapping[str, Any]], split: str = "heldout",
               step: Optional[int] = None) -> None:
        for source, summary in scores.items():
            for key, name in self.KEYS.items():
                v = _num(summary.get(key))
                if v is not None:
                    self.gauges[name].set(v, split, str(source))
        if step is not None:
            self.step.set(float(step), split)


class LearningMetrics:
    """The driver's per-step learning signals (``Trainer``'s ``learning`` record): ``zero_variance_share`` and
    ``by_kind`` ``{kind: {"reward", "exact_match", "searches"}}`` over the episodes finished since the last step."""

    KIND_KEYS = {"reward": LEARNING_REWARD_BY_KIND, "exact_match": LEARNING_EXACT_MATCH_BY_KIND,
                 "searches": LEARNING_SEARCHES_BY_KIND}

    def __init__(self, registry: CollectorRegistry):
        self.zero_variance = _gauges(registry, LEARNING_ZERO_VARIANCE_SHARE)
        self.by_kind = {n: _gauges(registry, n) for n in self.KIND_KEYS.values()}

    def update(self, m: Mapping[str, Any]) -> None:
        if _num(m.get("zero_variance_share")) is not None:
            self.zero_variance.set(float(m["zero_variance_share"]))
        for kind, values in (m.get("by_kind") or {}).items():
            for key, name in self.KIND_KEYS.items():
                if _num(values.get(key)) is not None:
                    self.by_kind[name].set(float(values[key]), str(kind))


UPDATERS = (RolloutMetrics, BufferMetrics, LearnerMetrics, DriverMetrics, EvalMetrics, LearningMetrics)


def register_all(registry: CollectorRegistry) -> dict[str, Any]:
    """Every updater on one registry (a driver that feeds all components' stats); keyed by component."""
    return {
        "rollout": RolloutMetrics(registry),
        "buffer": BufferMetrics(registry),
        "learner": LearnerMetrics(registry),
        "driver": DriverMetrics(registry),
        "eval": EvalMetrics(registry),
        "learning": LearningMetrics(registry),
    }


# ============================================================================================ reference doc
def render_markdown(specs: Iterable[MetricSpec] = ()) -> str:
    """``docs/METRICS.md``: one table per component (name, type, labels, meaning)."""
    specs = list(specs) or list(SPECS.values())
    titles = {
        "rollout": "Rollout actors (`RolloutMetrics`, from `RolloutActor.stats()`)",
        "search": "Search client in each rollout actor (`RolloutMetrics`, from `stats()['search']`)",
        "buffer": "Replay buffer (`BufferMetrics`, from `BufferActor.stats()`)",
        "admission": "Admission control in the buffer actor (`BufferMetrics`, from `stats()['admission']`)",
        "learner": "Learner (`LearnerMetrics`, from the `train_step` metrics dict)",
        "driver": "Driver and weight sync (`DriverMetrics`)",
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
        "`retriever_backend_latency_seconds`, `retriever_errors_total{kind}`.",
        "",
        "Scrape targets are found through `file_sd_configs` (`monitoring/prometheus.yml`, `targets.json` written by",
        "`monitoring.exporter.write_sd_file`); the target group's `job` label names the component.",
        "",
        "## Exporting and watching",
        "",
        "Components keep plain totals in their `stats()` dicts; the updaters of `monitoring.metrics` turn them into",
        "metrics in whichever process holds the registry (one registry per process). The driver's side in one call:",
        "",
        "```python",
        "from monitoring.exporter import RunMonitoring",
        "mon = RunMonitoring.from_config(cfg.monitoring, run_dir)  # registry, exporter, run_dir/prometheus/",
        "mon.set_targets(\"retriever\", [\"127.0.0.1:PORT\"])       # the retrieval server's own /metrics",
        "mon.poll(lambda: mon.observe(rollout=[...each RolloutActor.stats()...],",
        "                             buffer=buffer_actor_stats), every_s=cfg.monitoring.log_every_s)",
        "mon.observe(learner=train_step_metrics, publish=publish_stats.as_metrics())  # each step",
        "mon.eval.update(scores, split=\"heldout\", step=step)      # score_episodes(...) of each evaluation",
        "mon.close()",
        "```",
        "",
        "Then `prometheus --config.file=RUN_DIR/prometheus/prometheus.yml --web.listen-address=127.0.0.1:9090`",
        "(Debian package; `scripts/install_prometheus.sh`) and import `monitoring/grafana_dashboard.json` into Grafana",
        "with that Prometheus as `DS_PROMETHEUS`. `monitoring.prom.check_dashboard` runs every panel's query through",
        "a Prometheus and lists those without data.",
        "",
        "Optional rollout keys: `RolloutMetrics` also reads `turns` (total over finished episodes) when the rollout",
        "stats carry it. Train exact match comes from `reward_component_sums['exact_match']` (an `exact_match`",
        "reward term, as in the default config) or an `exact_match_sum` total.",
    ]
    for comp in COMPONENTS:
        rows = [s for s in specs if s.component == comp]
        if not rows:
            continue
        out += ["", f"## {titles[comp]}", "", "| name | type | labels | meaning |", "|---|---|---|---|"]
        for s in rows:
            labels = ", ".join(f"`{label}`" for label in s.labels) or "-"
            out.append(f"| `{s.name}` | {s.kind} | {labels} | {s.help.replace('|', '/')} |")
    out += ["", "## Buckets", "",
            f"- weight reload and publish seconds: {list(WEIGHT_SECONDS_BUCKETS)}",
            f"- learner step seconds: {list(STEP_SECONDS_BUCKETS)}",
            f"- consumed staleness: {list(STALENESS_BUCKETS)}", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render_markdown(), end="")
