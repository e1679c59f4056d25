"""A real Prometheus for tests and docs: start the Debian ``prometheus`` binary on loopback, query it, and check a
Grafana dashboard by running every panel's PromQL through it.

There is no Grafana server here, so a dashboard is checked the way Grafana would use it: each target's ``expr``,
with Grafana's interval variables expanded (``$__rate_interval`` and friends), is sent to ``/api/v1/query`` (one
instant) or ``/api/v1/query_range`` (a whole run). A query fails when Prometheus rejects it (HTTP 400/422: bad
PromQL) or when it returns no series, or only NaN samples (``histogram_quantile`` of a histogram that saw nothing).
Use the range form after a run: once a target is gone Prometheus marks its series stale, so an instant query
afterwards is empty even though the run exported everything::

    prom = start_prometheus(write_config(tmp, sd_file, "1s"), tmp / "data")
    ...  # the run, with its exporters listed in sd_file
    failures = check_dashboard(prom.url, "monitoring/grafana_dashboard.json", start=t0, end=time.time())
    assert not failures, "\\n".join(map(str, failures))
    prom.stop()

Only loopback URLs are queried; replies are JSON (nothing is unpickled).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from async_agent_rl.net import free_port
from monitoring.exporter import LOOPBACK, prometheus_config

BINARY = "prometheus"
DASHBOARD = Path(__file__).with_name("grafana_dashboard.json")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy: loopback only


class PromQLError(RuntimeError):
    """Prometheus rejected a query (``status`` is the HTTP code, ``message`` its error text)."""

    def __init__(self, status: int, message: str, query: str):
        super().__init__(f"HTTP {status} for {query!r}: {message}")
        self.status, self.message, self.query = status, message, query


class QueryFailure(NamedTuple):
    expr: str  # as written in the dashboard
    reason: str  # "HTTP 400: ...", "empty result", "only NaN samples"

    def __str__(self) -> str:
        return f"{self.expr}  ->  {self.reason}"


# ------------------------------------------------------------------------------------------------ the process
def prometheus_binary() -> Optional[str]:
    """The ``prometheus`` on PATH, or None (``scripts/install_prometheus.sh`` installs it)."""
    return shutil.which(BINARY)


def write_config(folder: str | os.PathLike, sd_file: str | os.PathLike, scrape_interval: str = "1s") -> Path:
    """``folder/prometheus.yml`` scraping the targets of ``sd_file`` every ``scrape_interval``."""
    path = Path(folder) / "prometheus.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prometheus_config(Path(sd_file).resolve(), scrape_interval, refresh_interval="1s"))
    return path


@dataclass
class PrometheusProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    config_path: Path
    _log: Any = field(repr=False, default=None)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` (idempotent)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "PrometheusProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_prometheus(config_path: str | os.PathLike, data_dir: str | os.PathLike, port: int = 0,
                     ready_timeout_s: float = 30.0, binary: Optional[str] = None) -> PrometheusProcess:
    """Run ``prometheus`` on ``127.0.0.1:port`` (0: a free port) with ``config_path`` and its TSDB in ``data_dir``;
    returns once ``/-/ready`` answers. The scrape interval is the config's (``write_config`` writes 1 s). The log
    goes to ``data_dir/../prometheus.log``. Raises ``FileNotFoundError`` without the binary, ``RuntimeError``
    (with the log's tail) if it exits or is not ready in time."""
    exe = binary or prometheus_binary()
    if exe is None:
        raise FileNotFoundError("no `prometheus` on PATH: run scripts/install_prometheus.sh (apt-get, as root)")
    config_path, data_dir = Path(config_path).resolve(), Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / f"prometheus-{data_dir.name}.log"
    last_error = ""
    for _attempt in range(3):  # a free port can be taken between the probe and the bind: retry a fresh one
        p = port or free_port()
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            [exe, f"--config.file={config_path}", f"--storage.tsdb.path={data_dir}",
             f"--web.listen-address={LOOPBACK}:{p}", "--storage.tsdb.retention.time=1d", "--log.level=info"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        prom = PrometheusProcess(proc, p, log_path, config_path, log)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with _OPENER.open(f"{prom.url}/-/ready", timeout=2.0) as r:
                    if r.status == 200:
                        return prom
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        last_error = prom.log_tail()
        prom.stop()
        if port or "address already in use" not in last_error:
            break
    raise RuntimeError(f"prometheus did not become ready on {LOOPBACK}; log tail:\n{last_error}")


# ----------------------------------------------------------------------------------------------------- queries
def _check_loopback(url: str) -> None:
    host = urllib.parse.urlsplit(url).hostname
    if host not in (LOOPBACK, "localhost"):
        raise ValueError(f"only loopback Prometheus URLs are queried, not {url!r}")


def _api(url: str, endpoint: str, params: dict[str, Any], timeout_s: float) -> Any:
    _check_loopback(url)
    body = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}/api/v1/{endpoint}", data=body, method="POST",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    try:
        with _OPENER.open(req, timeout=timeout_s) as r:
            payload = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", "")
        except (ValueError, AttributeError):
            message = e.reason
        raise PromQLError(e.code, str(message), str(params.get("query"))) from None
    if payload.get("status") != "success":
        raise PromQLError(200, str(payload.get("error")), str(params.get("query")))
    return payload["data"]


def query(url: str, promql: str, time: Optional[float] = None, timeout_s: float = 10.0) -> list[dict]:
    """Instant query (``/api/v1/query``): the ``result`` list (``[{"metric": {...}, "value": [t, "v"]}]`` for a
    vector; a scalar comes back as one such item). Raises :class:`PromQLError` when Prometheus rejects it."""
    data = _api(url, "query", {"query": promql, "time": time}, timeout_s)
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def query_range(url: str, promql: str, start: float, end: float, step: float | str = "5s",
                timeout_s: float = 30.0) -> list[dict]:
    """Range query (``/api/v1/query_range``): ``[{"metric": {...}, "values": [[t, "v"], ...]}]``."""
    data = _api(url, "query_range", {"query": promql, "start": start, "end": end, "step": step}, timeout_s)
    return data["result"]


def values(result: list[dict]) -> list[float]:
    """Every sample value of a ``query`` or ``query_range`` result, as floats."""
    out = []
    for series in result:
        for _, v in series.get("values") or [series["value"]]:
            out.append(float(v))
    return out


def wait_for(url: str, promql: str, ok: Callable[[list[dict]], bool] = bool, timeout_s: float = 30.0,
             poll_s: float = 0.5) -> list[dict]:
    """Poll an instant query until ``ok(result)`` (default: non-empty); the last result, or TimeoutError."""
    deadline = time.monotonic() + timeout_s
    result: list[dict] = []
    while True:
        result = query(url, promql)
        if ok(result):
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{promql!r} did not satisfy the condition within {timeout_s} s; last: {result}")
        time.sleep(poll_s)


def targets(url: str) -> list[dict]:
    """The active targets (``/api/v1/targets``): scrape URL, labels, health, last error."""
    _check_loopback(url)
    with _OPENER.open(f"{url.rstrip('/')}/api/v1/targets?state=active", timeout=10.0) as r:
        return json.loads(r.read())["data"]["activeTargets"]


# --------------------------------------------------------------------------------------------------- dashboards
def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels") or []))  # collapsed rows hold their panels
    return out


def dashboard_queries(json_path: str | os.PathLike = DASHBOARD) -> list[str]:
    """Every PromQL ``expr`` of every panel (rows included), in panel order, without duplicates, as written."""
    dash = json.loads(Path(json_path).read_text())
    dash = dash.get("dashboard", dash)  # the API's {"dashboard": ...} wrapper or the bare model
    seen: dict[str, None] = {}
    for p in _panels(dash.get("panels") or []):
        for t in p.get("targets") or []:
            expr = (t.get("expr") or "").strip()
            if expr and not t.get("hide"):
                seen.setdefault(expr, None)
    return list(seen)


_VAR = re.compile(r"\$\{?(__rate_interval|__interval|__range|__interval_ms|__range_s)\}?")


def expand_grafana_vars(expr: str, rate_interval: str = "30s", interval: str = "5s", range_: str = "5m") -> str:
    """Grafana's built-in interval variables, replaced the way Grafana would for a Prometheus query."""
    sub = {"__rate_interval": rate_interval, "__interval": interval, "__range": range_,
           "__interval_ms": str(_seconds(interval) * 1000), "__range_s": str(_seconds(range_))}
    expanded = _VAR.sub(lambda m: sub[m.group(1)], expr)
    if "$" in expanded:
        raise ValueError(f"dashboard query uses a variable this checker cannot expand: {expr!r}")
    return expanded


def _seconds(d: str) -> int:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    m = re.fullmatch(r"(\d+)(ms|s|m|h|d)", d)
    if not m:
        raise ValueError(f"not a duration: {d!r}")
    return int(int(m.group(1)) * units[m.group(2)])


def check_dashboard(prom_url: str, json_path: str | os.PathLike = DASHBOARD, *, at: Optional[float] = None,
                    start: Optional[float] = None, end: Optional[float] = None, step: float | str = "5s",
                    rate_interval: str = "30s") -> list[QueryFailure]:
    """Run every dashboard query; return those that fail (empty list: every panel has data).

    With ``start``/``end`` (unix seconds) each query runs over that range and passes if any sample of any series
    is a number (not NaN); otherwise it runs at the instant ``at`` (default now). ``rate_interval`` replaces
    ``$__rate_interval``: at least 4 scrape intervals, and short enough that a short run fills it."""
    if (start is None) != (end is None):
        raise ValueError("give both start and end, or neither")
    failures = []
    for expr in dashboard_queries(json_path):
        try:
            promql = expand_grafana_vars(expr, rate_interval=rate_interval)
        except ValueError as e:
            failures.append(QueryFailure(expr, str(e)))
            continue
        try:
            result = (query_range(prom_url, promql, start, end, step) if start is not None
                      else query(prom_url, promql, time=at))
        except PromQLError as e:
            failures.append(QueryFailure(expr, f"HTTP {e.status}: {e.message}"))
            continue
        if not result:
            failures.append(QueryFailure(expr, "empty result"))
        elif all(math.isnan(v) for v in values(result)):
            failures.append(QueryFailure(expr, "only NaN samples"))
    return failures
