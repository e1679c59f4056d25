"""Build ``monitoring/grafana_dashboard.json`` from the readable list of sections below, with Grafana's own typed
builders (``grafana-foundation-sdk``, pinned in the ``dev`` extra to the release for Grafana 10.4, dashboard schema 39).

    python monitoring/build_dashboard.py            # rewrite the JSON
    python monitoring/build_dashboard.py --check    # exit 1 if the committed JSON is out of date or not a dashboard

Each panel is (title, unit, [(PromQL, legend), ...]). Metric names are the constants of ``monitoring.metrics`` (the
definitions ``docs/METRICS.md`` is generated from), never written out here; the retrieval server's ``retriever_*``
families are named once below (``tests/unit/test_metrics.py`` checks them against ``retriever.server``). Queries use
Grafana's ``$__rate_interval``; the datasource is the dashboard variable ``DS_PROMETHEUS`` (pick the Prometheus that
scrapes the run, on import or in the variable bar). Every query must return data for a real run:
``monitoring.prom.check_dashboard`` runs them all through a real Prometheus. So the dashboard only queries what the
default configuration computes: reference-policy KL (``LEARNER_KL``, only with ``algorithm.kl_coef > 0``), the
critic's metrics (``gae``) and the optional corrections' fractions (``algorithm.icepop_band``,
``algorithm.behavior_weight_floor``) have no panel.

``--check`` also decodes the committed JSON through the SDK's model types (``Dashboard.from_json``, every panel's
options, field config and Prometheus queries through their registered plugin types) and requires it to encode back
to the same JSON: a field the schema does not know would be dropped on the way and fail the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import prometheus as prometheus_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_m
from grafana_foundation_sdk.models import prometheus as prometheus_m

from monitoring import metrics as M

OUT = Path(__file__).with_name("grafana_dashboard.json")
SCHEMA_VERSION = 39  # Grafana 10.4's dashboard schema (the SDK's model defaults to 36)
DS = dashboard_m.DataSourceRef(type_val="prometheus", uid="${DS_PROMETHEUS}")
RI = "[$__rate_interval]"

# The retrieval server's families (retriever/server.py defines them; monitoring does not import the retriever layer):
# counters without their ``_total``, histograms by family name, as there.
RETRIEVER_REQUESTS = "retriever_requests"
RETRIEVER_QUERIES = "retriever_queries"
RETRIEVER_BATCH_QUERIES = "retriever_batch_queries"
RETRIEVER_REQUEST_LATENCY = "retriever_request_latency_seconds"
RETRIEVER_BACKEND_LATENCY = "retriever_backend_latency_seconds"
RETRIEVER_TOOL_LIMIT_WAITS = "retriever_tool_limit_waits"
RETRIEVER_TOOL_INFLIGHT = "retriever_tool_inflight"
RETRIEVER_SIMULATED_TIMEOUTS = "retriever_simulated_timeouts"


def total(counter: str) -> str:
    """A retriever counter's sample name (``monitoring.metrics`` constants already end in ``_total``)."""
    return counter + "_total"


def sel(metric: str, **labels: str) -> str:
    """``metric{label="value",...}``."""
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def agg(fn: str, metric: str, by: str = "") -> str:
    """``fn(metric)`` or ``fn by (by) (metric)``."""
    return f"{fn} by ({by}) ({metric})" if by else f"{fn}({metric})"


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


def share_by(counter: str, label: str, stage: str) -> str:
    """Each ``label`` value's share of the stage's total of a labelled counter."""
    s = sel(counter, stage=stage)
    return f"sum by ({label}) ({s}) / ignoring({label}) group_left sum({s})"


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator} / {denominator}"


Panel = tuple[str, str, list[tuple[str, str]]]  # (title, unit, [(expr, legend)])

BUFFER_FILL = ratio(agg("sum", M.BUFFER_TRAJECTORIES), agg("sum", M.BUFFER_CAPACITY_TRAJECTORIES))

SECTIONS: list[tuple[str, list[Panel]]] = [
    ("Learning", [
        ("Held-out exact match (greedy)", "percentunit", [
            (sel(M.EVAL_EXACT_MATCH, split="heldout"), "{{source}}"),
        ]),
        ("Rollout exact match by question kind", "percentunit", [
            (M.LEARNING_EXACT_MATCH_BY_KIND, "{{kind}}"),
        ]),
        ("Groups with equal rewards (no signal)", "percentunit", [
            (M.LEARNING_ZERO_VARIANCE_SHARE, "share of completed groups"),
        ]),
        ("Policy entropy (nats/token)", "short", [
            (M.LEARNER_ENTROPY, "entropy"),
        ]),
        ("Searches per episode by question kind", "short", [
            (M.LEARNING_SEARCHES_BY_KIND, "{{kind}}"),
        ]),
        ("Rollout reward by question kind", "short", [
            (M.LEARNING_REWARD_BY_KIND, "{{kind}}"),
        ]),
    ]),
    ("Throughput", [
        ("Generated tokens/s", "short", [
            (rate(M.ROLLOUT_GENERATED_TOKENS), "all actors"),
            (rate(M.ROLLOUT_GENERATED_TOKENS, "actor"), "actor {{actor}}"),
        ]),
        ("Episodes/s", "short", [
            (rate(M.ROLLOUT_EPISODES_FINISHED), "finished, all actors"),
            (rate(M.ROLLOUT_EPISODES_FINISHED, "actor"), "finished, actor {{actor}}"),
            (rate(M.ROLLOUT_EPISODES_FAILED), "failed (lost)"),
        ]),
        ("Learner throughput", "short", [
            (rate(M.LEARNER_TRAINED_TOKENS), "trained tokens/s"),
            (rate(M.BUFFER_SAMPLED), "trained trajectories/s"),
            (M.LEARNER_TOKENS_PER_SECOND, "tokens/s within a step"),
        ]),
        ("Running episodes", "short", [
            (agg("sum", M.ROLLOUT_RUNNING_EPISODES), "all actors"),
            (M.ROLLOUT_RUNNING_EPISODES, "actor {{actor}}"),
            (M.ADMISSION_RUNNING, "admitted, not yet ended"),
        ]),
        ("Observation tokens and pushes", "short", [
            (rate(M.ROLLOUT_OBSERVATION_TOKENS), "observation tokens/s"),
            (rate(M.ROLLOUT_TRAJECTORIES_PUSHED, "actor"), "trajectories pushed/s, actor {{actor}}"),
        ]),
        ("Episode endings/s", "short", [
            (rate(M.ROLLOUT_FINISH_REASONS, "reason"), "{{reason}}"),
        ]),
    ]),
    ("Idle time", [
        ("Learner waiting for a batch (share of step wall time)", "percentunit", [
            (M.IDLE_LEARNER_BATCH_WAIT_SHARE, "latest step"),
        ]),
        ("Engine idle (no request in flight)", "percentunit", [
            (M.IDLE_ROLLOUT_ENGINE_IDLE_SHARE, "all actors, since the previous step"),
            (rate(M.ROLLOUT_ENGINE_IDLE_SECONDS, "actor"), "actor {{actor}}"),
        ]),
        ("Episode time waiting for the search tool", "percentunit", [
            (M.IDLE_ROLLOUT_TOOL_WAIT_SHARE, "all actors, since the previous step"),
            (ratio(rate(M.ROLLOUT_TOOL_WAIT_SECONDS), rate(M.ROLLOUT_EPISODE_SECONDS)), "all actors"),
        ]),
    ]),
    ("Staleness", [
        ("Staleness of consumed trajectories", "short", [
            (quantile(0.5, M.BUFFER_CONSUMED_STALENESS), "p50"),
            (quantile(0.9, M.BUFFER_CONSUMED_STALENESS), "p90"),
            (quantile(0.99, M.BUFFER_CONSUMED_STALENESS), "p99"),
            (mean_of(M.BUFFER_CONSUMED_STALENESS), "mean"),
        ]),
        ("Batch staleness (learner)", "short", [
            (M.LEARNER_BATCH_STALENESS_MAX, "max"),
            (M.LEARNER_BATCH_STALENESS_MEAN, "mean"),
        ]),
        ("Consumed trajectories by staleness (cumulative)", "short", [
            (agg("sum", M.BUFFER_CONSUMED_STALENESS + "_bucket", "le"), "staleness <= {{le}}"),
        ]),
        ("Evictions/s by reason", "short", [
            (rate(M.BUFFER_EVICTED, "reason"), "{{reason}}"),
            (rate(M.ADMISSION_REJECTED), "admitted episodes not accepted"),
        ]),
        ("Length bias: episodes by response tokens (share of stage)", "percentunit", [
            (share_by(M.BUFFER_EPISODES_BY_LENGTH, "tokens", "generated"), "generated {{tokens}}"),
            (share_by(M.BUFFER_EPISODES_BY_LENGTH, "tokens", "consumed"), "trained on {{tokens}}"),
        ]),
        ("Length bias: episodes by turns (share of stage)", "percentunit", [
            (share_by(M.BUFFER_EPISODES_BY_TURNS, "turns", "generated"), "generated {{turns}} turns"),
            (share_by(M.BUFFER_EPISODES_BY_TURNS, "turns", "consumed"), "trained on {{turns}} turns"),
        ]),
        ("Pacing: oldest open group", "short", [
            (f"{M.BUFFER_LEARNER_VERSION} - {M.ADMISSION_OLDEST_OPEN_VERSION}", "learner version - oldest open"),
            (M.ADMISSION_GROUPS_OPEN, "open groups"),
        ]),
    ]),
    ("Buffer", [
        ("Buffer fill", "percentunit", [
            (BUFFER_FILL, "trajectories"),
            (ratio(agg("sum", M.BUFFER_TOKENS), agg("sum", M.BUFFER_CAPACITY_TOKENS)), "tokens"),
        ]),
        ("Groups", "short", [
            (M.BUFFER_PENDING_GROUPS, "pending"),
            (M.BUFFER_READY_GROUPS, "ready"),
        ]),
        ("Oldest item age", "s", [
            (M.BUFFER_OLDEST_AGE, "oldest"),
        ]),
        ("Push and sample/s", "short", [
            (rate(M.BUFFER_PUSHED), "pushed"),
            (rate(M.BUFFER_SAMPLED), "sampled"),
            (rate(M.BUFFER_PUSH_REFUSED), "refused (full, pushed again)"),
        ]),
    ]),
    ("Learner", [
        ("Step time", "s", [
            (quantile(0.5, M.LEARNER_STEP_SECONDS), "p50"),
            (quantile(0.95, M.LEARNER_STEP_SECONDS), "p95"),
            (lifetime_mean(M.LEARNER_STEP_SECONDS), "mean since start"),
        ]),
        ("Loss", "short", [
            (M.LEARNER_POLICY_LOSS, "policy loss"),
            (M.LEARNER_ENTROPY, "entropy"),
        ]),
        ("KL", "short", [
            (M.LEARNER_APPROX_KL, "KL(anchor || live), the update"),
            (M.LEARNER_BEHAVIOR_KL, "KL(behavior || proximal), off-policyness"),
        ]),
        ("Importance weights", "short", [
            (M.LEARNER_IW_MEAN, "mean"),
            (M.LEARNER_IW_MAX, "max"),
            (M.LEARNER_IW_CAPPED_FRACTION, "capped fraction (tokens)"),
            (M.LEARNER_IW_CAPPED_SEQUENCE_FRACTION, "capped fraction (sequences)"),
            (M.LEARNER_CLIP_FRACTION, "PPO clip fraction"),
        ]),
        ("Engine/trainer mismatch (fresh tokens) vs staleness (stale)", "short", [
            (M.LEARNER_MISMATCH_KL_FRESH, "KL(behavior || proximal), fresh: mismatch alone"),
            (M.LEARNER_MISMATCH_KL_STALE, "KL(behavior || proximal), stale: staleness + mismatch"),
            (M.LEARNER_MISMATCH_ABS_LOGPROB_FRESH, "mean |log-prob diff|, fresh"),
            (M.LEARNER_MISMATCH_ABS_LOGPROB_STALE, "mean |log-prob diff|, stale"),
            (M.LEARNER_FRESH_TOKEN_FRACTION, "fresh share of sampled tokens"),
        ]),
        ("Sequence log importance ratio (product drift)", "short", [
            (M.LEARNER_SEQ_LOG_RATIO_MEAN, "mean over sequences"),
            (M.LEARNER_SEQ_LOG_RATIO_MAX, "largest |log ratio|"),
        ]),
        ("Gradient norm and learning rate", "short", [
            (M.LEARNER_GRAD_NORM, "grad norm"),
            (M.LEARNER_LR, "lr"),
        ]),
        ("Learner step", "short", [
            (M.LEARNER_STEP, "step"),
            (M.LEARNER_VERSION, "policy version"),
        ]),
    ]),
    ("Reward and exact match", [
        ("Reward (train)", "short", [
            (agg("avg", M.ROLLOUT_REWARD_MEAN), "episodes, all actors"),
            (M.ROLLOUT_REWARD_MEAN, "episodes, actor {{actor}}"),
            (M.LEARNER_BATCH_REWARD_MEAN, "trained batch"),
        ]),
        ("Exact match", "percentunit", [
            (agg("avg", M.ROLLOUT_EXACT_MATCH_MEAN), "train episodes"),
            (sel(M.EVAL_EXACT_MATCH, source="all"), "{{split}} (greedy)"),
        ]),
        ("Held-out F1 and searches", "short", [
            (sel(M.EVAL_F1, source="all"), "F1, {{split}}"),
            (sel(M.EVAL_SEARCHES, source="all"), "searches/question, {{split}}"),
        ]),
    ]),
    ("Search", [
        ("Search latency (retriever)", "s", [
            (quantile(0.5, RETRIEVER_REQUEST_LATENCY), "request p50"),
            (quantile(0.95, RETRIEVER_REQUEST_LATENCY), "request p95"),
            (quantile(0.99, RETRIEVER_REQUEST_LATENCY), "request p99"),
            (quantile(0.95, RETRIEVER_BACKEND_LATENCY), "backend call p95"),
        ]),
        ("Search load", "short", [
            (rate(total(RETRIEVER_QUERIES)), "queries/s (server)"),
            (mean_of(RETRIEVER_BATCH_QUERIES), "queries per backend call"),
            (ratio(rate(M.ROLLOUT_SEARCHES), rate(M.ROLLOUT_EPISODES_FINISHED)), "searches per episode"),
        ]),
        ("Search errors/s", "short", [
            (rate(M.SEARCH_ERRORS, "kind"), "client attempt errors: {{kind}}"),
            (rate(M.SEARCH_FAILURES), "client calls failed (error observation)"),
            (rate(M.SEARCH_RETRIES), "client retries"),
            (rate(total(RETRIEVER_REQUESTS), "code"), "server replies: HTTP {{code}}"),
        ]),
        ("Slow tools: limits and latency model (retriever)", "short", [
            (agg("sum", RETRIEVER_TOOL_INFLIGHT), "queries in flight to the tool"),
            (rate(total(RETRIEVER_TOOL_LIMIT_WAITS)), "queries/s that waited at retriever.tool_limits"),
            (rate(total(RETRIEVER_SIMULATED_TIMEOUTS)), "calls/s the latency model made hang"),
        ]),
    ]),
    ("Weight sync", [
        ("Publish seconds", "s", [
            (quantile(0.5, M.WEIGHT_PUBLISH_SECONDS), "p50"),
            (quantile(0.95, M.WEIGHT_PUBLISH_SECONDS), "p95"),
            (lifetime_mean(M.WEIGHT_PUBLISH_SECONDS), "mean since start"),
        ]),
        ("Engine reload seconds per actor", "s", [
            (lifetime_mean(M.ROLLOUT_WEIGHT_UPDATE_SECONDS, "actor"), "reload, actor {{actor}}"),
            (lifetime_mean(M.ROLLOUT_WEIGHT_UPDATE_PAUSE_SECONDS, "actor"), "generation paused, actor {{actor}}"),
        ]),
        ("Policy version per actor", "short", [
            (M.DRIVER_POLICY_VERSION, "published"),
            (M.ROLLOUT_WEIGHT_VERSION, "actor {{actor}}"),
        ]),
    ]),
]

OVERVIEW: list[tuple[str, str, str]] = [  # (title, unit, expr): stat panels on top
    ("Learner step", "short", agg("max", M.LEARNER_STEP)),
    ("Policy version", "short", agg("max", M.DRIVER_POLICY_VERSION)),
    ("Episodes/s", "short", rate(M.ROLLOUT_EPISODES_FINISHED)),
    ("Generated tokens/s", "short", rate(M.ROLLOUT_GENERATED_TOKENS)),
    ("Buffer fill", "percentunit", BUFFER_FILL),
    ("Held-out exact match", "percentunit", agg("max", sel(M.EVAL_EXACT_MATCH, source="all"))),
]

STAT_HEIGHT, STAT_WIDTH = 4, 24 // len(OVERVIEW)
PANEL_HEIGHT, PANEL_WIDTH = 8, 8  # three time series a line


def _query(expr: str, legend: str, ref: int) -> prometheus_b.Dataquery:
    return (prometheus_b.Dataquery().datasource(DS).editor_mode(prometheus_m.QueryEditorMode.CODE).expr(expr)
            .legend_format(legend).range().ref_id(chr(ord("A") + ref)))


def _stat(panel_id: int, title: str, unit: str, expr: str) -> stat_b.Panel:
    return (stat_b.Panel().id(panel_id).title(title).datasource(DS).height(STAT_HEIGHT).span(STAT_WIDTH)
            .unit(unit).decimals(2).overrides([])
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
            .color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.AREA)
            .text_mode(common.BigValueTextMode.AUTO).orientation(common.VizOrientation.AUTO)
            .with_target(_query(expr, title, 0)))


def _timeseries(panel_id: int, title: str, unit: str, exprs: list[tuple[str, str]]) -> timeseries_b.Panel:
    panel = (timeseries_b.Panel().id(panel_id).title(title).datasource(DS).height(PANEL_HEIGHT).span(PANEL_WIDTH)
             .unit(unit).overrides([])
             .draw_style(common.GraphDrawStyle.LINE).line_width(1).fill_opacity(0)
             .show_points(common.VisibilityMode.NEVER).span_nulls(True)
             .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.NONE)))
    for k, (expr, legend) in enumerate(exprs):
        panel = panel.with_target(_query(expr, legend, k))
    return panel


def build() -> dashboard_m.Dashboard:
    """The dashboard as the SDK's typed model (the builders lay the panels out on Grafana's 24-column grid)."""
    ids = iter(range(1, 1000))
    dash = (dashboard_b.Dashboard("async_agent_rl").uid("async-agent-rl")
            .description("async_agent_rl: throughput, idle time, staleness, buffer, learner, reward, search, "
                         "weight sync. Metric reference: docs/METRICS.md.")
            .tags(["async_agent_rl", "rl"]).editable().tooltip(dashboard_m.DashboardCursorSync.CROSSHAIR)
            .time("now-30m", "now").timezone("").week_start("").refresh("10s").fiscal_year_start_month(0)
            .version(1).links([])
            .annotation(dashboard_b.AnnotationQuery().built_in(1).name("Annotations & Alerts").type("dashboard")
                        .datasource(dashboard_m.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
                        .enable(True).hide(True).icon_color("rgba(0, 211, 255, 1)"))
            .with_variable(dashboard_b.DatasourceVariable("DS_PROMETHEUS").label("Prometheus").type("prometheus")
                           .hide(dashboard_m.VariableHide.DONT_HIDE).multi(False).include_all(False).regex("")))
    for title, unit, expr in OVERVIEW:
        dash = dash.with_panel(_stat(next(ids), title, unit, expr))
    for section, items in SECTIONS:
        dash = dash.with_row(dashboard_b.Row(section).id(next(ids)).collapsed(False))
        for title, unit, exprs in items:
            dash = dash.with_panel(_timeseries(next(ids), title, unit, exprs))
    model = dash.build()
    model.schema_version = SCHEMA_VERSION
    return model


def to_dict(model: dashboard_m.Dashboard) -> dict[str, Any]:
    """The model as plain JSON data, through the SDK's encoder."""
    return json.loads(json.dumps(model, cls=JSONEncoder))


def decode(data: dict[str, Any]) -> dashboard_m.Dashboard:
    """A dashboard's JSON data through the SDK's model types: panel options and field config by panel type, queries
    by datasource type (the default plugins registered first)."""
    plugins.register_default_plugins()
    return dashboard_m.Dashboard.from_json(data)


def render() -> str:
    return json.dumps(to_dict(build()), indent=2) + "\n"


def problems(path: Path) -> list[str]:
    """Why the JSON at ``path`` is not what this script builds, or not a dashboard the SDK decodes and encodes back
    unchanged (empty when it is current)."""
    try:
        text = path.read_text()
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"{path} cannot be read as JSON: {e}"]
    found = []
    try:
        if to_dict(decode(data)) != data:
            found.append(f"{path} does not round-trip through the SDK's Dashboard model (a field it does not know?)")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        found.append(f"{path} is not a dashboard the SDK decodes: {type(e).__name__}: {e}")
    if text != render():
        found.append(f"{path} is out of date: run python monitoring/build_dashboard.py")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the JSON differs from what this builds or does not round-trip through the SDK")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.check:
        found = problems(args.out)
        for line in found:
            print(f"error: {line}", file=sys.stderr)
        return 1 if found else 0
    text = render()
    try:
        args.out.write_text(text)
    except OSError as e:
        print(f"error: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    n = sum(len(p.targets or []) for p in build().panels if isinstance(p, dashboard_m.Panel))
    print(f"wrote {args.out} ({n} queries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
