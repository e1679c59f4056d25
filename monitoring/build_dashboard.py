"""Build ``monitoring/grafana_dashboard.json`` from the readable list of sections below.

    python monitoring/build_dashboard.py            # rewrite the JSON
    python monitoring/build_dashboard.py --check    # exit 1 if the committed JSON is out of date

Each panel is (title, unit, [(PromQL, legend), ...]). Queries use Grafana's ``$__rate_interval``; the datasource is
the dashboard variable ``DS_PROMETHEUS`` (pick the Prometheus that scrapes the run, on import or in the variable
bar). Every query must return data for a real run: ``monitoring.prom.check_dashboard`` runs them all through a
real Prometheus. So the dashboard only queries what the default configuration computes: reference-policy KL
(``aar_learner_kl``, only with ``algorithm.kl_coef > 0``), the critic's metrics (``gae``) and the optional
corrections' fractions (``algorithm.icepop_band``, ``algorithm.behavior_weight_floor``) have no panel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("grafana_dashboard.json")
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RI = "[$__rate_interval]"


def rate(metric: str, by: str = "") -> str:
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{RI}))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) (rate({histogram}_bucket{RI})))"


def mean_of(histogram: str, by: str = "") -> str:
    """Mean over the window: rate(sum) / rate(count)."""
    return f"{rate(histogram + '_sum', by)} / {rate(histogram + '_count', by)}"


def lifetime_mean(histogram: str, by: str = "") -> str:
    """Mean since the process started (data as soon as one event happened, however long ago)."""
    return f"sum{f' by ({by})' if by else ''} ({histogram}_sum) / sum{f' by ({by})' if by else ''} ({histogram}_count)"


Panel = tuple[str, str, list[tuple[str, str]]]  # (title, unit, [(expr, legend)])

SECTIONS: list[tuple[str, list[Panel]]] = [
    ("Learning", [
        ("Held-out exact match (greedy)", "percentunit", [
            ('aar_eval_exact_match{split="heldout"}', "{{source}}"),
        ]),
        ("Rollout exact match by question kind", "percentunit", [
            ("aar_learning_rollout_exact_match", "{{kind}}"),
        ]),
        ("Groups with equal rewards (no signal)", "percentunit", [
            ("aar_learning_zero_variance_share", "share of completed groups"),
        ]),
        ("Policy entropy (nats/token)", "short", [
            ("aar_learner_entropy", "entropy"),
        ]),
        ("Searches per episode by question kind", "short", [
            ("aar_learning_rollout_searches", "{{kind}}"),
        ]),
        ("Rollout reward by question kind", "short", [
            ("aar_learning_rollout_reward", "{{kind}}"),
        ]),
    ]),
    ("Throughput", [
        ("Generated tokens/s", "short", [
            (rate("aar_rollout_generated_tokens_total"), "all actors"),
            (rate("aar_rollout_generated_tokens_total", "actor"), "actor {{actor}}"),
        ]),
        ("Episodes/s", "short", [
            (rate("aar_rollout_episodes_finished_total"), "finished, all actors"),
            (rate("aar_rollout_episodes_finished_total", "actor"), "finished, actor {{actor}}"),
            (rate("aar_rollout_episodes_failed_total"), "failed (lost)"),
        ]),
        ("Learner throughput", "short", [
            (rate("aar_learner_trained_tokens_total"), "trained tokens/s"),
            (rate("aar_buffer_sampled_total"), "trained trajectories/s"),
            ("aar_learner_tokens_per_second", "tokens/s within a step"),
        ]),
        ("Running episodes", "short", [
            ("sum(aar_rollout_running_episodes)", "all actors"),
            ("aar_rollout_running_episodes", "actor {{actor}}"),
            ("aar_admission_running", "admitted, not yet ended"),
        ]),
        ("Observation tokens and pushes", "short", [
            (rate("aar_rollout_observation_tokens_total"), "observation tokens/s"),
            (rate("aar_rollout_trajectories_pushed_total", "actor"), "trajectories pushed/s, actor {{actor}}"),
        ]),
        ("Episode endings/s", "short", [
            (rate("aar_rollout_finish_reasons_total", "reason"), "{{reason}}"),
        ]),
    ]),
    ("Idle time", [
        ("Learner waiting for a batch (share of step wall time)", "percentunit", [
            ("aar_learner_batch_wait_share", "latest step"),
        ]),
        ("Engine idle (no request in flight)", "percentunit", [
            ("aar_rollout_engine_idle_share", "all actors, since the previous step"),
            (rate("aar_rollout_engine_idle_seconds_total", "actor"), "actor {{actor}}"),
        ]),
        ("Episode time waiting for the search tool", "percentunit", [
            ("aar_rollout_tool_wait_share", "all actors, since the previous step"),
            (f"{rate('aar_rollout_tool_wait_seconds_total')} / {rate('aar_rollout_episode_seconds_total')}",
             "all actors"),
        ]),
    ]),
    ("Staleness", [
        ("Staleness of consumed trajectories", "short", [
            (quantile(0.5, "aar_buffer_consumed_staleness"), "p50"),
            (quantile(0.9, "aar_buffer_consumed_staleness"), "p90"),
            (quantile(0.99, "aar_buffer_consumed_staleness"), "p99"),
            (mean_of("aar_buffer_consumed_staleness"), "mean"),
        ]),
        ("Batch staleness (learner)", "short", [
            ("aar_learner_batch_staleness_max", "max"),
            ("aar_learner_batch_staleness_mean", "mean"),
        ]),
        ("Consumed trajectories by staleness (cumulative)", "short", [
            ("sum by (le) (aar_buffer_consumed_staleness_bucket)", "staleness <= {{le}}"),
        ]),
        ("Evictions/s by reason", "short", [
            (rate("aar_buffer_evicted_total", "reason"), "{{reason}}"),
            (rate("aar_admission_rejected_total"), "admitted episodes not accepted"),
        ]),
        ("Length bias: episodes by response tokens (share of stage)", "percentunit", [
            ('sum by (tokens) (aar_buffer_episodes_by_length_total{stage="generated"}) / ignoring(tokens) '
             'group_left sum(aar_buffer_episodes_by_length_total{stage="generated"})', "generated {{tokens}}"),
            ('sum by (tokens) (aar_buffer_episodes_by_length_total{stage="consumed"}) / ignoring(tokens) '
             'group_left sum(aar_buffer_episodes_by_length_total{stage="consumed"})', "trained on {{tokens}}"),
        ]),
        ("Length bias: episodes by turns (share of stage)", "percentunit", [
            ('sum by (turns) (aar_buffer_episodes_by_turns_total{stage="generated"}) / ignoring(turns) '
             'group_left sum(aar_buffer_episodes_by_turns_total{stage="generated"})', "generated {{turns}} turns"),
            ('sum by (turns) (aar_buffer_episodes_by_turns_total{stage="consumed"}) / ignoring(turns) '
             'group_left sum(aar_buffer_episodes_by_turns_total{stage="consumed"})', "trained on {{turns}} turns"),
        ]),
        ("Pacing: oldest open group", "short", [
            ("aar_buffer_learner_version - aar_admission_oldest_open_version", "learner version - oldest open"),
            ("aar_admission_groups_open", "open groups"),
        ]),
    ]),
    ("Buffer", [
        ("Buffer fill", "percentunit", [
            ("sum(aar_buffer_trajectories) / sum(aar_buffer_capacity_trajectories)", "trajectories"),
            ("sum(aar_buffer_tokens) / sum(aar_buffer_capacity_tokens)", "tokens"),
        ]),
        ("Groups", "short", [
            ("aar_buffer_pending_groups", "pending"),
            ("aar_buffer_ready_groups", "ready"),
        ]),
        ("Oldest item age", "s", [
            ("aar_buffer_oldest_age_seconds", "oldest"),
        ]),
        ("Push and sample/s", "short", [
            (rate("aar_buffer_pushed_total"), "pushed"),
            (rate("aar_buffer_sampled_total"), "sampled"),
            (rate("aar_buffer_push_refused_total"), "refused (full, pushed again)"),
        ]),
    ]),
    ("Learner", [
        ("Step time", "s", [
            (quantile(0.5, "aar_learner_step_seconds"), "p50"),
            (quantile(0.95, "aar_learner_step_seconds"), "p95"),
            (lifetime_mean("aar_learner_step_seconds"), "mean since start"),
        ]),
        ("Loss", "short", [
            ("aar_learner_policy_loss", "policy loss"),
            ("aar_learner_entropy", "entropy"),
        ]),
        ("KL", "short", [
            ("aar_learner_approx_kl", "KL(anchor || live), the update"),
            ("aar_learner_behavior_kl", "KL(behavior || proximal), off-policyness"),
        ]),
        ("Importance weights", "short", [
            ("aar_learner_importance_weight_mean", "mean"),
            ("aar_learner_importance_weight_max", "max"),
            ("aar_learner_importance_weight_capped_fraction", "capped fraction (tokens)"),
            ("aar_learner_importance_weight_capped_sequence_fraction", "capped fraction (sequences)"),
            ("aar_learner_clip_fraction", "PPO clip fraction"),
        ]),
        ("Engine/trainer mismatch (fresh tokens) vs staleness (stale)", "short", [
            ("aar_learner_mismatch_kl_fresh", "KL(behavior || proximal), fresh: mismatch alone"),
            ("aar_learner_mismatch_kl_stale", "KL(behavior || proximal), stale: staleness + mismatch"),
            ("aar_learner_mismatch_abs_logprob_fresh", "mean |log-prob diff|, fresh"),
            ("aar_learner_mismatch_abs_logprob_stale", "mean |log-prob diff|, stale"),
            ("aar_learner_fresh_token_fraction", "fresh share of sampled tokens"),
        ]),
        ("Sequence log importance ratio (product drift)", "short", [
            ("aar_learner_seq_log_ratio_mean", "mean over sequences"),
            ("aar_learner_seq_log_ratio_max", "largest |log ratio|"),
        ]),
        ("Gradient norm and learning rate", "short", [
            ("aar_learner_grad_norm", "grad norm"),
            ("aar_learner_lr", "lr"),
        ]),
        ("Learner step", "short", [
            ("aar_learner_step", "step"),
            ("aar_learner_policy_version", "policy version"),
        ]),
    ]),
    ("Reward and exact match", [
        ("Reward (train)", "short", [
            ("avg(aar_rollout_episode_reward_mean)", "episodes, all actors"),
            ("aar_rollout_episode_reward_mean", "episodes, actor {{actor}}"),
            ("aar_learner_batch_reward_mean", "trained batch"),
        ]),
        ("Exact match", "percentunit", [
            ("avg(aar_rollout_episode_exact_match_mean)", "train episodes"),
            ('aar_eval_exact_match{source="all"}', "{{split}} (greedy)"),
        ]),
        ("Held-out F1 and searches", "short", [
            ('aar_eval_f1{source="all"}', "F1, {{split}}"),
            ('aar_eval_searches_per_question{source="all"}', "searches/question, {{split}}"),
        ]),
    ]),
    ("Search", [
        ("Search latency (retriever)", "s", [
            (quantile(0.5, "retriever_request_latency_seconds"), "request p50"),
            (quantile(0.95, "retriever_request_latency_seconds"), "request p95"),
            (quantile(0.99, "retriever_request_latency_seconds"), "request p99"),
            (quantile(0.95, "retriever_backend_latency_seconds"), "backend call p95"),
        ]),
        ("Search load", "short", [
            (rate("retriever_queries_total"), "queries/s (server)"),
            (mean_of("retriever_batch_queries"), "queries per backend call"),
            (f"{rate('aar_rollout_searches_total')} / {rate('aar_rollout_episodes_finished_total')}",
             "searches per episode"),
        ]),
        ("Search errors/s", "short", [
            (rate("aar_search_errors_total", "kind"), "client attempt errors: {{kind}}"),
            (rate("aar_search_failures_total"), "client calls failed (error observation)"),
            (rate("aar_search_retries_total"), "client retries"),
            (rate("retriever_requests_total", "code"), "server replies: HTTP {{code}}"),
        ]),
        ("Slow tools: limits and latency model (retriever)", "short", [
            ("sum(retriever_tool_inflight)", "queries in flight to the tool"),
            (rate("retriever_tool_limit_waits_total"), "queries/s that waited at retriever.tool_limits"),
            (rate("retriever_simulated_timeouts_total"), "calls/s the latency model made hang"),
        ]),
    ]),
    ("Weight sync", [
        ("Publish seconds", "s", [
            (quantile(0.5, "aar_weight_publish_seconds"), "p50"),
            (quantile(0.95, "aar_weight_publish_seconds"), "p95"),
            (lifetime_mean("aar_weight_publish_seconds"), "mean since start"),
        ]),
        ("Engine reload seconds per actor", "s", [
            (lifetime_mean("aar_rollout_weight_update_seconds", "actor"), "reload, actor {{actor}}"),
            (lifetime_mean("aar_rollout_weight_update_pause_seconds", "actor"), "generation paused, actor {{actor}}"),
        ]),
        ("Policy version per actor", "short", [
            ("aar_driver_policy_version", "published"),
            ("aar_rollout_weight_version", "actor {{actor}}"),
        ]),
    ]),
]

OVERVIEW: list[tuple[str, str, str]] = [  # (title, unit, expr): stat panels on top
    ("Learner step", "short", "max(aar_learner_step)"),
    ("Policy version", "short", "max(aar_driver_policy_version)"),
    ("Episodes/s", "short", rate("aar_rollout_episodes_finished_total")),
    ("Generated tokens/s", "short", rate("aar_rollout_generated_tokens_total")),
    ("Buffer fill", "percentunit", "sum(aar_buffer_trajectories) / sum(aar_buffer_capacity_trajectories)"),
    ("Held-out exact match", "percentunit", 'max(aar_eval_exact_match{source="all"})'),
]


def _target(expr: str, legend: str, ref: int) -> dict[str, Any]:
    return {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend, "range": True,
            "refId": chr(ord("A") + ref)}


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = iter(range(1, 1000))
    y = 0
    w_stat = 24 // len(OVERVIEW)
    for i, (title, unit, expr) in enumerate(OVERVIEW):
        panels.append({
            "id": next(next_id), "type": "stat", "title": title, "datasource": DS,
            "gridPos": {"h": 4, "w": w_stat, "x": i * w_stat, "y": y},
            "fieldConfig": {"defaults": {"unit": unit, "decimals": 2}, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto", "orientation": "auto"},
            "targets": [_target(expr, title, 0)],
        })
    y += 4
    for section, items in SECTIONS:
        panels.append({"id": next(next_id), "type": "row", "title": section, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        for i, (title, unit, exprs) in enumerate(items):
            panels.append({
                "id": next(next_id), "type": "timeseries", "title": title, "datasource": DS,
                "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
                "fieldConfig": {
                    "defaults": {"unit": unit, "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0,
                                                          "showPoints": "never", "spanNulls": True}},
                    "overrides": [],
                },
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "none"}},
                "targets": [_target(e, legend, k) for k, (e, legend) in enumerate(exprs)],
            })
        y += 8 * ((len(items) + 2) // 3)
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": "async_agent_rl: throughput, idle time, staleness, buffer, learner, reward, search, weight sync. "
                       "Metric reference: docs/METRICS.md.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["async_agent_rl", "rl"],
        "templating": {"list": [{
            "name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
            "regex": "", "skipUrlSync": False}]},
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "async_agent_rl",
        "uid": "async-agent-rl",
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the JSON differs from what this builds")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date: run python monitoring/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} ({sum(len(p.get('targets', [])) for p in build()['panels'])} queries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
