"""Metric names, the stats -> metrics updaters, the reference doc and the dashboard (no network here; the exporter
over real HTTP and a real Prometheus are in tests/integration/test_exporter_prometheus.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actors.rollout_worker import RolloutWorker, WorkerStats
from actors.search_client import SearchClient
from async_agent_rl import stats as stats_module
from async_agent_rl.config import BufferConfig, SearchClientConfig
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode import EpisodeRunner, TurnOutput, TurnRequest
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from async_agent_rl.staleness import AdmissionState
from async_agent_rl.stats import (
    BufferStats, DriverStats, LearnerStats, PublishStats, RolloutStats, SearchStats, WeightUpdate, idle_stats,
)
from buffer.actor import BufferActor
from buffer.replay_buffer import ReplayBuffer
from driver.console import LearningSignals
from monitoring import build_dashboard, metrics as M
from monitoring.exporter import prometheus_config, sd_groups, write_sd_file
from monitoring.prom import DASHBOARD, dashboard_queries, expand_grafana_vars
from retriever import server as retriever_server
from tests.helpers import LONGEST

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def value(reg: CollectorRegistry, name: str, **labels) -> float | None:
    return reg.get_sample_value(name, labels)


def rollout_stats(index=0, incarnation="a", **totals) -> RolloutStats:
    """What RolloutActor.stats() returns: WorkerStats.message() with the actor's index, version, search, ..."""
    ws = WorkerStats(incarnation=incarnation)
    for k, v in totals.items():
        if k not in ("finish_reasons", "reward_component_sums"):
            setattr(ws, k, v)
    ws.finish_reasons.update(totals.get("finish_reasons", {}))
    ws.reward_component_sums.update(totals.get("reward_component_sums", {}))
    search = SearchStats(errors={"timeout": 0, "connection": 0, "http_status": 0, "bad_reply": 0})
    return ws.message(index=index, version=0, search=search, ready=True)


# ------------------------------------------------------------------------------------------------------ names
def test_every_constant_is_defined_once_with_prefix_and_type():
    constants = {k: v for k, v in vars(M).items()
                 if k.isupper() and k != "PREFIX" and isinstance(v, str) and v.startswith(M.PREFIX)}
    assert sorted(constants.values()) == sorted(M.SPECS), "every aar_ constant is in SPECS and vice versa"
    assert len(set(constants.values())) == len(constants), "two constants share a name"
    for spec in M.SPECS.values():
        assert re.fullmatch(r"aar_[a-z0-9_]+", spec.name)
        assert spec.kind in (M.COUNTER, M.GAUGE, M.HISTOGRAM)
        assert spec.help and spec.component in M.COMPONENTS
        assert spec.name.endswith("_total") == (spec.kind == M.COUNTER)
    with pytest.raises(ValueError, match="defined twice"):
        M._define("learner", M.LEARNER_STEP, M.GAUGE, "again", field="step")
    with pytest.raises(ValueError, match="must start with"):
        M._define("learner", "aar_buffer_something_new", M.GAUGE, "wrong component", field="step")
    with pytest.raises(ValueError, match="_total"):
        M._define("learner", "aar_learner_something_new", M.COUNTER, "a counter without _total", field="step")
    with pytest.raises(ValueError, match="LearnerStats has no field 'stepz'"):
        M._define("learner", "aar_learner_something_new", M.GAUGE, "fed from nothing", field="stepz")


def test_every_metric_is_fed_from_a_field_of_a_stats_message():
    """By construction: a spec names the message and the field that feed it, and the field exists (``_define``
    refuses one that does not); the updaters read exactly those fields."""
    messages = {cls for cls in vars(stats_module).values() if dataclasses.is_dataclass(cls)}
    for spec in M.SPECS.values():
        assert spec.source in messages, spec
        names = {f.name for f in dataclasses.fields(spec.source)}
        assert spec.field in names or isinstance(getattr(spec.source, spec.field), property), spec
    fed = {spec.field for spec in M.SPECS.values() if spec.source is RolloutStats}
    assert {"turns", "finished", "generated_tokens", "search"} - fed == {"search"}  # search: the search_* metrics


def test_all_updaters_share_one_registry_and_registering_twice_fails():
    reg = M.new_registry()
    M.register_all(reg)
    with pytest.raises(ValueError, match="Duplicated"):
        M.RolloutMetrics(reg)
    with pytest.raises(ValueError, match="Duplicated"):
        M.LearnerMetrics(reg)


class ScriptedEngine:
    """Searches once, then answers (right for even question ids): an episode of two model turns."""

    version = 0

    def __init__(self, tok):
        self.tok, self.prompts = tok, set()

    async def generate(self, req: TurnRequest) -> TurnOutput:
        ids = tuple(req.prompt_ids)
        searched = any(len(p) < len(ids) and ids[: len(p)] == p for p in self.prompts)  # its first turn was asked
        self.prompts.add(ids)
        answer = "x" if req.prompt_ids[-1] % 2 == 0 else "y"
        text = f"<answer> {answer} </answer>" if searched else "<search> alpha </search>"
        ids = self.tok.encode(text, add_special_tokens=False)
        return TurnOutput(ids, [-0.5] * len(ids), [self.version] * len(ids), text, "stop")


def real_run(tok) -> tuple[RolloutStats, BufferStats]:
    """A real RolloutWorker (scripted engine; a real SearchClient whose retriever is down, so every search ends as
    an error observation) pushing into a real buffer actor (no Ray), which then hands out one batch."""
    settings = EpisodeSettings(max_turns=3, max_tokens_per_turn=32, max_response_length=256, max_obs_length=64,
                               max_model_len=1024, prompt_template="minimal")  # fmt: skip
    examples = [QAExample(id=f"q{i}", question=f"question {i} ?", gold_answers=["x"], data_source="world_single")
                for i in range(8)]
    buffer = BufferActor(BufferConfig(max_staleness=2, capacity_trajectories=64), group_size=2,
                         consumed_per_version=4, max_concurrent=8, batch_size=4, max_trajectory_tokens=LONGEST)

    async def go() -> RolloutStats:
        async with SearchClient("http://127.0.0.1:9", SearchClientConfig(timeout_s=1, retries=0, deadline_s=1)) as sc:
            async def sink(batch):
                buffer.push_many([t.encode() for t in batch])

            async def admit(n, version, group_id, prompt=None):
                return buffer.try_start(n, version, group_id, "actor0")

            worker = RolloutWorker(EpisodeRunner(ScriptedEngine(tok), sc, tok, settings), iter(examples), sink,
                                   group_size=2, max_concurrent=4, admit=admit, seed=0)
            await worker.run(num_groups=4)
            update = WeightUpdate(version=1, seconds=0.2, pause_seconds=0.05)
            return worker.stats.message(index=0, version=0, search=sc.stats(), weight_updates=[update], ready=True)

    rollout = asyncio.run(go())
    assert buffer.sample(4, learner_version=1) is not None
    return rollout, buffer.stats()


def test_every_metric_is_fed_by_some_updater(tok):
    """Messages of a real worker run and a real buffer (plus one message of each other kind): every SPECS name is
    in the exposition (no dead metric), aar_rollout_turns_total with the worker's real turn count."""
    rollout, buffer = real_run(tok)
    assert rollout.turns == 2 * rollout.finished == 16 and rollout.search.errors["connection"] > 0
    reg = M.new_registry()
    u = M.register_all(reg)
    u["rollout"].update(rollout)
    u["buffer"].update(buffer)
    gae = learner_stats(step=1, gae=True)
    u["learner"].update(gae)
    u["driver"].observe_publish(PublishStats(version=1, method="object_store", seconds=0.3, put_seconds=0.1,
                                             bytes=10**6, num_actors=1))
    u["driver"].update(DriverStats(lost_episodes=0, actor_restarts={"0": 0}))
    u["eval"].update({"all": {"n": 10, "exact_match": 0.5, "f1": 0.6, "searches_per_question": 1.2,
                              "turns_per_question": 2.0}}, split="heldout", step=0)
    u["learning"].update(LearningSignals().update([rollout], buffer, gae))
    u["idle"].update(idle_stats(1.5, 6.0, [rollout], {}))
    assert value(reg, M.ROLLOUT_TURNS, actor="0") == 16
    text = generate_latest(reg).decode()
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    missing = [n for n in M.SPECS if not any(x == n or x.startswith(n + "_") for x in samples)]
    assert not missing, f"metrics no updater sets: {missing}"


# ---------------------------------------------------------------------------------------------------- rollout
def test_rollout_counters_follow_monotonic_totals_per_actor():
    reg = M.new_registry()
    r = M.RolloutMetrics(reg)
    r.update(rollout_stats(0, started=5, finished=4, failed=1, generated_tokens=100, reward_sum=2.0,
                           finish_reasons={"answer": 3, "max_turns": 1}))
    r.update(rollout_stats(1, started=2, finished=2, generated_tokens=30, reward_sum=0.0))
    assert value(reg, M.ROLLOUT_GENERATED_TOKENS, actor="0") == 100
    assert value(reg, M.ROLLOUT_GENERATED_TOKENS, actor="1") == 30
    assert value(reg, M.ROLLOUT_EPISODES_FAILED, actor="0") == 1
    assert value(reg, M.ROLLOUT_FINISH_REASONS, actor="0", reason="max_turns") == 1
    assert value(reg, M.ROLLOUT_REWARD_MEAN, actor="0") == pytest.approx(0.5)
    assert value(reg, M.ROLLOUT_RUNNING_EPISODES, actor="0") == 0  # 5 - 4 - 1
    assert value(reg, M.SEARCH_ERRORS, actor="0", kind="timeout") == 0  # exported from the first sight

    # the same dict again: nothing moves
    r.update(rollout_stats(0, started=5, finished=4, failed=1, generated_tokens=100, reward_sum=2.0,
                           finish_reasons={"answer": 3, "max_turns": 1}))
    assert value(reg, M.ROLLOUT_GENERATED_TOKENS, actor="0") == 100
    # totals grew: the counter grows by the difference; the reward mean covers only the new episodes
    r.update(rollout_stats(0, started=8, finished=6, failed=1, generated_tokens=160,
                           reward_sum=4.0, finish_reasons={"answer": 5, "max_turns": 1}))
    assert value(reg, M.ROLLOUT_GENERATED_TOKENS, actor="0") == 160
    assert value(reg, M.ROLLOUT_FINISH_REASONS, actor="0", reason="answer") == 5
    assert value(reg, M.ROLLOUT_REWARD_MEAN, actor="0") == pytest.approx(1.0)  # (4 - 2) / (6 - 4)
    assert value(reg, M.ROLLOUT_GENERATED_TOKENS, actor="1") == 30


def test_rollout_restart_counts_new_totals_and_counters_never_decrease():
    reg = M.new_registry()
    r = M.RolloutMetrics(reg)
    r.update(rollout_stats(0, "a", started=10, finished=10, generated_tokens=500, reward_sum=5.0))
    # restarted actor (a new incarnation): its totals are all new
    r.update(rollout_stats(0, "b", started=3, finished=3, generated_tokens=60, reward_sum=3.0))
    assert value(reg, M.ROLLOUT_GENERATED_TOKENS, actor="0") == 560
    assert value(reg, M.ROLLOUT_REWARD_MEAN, actor="0") == pytest.approx(1.0)
    # restarted and already past the old totals: still a new incarnation
    r.update(rollout_stats(0, "c", started=12, finished=12, generated_tokens=700, reward_sum=6.0))
    assert value(reg, M.ROLLOUT_GENERATED_TOKENS, actor="0") == 1260
    assert value(reg, M.ROLLOUT_EPISODES_FINISHED, actor="0") == 25
    assert value(reg, M.ROLLOUT_REWARD_MEAN, actor="0") == pytest.approx(0.5)
    # the same incarnation again: nothing moves
    r.update(rollout_stats(0, "c", started=12, finished=12, generated_tokens=700, reward_sum=6.0))
    assert value(reg, M.ROLLOUT_GENERATED_TOKENS, actor="0") == 1260


def test_rollout_turns_weight_updates_and_search():
    reg = M.new_registry()
    r = M.RolloutMetrics(reg)
    s = rollout_stats(0, started=4, finished=4)
    r.update(s)
    assert value(reg, M.ROLLOUT_TURNS, actor="0") == 0
    assert value(reg, M.ROLLOUT_EXACT_MATCH_MEAN, actor="0") is None  # no exact_match term: not exported
    ups = [WeightUpdate(version=1, seconds=0.2, pause_seconds=0.05), WeightUpdate(2, 0.4, 0.1)]
    s = rollout_stats(0, started=8, finished=8, turns=20, reward_component_sums={"exact_match": 2.0})
    s.weight_updates, s.version = ups, 2
    s.search = SearchStats(requests=9, attempts=11, retries=2, failures=1,
                           errors={"timeout": 2, "connection": 0, "http_status": 0, "bad_reply": 0})
    r.update(s)
    r.update(s)  # the same records again are not observed twice
    assert value(reg, M.ROLLOUT_TURNS, actor="0") == 20
    assert value(reg, M.ROLLOUT_EXACT_MATCH_MEAN, actor="0") == pytest.approx(0.5)  # 2 / 4 new episodes
    # the worker's per-term sums: exact match from the exact_match term, and every term's mean
    r.update(rollout_stats(2, started=4, finished=4, reward_sum=3.0,
                           reward_component_sums={"exact_match": 1.0, "format": 3.0}))
    r.update(rollout_stats(2, started=8, finished=8, reward_sum=4.0,
                           reward_component_sums={"exact_match": 4.0, "format": 3.5}))
    assert value(reg, M.ROLLOUT_EXACT_MATCH_MEAN, actor="2") == pytest.approx(0.75)  # (4 - 1) / 4
    assert value(reg, M.ROLLOUT_REWARD_COMPONENT_MEAN, actor="2", component="format") == pytest.approx(0.125)
    assert value(reg, M.ROLLOUT_REWARD_MEAN, actor="2") == pytest.approx(0.25)
    assert value(reg, M.ROLLOUT_WEIGHT_UPDATE_SECONDS + "_count", actor="0") == 2
    assert value(reg, M.ROLLOUT_WEIGHT_UPDATE_SECONDS + "_sum", actor="0") == pytest.approx(0.6)
    assert value(reg, M.ROLLOUT_WEIGHT_VERSION, actor="0") == 2
    assert value(reg, M.SEARCH_ERRORS, actor="0", kind="timeout") == 2
    assert value(reg, M.SEARCH_RETRIES, actor="0") == 2
    s.weight_updates = ups[1:] + [WeightUpdate(version=3, seconds=0.1, pause_seconds=0.01)]
    r.update(s)
    assert value(reg, M.ROLLOUT_WEIGHT_UPDATE_SECONDS + "_count", actor="0") == 3


# ----------------------------------------------------------------------------------------------------- buffer
def traj(gid: str, member: int, version: int, n: int = 3) -> bytes:
    return Trajectory(prompt_ids=[1, 2], response_ids=[5] * n, loss_mask=[1] * n, behavior_logprobs=[-0.1] * n,
                      versions=[version] * n, turns=[TurnSpan("model", 0, n)],
                      meta=EpisodeMeta(group_id=gid, trajectory_id=f"{gid}/{member}")).encode()


def buffer_stats() -> tuple[BufferStats, ReplayBuffer, AdmissionState]:
    """A real ReplayBuffer: 3 groups of 2 at versions 0, 0, 1; one consumed at learner version 1 (staleness 1),
    then the other version-0 group evicted stale at learner version 4 (eta = 2)."""
    adm = AdmissionState(max_staleness=2, batch_size=2, max_concurrent=8, granule=2)
    buf = ReplayBuffer(BufferConfig(max_staleness=2, capacity_trajectories=16), 2, max_trajectory_tokens=LONGEST,
                       on_evict=lambda n, gid: adm.on_evicted(gid, n), on_consume=adm.on_consumed)
    for g in "abc":
        adm.try_start(2, 0, g)
    buf.push([traj("a", 0, 0), traj("a", 1, 0), traj("b", 0, 0), traj("b", 1, 0), traj("c", 0, 1),
              traj("c", 1, 1)])
    for g in "abc":
        adm.on_finished(g, 2, accepted=True)
    return with_admission(buf, adm), buf, adm


def with_admission(buf: ReplayBuffer, adm: AdmissionState, incarnation: str = "a") -> BufferStats:
    """What BufferActor.stats() adds to ReplayBuffer.stats()."""
    return dataclasses.replace(buf.stats(), admission=adm.stats(), incarnation=incarnation)


def test_buffer_metrics_from_a_real_replay_buffer():
    stats, buf, adm = buffer_stats()
    reg = M.new_registry()
    b = M.BufferMetrics(reg)
    b.update(stats)
    assert value(reg, M.BUFFER_TRAJECTORIES) == 6
    assert value(reg, M.BUFFER_PUSHED) == 6
    assert value(reg, M.BUFFER_CAPACITY_TRAJECTORIES) == 16
    assert value(reg, M.BUFFER_READY_GROUPS) == 3
    assert value(reg, M.BUFFER_EVICTED, reason="stale") == 0  # every reason exported from the start
    assert value(reg, M.ADMISSION_ACCEPTED) == 6
    assert value(reg, M.BUFFER_EPISODES_BY_LENGTH, stage="generated", tokens="<32") == 6
    assert value(reg, M.BUFFER_EPISODES_BY_TURNS, stage="generated", turns="0") == 6
    assert value(reg, M.ADMISSION_GROUPS_OPEN) == 3 and value(reg, M.ADMISSION_OLDEST_OPEN_VERSION) == 0

    assert len(buf.sample(2, learner_version=1)) == 2  # group a, staleness 1
    b.update(with_admission(buf, adm))
    assert value(reg, M.BUFFER_SAMPLED) == 2
    assert value(reg, M.BUFFER_CONSUMED_STALENESS + "_bucket", le="0.0") == 0
    assert value(reg, M.BUFFER_CONSUMED_STALENESS + "_bucket", le="1.0") == 2
    assert value(reg, M.BUFFER_CONSUMED_STALENESS + "_count") == 2

    assert len(buf.sample(2, learner_version=3)) == 2  # b (staleness 3) is evicted stale; c (staleness 2) comes
    b.update(with_admission(buf, adm))
    b.update(with_admission(buf, adm))  # twice: no double counting
    assert value(reg, M.BUFFER_EVICTED, reason="stale") == 2
    assert value(reg, M.ADMISSION_EVICTED) == 2
    assert value(reg, M.BUFFER_EPISODES_BY_LENGTH, stage="consumed", tokens="<32") == 4
    assert value(reg, M.BUFFER_EPISODES_BY_LENGTH, stage="evicted", tokens="<32") == 2
    assert value(reg, M.ADMISSION_GROUPS_OPEN) == 0
    assert value(reg, M.BUFFER_CONSUMED_STALENESS + "_count") == 4
    assert value(reg, M.BUFFER_CONSUMED_STALENESS + "_sum") == 2 * 1 + 2 * 2
    assert value(reg, M.BUFFER_CONSUMED_STALENESS + "_bucket", le="2.0") == 4
    assert value(reg, M.BUFFER_TRAJECTORIES) == 0
    assert value(reg, M.BUFFER_LEARNER_VERSION) == 3

    # a buffer rebuilt from nothing (a new incarnation): its totals are new increments, the histogram keeps growing
    fresh, _, _ = buffer_stats()
    fresh.incarnation, fresh.staleness_histogram = "b", {0: 1}
    b.update(fresh)
    assert value(reg, M.BUFFER_PUSHED) == 12
    assert value(reg, M.BUFFER_CONSUMED_STALENESS + "_count") == 5
    assert value(reg, M.BUFFER_CONSUMED_STALENESS + "_bucket", le="0.0") == 1


# ---------------------------------------------------------------------------------------------------- learner
def learner_stats(step: int, gae: bool = False, **over) -> LearnerStats:
    """What Learner.train_step returns under decoupled PPO without a KL term (gae adds the critic's, the KL term's
    and the optional corrections' metrics: IcePop band and floor veto)."""
    d = {"policy_loss": 0.1, "entropy": 2.0, "clip_frac": 0.05, "dual_clip_frac": 0.0, "approx_kl": 0.01,
         "iw_mean": 1.0, "iw_max": 1.8, "iw_capped_frac": 0.0, "iw_capped_seq_frac": 0.0, "behavior_kl": 0.001,
         "mismatch_kl_fresh": 1e-4, "mismatch_abs_logprob_fresh": 0.01, "mismatch_kl_stale": 0.002,
         "mismatch_abs_logprob_stale": 0.05, "seq_log_ratio_mean": -0.2, "seq_log_ratio_max": 1.5,
         "fresh_token_fraction": 0.6, "proximal_pass_skipped": 0.0, "grad_norm": 0.7,
         "lr": 1e-4, "staleness_mean": 0.5, "staleness_max": 1.0, "reward_mean": 0.25, "advantage_mean": 0.0,
         "loss_tokens": 300.0, "step_time_s": 2.0, "tokens_per_s": 250.0, "step": float(step), "version": 0.0}
    if gae:
        d.update(value_loss=0.3, critic_grad_norm=0.2, kl=0.02, vf_clip_frac=0.1, icepop_masked_frac=0.01,
                 floor_veto_frac=0.02, floor_veto_seq_frac=0.05)
    d.update(over)
    return LearnerStats.from_dict(d)


def test_learner_metrics_count_each_step_once_and_skip_uncomputed_gauges():
    reg = M.new_registry()
    lm = M.LearnerMetrics(reg)
    assert value(reg, M.LEARNER_POLICY_LOSS) is None  # nothing set yet: no misleading zeros
    lm.update(learner_stats(1))
    lm.update(learner_stats(1))  # the same step again
    lm.update(learner_stats(2, step_time_s=4.0, tokens_per_s=100.0, policy_loss=-0.2))
    assert value(reg, M.LEARNER_STEPS) == 2
    assert value(reg, M.LEARNER_STEP) == 2
    assert value(reg, M.LEARNER_POLICY_LOSS) == pytest.approx(-0.2)
    assert value(reg, M.LEARNER_STEP_SECONDS + "_count") == 2
    assert value(reg, M.LEARNER_STEP_SECONDS + "_sum") == pytest.approx(6.0)
    assert value(reg, M.LEARNER_TRAINED_TOKENS) == pytest.approx(2.0 * 250 + 4.0 * 100)
    assert value(reg, M.LEARNER_LOSS_TOKENS) == 600
    assert value(reg, M.LEARNER_IW_MAX) == pytest.approx(1.8)
    assert value(reg, M.LEARNER_BATCH_STALENESS_MAX) == 1
    assert value(reg, M.LEARNER_KL) is None  # no KL term in this config: absent, not 0
    assert value(reg, M.LEARNER_VALUE_LOSS) is None


def test_every_learner_quantity_is_declared_once_exported_and_recorded():
    """``LEARNER_METRICS`` is the one declaration: a ``LearnerStats`` field without a row fails at import (shown here
    on a copy with one field more), every row is a Prometheus metric of its kind, help and field, a step with every
    quantity set sets every one of them, and metrics.jsonl's ``learner`` record (``as_dict``) has every field."""
    rows = stats_module.LEARNER_METRICS
    stats_module.check_learner_metrics()
    grown = dataclasses.make_dataclass("GrownLearnerStats", [("new_quantity", float, 0.0)], bases=(LearnerStats,))
    with pytest.raises(TypeError, match=r"fields without a row \(declare each in LEARNER_METRICS\) \['new_quantity'\]"):
        stats_module.check_learner_metrics(grown)
    with pytest.raises(TypeError, match=r"rows without a field \['gone'\]"):
        stats_module.check_learner_metrics(rows=rows + (stats_module.LearnerMetric("gone", "x", "", "aar_learner_gone"),))

    learner_specs = {s.name: s for s in M.SPECS.values() if s.component == "learner"}
    assert sorted(learner_specs) == sorted(m.metric for m in rows)  # nothing declared elsewhere
    for m in rows:
        spec = learner_specs[m.metric]
        assert (spec.kind, spec.field, spec.help, spec.source) == (m.kind, m.field, m.help, LearnerStats), m
        assert m.meaning and m.unit in ("", "s", "tokens", "tokens/s", "nats", "versions"), m

    full = learner_stats(step=3, gae=True)
    unset = [f.name for f in dataclasses.fields(full) if getattr(full, f.name) is None]
    assert not unset, f"learner_stats() leaves {unset} unset: give them values"
    reg = M.new_registry()
    M.LearnerMetrics(reg).update(full)
    for m in rows:
        sample = m.metric + ("_count" if m.kind == M.HISTOGRAM else "")
        assert value(reg, sample) is not None, f"{m.metric} (LearnerStats.{m.field}) is not exported"
    record = full.as_dict()  # the learner entry of metrics.jsonl
    fields = {f.name for f in dataclasses.fields(full)} - {"extra", "batch"}
    assert fields <= set(record), f"not recorded in metrics.jsonl: {sorted(fields - set(record))}"


def test_unknown_learner_key_is_an_error_under_strict_keys():
    """Regression: an unknown key went silently to ``extra``, so a renamed metric became None without a word."""
    assert stats_module.strict_keys(), "tests/conftest.py turns strict keys on for the whole suite"
    with pytest.raises(stats_module.UnknownStatsKeyError, match=r"LearnerStats: unknown key\(s\) \['iw_capped_fraction'\]"):
        learner_stats(1, iw_capped_fraction=0.5)  # a renamed iw_capped_frac
    # the declared extra keys are known: they go to extra, fields to fields
    stats = learner_stats(1, gae=True)
    assert stats.extra == {"vf_clip_frac": 0.1} and stats.iw_capped_frac == 0.0
    assert stats.as_dict()["vf_clip_frac"] == 0.1


def test_unknown_learner_key_outside_tests_is_warned_of_once_and_dropped(monkeypatch, caplog):
    monkeypatch.delenv(stats_module.STRICT_KEYS_ENV)
    monkeypatch.setattr(stats_module, "_warned_keys", set())
    with caplog.at_level("WARNING", logger=stats_module.__name__):
        first = learner_stats(1, renamed_a=1.0, renamed_b=2.0)
        learner_stats(2, renamed_a=1.0)  # the same key again: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["LearnerStats: unknown key 'renamed_a' dropped (renamed metric? it is not recorded)",
                     "LearnerStats: unknown key 'renamed_b' dropped (renamed metric? it is not recorded)"]
    assert first.extra == {} and "renamed_a" not in first.as_dict()
    assert first.policy_loss == 0.1  # the known keys are kept


def test_driver_and_eval_metrics():
    reg = M.new_registry()
    d, e = M.DriverMetrics(reg), M.EvalMetrics(reg)
    pub = PublishStats(version=1, method="object_store", seconds=0.3, put_seconds=0.1, bytes=2 * 10**6,
                       num_actors=2)
    d.observe_publish(pub)
    d.observe_publish(pub)  # the same publish twice
    d.observe_publish(dataclasses.replace(pub, version=2, seconds=0.5))
    assert value(reg, M.WEIGHT_PUBLISH_SECONDS + "_count") == 2
    assert value(reg, M.WEIGHT_PUBLISH_SECONDS + "_sum") == pytest.approx(0.8)
    assert value(reg, M.DRIVER_POLICY_VERSION) == 2
    d.update(DriverStats(lost_episodes=3, actor_restarts={"1": 1}))
    d.update(DriverStats(lost_episodes=5, actor_restarts={"1": 1}))
    assert value(reg, M.DRIVER_LOST_EPISODES) == 5
    assert value(reg, M.DRIVER_ACTOR_RESTARTS, actor="1") == 1
    e.update({"all": {"n": 50, "exact_match": 0.4, "f1": 0.5}, "nq": {"n": 50, "exact_match": 0.4, "f1": 0.5}},
             split="heldout", step=20)
    assert value(reg, M.EVAL_EXACT_MATCH, split="heldout", source="all") == pytest.approx(0.4)
    assert value(reg, M.EVAL_QUESTIONS, split="heldout", source="nq") == 50
    assert value(reg, M.EVAL_STEP, split="heldout") == 20
    assert value(reg, M.EVAL_SEARCHES, split="heldout", source="all") is None


# -------------------------------------------------------------------------------------------- doc, dashboard
def test_metrics_doc_lists_every_metric_and_is_generated():
    doc = (REPO / "docs" / "METRICS.md").read_text()
    for spec in M.SPECS.values():
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{spec.name}` |")), None)
        assert row is not None, f"{spec.name} missing from docs/METRICS.md"
        assert f"| {spec.kind} |" in row
        for label in spec.labels:
            assert f"`{label}`" in row
    assert doc == M.render_markdown(), "regenerate: python -m monitoring.metrics > docs/METRICS.md"


def test_dashboard_json_is_built_from_the_script():
    assert DASHBOARD.read_text() == build_dashboard.render(), "run python monitoring/build_dashboard.py"
    assert build_dashboard.main(["--check"]) == 0


def test_committed_dashboard_decodes_through_the_sdk_types_and_round_trips():
    """The committed JSON read back through grafana-foundation-sdk's model types: every panel's options, field config
    and queries land in their typed classes (not the SDK's bags for unknown plugins), and encoding the model gives
    the same JSON (a field the schema does not know would be dropped)."""
    from grafana_foundation_sdk.cog.runtime import UnknownDataquery
    from grafana_foundation_sdk.models import dashboard as gd, prometheus as gp, stat as gs, timeseries as gt

    data = json.loads(DASHBOARD.read_text())
    model = build_dashboard.decode(data)
    assert build_dashboard.to_dict(model) == data
    assert model.schema_version == 39 and model.uid == "async-agent-rl"
    kinds = {"stat": (gs.Options, type(None)), "timeseries": (gt.Options, gt.FieldConfig)}
    panels = [p for p in model.panels if isinstance(p, gd.Panel)]
    assert [p.type_val for p in panels] == ["stat"] * 6 + ["timeseries"] * (len(panels) - 6)
    for p in panels:
        options, custom = kinds[p.type_val]
        assert isinstance(p.options, options), p.title
        assert isinstance(p.field_config.defaults.custom, custom), p.title
        assert p.targets and all(isinstance(t, gp.Dataquery) and not isinstance(t, UnknownDataquery)
                                 for t in p.targets), p.title
    assert [r.title for r in model.panels if isinstance(r, gd.RowPanel)] == [s for s, _ in build_dashboard.SECTIONS]


def test_dashboard_check_rejects_a_stale_or_unknown_field(tmp_path, capsys):
    data = json.loads(DASHBOARD.read_text())
    data["panels"][1]["targets"][0]["exprr"] = data["panels"][1]["targets"][0].pop("expr")  # a field no schema has
    bad = tmp_path / "dashboard.json"
    bad.write_text(json.dumps(data, indent=2) + "\n")
    assert build_dashboard.main(["--check", "--out", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {bad} does not round-trip through the SDK's Dashboard model (a field it does not know?)",
                   f"error: {bad} is out of date: run python monitoring/build_dashboard.py"]
    bad.write_text(DASHBOARD.read_text().replace('"max(aar_learner_step)"', '"max(aar_learner_version)"'))
    assert build_dashboard.main(["--check", "--out", str(bad)]) == 1
    assert capsys.readouterr().err.strip() == f"error: {bad} is out of date: run python monitoring/build_dashboard.py"
    bad.write_text("{")
    assert build_dashboard.main(["--check", "--out", str(bad)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {bad} cannot be read as JSON")


def test_dashboard_names_metrics_only_through_their_definitions():
    """No metric name written out in build_dashboard.py: aar_* come from monitoring.metrics (as docs/METRICS.md),
    and the retriever's families, named once there, are retriever.server's."""
    source = (REPO / "monitoring" / "build_dashboard.py").read_text()
    assert not re.findall(r"[\"']aar_", source)
    s = retriever_server
    assert (build_dashboard.RETRIEVER_REQUESTS, build_dashboard.RETRIEVER_QUERIES, build_dashboard.RETRIEVER_BATCH_QUERIES,
            build_dashboard.RETRIEVER_REQUEST_LATENCY, build_dashboard.RETRIEVER_BACKEND_LATENCY,
            build_dashboard.RETRIEVER_TOOL_LIMIT_WAITS, build_dashboard.RETRIEVER_TOOL_INFLIGHT,
            build_dashboard.RETRIEVER_SIMULATED_TIMEOUTS) == (
        s.REQUESTS, s.QUERIES, s.BATCH_QUERIES, s.REQUEST_LATENCY, s.BACKEND_LATENCY, s.TOOL_LIMIT_WAITS,
        s.TOOL_INFLIGHT, s.SIMULATED_TIMEOUTS)
    assert len(re.findall(r"[\"']retriever_", source)) == 8


def _retriever_names() -> set[str]:
    s = retriever_server
    return {s.REQUESTS + "_total", s.QUERIES + "_total", s.ERRORS + "_total", s.BATCH_QUERIES, s.REQUEST_LATENCY,
            s.BACKEND_LATENCY, s.TOOL_LIMIT_WAITS + "_total", s.TOOL_LIMIT_WAIT, s.TOOL_INFLIGHT, s.ADDED_LATENCY,
            s.SIMULATED_TIMEOUTS + "_total"}


def test_dashboard_queries_use_only_defined_metrics_and_cover_the_sections():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] == 39
    assert any(v["name"] == "DS_PROMETHEUS" and v["type"] == "datasource" for v in dash["templating"]["list"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert p["targets"] and all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"])
    known = set(M.SPECS) | _retriever_names()
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) > 40
    for q in queries:
        names = re.findall(r"\b((?:aar|retriever)_[a-z0-9_]+)", q)
        assert names, q
        for n in names:
            base = re.sub(r"_(bucket|sum|count)$", "", n)
            assert n in known or base in known, f"{q}: unknown metric {n}"
        expand_grafana_vars(q)  # no variable the checker cannot expand
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Learning", "Throughput", "Idle time", "Staleness", "Buffer", "Learner", "Reward and exact match", "Search", "Weight sync"]
    joined = "\n".join(queries)
    for needle in ("by (actor) (rate(aar_rollout_generated_tokens_total", "by (actor) (rate(aar_rollout_episodes_",
                   "histogram_quantile(0.9, sum by (le) (rate(aar_buffer_consumed_staleness_bucket",
                   "by (reason) (rate(aar_buffer_evicted_total", "aar_learner_approx_kl",
                   "aar_learner_importance_weight_mean", "aar_eval_exact_match", "retriever_request_latency_seconds",
                   "aar_weight_publish_seconds", "aar_rollout_weight_version"):
        assert needle in joined, needle


def test_expand_grafana_vars():
    assert expand_grafana_vars("rate(x[$__rate_interval])", rate_interval="15s") == "rate(x[15s])"
    assert expand_grafana_vars("rate(x[${__interval}])", interval="2s") == "rate(x[2s])"
    with pytest.raises(ValueError, match="cannot expand"):
        expand_grafana_vars('x{actor=~"$actor"}')


# ---------------------------------------------------------------------------------------- discovery and config
def test_write_sd_file_is_prometheus_file_sd_json(tmp_path):
    path = write_sd_file(tmp_path / "sd" / "targets.json",
                         {"driver": ["127.0.0.1:9001"], "rollout": ["127.0.0.1:9003", "127.0.0.1:9002"], "x": []})
    groups = json.loads(path.read_text())
    assert groups == [{"targets": ["127.0.0.1:9001"], "labels": {"job": "driver"}},
                      {"targets": ["127.0.0.1:9002", "127.0.0.1:9003"], "labels": {"job": "rollout"}}]
    write_sd_file(path, {"driver": ["127.0.0.1:9001"]})  # replaced whole, no temp file left behind
    assert json.loads(path.read_text()) == groups[:1]
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"]
    with pytest.raises(ValueError, match="host:port"):
        sd_groups({"driver": ["http://127.0.0.1:9001/metrics"]})


def test_prometheus_configs_use_file_sd():
    cfg = yaml.safe_load(prometheus_config("/some where/targets.json", "1s"))
    assert cfg["global"]["scrape_interval"] == "1s"
    (job,) = cfg["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/some where/targets.json"]
    shipped = yaml.safe_load((REPO / "monitoring" / "prometheus.yml").read_text())
    assert shipped["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["targets.json"]
    assert shipped == yaml.safe_load(prometheus_config("targets.json", "5s"))


def test_close_waits_for_a_final_scrape_only_when_prometheus_is_scraping(tmp_path):
    """The run's last values (final step) must reach a Prometheus that scrapes the exporter: close() waits for one
    more scrape after the last update; with nobody scraping it does not wait at all."""
    import threading
    import time
    import urllib.request

    from monitoring.exporter import RunMonitoring

    # nobody scrapes: close returns at once even with a long timeout
    mon = RunMonitoring.start(tmp_path / "a")
    t0 = time.monotonic()
    mon.close(final_scrape_timeout_s=30.0)
    assert time.monotonic() - t0 < 5.0

    # a scraper every 0.5 s: the value set right before close() is what the last scrape returned
    mon = RunMonitoring.start(tmp_path / "b")
    seen: list[str] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            try:
                seen.append(urllib.request.urlopen(mon.exporter.url, timeout=5).read().decode())
            except OSError:
                return  # the exporter is gone
            stop.wait(0.5)

    th = threading.Thread(target=scraper, daemon=True)
    th.start()
    while not seen:
        time.sleep(0.05)
    mon.learner.update(LearnerStats(step=7))
    mon.close(final_scrape_timeout_s=10.0)
    stop.set()
    th.join(timeout=10)
    last_step = [ln for ln in seen[-1].splitlines() if ln.startswith(M.LEARNER_STEP + " ")]
    assert last_step and float(last_step[0].split()[1]) == 7.0, seen[-1][:2000]


def test_a_failing_poll_logs_one_line_without_a_traceback(tmp_path, caplog):
    """A component restarting (a rollout actor killed, a stats call timing out) made the poll thread print a whole
    traceback on the console; the fault-injection suite forbids any. One line, with the cause; not every time."""
    import logging
    import time

    from monitoring.exporter import RunMonitoring

    calls = []

    def fails() -> None:
        calls.append(1)
        raise TimeoutError("Get timed out: some object(s) not ready.\nmore detail")

    mon = RunMonitoring.start(tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="monitoring.exporter"):
        mon.poll(fails, every_s=0.01)
        deadline = time.monotonic() + 10
        while len(calls) < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        mon.close()
    records = [r for r in caplog.records if "metrics poll failed" in r.getMessage()]
    assert [r.getMessage() for r in records][:2] == [
        "metrics poll failed (1 in a row): TimeoutError: Get timed out: some object(s) not ready.",
        "metrics poll failed (10 in a row): TimeoutError: Get timed out: some object(s) not ready."]
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in records)
