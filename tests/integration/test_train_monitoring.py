"""A real Prometheus (the Debian binary, started here on 127.0.0.1) scrapes a short REAL training run
(``async-agent-rl train`` as a subprocess: Ray, retriever server, buffer, DeepSpeed learner, a vLLM rollout actor),
then every query of ``monitoring/grafana_dashboard.json`` must return data over the run's time range.

Prometheus is started before the run with a 1 s scrape interval on an empty file-sd ``targets.json``; the run is
pointed at that same file (``monitoring.prometheus_sd_file``) and lists its own exporters there (the driver's and the
retrieval server's), so Prometheus picks them up as soon as they exist. The run folder is checked too: resolved
config, one metrics line per step, plots, summary, and the run's own ``prometheus/prometheus.yml``. A short SFT
warm start comes first so that the policy searches (the retriever panels need requests).

Needs the ``prometheus`` binary (``scripts/install_prometheus.sh``; ``scripts/test.sh`` runs it); skips without it.
About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from monitoring import metrics as M
from monitoring.exporter import write_sd_file
from monitoring.prom import (
    DASHBOARD, check_dashboard, dashboard_queries, prometheus_binary, query_range, start_prometheus, targets,
    write_config,
)
from tests.helpers import cli, end_tree

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 3
RUN_TIMEOUT_S = 480  # the run itself takes ~1.5-2.5 min on 2 shared cores

# Dashboard queries that cannot have data in the CPU quickstart, with the reason. Keep this empty unless a query is
# structurally impossible in this configuration (never to hide a metric the system forgot to export).
NO_DATA_IN_QUICKSTART: dict[str, str] = {}
# Metrics of quantities the quickstart's configuration never computes (gauges appear only once set), with the reason.
NOT_COMPUTED_IN_QUICKSTART: dict[str, str] = {
    M.LEARNER_KL: "algorithm.kl_coef is 0: no KL term",
    M.LEARNER_VALUE_LOSS: "advantage_estimator grpo: no critic",
    M.LEARNER_CRITIC_GRAD_NORM: "advantage_estimator grpo: no critic",
    M.LEARNER_ICEPOP_MASKED_FRACTION: "algorithm.icepop_band is null: no IcePop band",
    M.LEARNER_FLOOR_VETO_FRACTION: "algorithm.behavior_weight_floor is null: no floor veto",
    M.LEARNER_FLOOR_VETO_SEQUENCE_FRACTION: "algorithm.behavior_weight_floor is null: no floor veto",
}

needs_prometheus = pytest.mark.skipif(
    prometheus_binary() is None,
    reason="no `prometheus` binary on PATH: install it with scripts/install_prometheus.sh (apt-get, as root)",
)






def small_run_overrides(out_dir: Path, world_dir: Path, model_dir: Path) -> list[str]:
    """A 3-step run of the quickstart on the session's world and tiny model (no writes into the repo's runs/)."""
    return [
        "run.name=monitored",
        f"run.output_dir={out_dir}",
        f"model.path={model_dir}",
        # the session's tiny model is the code default, not the quickstart's model.init: use it as it is
        "model.build_if_missing=false",
        f"data.world_dir={world_dir}",
        f"data.train_files={json.dumps([str(world_dir / 'train.parquet')])}",
        f"data.test_files={json.dumps([str(world_dir / 'test.parquet')])}",
        f"data.corpus_file={world_dir / 'corpus.jsonl'}",
        f"learner.total_steps={TOTAL_STEPS}",
        "learner.batch_size=16",
        "learner.mini_batch_size=16",
        "learner.micro_batch_size=8",
        "eval.num_questions=16",
        "monitoring.log_every_s=1",
        # the proximal pass every step, so the engine/trainer mismatch panels have a value at every step (skip_fresh,
        # the default, skips it for an all-fresh batch, and a 3-step run's first batches are all fresh)
        "algorithm.proximal=recompute",
        # A short, hot warm start (8 SFT steps, ~40 s) so the policy writes <search>, which the random-init model
        # never does. Every demonstration searches (the quickstart's expert answers at once in half of them: with
        # that, a CI run once saw 0 searches in 3 steps, and 5 searches in ~50 episodes was typical).
        "sft.enabled=true",
        "sft.expert_search_prob=1.0",
        "sft.num_demos=64",
        "sft.epochs=2",
        "sft.warmup_steps=1",
        "sft.lr=1e-2",
        "sft.pretrain_steps=0",
        "buffer.group_filter_max_streak=4",  # the hot warm start rarely scores: most groups have equal rewards
    ]


def tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@needs_prometheus
def test_every_dashboard_query_has_data_from_a_real_training_run(tmp_path, request, world_dir, tiny_model_dir):
    # --- Prometheus first, on an empty discovery file that the run will fill in
    sd = tmp_path / "sd" / "targets.json"
    write_sd_file(sd, {})
    prom = start_prometheus(write_config(tmp_path / "prom", sd, "1s"), tmp_path / "prom" / "data")
    request.addfinalizer(prom.stop)

    # --- the real run, as a subprocess (its own session, so teardown can end everything it started)
    out_dir = tmp_path / "runs"
    run_dir = out_dir / "monitored"
    log_path = tmp_path / "train.log"
    cmd = [*cli(), "train", "--config", "configs/quickstart.yaml",
           *small_run_overrides(out_dir, world_dir, tiny_model_dir), f"monitoring.prometheus_sd_file={sd}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    request.addfinalizer(lambda: end_tree(proc))

    # While it runs: the run's targets must show up in Prometheus through the shared discovery file, and be up.
    seen_up: set[str] = set()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        seen_up |= {t["labels"]["job"] for t in targets(prom.url) if t["health"] == "up"}
        time.sleep(1.0)
    if proc.poll() is None:
        end_tree(proc)
        pytest.fail(f"training did not finish within {RUN_TIMEOUT_S} s; log tail:\n{tail(log_path)}")
    assert proc.returncode == 0, f"training exited with {proc.returncode}; log tail:\n{tail(log_path)}"
    time.sleep(2.5)  # the last scrapes are in; the run's exporters are gone by now
    end = time.time()
    assert {"driver", "retriever"} <= seen_up, (
        f"Prometheus never scraped the run's exporters (up: {sorted(seen_up)}); targets file "
        f"{sd.read_text() if sd.is_file() else '(missing)'}; prometheus log:\n{prom.log_tail()}")

    # --- the run folder
    assert (run_dir / "config.yaml").is_file()
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["learner"]["total_steps"] == TOTAL_STEPS
    assert resolved["monitoring"]["prometheus_sd_file"] == str(sd)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in lines] == list(range(1, TOTAL_STEPS + 1)), lines
    pngs = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert pngs and all((run_dir / "plots" / p).stat().st_size > 1000 for p in pngs), pngs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS and summary["episodes"] > 0, summary
    assert (run_dir / "prometheus" / "prometheus.yml").is_file()
    assert "file_sd_configs" in (run_dir / "prometheus" / "prometheus.yml").read_text()

    # --- what Prometheus saw matches the run: the learner gauge reached the last step
    steps = query_range(prom.url, "max(aar_learner_step)", t0, end, step="1s")
    assert steps and max(float(v) for _, v in steps[0]["values"]) == TOTAL_STEPS, steps

    # The retriever panels need searches: a random-init model never writes <search> (no request reaches the
    # retrieval server; measured: every retriever latency/batch/requests panel empty over a 3-step run), which is
    # why this run warm-starts with a short SFT on demonstrations (the sft.* overrides above).
    def peak(promql: str) -> float:
        return max((float(v) for s in query_range(prom.url, promql, t0, end, step="1s") for _, v in s["values"]),
                   default=0.0)

    searches, requests = peak("sum(aar_rollout_searches_total)"), peak("sum(retriever_requests_total)")
    print(f"searches in finished episodes: {searches:.0f}; /retrieve requests: {requests:.0f}")
    assert requests > 0, ("the policy never searched: no /retrieve request reached the retrieval server; "
                          f"log tail:\n{tail(log_path)}")

    # --- every dashboard query has data over the run
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) > 40, queries
    failures = check_dashboard(prom.url, DASHBOARD, start=t0, end=end, step="1s", rate_interval="5s")
    unexpected = [f for f in failures if f.expr not in NO_DATA_IN_QUICKSTART]
    assert not unexpected, (
        f"{len(unexpected)} of {len(queries)} dashboard queries without data over a real {TOTAL_STEPS}-step run:\n"
        + "\n".join(map(str, unexpected)))
    # an allow-listed query that does have data is stale in the list: keep it honest
    have_data = sorted(set(NO_DATA_IN_QUICKSTART) - {f.expr for f in failures})
    assert not have_data, f"remove from NO_DATA_IN_QUICKSTART, they have data now: {have_data}"

    # --- no dead metric: every metric of monitoring.metrics has a series from this real run, except the quantities
    # this configuration never computes (absent by design, never a false zero)
    def has_series(name: str) -> bool:
        return bool(query_range(prom.url, f'count({{__name__=~"{name}|{name}_count"}})', t0, end, step="1s"))

    dead = [name for name in M.SPECS if name not in NOT_COMPUTED_IN_QUICKSTART and not has_series(name)]
    assert not dead, f"metrics without a series over a real {TOTAL_STEPS}-step run: {dead}"
    fed = sorted(name for name in NOT_COMPUTED_IN_QUICKSTART if has_series(name))
    assert not fed, f"remove from NOT_COMPUTED_IN_QUICKSTART, they have series now: {fed}"
