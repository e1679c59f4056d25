"""The exporter over real loopback HTTP, and a real Prometheus (the Debian binary, started here on 127.0.0.1)
finding it through file-based discovery and answering queries; the dashboard's PromQL run through it.

Needs the ``prometheus`` binary: ``scripts/install_prometheus.sh`` (apt-get, as root) installs it; the test set-up
is meant to run that script before the tests. Without it the Prometheus tests skip, saying so; the exporter test
always runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from actors.rollout_worker import WorkerStats
from actors.search_client import SearchClient
from async_agent_rl.config import BufferConfig, MonitoringConfig, RetrieverConfig, SearchClientConfig
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from async_agent_rl.staleness import AdmissionState
from async_agent_rl.stats import LearnerStats, PublishStats, RolloutStats, WeightUpdate, idle_stats
from buffer.replay_buffer import ReplayBuffer
from driver.console import LearningSignals
from monitoring import metrics as M
from monitoring.exporter import RunMonitoring, start_exporter, write_sd_file
from async_agent_rl.search import Hit
from retriever.server import start_server_in_thread
from tests.helpers import LONGEST
from monitoring.prom import (
    DASHBOARD, PromQLError, check_dashboard, prometheus_binary, query, start_prometheus, targets, values, wait_for,
    write_config,
)

pytestmark = pytest.mark.integration

needs_prometheus = pytest.mark.skipif(
    prometheus_binary() is None,
    reason="no `prometheus` binary on PATH: install it with scripts/install_prometheus.sh (apt-get, as root)",
)


def fetch(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as r:
        assert r.status == 200
        return r.read().decode()


def test_exporter_serves_its_registry_over_loopback_http():
    reg = M.new_registry()
    learner = M.LearnerMetrics(reg)
    learner.update(LearnerStats(step=3, policy_loss=0.25, step_time_s=1.5, tokens_per_s=10.0))
    with start_exporter(reg) as exp:
        assert exp.host == "127.0.0.1" and exp.port > 0 and exp.target == f"127.0.0.1:{exp.port}"
        text = fetch(exp.url)
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
        assert samples[M.LEARNER_STEP] == 3.0
        assert samples[M.LEARNER_POLICY_LOSS] == 0.25
        assert samples[M.LEARNER_STEPS] == 1.0
        learner.update(LearnerStats(step=4, policy_loss=0.5))
        assert f"{M.LEARNER_POLICY_LOSS} 0.5" in fetch(exp.url)  # served live, not a snapshot
        url = exp.url
    with pytest.raises(urllib.error.URLError):  # closed: the port is free again
        fetch(url)
    with pytest.raises(ValueError, match="loopback"):
        start_exporter(reg, host="0.0.0.0")


def test_run_monitoring_from_config_polls_and_serves(tmp_path):
    assert RunMonitoring.from_config(MonitoringConfig(enabled=False), tmp_path) is None
    sd = tmp_path / "elsewhere" / "sd.json"
    calls = []
    with RunMonitoring.from_config(MonitoringConfig(prometheus_sd_file=str(sd)), tmp_path / "run") as mon:
        assert mon.config_file == tmp_path / "run" / "prometheus" / "prometheus.yml"
        cfg = yaml.safe_load(mon.config_file.read_text())
        assert cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(sd.resolve())]
        assert json.loads(sd.read_text()) == [{"targets": [mon.exporter.target], "labels": {"job": "driver"}}]

        def fetch_stats():
            calls.append(len(calls))
            if len(calls) == 2:
                raise RuntimeError("an actor is restarting")  # logged; polling goes on
            mon.observe(rollout=[RolloutStats(index=0, incarnation="a", finished=2 * len(calls))])

        mon.poll(fetch_stats, every_s=0.05)
        deadline = time.monotonic() + 10
        while len(calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(calls) >= 4
        text = fetch(mon.exporter.url)
        assert f'{M.ROLLOUT_EPISODES_FINISHED}{{actor="0"}}' in text
    n = len(calls)
    time.sleep(0.2)
    assert len(calls) == n  # close() stopped the polling
    with pytest.raises(ValueError, match="loopback"):
        RunMonitoring.from_config(MonitoringConfig(host="0.0.0.0"), tmp_path / "x")


def test_an_exporter_whose_thread_died_serves_again_and_discovery_follows(tmp_path):
    """The exporter is a thread in the driver: if it dies (here its server is shut down under it, as an exception
    in its loop would), the next step's ``heal()`` serves the same registry again and rewrites the discovery file;
    the run goes on. Before, its metrics stopped for the rest of the run with no line anywhere."""
    with RunMonitoring.start(tmp_path / "prometheus") as mon:
        mon.observe(learner=LearnerStats(step=7, policy_loss=0.5))
        assert mon.heal() is None  # serving: nothing to do
        old = mon.exporter
        old._server.shutdown()  # the server loop ends: the thread dies, the registry stays
        old._thread.join(5)
        assert not old.serving
        line = mon.heal()
        assert line is not None and "stopped serving" in line and mon.exporter_restarts == 1, line
        assert mon.exporter is not old and mon.exporter.serving
        text = fetch(mon.exporter.url)
        assert f"{M.LEARNER_STEP} 7.0" in text  # the same registry, every value kept
        sd = json.loads((tmp_path / "prometheus" / "targets.json").read_text())
        assert sd == [{"targets": [mon.exporter.target], "labels": {"job": "driver"}}]
        assert mon.heal() is None
    assert not mon.exporter.serving  # closed with the run: not healed back


@pytest.fixture()
def prom(tmp_path):
    sd = tmp_path / "targets.json"
    write_sd_file(sd, {})
    p = start_prometheus(write_config(tmp_path, sd, "1s"), tmp_path / "data")
    p.sd_file = sd
    yield p
    p.stop()
    assert p.proc.poll() is not None


@needs_prometheus
def test_prometheus_scrapes_an_exporter_found_through_file_sd(prom):
    reg = M.new_registry()
    learner = M.LearnerMetrics(reg)
    learner.update(LearnerStats(step=7, policy_loss=0.125))
    with start_exporter(reg) as exp:
        write_sd_file(prom.sd_file, {"learner": [exp.target]})
        got = wait_for(prom.url, f'{M.LEARNER_STEP}{{job="learner"}}', timeout_s=30)
        assert values(got) == [7.0]
        assert got[0]["metric"]["instance"] == exp.target
        learner.update(LearnerStats(step=8))
        wait_for(prom.url, M.LEARNER_STEP, lambda r: values(r) == [8.0], timeout_s=15)
        assert values(query(prom.url, M.LEARNER_POLICY_LOSS)) == [0.125]

        # a second component appears: rewriting the discovery file is enough
        reg2 = M.new_registry()
        M.DriverMetrics(reg2).set_version(5)
        with start_exporter(reg2) as exp2:
            write_sd_file(prom.sd_file, {"learner": [exp.target], "driver": [exp2.target]})
            got = wait_for(prom.url, f'{M.DRIVER_POLICY_VERSION}{{job="driver"}}', timeout_s=30)
            assert values(got) == [5.0]
            health = {t["labels"]["job"]: t["health"] for t in targets(prom.url)}
            assert health == {"learner": "up", "driver": "up"}
    with pytest.raises(PromQLError) as e:
        query(prom.url, "sum(rate(")
    assert e.value.status == 400


def trajectory(gid: str, member: int, version: int, n: int = 6) -> bytes:
    return Trajectory(prompt_ids=[1, 2, 3], response_ids=[5] * n, loss_mask=[1] * n, behavior_logprobs=[-0.5] * n,
                      versions=[version] * n, turns=[TurnSpan("model", 0, n)], reward=float(member % 2),
                      meta=EpisodeMeta(group_id=gid, trajectory_id=f"{gid}/{member}")).encode()


def finished_episode(tick: int, worker: int, member: int) -> Trajectory:
    """One finished episode: half single-hop, half bridge; one search per hop; right on odd members."""
    kind = ("single_hop", "bridge")[member % 2]
    right = float(member % 2 == 1 or tick % 3 == 0)
    n = 30 + 2 * worker
    return Trajectory(prompt_ids=[1, 2, 3], response_ids=[5] * n, loss_mask=[1] * 20 + [0] * (n - 20),
                      behavior_logprobs=[-0.5] * n, versions=[0] * n, turns=[TurnSpan("model", 0, n)], reward=right,
                      reward_components={"exact_match": right},
                      meta=EpisodeMeta(group_id=f"g{tick}", data_source=kind, num_searches=1 + member % 2,
                                       finish_reason="answer"))


class KeywordBackend:
    """A small search backend for the real retrieval server (BM25 would spend ~10 s compiling its kernels on
    these cores; the server's metrics, which this test is about, are the same for any backend)."""

    name = "keyword"
    passages = [(str(i), f'"Title {i}"\nText about passage {i} and its subject {i % 3}.') for i in range(30)]

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        out = []
        for q in queries:
            words = set(q.lower().split())
            scored = [(len(words & set(c.lower().split())), pid, c) for pid, c in self.passages]
            scored.sort(key=lambda x: (-x[0], x[1]))
            out.append([Hit(pid, c, float(n)) for n, pid, c in scored[:topk]])
        return out


async def simulated_run(mon: RunMonitoring, search_url: str, seconds: float) -> None:
    """The driver's monitoring loop over real components driven by hand: two workers' stats (real WorkerStats,
    a real SearchClient against the real retriever), a real ReplayBuffer with admission, learner step dicts,
    publishes and a held-out evaluation. Bounded: ``seconds`` of 0.25 s ticks."""
    u = mon.updaters
    workers = {i: WorkerStats() for i in (0, 1)}
    adm = AdmissionState(max_staleness=2, batch_size=4, max_concurrent=64, granule=2)
    buf = ReplayBuffer(BufferConfig(max_staleness=2, capacity_trajectories=64), 2, max_trajectory_tokens=LONGEST,
                       on_evict=lambda n, gid: adm.on_evicted(gid, n), on_consume=adm.on_consumed)
    u["eval"].update({"all": {"n": 20, "exact_match": 0.1, "f1": 0.2, "searches_per_question": 1.0,
                              "turns_per_question": 2.0}}, split="heldout", step=0)
    version = 0
    signals = LearningSignals()
    previous: dict[int, RolloutStats] = {}  # each worker's stats at the last learner step (the driver's idle_stats)
    recorded_at = time.monotonic()
    async with SearchClient(search_url, SearchClientConfig(timeout_s=5.0)) as client:
        for tick in range(int(seconds / 0.25)):
            await client.search_many([f"title {tick % 7}", "text about passages"])
            rollout = []
            for i, ws in workers.items():
                ws.started += 4
                ws.groups_started += 2
                ws.pushed += 4
                for member in range(4):  # finished episodes of both question kinds, as the episode loop adds them
                    ws.add_finished(finished_episode(tick, i, member))
                rollout.append(ws.message(index=i, version=version, search=client.stats(), ready=True,
                                          weight_updates=[WeightUpdate(version, seconds=0.05, pause_seconds=0.01)],
                                          engine_idle_s=0.05 * (tick + 1), episode_s=2.0 * (tick + 1),
                                          tool_wait_s=0.1 * (tick + 1)))  # as MeteredEngine and EpisodeTimers count
            learner = publish = idle = None
            adm.try_start(2, version, f"g{tick}")
            buf.push([trajectory(f"g{tick}", 0, version), trajectory(f"g{tick}", 1, version)])
            adm.on_finished(f"g{tick}", 2, accepted=True)
            if tick % 2:
                buf.sample(4, learner_version=version + 1)
                version += 1
                learner = LearnerStats(step=version, version=version, policy_loss=0.1, entropy=1.5, approx_kl=0.01,
                                       behavior_kl=0.002, iw_mean=1.0, iw_max=1.4, iw_capped_frac=0.0,
                                       clip_frac=0.03, grad_norm=0.8, lr=1e-4, staleness_mean=0.5, staleness_max=1.0,
                                       reward_mean=0.5, advantage_mean=0.0, loss_tokens=200.0, step_time_s=0.5,
                                       tokens_per_s=800.0, iw_capped_seq_frac=0.0, mismatch_kl_fresh=1e-6,
                                       mismatch_abs_logprob_fresh=1e-3, mismatch_kl_stale=0.002,
                                       mismatch_abs_logprob_stale=0.05, seq_log_ratio_mean=0.01,
                                       seq_log_ratio_max=0.2, fresh_token_fraction=0.5)
                publish = PublishStats(version=version, method="object_store", seconds=0.08, put_seconds=0.02,
                                       bytes=10**6, num_actors=2)
                now = time.monotonic()
                idle = idle_stats(0.1, now - recorded_at, rollout, previous)
                previous, recorded_at = {r.index: r for r in rollout}, now
            buffer = dataclasses.replace(buf.stats(), admission=adm.stats())
            mon.observe(rollout=rollout, buffer=buffer, learner=learner, publish=publish, idle=idle)
            if learner:  # the driver's per-step learning signals, from the same totals
                mon.learning.update(signals.update(rollout, buffer, learner))
            await asyncio.sleep(0.25)


@needs_prometheus
def test_every_dashboard_query_returns_data_and_bad_ones_are_reported(tmp_path, request):
    """The driver's RunMonitoring folder (its prometheus.yml with the relative targets.json) scraped by a real
    Prometheus while a simulated run feeds the updaters; every dashboard query has data over the run."""
    with start_server_in_thread(KeywordBackend(), RetrieverConfig()) as server, \
            RunMonitoring.start(tmp_path / "run" / "prometheus", scrape_interval="1s") as mon:
        assert yaml.safe_load(mon.config_file.read_text())["scrape_configs"][0]["file_sd_configs"][0]["files"] == [
            "targets.json"]  # relative: resolved against the config's folder by Prometheus
        assert json.loads(mon.sd_file.read_text()) == [{"targets": [mon.exporter.target],
                                                         "labels": {"job": "driver"}}]
        mon.set_targets("retriever", [urlsplit(server.url).netloc])
        prom = start_prometheus(mon.config_file, tmp_path / "data")
        request.addfinalizer(prom.stop)
        wait_for(prom.url, 'count(up{job=~"driver|retriever"} == 1) == 2', timeout_s=30)
        t0 = time.time()
        asyncio.run(simulated_run(mon, server.url, seconds=8.0))
        time.sleep(2.5)  # two more scrapes after the last update
        end = time.time()
        failures = check_dashboard(prom.url, DASHBOARD, start=t0, end=end, step="1s", rate_interval="5s")
        assert not failures, "dashboard queries without data:\n" + "\n".join(map(str, failures))

        # the checker notices a query with a typo'd metric, bad PromQL and a NaN-only quantile
        dash = json.loads(DASHBOARD.read_text())
        panel = next(p for p in dash["panels"] if p["type"] == "timeseries")
        bad = ["sum(rate(aar_rollout_generated_token_total[$__rate_interval]))", "sum(rate(aar_learner_step[",
               "aar_learner_step * 0 / 0"]
        panel["targets"] += [{"refId": f"Z{i}", "expr": e} for i, e in enumerate(bad)]
        doctored = tmp_path / "doctored.json"
        doctored.write_text(json.dumps(dash))
        failures = check_dashboard(prom.url, doctored, start=t0, end=end, step="1s", rate_interval="5s")
        assert [f.expr for f in failures] == bad
        assert failures[0].reason == "empty result"
        assert failures[1].reason.startswith("HTTP 400")
        assert failures[2].reason == "only NaN samples"
