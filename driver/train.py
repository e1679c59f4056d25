"""``async-agent-rl train``: the whole system on Ray.

The driver's loop, top to bottom::

    prepare inputs        world + tiny model if the config asks; SFT warm start if sft.enabled
    start components      Ray, retriever server, replay buffer, learner rank(s), N rollout actors
    evaluate (start)      greedy exact match on held-out questions with the starting weights
    start rollouts        every actor runs episodes continuously (no batch barrier), admission-controlled
    for each step:        sample + update: the learner trains on the buffer's next batch (buffer -> learner by
                          object reference; the buffer waits while it has too few fresh groups)
                          publish if due: every k steps the learner bumps its version and the weights reach every
                          actor (``driver/versions.py``, the one holder of the policy version)
                          check the fleet: dead or stuck rollout actors restarted, the retriever kept up
                          (``driver/fleet.py``)
                          record: metrics.jsonl, the console line; a checkpoint when due
    stop rollouts, evaluate (end), save the final policy, plots

A step that does not come within the watchdog's limit (``driver/limits.py``) ends the run with the fleet's report of
every component. Everything the run produces lands in ``run_dir`` (``run.output_dir/run.name``): ``config.yaml``
(resolved), ``metrics.jsonl`` (one line per step), ``eval.jsonl``, ``checkpoints/``, ``final/``, ``plots/*.png``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import ray  # also sets up the "ray" logger and its console handler, which _logs_to_file redirects
import yaml
from ray.exceptions import GetTimeoutError

from actors.rollout_actor import create_evaluator, create_rollout_actors
from async_agent_rl.config import Config, load_config
from async_agent_rl.errors import InputError
from async_agent_rl.stats import (
    BufferStats, IdleStats, LearnerStats, PublishStats, RolloutStats, RunTotals, idle_stats,
)
from async_agent_rl.weight_group import backend_for
from buffer.actor import SNAPSHOT_FILE, create_buffer_actor
from driver.cluster import (
    actor_node, check_actors_fit, check_address, check_job_paths, check_machines, check_placement, job_runtime_env,
    link_ray_logs, node_gone, ray_init, resources_line,
)
from driver.evaluation import EvaluationBeside
from driver.console import LOG_FILE, LearningSignals, RunLog, closing_lines, duration, eval_brief
from driver.fleet import SETTLE_S, Fleet, run_totals
from driver.limits import (
    REPORT_TIMEOUT_S, ProgressWatchdog, RunFailed, ask, cause, eval_limit_s, first_step_s, stop_s,
)
from driver.plots import plot_run
from driver.prepare import prepare
from driver.reaper import reaper
from driver.run_folder import check_safetensors, hold, read_metrics_lines, set_aside_earlier_run
from driver.versions import PolicyVersions
from driver.weight_sync import create_publisher
from learner.actor import LearnerTimeout, create_learner_group
from learner.checkpoint import (
    CONFIG_FILE,
    CheckpointError,
    check_model_matches,
    commit_checkpoint,
    config_differences,
    newest_intact,
)
from monitoring.exporter import RunMonitoring
from retriever.server import ServerProcess, exposure_warning, spawn_server
from warm_start.sft import check_warm_start, run_sft, warm_start_inputs

log = logging.getLogger(__name__)


SUPERVISE_WHILE_WAITING_S = 5.0  # while waiting for a batch, check the rollout actors this often
STEP_LIMIT_OFF_S = 7 * 86400.0  # one learner step's limit with the watchdog off
DISK_FULL_BYTES = 64 << 20  # a checkpoint that failed with less free space than this failed for lack of space
SEARCH_ERROR_WARN_RATE = 0.5  # warn when more than this share of a step's searches failed (at least 4 of them)
SEARCH_WARN_EVERY_S = 60.0
DRIVER_STATE = "driver_state.json"


class Stopped(InputError):
    """A second SIGINT or SIGTERM: the run stops at once, without a checkpoint."""


class _StopRequested(Exception):
    """SIGINT or SIGTERM received: the run stops at the next safe point (``Trainer._check_stop``)."""


def latest_checkpoint(run_dir: Path) -> tuple[Path, list[str]]:
    """The newest intact ``checkpoints/step_N`` (its manifest verified; a crash mid-checkpoint leaves only a
    ``.step_N.tmp`` folder) and one line per damaged newer checkpoint skipped; ``InputError`` when there is none."""
    candidates = [p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()]
    if not candidates:
        raise InputError(f"{run_dir}: no checkpoint under checkpoints/ to resume from")
    ckpt, skipped = newest_intact(candidates)
    if ckpt is None:
        raise CheckpointError(f"{run_dir}: no intact checkpoint to resume from: {'; '.join(skipped)}")
    return ckpt, skipped


RAY_SHUTDOWN_S = 60.0
ray_shutdown_stuck = False  # set when ray.shutdown() did not return: the process then ends without waiting for it


def _shutdown_ray() -> None:
    """``ray.shutdown()``, bounded: a component left stopped or hung must not keep the run from ending with its
    line. If it does not return within ``RAY_SHUTDOWN_S``, the run ends anyway (the CLI exits at once after its
    last line) and the run's reaper ends what is left of the cluster."""
    global ray_shutdown_stuck
    done = threading.Event()

    def shut() -> None:
        try:
            ray.shutdown()
        finally:
            done.set()

    threading.Thread(target=shut, name="ray-shutdown", daemon=True).start()
    if not done.wait(RAY_SHUTDOWN_S):
        ray_shutdown_stuck = True
        log.warning("ray.shutdown() did not return within %.0f s; the run's reaper ends the cluster's processes",
                    RAY_SHUTDOWN_S)



@contextmanager
def _logs_to_file(path: Path) -> Iterator[None]:
    """For the run: library and engine logs (INFO and up) go to ``path``; the terminal keeps the run's own lines
    (``RunLog.say``) and warnings. Ray's driver-side logger (its own console handler, not propagated) goes to the
    file too and keeps only errors on the terminal. Progress bars of transformers are turned off."""
    def consoles(logger: logging.Logger) -> list[tuple[logging.Handler, int]]:
        return [(h, h.level) for h in logger.handlers if isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)]

    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    handler, ray_handler = logging.FileHandler(path), logging.FileHandler(path)
    for h in (handler, ray_handler):
        h.setFormatter(fmt)
        h.setLevel(logging.DEBUG if root.level <= logging.DEBUG else logging.INFO)
    quieted = [(h, old, logging.WARNING) for h, old in consoles(root)]
    quieted += [(h, old, logging.ERROR) for h, old in consoles(ray_logger)]
    level = root.level
    for h, _, floor in quieted:
        h.setLevel(max(h.level, floor))
    root.addHandler(handler)
    ray_logger.addHandler(ray_handler)
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    _progress_bars(False)
    try:
        yield
    finally:
        root.removeHandler(handler)
        ray_logger.removeHandler(ray_handler)
        handler.close()
        ray_handler.close()
        root.setLevel(level)
        for h, old, _ in quieted:
            h.setLevel(old)
        _progress_bars(True)


def _progress_bars(on: bool) -> None:
    """Turn the progress bars of Hugging Face's libraries on or off, without importing transformers (seconds of a
    run's start): it reads the hub's setting when it is imported, and its own switch is set if it was."""
    from huggingface_hub import utils as hub

    (hub.enable_progress_bars if on else hub.disable_progress_bars)()
    loaded = sys.modules.get("transformers.utils.logging")
    if loaded is not None:
        (loaded.enable_progress_bar if on else loaded.disable_progress_bar)()


class Trainer:
    """The RL loop and the run around it (see the module docstring). The policy version is ``self.versions``'
    (``driver.versions.PolicyVersions``), the rollout actors and the retriever are ``self.fleet``'s
    (``driver.fleet.Fleet``); both exist once the components have started."""

    def __init__(self, cfg: Config, run_dir: Path | None = None, quiet: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run_dir)
        self.log = RunLog(self.run_dir, quiet)
        self.policy_path = cfg.model.path
        self.step = 0
        self.history: list[dict] = []
        self.versions: PolicyVersions | None = None
        self.fleet: Fleet | None = None
        self.mon: RunMonitoring | None = None
        self.resume_from: Path | None = None
        self._resumed: dict | None = None  # the checkpoint's driver state, for the fleet once it exists
        self.beside: EvaluationBeside | None = None  # eval.beside: the evaluations that run beside training
        self.taken_up: list[dict] = []  # a resumed run: what each rollout actor took up (RolloutActor.start)
        self.learning = LearningSignals()
        self.first_step: int | None = None  # the step the RL loop started from (a resumed run: its checkpoint's)
        self._search_warned_at = -SEARCH_WARN_EVERY_S
        self.watchdog = ProgressWatchdog(cfg.cluster.progress_timeout_s, floor=first_step_s(cfg))
        self.stop_signal: int | None = None  # SIGINT or SIGTERM received: stop at the next safe point
        self.in_warm_start = False
        self._recorded_at: float | None = None  # when the previous step was recorded (its wall time ends there)
        self._recorded_rollout: dict[int, RolloutStats] = {}  # each actor's stats at that record (idle time since)
        self._core_nodes: dict[str, list[str]] = {}  # node id -> what of the learner and buffer it holds

    # --------------------------------------------------------------------------------------------- the loop
    def run(self) -> dict:
        cfg = self.cfg
        closing = None
        with ExitStack() as stack:
            stack.enter_context(hold(self.run_dir))  # one run at a time in a run folder
            check_address(cfg)  # an address with no cluster behind it: one error line now, not after the warm start
            if self.resume_from is None:
                moved = set_aside_earlier_run(self.run_dir)  # a fresh run never mixes into an earlier run's results
                if moved:
                    self.log.say(f"[run] {moved}")
            cfg.save(self.run_dir / "config.yaml")
            self._catch_stop_signals(stack)
            stack.enter_context(_logs_to_file(self.run_dir / LOG_FILE))
            self.log.say(f"[run] {self.run_dir}: {cfg.learner.total_steps} RL steps; engine, Ray and library logs "
                         f"go to {self.run_dir / LOG_FILE}")
            try:
                self.prepare_inputs()
                self._check_stop()
                self.start_components(stack)
                self._catch_stop_signals(stack)  # ray.init put its own SIGTERM handler (sys.exit) in place of ours
                self._check_stop()
                start = self.evaluate("start") if cfg.eval.at_start and self.resume_from is None else None
                self._check_stop()
                self.start_rollouts()
                t0 = time.monotonic()
                self.first_step = self.step
                with self._core_node_loss():
                    while self.step < cfg.learner.total_steps:
                        self.train_step(t0)
                        self._check_stop()
                        if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0 and self.step < cfg.learner.total_steps:
                            if self.beside is not None:
                                self.evaluate_beside()
                            else:
                                self.evaluate(f"step {self.step}")
                                self._check_stop()
                        if self.beside is not None:
                            self.record_eval(self.beside.poll())
                if self.beside is not None:  # the last one still running (a stop request ends the wait)
                    self.record_eval(self.beside.finish(stopping=lambda: self.stop_signal is not None))
                    self._check_stop()
            except _StopRequested:
                closing = self._stop_now()
            if closing is None:
                rollout = self.stop_rollouts()
                end = self.evaluate("end") if cfg.eval.at_end else None
                final = self.save(self.run_dir / "final")
                summary = self.summary(start, end, rollout, time.monotonic() - t0, final)
                (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
                plots = self.plots()
        if closing is not None:  # stopped by a signal: one line, after Ray is down
            self.log.say(closing)
            return {"run_dir": str(self.run_dir), "steps": self.step, "stopped_by": self.stop_signal}
        for line in closing_lines(summary, start, end, plots, self.run_dir):
            self.log.say(line)
        return summary

    def train_step(self, t0: float) -> None:
        """One RL step: the learner samples a batch from the buffer and updates on it; the new weights are published
        to the rollout actors when due; the fleet is checked and the step recorded; a checkpoint when due.
        Evaluation runs between steps (``run``)."""
        metrics, wait_s = self._sample_and_update()
        self.step = metrics.step
        self._note_core_nodes()
        publish = self.versions.stepped(self.step)
        rollout = self.fleet.supervise()
        self._record_step(metrics, publish, rollout, wait_s, t0)
        if self.cfg.learner.checkpoint_every and self.step % self.cfg.learner.checkpoint_every == 0:
            self.checkpoint()  # after the step's metrics line: a resume keeps exactly the lines up to here

    @contextmanager
    def _core_node_loss(self) -> Iterator[None]:
        """A failure of the RL loop that comes of a lost node holding the learner or the replay buffer (a machine
        gone from a multi-node cluster: Ray does not restart them) ends the run in one line naming the node, what
        it held and the checkpoint to resume from; any other failure goes on as it is."""
        try:
            yield
        except (ray.exceptions.RayError, InputError) as e:
            lost = self._lost_core_nodes()
            if not lost:
                raise
            try:
                ckpt, _ = latest_checkpoint(self.run_dir)
                resume = (f"resume from {ckpt} with `async-agent-rl train --resume {self.run_dir}` once nodes offer "
                          "what they ask")
            except InputError:
                resume = ("no intact checkpoint to resume from (learner.checkpoint_every="
                          f"{self.cfg.learner.checkpoint_every})")
            raise RunFailed(f"{'; '.join(lost)} at step {self.step + 1} ({cause(e)}); {resume}") from None

    def _lost_core_nodes(self) -> list[str]:
        """"the node ID8 at IP holding X was lost" for each lost node that held the learner or the buffer (their
        nodes as placed at the first step). When they do not all answer, Ray may have yet to declare their node
        dead (its health checks take about 15 s): waited for, up to ``SETTLE_S``. The driver's own node is never
        lost while the driver runs, so what it holds is not asked about (on one machine: nothing is, and a stopped
        learner's error line is not held back ``REPORT_TIMEOUT_S + SETTLE_S``)."""
        own = ray.get_runtime_context().get_node_id()
        held = {node: what for node, what in self._core_nodes.items() if node != own}
        if not held:
            return []
        probes = [self.buffer.stats.remote(), *(a.rank.remote() for a in self.learner.actors)]
        try:
            ray.get(probes, timeout=REPORT_TIMEOUT_S)
            return []  # all there: the failure was something else
        except (ray.exceptions.RayError, GetTimeoutError):
            pass
        deadline = time.monotonic() + SETTLE_S
        while True:
            gone = {node: node_gone(node) for node in held}
            if any(gone.values()) or time.monotonic() > deadline:
                return [f"the {gone[node]} holding {' and '.join(what)} was lost" for node, what in held.items()
                        if gone[node]]
            time.sleep(0.5)

    def _note_core_nodes(self) -> None:
        """The nodes the learner ranks and the replay buffer run on (Ray's record), once."""
        if self._core_nodes:
            return
        ranks = self.learner.actors
        for what, actor in [("the replay buffer", self.buffer),
                            *((f"learner rank {r}" if len(ranks) > 1 else "the learner", a) for r, a in enumerate(ranks))]:
            node = actor_node(actor)
            if node:
                self._core_nodes.setdefault(node, []).append(what)

    # ------------------------------------------------------------------------------------------------ signals
    def _catch_stop_signals(self, stack: ExitStack) -> None:
        """SIGINT and SIGTERM stop the run at the next safe point (between steps, or while the learner waits for a
        batch) with a checkpoint and one closing line; a second one stops it at once. Without this, Ray's driver
        handler (``sys.exit`` from inside Ray's C++ code) ended a SIGTERM in SIGABRT and a C++ stack dump."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            if self.stop_signal is None:
                self.stop_signal = signum
                when = ("after the current step with a checkpoint" if self.step > 0 else
                        "at the next step of the warm start, unsaved" if self.in_warm_start else "before the first step")
                self.log.say(f"[stop] {signal.Signals(signum).name}: stopping {when} (send it again to stop at once)")
            else:
                self.stop_signal = -abs(self.stop_signal)
                raise Stopped(f"stopped at once by a second {signal.Signals(signum).name} at step {self.step}, "
                              "no checkpoint written")

        for sig in (signal.SIGINT, signal.SIGTERM):
            old = signal.signal(sig, handler)
            stack.callback(signal.signal, sig, old)

    def _check_stop(self) -> None:
        if self.stop_signal is not None:
            raise _StopRequested()

    def _stop_now(self) -> str:
        """A checkpoint of the current step (the learner is idle at every point ``_check_stop`` is called) and the
        closing line of a stopped run. Episodes in flight are not waited for: Ray's shutdown ends them."""
        name = signal.Signals(abs(self.stop_signal or signal.SIGTERM)).name
        saved = None
        if self.step > 0 and getattr(self, "learner", None) is not None:
            last = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
            saved = str(last) if last.is_dir() else self.checkpoint()
        if saved is None:
            return f"[stopped] {name} at step {self.step} of {self.cfg.learner.total_steps}: no step yet, nothing to checkpoint"
        return (f"[stopped] {name} at step {self.step} of {self.cfg.learner.total_steps}: checkpoint {saved}; continue "
                f"with `async-agent-rl train --resume {self.run_dir}`")

    # ------------------------------------------------------------------------------------------------ start
    def prepare_inputs(self) -> None:
        for line in prepare(self.cfg):
            self.log.say(f"[prepare] {line}")
        if self.cfg.sft.enabled:
            sft_dir = Path(self.cfg.sft.output_dir) if self.cfg.sft.output_dir else self.run_dir / "sft"
            if not check_warm_start(sft_dir, warm_start_inputs(self.cfg, self.cfg.model.path)):
                self.log.say(f"[sft] warm start on {self.cfg.sft.num_demos} demonstrations -> {sft_dir}")
                # prints progress and a readable closing line; a stop signal ends it at the next step, unsaved (a
                # folder without its summary is not a warm start: the next run makes it again)
                self.in_warm_start = True
                try:
                    run_sft(self.cfg, self.cfg.model.path, sft_dir, on_step=lambda _: self._check_stop())
                finally:
                    self.in_warm_start = False
            else:
                self.log.say(f"[sft] warm start present: {sft_dir}")
            self.policy_path = str(sft_dir)

    def start_components(self, stack: ExitStack) -> None:
        cfg = self.cfg
        stack.enter_context(reaper())  # first in, last out: if this process is killed, nothing of the run outlives it
        # (read before ray.init, which sets RAY_ADDRESS for this process' children)
        local_cluster = not (cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS"))
        # the policy's pad id, for the buffer: its tokenizer (and transformers, seconds to import) loads while Ray
        # starts, which mostly waits for the cluster's processes
        pad_id = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="pad-id")).submit(self._pad_id)
        ray_init(cfg)
        stack.callback(_shutdown_ray)
        if local_cluster:
            check_actors_fit(cfg, ray.cluster_resources())
        check_placement(cfg, ray.nodes())  # the nodes cluster.*_resources name: before any actor waits for them
        check_machines(cfg, ray.nodes(), ray.util.get_node_ip_address())  # loopback-only parts, several machines
        check_job_paths(cfg, ray.nodes(), job_runtime_env())  # a job's relative paths, several nodes
        link_ray_logs(self.run_dir / "ray_logs")
        # The slow starts overlap, each mostly one core: the learner ranks (DeepSpeed) start in a thread while the
        # retriever server builds its index and the rollout actors start their engines (which need its URL). On
        # the quickstart, one after the other took about 55 s.
        learner_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": self.policy_path})})
        with ThreadPoolExecutor(1, thread_name_prefix="start-learner") as pool:
            learner = pool.submit(create_learner_group, learner_cfg)
            retriever: ServerProcess | None = None  # the retrieval server the run started (None: the user's URL)
            if cfg.retriever.url:  # the user's server: theirs to keep up
                self.url = cfg.retriever.url
            else:  # a child process the fleet supervises
                retriever = stack.enter_context(
                    spawn_server(cfg.data.corpus_file, cfg.retriever, log_file=self.run_dir / "retriever.log"))
                self.url = retriever.url
            self.log.say(f"[start] retriever {self.url}")
            exposed = None if cfg.retriever.url else exposure_warning(cfg.retriever.host)  # a server the run started
            if exposed:
                log.warning(exposed)
                self.log.say(f"[warn] {exposed}")
            self.mon = self._start_monitoring(stack)
            self.pad_id = pad_id.result()
            self.buffer = create_buffer_actor(cfg, pad_id=self.pad_id)
            self.versions = PolicyVersions(cfg, None, None, self.log.say)
            actor_model = self.policy_path
            if self.resume_from is not None:  # the actors start at the learner's restored version
                self.learner = self.versions.learner = self._started(learner.result)
                self._restore()
                actor_model = str(self.resume_from / "policy")
            actors = create_rollout_actors(cfg, self.url, actor_model, self.versions.version,
                                           max_restarts=cfg.cluster.max_actor_restarts)
            evaluators = [create_evaluator(cfg, self.url, actor_model, self.versions.version)] * cfg.evaluators
            infos = self._started(lambda: ray.get([a.setup.remote(self.buffer) for a in actors + evaluators],
                                                  timeout=cfg.cluster.actor_setup_timeout_s), what="rollout")
            if evaluators:
                self.beside = EvaluationBeside(cfg, evaluators[0], self.log.say)
                if self._resumed is not None:
                    self.beside.finished, self.beside.skipped = (self._resumed["evals_beside"],
                                                                 self._resumed["evals_skipped"])
                infos = infos[: len(actors)]
                self.log.say("[start] evaluator: evaluations every "
                             f"{cfg.eval.every_steps} steps run beside training on an engine of their own")
            self.learner = self.versions.learner = self._started(learner.result)
        self.versions.publisher = create_publisher(
            cfg.weight_sync.method, actors, self.learner, actor_timeout_s=cfg.cluster.actor_timeout_s,
            backend=backend_for(cfg.run.device, cfg.weight_sync.backend), timeout_s=cfg.weight_sync.timeout_s)
        stack.callback(self._close_publisher)
        self.fleet = Fleet(cfg, self.log.say, self.buffer, actors, self.versions, retriever, local_cluster,
                           on_restart=self._restarted)
        if self._resumed is not None:
            self.fleet.restarts, self.fleet.lost_episodes = self._resumed["restarts"], self._resumed["lost_episodes"]
            self.fleet.totals = self._resumed["totals"]
        self.log.say(f"[start] buffer, {cfg.learner.num_ranks} learner rank(s), rollout actors {infos}")

    @property
    def actors(self) -> list[Any]:
        """The rollout actors the run has (those given up after a node loss left out)."""
        return [a for _, a in self.fleet.active]

    def _restarted(self) -> None:
        """A rollout actor was restarted: its restart does not count against the watchdog (it has its own limit,
        ``cluster.actor_setup_timeout_s``), and the monitor's counters move."""
        self.watchdog.waiting()
        if self.mon is not None:
            self.mon.driver.update(self.fleet.driver_stats())

    def _started(self, start: Callable[[], Any], what: str = "learner") -> Any:
        """``start()``: the learner group or the rollout actors' set-up, each bounded by
        ``cluster.actor_setup_timeout_s``; past it, one error line naming what did not start and what it asks Ray
        for (a rank or an actor Ray cannot place waits forever otherwise)."""
        c = self.cfg.cluster
        try:
            return start()
        except GetTimeoutError:
            if what == "learner":
                whom = f"{self.cfg.learner.num_ranks} learner actor(s)"
                asks = f"cluster.learner_cpus={c.learner_cpus:g}, learner_gpus={c.learner_gpus:g}"
                custom = c.learner_resources
            else:
                whom = f"{self.cfg.rollout.num_actors} {what} actor(s)" + (" and the evaluator"
                                                                          if self.cfg.evaluators else "")
                asks = f"cluster.rollout_actor_cpus={c.rollout_actor_cpus:g}, rollout_actor_gpus={c.rollout_actor_gpus:g}"
                custom = c.rollout_resources
            if custom:
                asks += f", {'learner' if what == 'learner' else 'rollout'}_resources={custom}"
            raise RunFailed(f"the {whom} were not started within cluster.actor_setup_timeout_s="
                            f"{c.actor_setup_timeout_s:g} s (each asks Ray for {asks}; the cluster has "
                            f"{resources_line(ray.cluster_resources())})") from None

    def _close_publisher(self) -> None:
        """The learner's side of the collective path's group, released before Ray shuts down (a learner that is
        already gone has nothing left to release)."""
        try:
            self.versions.publisher.close()
        except ray.exceptions.RayError:
            pass

    def _start_monitoring(self, stack: ExitStack):
        """One exporter for the run (driver-side view of every component) plus the retriever's own /metrics, both
        listed in ``run_dir/prometheus/targets.json`` for Prometheus' file-based discovery."""
        mon = RunMonitoring.from_config(self.cfg.monitoring, self.run_dir)
        if mon is None:
            return None
        stack.callback(mon.close, self.cfg.monitoring.final_scrape_timeout_s)
        mon.set_targets("retriever", [urlsplit(self.url).netloc])
        self.log.say(f"[start] metrics on {mon.exporter.url}; prometheus --config.file={mon.config_file}")
        return mon

    def _ask(self, ref: "ray.ObjectRef", what: str) -> Any:
        return ask(ref, self.cfg.cluster.actor_timeout_s, what)

    def _observe_components(self) -> None:
        self.mon.observe(rollout=ray.get([a.stats.remote() for a in self.actors], timeout=REPORT_TIMEOUT_S),
                         buffer=ray.get(self.buffer.stats.remote(), timeout=REPORT_TIMEOUT_S))

    def _pad_id(self) -> int:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.policy_path)
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def start_rollouts(self) -> None:
        taken = self._ask([a.start.remote() for a in self.actors], "a rollout actor asked to start")
        if self.resume_from is not None:
            self.taken_up = taken
            for line in taken_up_lines(taken):
                self.log.say(line)
        if self.mon is not None:
            self.mon.driver.update(self.fleet.driver_stats())  # every actor's restart count from 0 on
            self.mon.poll(self._observe_components, every_s=self.cfg.monitoring.log_every_s)

    # ------------------------------------------------------------------------------------------------ a step
    def _sample_and_update(self) -> tuple[LearnerStats, float]:
        """The learner's step on the next batch, and the seconds until that batch reached the learner. While no
        batch comes, the fleet is supervised (a dead actor is restarted), a stop request is honoured and the
        watchdog is checked; once a minute a line says why there is no batch."""
        wait0 = time.monotonic()
        next_report = wait0 + 60.0
        self.watchdog.waiting()
        while True:
            # the batch goes from the buffer to the learner by reference; None: no batch within the timeout
            batch = self.buffer.sample_batch.remote(self.versions.version, SUPERVISE_WHILE_WAITING_S)
            metrics = self._learner_step(batch)
            if metrics is not None:
                break
            # an actor that died while the buffer is short would otherwise never be restarted: no batch comes
            self.fleet.supervise()
            self._check_stop()  # the learner is idle here: a stop can checkpoint
            if self.watchdog.expired():
                raise self._stalled("waiting for a batch (idle)", healthy=True)
            if time.monotonic() > next_report:
                next_report += 60.0
                b = self._ask(self.buffer.stats.remote(), "the buffer actor")
                self.log.say(f"[wait] no batch for {time.monotonic() - wait0:.0f} s: buffer size {b.size}, ready "
                             f"groups {b.ready_groups}, pending {b.pending_groups}, evicted {b.evicted}, "
                             f"admission {dataclasses.asdict(b.admission)}")
        self.watchdog.step_done()
        return metrics, max(0.0, time.monotonic() - wait0 - metrics.step_time_s)

    def _learner_step(self, batch: "ray.ObjectRef") -> LearnerStats | None:
        """``self.learner.train_step(batch)``, watched: it runs in a thread of its own while this one checks every
        few seconds that the step has not been going on for longer than the watchdog allows (a buffer that never
        answers ``sample_batch``, a learner whose step never ends)."""
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["stats"] = self.learner.train_step(batch, self._step_limit())
            except BaseException as e:  # noqa: BLE001 - handed to the driver's thread below
                box["error"] = e

        started = time.monotonic()
        thread = threading.Thread(target=call, name="learner-step", daemon=True)  # daemon: a hung one never blocks exit
        thread.start()
        no_batch: bool | None = None  # whether the buffer's answer was "no batch" (known once it has arrived)
        while True:
            thread.join(timeout=1.0)
            if not thread.is_alive():
                break
            if self.watchdog.expired():
                took = time.monotonic() - started
                if ray.wait([batch], timeout=0, fetch_local=False)[0]:
                    if no_batch is None:  # fetched once, when the run is about to end
                        try:
                            no_batch = ray.get(batch, timeout=REPORT_TIMEOUT_S) is None
                        except GetTimeoutError:  # an answer this slow to fetch is a batch, not None
                            no_batch = False
                        except ray.exceptions.RayError:  # the sampler failed: the learner's thread raises it soon
                            no_batch = True
                    if not no_batch:
                        state = f"computing step {self.step + 1} for up to {took:.0f} s (its batch has arrived)"
                    elif took > SUPERVISE_WHILE_WAITING_S + REPORT_TIMEOUT_S:
                        state = f"not answering for {took:.0f} s after the buffer answered sample_batch with no batch"
                    else:  # the idle learner's "no batch" is on its way back: reported (and saved) below
                        continue
                elif took > SUPERVISE_WHILE_WAITING_S + REPORT_TIMEOUT_S:
                    state = f"waiting {took:.0f} s for the buffer's answer to sample_batch (asked with a " \
                            f"{SUPERVISE_WHILE_WAITING_S:.0f} s timeout)"
                else:  # the buffer answers within its timeout: the idle learner is reported (and saved) below
                    continue
                raise self._stalled(state, healthy=False)
        if "error" in box:
            raise box["error"]
        return box.get("stats")

    def _step_limit(self) -> float:
        """The learner group's own limit for one step: the watchdog's, with the room its report needs (the
        watchdog ends a slow step first); a week when the watchdog is off (``cluster.progress_timeout_s=0``)."""
        limit = self.watchdog.limit()
        return STEP_LIMIT_OFF_S if limit is None else limit + SUPERVISE_WHILE_WAITING_S + 3 * REPORT_TIMEOUT_S

    def _stalled(self, learner_state: str, healthy: bool) -> RunFailed:
        """What ends a run in which no step completed within the watchdog's limit: the fleet's report of every
        component in one line and, when the learner and the buffer can still save one, a checkpoint."""
        def save() -> str:
            return f"checkpoint {self.checkpoint()}" if self.step > 0 else "no checkpoint (no step yet)"

        return self.fleet.stall_report(step=self.step, waited=self.watchdog.waited(),
                                       limit=self.watchdog.limit() or 0.0, learner=learner_state,
                                       checkpoint=save if healthy else None, floor=self.watchdog.floor)

    def _record_step(self, metrics: LearnerStats, publish: PublishStats | None, rollout: list[RolloutStats],
                     wait_s: float, t0: float) -> None:
        """Everything a step reports: the monitor, the learning signals and their warnings, where time idled since the
        previous step (``IdleStats``: the learner's wait for its batch, the engines' idle time, the episodes' wait for
        the search tool), one metrics.jsonl record and the console line."""
        buffer = self._ask(self.buffer.stats.remote(), "the buffer actor")
        now = time.monotonic()
        idle = idle_stats(wait_s, now - (t0 if self._recorded_at is None else self._recorded_at), rollout,
                          self._recorded_rollout)
        self._recorded_at, self._recorded_rollout = now, {r.index: r for r in rollout}
        if self.mon is not None:
            healed = self.mon.heal()  # an exporter whose thread died serves again (not a reason to stop a run)
            if healed:
                self.log.say(f"[fault] {healed}")
            self.mon.observe(rollout=rollout, buffer=buffer, learner=metrics, publish=publish, idle=idle)
        record = self._record(metrics, publish, rollout, buffer, idle, time.monotonic() - t0)
        record["batch"] = metrics.batch
        learning = self.learning.update(rollout, buffer, metrics)
        record["learning"] = dataclasses.asdict(learning)
        if self.mon is not None:
            self.mon.learning.update(learning)
        for warning in self.learning.warnings():
            self.log.say(f"[warn] {warning}")
        self._warn_search_errors(record)
        self.history.append(record)
        self.log.write("metrics.jsonl", record)
        self.log.say(self._step_line(record, metrics, t0))

    def _step_line(self, record: dict, metrics: LearnerStats, t0: float) -> str:
        total = self.cfg.learner.total_steps
        elapsed = time.monotonic() - t0
        done = max(1, self.step - (self.first_step or 0))
        left = elapsed / done * (total - self.step)  # time left at the pace so far
        flat = record["learning"]["zero_variance_share"]
        return (
            f"step {self.step:>{len(str(total))}}/{total}  reward {record['batch_reward']:.2f}  "
            f"rollout EM {record['rollout_exact_match']:.2f}  "
            f"entropy {float('nan') if metrics.entropy is None else metrics.entropy:.3f}  "
            f"equal-reward groups {'  -' if flat is None else f'{flat:3.0%}'}  "
            f"stale {metrics.staleness_mean:.1f}/{metrics.staleness_max:.0f}  "
            f"{record['episodes_per_s']:.0f} ep/s  wait {record['sample_wait_s']:.1f}s  left {duration(left)}"
        )

    def _record(self, metrics: LearnerStats, publish: PublishStats | None, rollout: list[RolloutStats],
                buffer: BufferStats, idle: IdleStats, elapsed: float) -> dict:
        per_actor = {f"actor{r.index}": run_totals(r) for r in rollout}
        run = self.fleet.totals.run()
        finished, em_sum, generated = run.get("finished", 0), run.get("em_sum", 0.0), run.get("generated_tokens", 0)
        searches, search_errors = run.get("searches", 0), run.get("search_errors", 0)
        prev = self.history[-1] if self.history else {"episodes_total": 0, "em_sum_total": 0.0}
        new_eps = finished - prev["episodes_total"]
        return {
            "step": self.step,
            "version": self.versions.version,
            "elapsed_s": elapsed,
            "batch_reward": metrics.reward_mean,
            "rollout_exact_match": (em_sum - prev["em_sum_total"]) / new_eps if new_eps else prev.get("rollout_exact_match", 0.0),
            "episodes_total": int(finished),
            "em_sum_total": em_sum,
            "generated_tokens_total": generated,
            "searches_total": int(searches),
            "search_errors_total": int(search_errors),
            "episodes_per_s": finished / elapsed if elapsed > 0 else 0.0,
            "gen_tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            "per_actor": per_actor,
            "actor_restarts": dict(self.fleet.restarts),
            "lost_episodes": self.fleet.lost_episodes,
            **dataclasses.asdict(idle),  # sample_wait_s (the learner's wait for the batch) and the idle shares
            "buffer_size": buffer.size,
            "buffer_evicted": buffer.evicted,
            "buffer_filtered_groups": buffer.filtered_groups,
            "buffer_staleness_histogram": {str(k): v for k, v in buffer.staleness_histogram.items()},
            "buffer_length_tokens": buffer.length_tokens,
            "buffer_length_turns": buffer.length_turns,
            "admission_groups_open": buffer.admission.groups_open,
            "learner": metrics.as_dict(),
            "publish": publish.as_metrics() if publish is not None else {},
        }

    def _warn_search_errors(self, record: dict) -> None:
        """A run whose searches fail (``retriever.url`` pointing nowhere, a retriever down) still trains, on error
        observations: say so while it runs, at most once a minute."""
        prev = self.history[-1] if self.history else {}
        searches = record["searches_total"] - prev.get("searches_total", 0)
        errors = record["search_errors_total"] - prev.get("search_errors_total", 0)
        now = time.monotonic()
        if searches >= 4 and errors > SEARCH_ERROR_WARN_RATE * searches and now - self._search_warned_at >= SEARCH_WARN_EVERY_S:
            self._search_warned_at = now
            msg = (f"{errors} of {searches} searches failed since the last step (retriever {self.url}); the policy "
                   "trains on error observations")
            log.warning(msg)
            self.log.say(f"[warn] {msg}")

    def evaluate(self, when: str) -> dict:
        cfg = self.cfg
        t = time.monotonic()
        limit = eval_limit_s(cfg)
        scores = ask(self.actors[0].evaluate.remote(cfg.data.test_files, cfg.eval.num_questions), limit,
                     f"rollout actor 0 (the evaluation at {when})", key="")
        rec = {"when": when, "step": self.step, "version": self.versions.version, "seconds": time.monotonic() - t, **scores}
        self.record_eval(rec)
        return rec

    def evaluate_beside(self) -> None:
        """The evaluation of this step on the evaluator, not waited for (``driver.evaluation``): the learner's
        weights of this step (on the object-store path, the ones just published when this step published), tagged
        with their policy version when they were published as one."""
        if not self.beside.can_start(self.step):  # skipped before any weights are taken
            return
        v = self.versions
        published = v.published_step == self.step
        weights = v.weights_ref if published and v.weights_ref is not None else self.learner.state_dict_ref()
        self.beside.start(self.step, v.version if published else None, weights)

    def record_eval(self, rec: dict | None) -> None:
        """An evaluation's record: ``eval.jsonl``, the monitor and one console line (None: nothing to record)."""
        if rec is None:
            return
        if rec.get("beside"):
            rec["done_at_step"] = self.step  # the learner's step when it was done: the loop went on meanwhile
        self.log.write("eval.jsonl", rec)
        if self.mon is not None:
            self.mon.eval.update({k: v for k, v in rec.items() if isinstance(v, dict)}, split="heldout",
                                 step=rec["step"])
        overall = rec["all"]
        beside = f", beside training: version {rec['version']}, done at step {self.step}" if rec.get("beside") else ""
        self.log.say(
            f"[eval {rec['when']}] held-out exact match {overall['exact_match']:.3f}  F1 {overall['f1']:.3f}  "
            f"searches/q {overall['searches_per_question']:.2f}  turns/q {overall['turns_per_question']:.2f}  "
            f"(n={overall['n']}, {rec['seconds']:.0f}s{beside})"
        )

    def stop_rollouts(self) -> list[RolloutStats]:
        """Every actor stops starting episodes and finishes and pushes its in-flight ones within ``stop_s``; one
        that takes longer is left to Ray's shutdown (its in-flight episodes are dropped, said in one line) and its
        last stats stand for it: a run whose steps are done never ends in error because stopping took long."""
        limit = stop_s(self.cfg)
        active = [i for i, _ in self.fleet.active]
        refs = [a.stop.remote(limit) for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=limit + self.cfg.cluster.actor_timeout_s)
        out = []
        for i, ref in zip(active, refs):
            try:
                out.append(ray.get(ref, timeout=REPORT_TIMEOUT_S) if ref in ready else None)
            except ray.exceptions.RayError as e:
                self.log.say(f"[warn] rollout actor {i} failed while stopping ({cause(e)}); its last stats stand")
                out.append(None)
                continue
            if out[-1] is None:
                self.log.say(f"[warn] rollout actor {i} did not stop within {limit:.0f} s; its in-flight episodes "
                             "are dropped and its last stats stand")
        last = {s.index: s for s in self.fleet.last_stats}
        return [s if s is not None else last[i] for i, s in zip(active, out) if s is not None or i in last]

    def checkpoint(self) -> str:
        """Learner checkpoint (policy, DeepSpeed state, RNG), buffer snapshot and the driver's counters, written
        into ``checkpoints/step_N``; ``train --resume RUN_DIR`` continues from the newest complete one."""
        final = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        tmp = final.with_name(f".{final.name}.tmp")  # written here, renamed into place once complete
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.learner.save_checkpoint(tmp)
            self._ask(self.buffer.snapshot.remote(str(tmp / SNAPSHOT_FILE)), "the buffer actor (snapshot)")
            state = {"step": self.step, "version": self.versions.version, "restarts": self.fleet.restarts,
                     "lost_episodes": self.fleet.lost_episodes, "totals": self.fleet.totals.run()}  # fmt: skip
            if self.beside is not None:  # an evaluation running now is not redone by a resume
                state["evals_beside"], state["evals_skipped"] = self.beside.finished, self.beside.skipped
            (tmp / DRIVER_STATE).write_text(json.dumps(state))
            path = commit_checkpoint(tmp, final)  # checksum manifest last, then the rename
        except (RunFailed, LearnerTimeout):  # a component that stopped answering: the partial copy goes too
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except (OSError, RuntimeError, ray.exceptions.RayError) as e:  # a full disk, a failing one, a dead learner
            shutil.rmtree(tmp, ignore_errors=True)  # the partial copy goes; the complete ones stay as they are
            if isinstance(e, ray.exceptions.RayActorError):
                raise
            try:
                full = shutil.disk_usage(final.parent).free < DISK_FULL_BYTES
            except OSError:
                full = False
            why = "no space left on the device" if full else cause(e)
            kept = sorted(p.name for p in final.parent.glob("step_*"))
            raise RunFailed(f"the checkpoint of step {self.step} could not be written in {final.parent}: {why}; "
                            f"{f'the last complete one is {kept[-1]}' if kept else 'no complete checkpoint'}") \
                from None
        self.log.say(f"[checkpoint] {path}")
        return str(path)

    @classmethod
    def resume(cls, run_dir: str | Path, quiet: bool = False) -> "Trainer":
        """A trainer for ``run_dir`` that continues from its newest intact checkpoint (config from the run). Damaged
        newer checkpoints are skipped with a warning; a checkpoint whose config differs from the run's on anything
        the saved state depends on is an error naming the keys."""
        run_dir = Path(run_dir)
        if not (run_dir / "config.yaml").is_file():
            raise InputError(f"{run_dir}: not a run folder (no config.yaml)")
        cfg = load_config(run_dir / "config.yaml")
        ckpt, skipped = latest_checkpoint(run_dir)
        diff = config_differences(yaml.safe_load((ckpt / CONFIG_FILE).read_text()), cfg.to_dict())
        if diff:
            raise CheckpointError(f"{ckpt} does not match {run_dir / 'config.yaml'}: {'; '.join(diff)}")
        read_metrics_lines(run_dir / "metrics.jsonl")  # not UTF-8: one error line naming it, before anything starts
        for weights in sorted((ckpt / "policy").glob("*.safetensors")):
            check_safetensors(weights)
        trainer = cls(cfg, run_dir, quiet)
        for line in skipped:
            trainer.log.say(f"[resume] warning: skipped a damaged checkpoint: {line}")
        trainer.resume_from = ckpt
        return trainer

    def _restore(self) -> None:
        """Load the checkpoint into the learner and buffer; drop the metrics of steps that will be redone."""
        ckpt = self.resume_from
        state = json.loads((ckpt / DRIVER_STATE).read_text())
        check_model_matches(ckpt, self.policy_path)
        self.step, version = self.learner.load_checkpoint(ckpt)  # the learner owns both
        self.versions.restored(self.step, version)  # the actors start from this checkpoint's policy, its version
        actor_ids = [f"actor{i}" for i in range(self.cfg.rollout.num_actors)]  # RolloutActor.actor_id
        buffer = self._ask(self.buffer.restore.remote(str(ckpt / SNAPSHOT_FILE), actor_ids),
                           "the buffer actor (restore)")
        self.learning.resumed(buffer)  # the counts as the checkpoint had them: the next step counts from there
        line = kept_line(self._ask(self.buffer.resume_report.remote(), "the buffer actor (restore)"))
        if line:
            self.log.say(line)
        metrics = self.run_dir / "metrics.jsonl"
        kept = []
        for line in read_metrics_lines(metrics):
            try:
                if json.loads(line)["step"] <= self.step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line cut off by the crash: its step is redone anyway
                self.log.say(f"[resume] dropped an unreadable line of {metrics}")
        metrics.write_text("".join(line + "\n" for line in kept))
        self.history = [json.loads(line) for line in kept]
        # episodes counted before the crash are history now: the new actors count from zero
        base = state.get("totals", state.get("retired", {}))  # "retired": checkpoints of older versions
        if self.history:
            last = self.history[-1]
            base = {"finished": last["episodes_total"], "em_sum": last["em_sum_total"],
                    "generated_tokens": last.get("generated_tokens_total", 0),
                    "searches": last.get("searches_total", 0),
                    "search_errors": last.get("search_errors_total", 0)}  # fmt: skip
        self._resumed = {"restarts": state["restarts"], "lost_episodes": state["lost_episodes"],
                         "totals": RunTotals(base), "evals_beside": state.get("evals_beside", 0),
                         "evals_skipped": state.get("evals_skipped", 0)}
        self.log.say(f"[resume] {ckpt}: step {self.step}, version {version}")

    def save(self, directory: Path) -> str:
        return self.learner.save_checkpoint(directory)

    def summary(self, start: dict | None, end: dict | None, rollout: list[RolloutStats], seconds: float,
                final: str) -> dict:
        s: dict[str, Any] = {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "version": self.versions.version,
            "train_seconds": seconds,
            "final_checkpoint": final,
            "final_policy": str(Path(final) / "policy"),
            "episodes": self.history[-1]["episodes_total"] if self.history else 0,
            "episodes_failed": sum(r.failed for r in rollout),
            "searches": self.history[-1]["searches_total"] if self.history else 0,
            "search_errors": self.history[-1]["search_errors_total"] if self.history else 0,
            "actor_restarts": dict(self.fleet.restarts),
            "lost_episodes": self.fleet.lost_episodes,
            "exporter_restarts": self.mon.exporter_restarts if self.mon is not None else 0,
            "retriever_restarts": self.fleet.retriever.restarts if self.fleet.retriever is not None else 0,
        }
        if start:
            s["exact_match_start"] = start["all"]["exact_match"]
            s["eval_start"] = eval_brief(start)
        if end:
            s["exact_match_end"] = end["all"]["exact_match"]
            s["eval_end"] = eval_brief(end)
        if self.beside is not None:
            s.update(self.beside.summary())
        if s["search_errors"] > SEARCH_ERROR_WARN_RATE * s["searches"] > 0:
            self.log.say(f"[warn] {s['search_errors']} of {s['searches']} searches in this run failed")
        return s

    def plots(self) -> list[Path]:

        return list(plot_run(self.run_dir))


def kept_line(kept: dict) -> str | None:
    """The ``[resume]`` line for what the buffer's restore kept (``BufferActor.restore``), or None when there
    was nothing in flight to speak of. A checkpoint of an older version recorded neither the groups in flight nor
    the prompt stream positions: said here, once."""
    missing = [what for what, key in (("the groups in flight", "recorded"),
                                      ("the prompt stream positions", "cursors_recorded")) if not kept.get(key)]
    if missing:
        lost = f"; {kept.get('rejected', 0)} episode(s) in flight count as rejected" if kept.get("rejected") else ""
        return (f"[resume] the checkpoint did not record {' or '.join(missing)} (an older version's): nothing "
                f"recorded is taken up{lost}; the prompt streams without a position start from their beginning")
    if kept.get("groups") or kept.get("rejected"):
        unrecorded = (f"; {kept['rejected']} episode(s) whose prompt was not recorded count as rejected"
                      if kept.get("rejected") else "")
        return (f"[resume] {kept.get('groups', 0)} group(s) in flight at the checkpoint "
                f"({kept.get('episodes', 0)} episode(s)) are generated again first{unrecorded}")
    return None


def taken_up_lines(taken: list[dict]) -> list[str]:
    """The ``[resume]`` lines for what the rollout actors took up when they started (``RolloutActor.start``)."""
    groups = sum(len(t.get("groups", [])) for t in taken)
    episodes = sum(int(m) for t in taken for *_, m in t.get("groups", []))
    at = [f"actor{i} pass {t['cursor']['epoch']} prompt {t['cursor']['index']}" for i, t in enumerate(taken)
          if t.get("cursor")]
    lines = [f"[resume] rollout actors: {groups} group(s) in flight at the checkpoint restarted ({episodes} "
             f"episode(s)); prompt streams continue at {', '.join(at) if at else 'their beginning'}"]
    for i, t in enumerate(taken):
        if t.get("note"):
            lines.append(f"[resume] warning: actor{i}'s prompt stream starts from its beginning: {t['note']}")
        if t.get("unknown"):
            lines.append(f"[resume] warning: actor{i}: {len(t['unknown'])} prompt(s) in flight are not in the "
                         f"training data any more (first {t['unknown'][0]!r}); their episodes count as rejected")
    return lines


def train(cfg: Config, quiet: bool = False, resume: str | Path | None = None) -> dict:
    trainer = Trainer.resume(resume, quiet) if resume else Trainer(cfg, quiet=quiet)
    return trainer.run()
