"""``async-agent-rl train``: the whole system on Ray.

The driver's loop, top to bottom (``Trainer.run``, each step ``Trainer.train_step``)::

    prepare inputs        world + tiny model if the config asks; SFT warm start if sft.enabled (``driver/start.py``)
    start components      Ray, retriever server, replay buffer, learner rank(s), N rollout actors; a resumed run
                          restores its checkpoint into them (``driver/restore.py``)
    evaluate (start)      greedy exact match on held-out questions with the starting weights
    start rollouts        every actor runs episodes continuously (no batch barrier), admission-controlled
    for each step:        sample + update: the learner trains on the buffer's next batch (buffer -> learner by
                          object reference; the buffer waits while it has too few fresh groups)
                          publish if due: every k steps the learner bumps its version and the weights reach every
                          actor (``driver/versions.py``, the one holder of the policy version and the learner step)
                          check the fleet: dead or stuck rollout actors restarted, the retriever kept up (fleet.py)
                          record: metrics.jsonl, the console line, the episode sample; checkpoint if due
                          evaluate if due, on rollout actor 0 or beside training (evaluation.py)
    stop rollouts, evaluate (end), save the final policy, plots

Around the loop: a stop request (SIGINT, SIGTERM) ends it at the next safe point with a checkpoint (stops.py); a
lost node holding the learner or the buffer ends it in one line (nodes.py); a step late past the watchdog's limit
(limits.py) ends it with the fleet's report. The run's files land in ``run_dir``: ``config.yaml``, ``metrics.jsonl``,
``eval.jsonl``, ``episodes/`` (a sample per step, for ``async-agent-rl view``), ``checkpoints/``, ``final/``, ``plots/``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ray  # also sets up the "ray" logger and its console handler, which driver.console.logs_to_file redirects
from ray.exceptions import GetTimeoutError

from actors.rollout_actor import create_evaluator, create_rollout_actors
from async_agent_rl.config import Config
from async_agent_rl.stats import LearnerStats, RolloutStats
from async_agent_rl.waits import WaitTimeout, bounded, call_within
from async_agent_rl.weight_group import backend_for
from buffer.actor import create_buffer_actor
from driver.checkpoints import Checkpoints
from driver.cluster import (
    check_actors_fit, check_address, check_job_paths, check_machines, check_placement, job_runtime_env,
    link_ray_logs, ray_init,
)
from driver.console import LOG_FILE, RunLog, closing_lines, logs_to_file, start_lines, wait_line
from driver.evaluation import EvaluationBeside, Evaluations
from driver.fleet import Fleet
from driver.limits import REPORT_TIMEOUT_S, ProgressWatchdog, RunFailed, ask, first_step_s, stop_s
from driver.limits import model_bytes, phase_limit
from driver.nodes import CoreNodes
from driver.plots import plot_run
from driver.prepare import prepare  # noqa: F401 - benchmarks/sft_bench.py imports it from here
from driver.reaper import reaper
from driver.records import Records
from driver.restore import Restored, restore, resume_inputs, taken_up_lines
from driver.run_folder import hold, set_aside_earlier_run
from driver.start import learner_started, observe_components, pad_id, prepare_inputs, set_up, start_monitoring
from driver.stops import StopRequested, StopRequests
from driver.versions import PolicyVersions
from driver.weight_sync import create_publisher
from learner.actor import create_learner_group
from monitoring.episode_sample import EpisodeSample
from monitoring.exporter import RunMonitoring
from retriever.server import ServerProcess, exposure_warning, spawn_server

log = logging.getLogger(__name__)


SUPERVISE_WHILE_WAITING_S = 5.0  # while waiting for a batch, check the rollout actors this often
STEP_LIMIT_OFF_S = 7 * 86400.0  # one learner step's limit with the watchdog off
RAY_SHUTDOWN_S = 60.0
ray_shutdown_stuck = False  # set when ray.shutdown() did not return: the process then ends without waiting for it


def _shutdown_ray() -> None:
    """``ray.shutdown()``, bounded: a component left stopped or hung must not keep the run from ending with its
    line. If it does not return within ``RAY_SHUTDOWN_S``, the run ends anyway (the CLI exits at once after its
    last line) and the run's reaper ends what is left of the cluster."""
    global ray_shutdown_stuck
    try:
        call_within(ray.shutdown, timeout_s=RAY_SHUTDOWN_S, what="ray.shutdown()")
    except WaitTimeout:
        ray_shutdown_stuck = True
        log.warning("ray.shutdown() did not return within %.0f s; the run's reaper ends the cluster's processes",
                    RAY_SHUTDOWN_S)


class Trainer:
    """The RL loop (see the module docstring). The learner step and the policy version are ``self.versions``', the
    rollout actors and the retriever ``self.fleet``'s (once started); stop requests, checkpoints, the core nodes,
    the evaluations and the records each have their own part."""

    def __init__(self, cfg: Config, run_dir: Path | None = None, quiet: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run_dir)
        self.log = RunLog(self.run_dir, quiet)
        self.policy_path = cfg.model.path
        self.versions = PolicyVersions(cfg, None, None, self.log.say)  # the learner and publisher once started
        self.fleet: Fleet | None = None
        self.mon: RunMonitoring | None = None
        self.episodes: EpisodeSample | None = None
        self.learner: Any = None
        self.buffer: Any = None
        self.url = cfg.retriever.url
        self.resume_from: Path | None = None
        self.taken_up: list[dict] = []  # a resumed run: what each rollout actor took up (RolloutActor.start)
        self.watchdog = ProgressWatchdog(cfg.cluster.progress_timeout_s, floor=first_step_s(cfg))
        self.stops = StopRequests(self.log.say, lambda: self.step)
        self.checkpoints = Checkpoints(cfg, self.run_dir, self.log.say, self.stops)
        self.nodes = CoreNodes(cfg, self.run_dir)
        self.records = Records(cfg, self.log)
        self.evaluations = Evaluations(cfg, self.records.eval, self.stops)

    @property
    def step(self) -> int:
        """The learner's newest step (``PolicyVersions.learner_step``: the one holder)."""
        return self.versions.learner_step

    @property
    def actors(self) -> list[Any]:  # the rollout actors the run has (those given up after a node loss left out)
        return [a for _, a in self.fleet.active]

    # --------------------------------------------------------------------------------------------- the loop
    def run(self) -> dict:
        cfg = self.cfg
        closing = None
        with ExitStack() as stack:
            stack.enter_context(hold(self.run_dir))  # one run at a time in a run folder
            check_address(cfg)  # an address with no cluster behind it: one error line now, not after the warm start
            if self.resume_from is None:
                # a fresh run never mixes into an earlier run's results (kept in RUN_DIR.N unless told to delete)
                moved = set_aside_earlier_run(self.run_dir, delete=cfg.run.delete_earlier_run)
                if moved:
                    self.log.say(f"[run] {moved}")
            cfg.save(self.run_dir / "config.yaml")
            self.stops.catch(stack)
            stack.enter_context(logs_to_file(self.run_dir / LOG_FILE))
            self.log.say(f"[run] {self.run_dir}: {cfg.learner.total_steps} RL steps; engine, Ray and library logs "
                         f"go to {self.run_dir / LOG_FILE}")
            try:
                self.policy_path = prepare_inputs(cfg, self.run_dir, self.log.say, self.stops)
                self.stops.check()
                self.start_components(stack)
                self.stops.check()
                start = (self.evaluations.waited(self.actors[0], "start", self.step, self.versions.version)
                         if cfg.eval.at_start and self.resume_from is None else None)
                self.stops.check()
                self.start_rollouts()
                t0 = time.monotonic()
                self.records.first_step = self.step
                with self.nodes.watch(lambda: self.step):
                    while self.step < cfg.learner.total_steps:
                        self.train_step(t0)
                        self.stops.check()
                        self.evaluations.after_step(self.step, self.versions, self.actors[0], self.stops)
                self.evaluations.finish(self.step, self.stops)  # the last one beside training, if it still runs
            except StopRequested:  # a checkpoint of the current step (the learner is idle at every safe point)
                saved = None
                if self.step > 0 and self.learner is not None:
                    saved = self.checkpoints.existing(self.step) or self.checkpoint()
                closing = self.stops.closing(cfg.learner.total_steps, saved, self.run_dir)
            if closing is None:
                rollout = self.stop_rollouts()
                end = (self.evaluations.waited(self.actors[0], "end", self.step, self.versions.version)
                       if cfg.eval.at_end else None)
                final = self.checkpoints.learner_save(self.learner, self.run_dir / "final", "the final policy")
                summary = self.records.summary(str(self.run_dir), self.step, start, end, rollout,
                                               time.monotonic() - t0, final, self.evaluations.summary())
                (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
                plots = list(plot_run(self.run_dir))
        if closing is not None:  # stopped by a signal: one line, after Ray is down; episodes in flight not waited for
            self.log.say(closing)
            return {"run_dir": str(self.run_dir), "steps": self.step, "stopped_by": self.stops.signal}
        for line in closing_lines(summary, start, end, plots, self.run_dir):
            self.log.say(line)
        return summary

    def train_step(self, t0: float) -> None:
        """One RL step: the learner samples a batch from the buffer and updates on it; the new weights are published
        to the rollout actors when due; the fleet is checked and the step recorded; a checkpoint when due.
        Evaluation runs between steps (``run``). ``t0``: when the RL loop started."""
        metrics, wait_s = self._sample_and_update()
        self.nodes.note(self.buffer, self.learner)  # where the learner and the buffer run, once
        publish = self.versions.stepped(metrics.step)  # the learner's step; its weights published when due
        rollout = self.fleet.supervise()
        self.records.step(self.step, metrics, publish, rollout, wait_s, t0)
        if self.episodes is not None:  # the batch just trained on, before the next step's sample replaces it
            self.episodes.record(self.step, self.buffer.latest_batch.remote(self.episodes.per_step))
        if self.checkpoints.due(self.step):
            self.checkpoint()  # after the step's metrics line: a resume keeps exactly the lines up to here

    def checkpoint(self) -> str:
        """A checkpoint of the current step (``driver.checkpoints``); ``train --resume RUN_DIR`` continues from the
        newest complete one."""
        return self.checkpoints.save(self.step, self.learner, self.buffer, self.fleet, self.evaluations.beside)

    # ------------------------------------------------------------------------------------------------ start
    def start_components(self, stack: ExitStack) -> None:
        cfg = self.cfg
        stack.enter_context(reaper())  # first in, last out: if this process is killed, nothing of the run outlives it
        # (read before ray.init, which sets RAY_ADDRESS for this process' children)
        local_cluster = not (cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS"))
        # the policy's pad id, for the buffer: its tokenizer (and transformers, seconds to import) loads while Ray
        # starts, which mostly waits for the cluster's processes
        pad = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="pad-id")).submit(pad_id, self.policy_path)
        ray_init(cfg)
        stack.callback(_shutdown_ray)
        self.stops.catch(stack)  # ray.init put its own SIGTERM handler (sys.exit) in place of ours
        if local_cluster:
            check_actors_fit(cfg, ray.cluster_resources())
        check_placement(cfg, ray.nodes())  # the nodes cluster.*_resources name: before any actor waits for them
        check_machines(cfg, ray.nodes(), ray.util.get_node_ip_address())  # loopback-only parts, several machines
        check_job_paths(cfg, ray.nodes(), job_runtime_env())  # a job's relative paths, several nodes
        link_ray_logs(self.run_dir / "ray_logs")
        # The slow starts overlap, each mostly one core: the learner ranks (DeepSpeed) start in a thread while the
        # retriever server builds its index and the rollout actors start their engines (which need its URL); on the
        # quickstart, one after the other took ~55 s. A stop does not wait for the thread: Ray's shutdown ends it.
        learner_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": self.policy_path})})
        restored: Restored | None = None
        stack.callback((pool := ThreadPoolExecutor(1, thread_name_prefix="start-learner")).shutdown, wait=False)
        learner = pool.submit(create_learner_group, learner_cfg)
        retriever: ServerProcess | None = None  # the retrieval server the run started (None: the user's URL)
        if not cfg.retriever.url:  # a child process the fleet supervises; the user's server is theirs to keep up
            retriever = stack.enter_context(
                spawn_server(cfg.data.corpus_file, cfg.retriever, log_file=self.run_dir / "retriever.log"))
            self.url = retriever.url
        self.log.say(f"[start] retriever {self.url}")
        exposed = None if cfg.retriever.url else exposure_warning(cfg.retriever.host)  # a server the run started
        if exposed:
            log.info(exposed)  # the log file's copy: the terminal has the [warn] line
            self.log.say(f"[warn] {exposed}")
        self.mon = start_monitoring(cfg, self.run_dir, self.url, stack, self.log.say)
        self.buffer = create_buffer_actor(cfg, pad_id=pad.result())
        n = cfg.monitoring.episodes_per_step  # a sample of each step's batch for the run viewer
        self.episodes = EpisodeSample(self.run_dir, self.policy_path, per_step=n) if n else None
        actor_model = self.policy_path
        if self.resume_from is not None:  # the actors start at the learner's restored version
            self.learner = self.versions.learner = learner_started(cfg, learner, self.stops)
            restored = restore(self.resume_from, cfg, self.run_dir, self.policy_path, self.learner, self.buffer,
                               self.versions, self.log.say, self.stops)
            actor_model = str(self.resume_from / "policy")
        actors = create_rollout_actors(cfg, self.url, actor_model, self.versions.version,
                                       max_restarts=cfg.cluster.max_actor_restarts)
        evaluators = [create_evaluator(cfg, self.url, actor_model, self.versions.version)] * cfg.evaluators
        infos = set_up(cfg, actors + evaluators, self.buffer, self.stops)
        if evaluators:
            beside = self.evaluations.beside = EvaluationBeside(cfg, evaluators[0], self.log.say)
            if restored is not None:
                beside.finished, beside.skipped = restored.evals_beside, restored.evals_skipped
            infos = infos[: len(actors)]
            self.log.say("[start] evaluator: evaluations every "
                         f"{cfg.eval.every_steps} steps run beside training on an engine of their own")
        self.learner = self.versions.learner = learner_started(cfg, learner, self.stops)
        self.versions.publisher = create_publisher(
            cfg.weight_sync.method, actors, self.learner, stops=self.stops,
            actor_timeout_s=phase_limit(cfg, "publish", model_bytes(self.policy_path))[0],
            backend=backend_for(cfg.run.device, cfg.weight_sync.backend), timeout_s=cfg.weight_sync.timeout_s)
        stack.callback(self.versions.close)

        def restarted() -> None:
            """A rollout actor was restarted: its restart does not count against the watchdog (it has its own limit,
            ``cluster.actor_setup_timeout_s``), and the monitor's counters move."""
            self.watchdog.waiting()
            if self.mon is not None:
                self.mon.driver.update(self.fleet.driver_stats())

        self.fleet = Fleet(cfg, self.log.say, self.buffer, actors, self.versions, retriever, local_cluster,
                           on_restart=restarted)
        if restored is not None:
            self.fleet.restarts, self.fleet.lost_episodes = restored.restarts, restored.lost_episodes
            self.fleet.totals = restored.totals
        self.records.start(self.fleet, self.versions, self.buffer, self.mon, self.url, restored)
        for line in start_lines(cfg.learner.num_ranks, infos):
            self.log.say(line)

    def start_rollouts(self) -> None:
        taken = ask([a.start.remote() for a in self.actors], self.cfg.cluster.actor_timeout_s,
                    "a rollout actor asked to start")
        if self.resume_from is not None:
            self.taken_up = taken
            for line in taken_up_lines(taken):
                self.log.say(line)
        if self.mon is not None:
            self.mon.driver.update(self.fleet.driver_stats())  # every actor's restart count from 0 on
            self.mon.poll(observe_components(self.mon, lambda: self.actors, self.buffer),
                          every_s=self.cfg.monitoring.log_every_s)

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
            self.stops.check()  # the learner is idle here: a stop can checkpoint
            if self.watchdog.expired():
                raise self._stalled("waiting for a batch (idle)", healthy=True)
            if time.monotonic() > next_report:
                next_report += 60.0
                b = ask(self.buffer.stats.remote(), self.cfg.cluster.actor_timeout_s, "the buffer actor")
                self.log.say(wait_line(time.monotonic() - wait0, b))
        self.watchdog.step_done()
        return metrics, max(0.0, time.monotonic() - wait0 - metrics.step_time_s)

    def _learner_step(self, batch: "ray.ObjectRef") -> LearnerStats | None:
        """``self.learner.train_step(batch)``, watched: it runs in a thread of its own while this one checks every
        few seconds that the step has not been going on for longer than the watchdog allows (a buffer that never
        answers ``sample_batch``, a learner whose step never ends). The learner group's own limit for the step is
        the watchdog's, with the room its report needs (the watchdog ends a slow step first); a week when the
        watchdog is off (``cluster.progress_timeout_s=0``)."""
        box: dict[str, Any] = {}
        limit = self.watchdog.limit()
        step_limit = STEP_LIMIT_OFF_S if limit is None else limit + SUPERVISE_WHILE_WAITING_S + 3 * REPORT_TIMEOUT_S

        def call() -> None:
            try:
                box["stats"] = self.learner.train_step(batch, step_limit)
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
                if bounded(ray.wait, [batch], timeout_s=0, what="the batch", fetch_local=False)[0]:
                    if no_batch is None:  # fetched once, when the run is about to end
                        try:
                            no_batch = bounded(ray.get, batch, timeout_s=REPORT_TIMEOUT_S, what="the batch") is None
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

    def _stalled(self, learner_state: str, healthy: bool) -> RunFailed:
        """What ends a run in which no step completed within the watchdog's limit: the fleet's report of every
        component in one line and, when the learner and the buffer can still save one, a checkpoint."""
        def save() -> str:
            return f"checkpoint {self.checkpoint()}" if self.step > 0 else "no checkpoint (no step yet)"

        return self.fleet.stall_report(step=self.step, waited=self.watchdog.waited(),
                                       limit=self.watchdog.limit() or 0.0, learner=learner_state,
                                       checkpoint=save if healthy else None, floor=self.watchdog.floor)

    # ------------------------------------------------------------------------------------------------ the end
    def stop_rollouts(self) -> list[RolloutStats]:
        """The rollouts stopped at the end of the run (``Fleet.stop``): every actor's last stats."""
        return self.fleet.stop(stop_s(self.cfg))

    @classmethod
    def resume(cls, run_dir: str | Path, quiet: bool = False) -> "Trainer":
        """A trainer for ``run_dir`` that continues from its newest intact checkpoint (config from the run). Damaged
        newer checkpoints are skipped with a warning; a checkpoint whose config differs from the run's on anything
        the saved state depends on is an error naming the keys (``driver.restore.resume_inputs``)."""
        cfg, ckpt, skipped = resume_inputs(Path(run_dir))
        trainer = cls(cfg, Path(run_dir), quiet)
        for line in skipped:
            trainer.log.say(line)
        trainer.resume_from = ckpt
        return trainer


def train(cfg: Config, quiet: bool = False, resume: str | Path | None = None) -> dict:
    trainer = Trainer.resume(resume, quiet) if resume else Trainer(cfg, quiet=quiet)
    return trainer.run()
