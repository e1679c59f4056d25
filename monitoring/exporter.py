"""Serve a registry over HTTP on loopback, and tell Prometheus where the servers are (file-based discovery).

In any process (the driver, or inside a Ray actor's ``__init__``; the server is a daemon thread, so it needs no
event loop and never blocks the actor)::

    registry = new_registry()
    rollout = RolloutMetrics(registry)
    exporter = start_exporter(registry)      # 127.0.0.1, a free port
    exporter.target                          # "127.0.0.1:PORT", for write_sd_file
    ...
    exporter.close()

The driver collects every component's target (its own, each actor's, the retrieval server's ``host:port``) and
rewrites the discovery file whenever the set changes (an actor restarted on a new port)::

    write_sd_file(run_dir / "prometheus" / "targets.json", {"driver": [exporter.target], "retriever": [...]})

Prometheus re-reads that file by itself (``file_sd_configs``); ``prometheus_config`` writes a config pointing at it,
and ``monitoring/prometheus.yml`` is the same config shipped with a relative ``targets.json``.

``RunMonitoring.start(folder)`` bundles the driver's side: one registry with every updater, its exporter, and
``folder/targets.json`` plus ``folder/prometheus.yml``. Where the metrics live is a choice: the driver can feed the
updaters from the ``stats()`` it already polls (one target; restarts of actors show as totals going down, which
the updaters handle), or an actor can hold its own registry and exporter and hand ``exporter.target`` to the
driver for ``set_targets`` (one target per process; Prometheus's ``instance`` label tells them apart).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from prometheus_client import CollectorRegistry, start_http_server

from async_agent_rl.stats import BufferStats, IdleStats, LearnerStats, PublishStats, RolloutStats

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
JOB_LABEL = "job"
DEFAULT_SCRAPE_INTERVAL = "5s"
SD_REFRESH_INTERVAL = "5s"


@dataclass
class Exporter:
    """A running ``/metrics`` server (any path answers with the registry's text format)."""

    registry: CollectorRegistry
    host: str
    port: int
    _server: object = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _scrapes: "_ScrapeCounter" = field(default=None, repr=False)

    @property
    def scrapes(self) -> int:
        """How many times the registry has been collected over HTTP (each Prometheus scrape is one)."""
        return self._scrapes.count if self._scrapes is not None else 0

    def wait_for_scrape(self, after: int, timeout_s: float) -> bool:
        """Block until the exporter has served more than ``after`` scrapes (so the values set before reading
        ``after`` are in Prometheus), or ``timeout_s`` passed. Returns whether a scrape came."""
        deadline = time.monotonic() + timeout_s
        while self.scrapes <= after:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    @property
    def serving(self) -> bool:
        """Whether the server thread is still answering (False once closed, or when its thread died)."""
        return self._server is not None and self._thread.is_alive()

    @property
    def target(self) -> str:
        """``host:port``, as a Prometheus target."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=5.0)

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ScrapeCounter:
    """A collector with no metrics that counts how often the registry is collected (one per scrape)."""

    def __init__(self) -> None:
        self.count = 0

    def collect(self):
        self.count += 1
        return iter(())

    def describe(self):
        return []  # registering must not call collect() (that would count a scrape that never happened)


def start_exporter(registry: CollectorRegistry, port: int = 0, host: str = LOOPBACK) -> Exporter:
    """Serve ``registry`` on ``host:port`` from a daemon thread; ``port=0`` picks a free port. Returns the
    :class:`Exporter` with the bound port. Only loopback addresses are accepted."""
    if host not in (LOOPBACK, "localhost"):
        raise ValueError(f"exporters bind loopback only, not {host!r}")
    counter = _ScrapeCounter()
    registry.register(counter)
    try:
        server, thread = start_http_server(port, addr=LOOPBACK, registry=registry)
    except BaseException:
        registry.unregister(counter)
        raise
    bound = server.server_address[1]
    return Exporter(registry, LOOPBACK, int(bound), server, thread, counter)


def sd_groups(targets: Mapping[str, Sequence[str]]) -> list[dict]:
    """Prometheus file-sd target groups: one group per job, ``labels: {job: name}`` (a target group's ``job``
    label overrides the scrape config's job name)."""
    groups = []
    for job, addrs in sorted(targets.items()):
        addrs = [str(a) for a in addrs]
        for a in addrs:
            if "://" in a or "/" in a or ":" not in a:
                raise ValueError(f"target {a!r} of job {job!r} must be host:port")
        if addrs:
            groups.append({"targets": sorted(set(addrs)), "labels": {JOB_LABEL: str(job)}})
    return groups


def write_sd_file(path: str | os.PathLike, targets: Mapping[str, Sequence[str]]) -> Path:
    """Write ``targets`` (job name -> ``["127.0.0.1:port", ...]``) as a file-sd JSON file, atomically (a temp file
    in the same folder, then ``os.replace``), so Prometheus never reads half a file. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(sd_groups(targets), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def prometheus_config(sd_file: str | os.PathLike, scrape_interval: str = DEFAULT_SCRAPE_INTERVAL,
                      job_name: str = "async_agent_rl", refresh_interval: Optional[str] = None) -> str:
    """The text of a ``prometheus.yml`` scraping every target listed in ``sd_file`` (relative paths resolve
    against the config file's folder). ``scrape_interval`` is a Prometheus duration (``"1s"``, ``"5s"``)."""
    refresh = refresh_interval or SD_REFRESH_INTERVAL
    # JSON strings are valid YAML scalars: quoting this way is safe for any path.
    return (
        "# Prometheus scrape config for async_agent_rl (written by monitoring.exporter.prometheus_config).\n"
        "global:\n"
        f"  scrape_interval: {scrape_interval}\n"
        f"  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n"
        f"  - job_name: {json.dumps(job_name)}\n"
        "    metrics_path: /metrics\n"
        "    file_sd_configs:\n"
        f"      - files: [{json.dumps(str(sd_file))}]\n"
        f"        refresh_interval: {refresh}\n"
    )


# ------------------------------------------------------------------------------------------- a run's monitoring
class RunMonitoring:
    """The driver's side of monitoring for one run, in ``folder`` (``RUN_DIR/prometheus``): one registry with every
    updater (``rollout``, ``buffer``, ``learner``, ``driver``, ``eval``, ``learning``, ``idle``), its exporter on 127.0.0.1, the discovery
    file (``targets.json`` unless ``sd_file`` says otherwise) and a ``prometheus.yml`` beside it that scrapes it::

        mon = RunMonitoring.from_config(cfg.monitoring, run_dir)          # None when monitoring.enabled is false
        mon.set_targets("retriever", ["127.0.0.1:8000"])                   # the retrieval server's own /metrics
        mon.poll(lambda: mon.observe(rollout=ray.get([a.stats.remote() for a in actors]),
                                     buffer=ray.get(buffer.stats.remote())), every_s=cfg.monitoring.log_every_s)
        ...  # each learner step:
        mon.observe(learner=learner_stats, publish=publish_stats, idle=idle_stats)
        mon.eval.update(scores, split="heldout", step=step)                # after each evaluation
        mon.close()                                                        # stops polling, frees the port

    Then ``prometheus --config.file=RUN_DIR/prometheus/prometheus.yml`` scrapes the run."""

    def __init__(self, folder: str | os.PathLike, exporter: Exporter, updaters: dict, job: str,
                 scrape_interval: str, sd_file: Optional[str | os.PathLike] = None):
        self.folder = Path(folder)
        self.exporter = exporter
        self.registry = exporter.registry
        self.updaters = updaters
        self.rollout, self.buffer, self.learner = updaters["rollout"], updaters["buffer"], updaters["learner"]
        self.driver, self.eval, self.learning = updaters["driver"], updaters["eval"], updaters["learning"]
        self.idle = updaters["idle"]
        self.sd_file = Path(sd_file) if sd_file else self.folder / "targets.json"
        self.config_file = self.folder / "prometheus.yml"
        self.job = job
        self.exporter_restarts = 0
        self._targets: dict[str, list[str]] = {job: [exporter.target]}
        self._stop = threading.Event()
        self._pollers: list[threading.Thread] = []
        beside = self.sd_file.resolve().parent == self.folder.resolve()
        self.config_file.write_text(prometheus_config(self.sd_file.name if beside else self.sd_file.resolve(),
                                                      scrape_interval))
        write_sd_file(self.sd_file, self._targets)

    @classmethod
    def start(cls, folder: str | os.PathLike, scrape_interval: str = DEFAULT_SCRAPE_INTERVAL, port: int = 0,
              job: str = "driver", sd_file: Optional[str | os.PathLike] = None) -> "RunMonitoring":
        from monitoring.metrics import new_registry, register_all

        Path(folder).mkdir(parents=True, exist_ok=True)
        registry = new_registry()
        updaters = register_all(registry)
        return cls(folder, start_exporter(registry, port), updaters, job, scrape_interval, sd_file)

    @classmethod
    def from_config(cls, monitoring: Any, run_dir: str | os.PathLike) -> Optional["RunMonitoring"]:
        """From ``Config.monitoring`` (``enabled``, ``host``, ``exporter_port``, ``prometheus_sd_file``): None when
        disabled; the folder is ``run_dir/prometheus``."""
        if not monitoring.enabled:
            return None
        if monitoring.host not in (LOOPBACK, "localhost"):
            raise ValueError(f"monitoring.host must be loopback, not {monitoring.host!r}")
        return cls.start(Path(run_dir) / "prometheus", port=monitoring.exporter_port,
                         sd_file=monitoring.prometheus_sd_file)

    @property
    def targets(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self._targets.items()}

    def set_targets(self, job: str, targets: Sequence[str]) -> None:
        """Replace ``job``'s targets (an empty list removes the job) and rewrite the discovery file."""
        if targets:
            self._targets[job] = [str(t) for t in targets]
        else:
            self._targets.pop(job, None)
        write_sd_file(self.sd_file, self._targets)

    def heal(self) -> Optional[str]:
        """If the exporter stopped serving (its thread died), serve the same registry again, on the same port when
        it is free, else on a new one (the discovery file follows, so Prometheus does too); say so in one line.
        None while it serves. The run never stops for its metrics."""
        old = self.exporter
        if old.serving or self._stop.is_set():
            return None
        old.close()
        registry = old.registry
        if old._scrapes is not None:
            registry.unregister(old._scrapes)
        try:
            new = start_exporter(registry, old.port)
        except OSError:
            new = start_exporter(registry, 0)
        self.exporter = new
        self.exporter_restarts += 1
        self.set_targets(self.job, [new.target])
        return f"metrics exporter on {old.target} stopped serving; serving again on {new.target} " \
               f"({self.exporter_restarts} restart(s))"

    def observe(self, *, rollout: Sequence[RolloutStats] = (), buffer: Optional[BufferStats] = None,
                learner: Optional[LearnerStats] = None, publish: Optional[PublishStats] = None,
                idle: Optional[IdleStats] = None) -> None:
        """Fold in whatever the driver has at hand: ``RolloutActor.stats()`` of each actor, ``BufferActor.stats()``,
        the ``train_step`` stats, the step's ``PublishStats`` and ``IdleStats`` (None: skipped)."""
        for stats in rollout:
            self.rollout.update(stats)
        if buffer is not None:
            self.buffer.update(buffer)
        if learner is not None:
            self.learner.update(learner)
        if publish is not None:
            self.driver.observe_publish(publish)
        if idle is not None:
            self.idle.update(idle)

    def poll(self, fn: Callable[[], Any], every_s: float) -> None:
        """Call ``fn`` every ``every_s`` seconds from a daemon thread until ``close()`` (e.g. fetch the actors'
        stats and ``observe`` them, so metrics move between learner steps). A failing call is logged and the
        next one tried; ``fn`` must be safe to run beside the driver's loop (Ray calls are)."""
        if every_s <= 0:
            raise ValueError("every_s must be > 0")

        def loop() -> None:
            failures = 0
            while not self._stop.wait(every_s):
                try:
                    fn()
                    failures = 0
                except Exception as e:  # monitoring must never take the run down
                    failures += 1
                    if failures in (1, 10) or failures % 100 == 0:  # one line (a component restarting is expected)
                        cause = (str(e).strip().splitlines() or [""])[0]
                        logger.warning("metrics poll failed (%d in a row): %s: %s", failures, type(e).__name__, cause)

        t = threading.Thread(target=loop, name="metrics-poll", daemon=True)
        t.start()
        self._pollers.append(t)

    def close(self, final_scrape_timeout_s: float = 0.0) -> None:
        """Stop polling and free the port. With ``final_scrape_timeout_s > 0`` and a Prometheus that has scraped
        this exporter before, first wait (at most that long) for one more scrape, so the run's last values (the
        final step, the last evaluation) reach the dashboards instead of dying with the process."""
        self._stop.set()
        for t in self._pollers:
            t.join(timeout=30.0)
        seen = self.exporter.scrapes
        if final_scrape_timeout_s > 0 and seen > 0:
            if not self.exporter.wait_for_scrape(seen, final_scrape_timeout_s):
                logger.warning("no final scrape of %s within %.0f s; the last values may be missing from Prometheus",
                               self.exporter.url, final_scrape_timeout_s)
        self.exporter.close()

    def __enter__(self) -> "RunMonitoring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
