"""``async-agent-rl train``: the whole system on Ray.

The driver's loop, top to bottom::

    prepare inputs        world + tiny model if the config asks; SFT warm start if sft.enabled
    start components      Ray, retriever server, replay buffer, learner rank(s), N rollout actors
    evaluate (start)      greedy exact match on held-out questions with the starting weights
    start rollouts        every actor runs episodes continuously (no batch barrier), admission-controlled
    for each step:        the learner trains on the buffer's next batch (buffer -> learner by object reference;
                          the buffer waits while it has too few fresh groups), proximal log-probs, advantages,
                          importance-corrected PPO
                          every k steps: the learner bumps its version; publish weights to every actor
                          log metrics, checkpoint
    stop rollouts, evaluate (end), save the final policy, plots

Everything the run produces lands in ``run_dir`` (``run.output_dir/run.name``): ``config.yaml`` (resolved),
``metrics.jsonl`` (one line per step), ``eval.jsonl``, ``checkpoints/``, ``final/``, ``plots/*.png``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import urlsplit

import ray  # also sets up the "ray" logger and its console handler, which _logs_to_file redirects
import transformers
import yaml
from ray._private.worker import global_worker
from ray.exceptions import GetTimeoutError, RayActorError
from transformers import AutoTokenizer

from actors.rollout_actor import create_rollout_actors
from async_agent_rl.config import Config, load_config
from async_agent_rl.errors import InputError, error_line
from async_agent_rl.stats import (
    BufferStats, DriverStats, LearnerStats, LearningStats, PublishStats, RolloutStats, RunTotals,
)
from async_agent_rl.weight_group import backend_for
from buffer.actor import SNAPSHOT_FILE, create_buffer_actor
from driver.plots import plot_run
from driver.prepare import prepare
from driver.reaper import reaper
from driver.weight_sync import WeightsRefused, create_publisher
from learner.actor import create_learner_group
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


class RunFailed(InputError):
    """A component failed for good (a rollout actor out of restarts, weight publishes that keep failing): the run
    ends with one ``error:`` line naming it and the cause (exit status 2, as the CLI maps ``InputError``)."""


def check_actors_fit(cfg: Config, resources: dict[str, float]) -> None:
    """On the local cluster the run starts, every actor must fit at once (a dead rollout actor's share is freed
    for its restart): Ray leaves an actor it cannot place pending for ever. One ``InputError`` naming the keys."""
    for res in ("CPU", "GPU"):
        parts = cfg.actor_asks(res)
        need, have = sum(n * each for _, n, each in parts), resources.get(res, 0.0)
        if need > have + 1e-9:
            detail = ", ".join(f"{name} {n} x {each:g}" for name, n, each in parts if each)
            fix = "raise cluster.num_cpus or lower cluster.*_cpus" if res == "CPU" else "lower cluster.*_gpus"
            raise InputError(f"the run's actors ask the local Ray cluster for {need:g} {res}s ({detail}) and it has "
                             f"{have:g}: {fix}")


def _resources(res: dict) -> str:
    return f"{res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs"


def _cause(e: BaseException) -> str:
    """An exception in one line: the component and the cause (unwrapped from Ray), else its type and first line."""
    line = error_line(e)
    if line is not None:
        return line.removeprefix("error: ")
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}".rstrip(": ")


PUBLISH_FAILURES_FATAL = 3  # weight publishes failing in a row that end the run
PROGRESS_FLOOR_S = 600.0  # cluster.progress_timeout_s unset: max(this, PROGRESS_STEPS x the slowest step so far)
PROGRESS_STEPS = 10
REPORT_TIMEOUT_S = 10.0  # a component that does not answer a stall report's question within this is "not answering"
SUPERVISE_WHILE_WAITING_S = 5.0  # while waiting for a batch, check the rollout actors this often
DISK_FULL_BYTES = 64 << 20  # a checkpoint that failed with less free space than this failed for lack of space
RETRIEVER_HEALTH_TIMEOUT_S = 10.0  # the run's retrieval server must answer GET /health within this, or is restarted
SEARCH_ERROR_WARN_RATE = 0.5  # warn when more than this share of a step's searches failed (at least 4 of them)
SEARCH_WARN_EVERY_S = 60.0
DRIVER_STATE = "driver_state.json"


class ProgressWatchdog:
    """When did a learner step last complete, and is that too long ago? (``cluster.progress_timeout_s``)

    The clock runs while the driver waits for a step (a batch from the buffer, then the learner's computation), from
    the moment it asks for one; evaluations, publishes and checkpoints between steps are not counted, and a rollout
    actor's restart starts the clock again (the restart has its own limit, ``cluster.actor_setup_timeout_s``). The
    limit is the configured one, or with none configured ``max(PROGRESS_FLOOR_S, PROGRESS_STEPS x the slowest step
    so far)``; 0 turns the watchdog off."""

    def __init__(self, setting: float | None, clock: Callable[[], float] = time.monotonic):
        self.setting, self.clock = setting, clock
        self.slowest = 0.0  # seconds, the slowest completed step (waiting included)
        self.since = clock()

    def limit(self) -> float | None:
        if self.setting == 0:
            return None
        if self.setting is not None:
            return float(self.setting)
        return max(PROGRESS_FLOOR_S, PROGRESS_STEPS * self.slowest)

    def waiting(self) -> None:
        """The driver starts waiting for the next step."""
        self.since = self.clock()

    def step_done(self) -> float:
        """A step completed; returns how long it took since ``waiting()``."""
        took = self.clock() - self.since
        self.slowest = max(self.slowest, took)
        self.since = self.clock()
        return took

    def waited(self) -> float:
        return self.clock() - self.since

    def expired(self) -> bool:
        limit = self.limit()
        return limit is not None and self.waited() > limit


def stall_message(*, step: int, waited: float, limit: float, configured: bool, learner: str,
                  buffer: BufferStats | str, actors: Sequence[RolloutStats | str], last_push_s: Sequence[float | None],
                  last_publish: tuple[int, float] | None, checkpoint: str) -> str:
    """The one line a stalled run ends with: how long nothing happened, which component is blocked, and the state
    of every component (``learner``: what the learner does; ``buffer``/``actors``: their stats, or why there are
    none; ``last_push_s``: seconds since each actor's pushed count last rose, None: never; ``last_publish``:
    (version, seconds ago))."""
    running = [a.running for a in actors if isinstance(a, RolloutStats)]
    silent = [i for i, a in enumerate(actors) if isinstance(a, str)]
    if learner.startswith(("computing", "not answering")):
        blocked = f"the learner ({learner})"
    elif isinstance(buffer, str):
        blocked = f"the replay buffer ({buffer})"
    elif silent:
        blocked = f"rollout actor{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} (not answering)"
    elif sum(running) == 0:
        blocked = (f"admission (no episode running: {buffer.admission.groups_open} groups open, the oldest "
                   f"admitted at version {buffer.admission.oldest_open_version}, learner version {buffer.learner_version})")
    else:
        blocked = f"the rollout actors ({sum(running)} episodes running, no batch completed)"
    parts = [f"no learner step completed for {waited:.0f} s (step {step + 1}; limit {limit:.0f} s, "
             f"cluster.progress_timeout_s{'' if configured else ' unset: max(600, 10 x the slowest step)'})",
             f"blocked: {blocked}", f"learner: {learner}"]
    if isinstance(buffer, str):
        parts.append(f"buffer: {buffer}")
    else:
        a = buffer.admission
        parts.append(f"buffer: {buffer.size} rows, {buffer.ready_groups} ready groups, {buffer.pending_groups} "
                     f"pending groups; admission: {a.running} running, {a.groups_open} groups open, oldest open "
                     f"version {a.oldest_open_version}")
    for i, (stats, ago) in enumerate(zip(actors, last_push_s)):
        if isinstance(stats, str):
            parts.append(f"actor{i}: {stats}")
            continue
        pushed = "never pushed" if ago is None else f"last push {ago:.0f} s ago"
        state = "done (error)" if stats.done else ("running" if stats.ready else "not set up")
        parts.append(f"actor{i}: {state}, {stats.running} episodes running, {stats.pushed} pushed, {pushed}, "
                     f"{stats.failed} failed")
    parts.append("last publish: none" if last_publish is None else
                 f"last publish: version {last_publish[0]}, {last_publish[1]:.0f} s ago")
    parts.append(checkpoint)
    return "; ".join(parts)


class Stopped(InputError):
    """A second SIGINT or SIGTERM: the run stops at once, without a checkpoint."""


class _StopRequested(Exception):
    """SIGINT or SIGTERM received: the run stops at the next safe point (``Trainer._check_stop``)."""


def run_totals(stats: RolloutStats) -> dict[str, float]:
    """The rollout totals metrics.jsonl keeps per actor and for the run (``episodes_total``, ``em_sum_total``, ...)."""
    return {"finished": stats.finished, "em_sum": stats.exact_match_sum or 0.0,
            "generated_tokens": stats.generated_tokens, "searches": stats.searches,
            "search_errors": stats.search_errors}


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


class RunLog:
    """Appends JSON lines and prints one progress line per step."""

    def __init__(self, run_dir: Path, quiet: bool = False):
        self.run_dir = run_dir
        self.quiet = quiet
        run_dir.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, record: dict) -> None:
        with open(self.run_dir / name, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)


def _job_env_vars() -> dict[str, str] | None:
    """The runtime-env variables of the ``ray job submit`` job this driver runs in, or None outside a job."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if raw is None:
        return None
    try:
        return dict((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})
    except (ValueError, AttributeError):
        return {}


def _ray_init(cfg: Config) -> None:
    """Connect to ``cluster.ray_address`` (or the job's cluster under ``ray job submit``), else start a local Ray.

    Authentication is Ray's own token authentication and is never turned off here: a local ``ray.init`` turns it on
    (creating ``~/.ray/auth_token`` once) and every process of the cluster, workers included, inherits it.
    ``RAY_AUTH_MODE`` is never put into the workers' runtime env, which is what used to get them rejected. Ray binds
    the local cluster's gRPC servers to every interface (it rewrites a loopback node address to the host's), so a
    local cluster with authentication disabled would let anyone on the network run code here: refused.
    """
    if ray.is_initialized():
        return
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    mode = os.environ.get("RAY_AUTH_MODE")
    if not address and mode is not None and mode.lower() != "token":  # Ray: any set value but "token" is no auth
        raise InputError(f"RAY_AUTH_MODE={mode!r} would start a local Ray cluster that listens on every network "
                         "interface without authentication (Ray turns authentication on only for RAY_AUTH_MODE=token "
                         "or unset); unset it or set it to token")
    if any(k.startswith("RAY_AUTH") for k in cfg.cluster.env_vars):
        raise InputError("cluster.env_vars: RAY_AUTH_* must not be set per worker (workers whose mode differs from "
                         "the cluster's are rejected); set it in the environment of `ray start` instead")
    env = dict(cfg.cluster.env_vars)
    if cfg.run.device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    job_env = _job_env_vars()
    if job_env is not None:
        env = {k: v for k, v in env.items() if k not in job_env}  # Ray refuses to merge a key the job's env sets
        if not Path(cfg.run.output_dir).is_absolute():
            log.warning("run.output_dir=%r is relative: under `ray job submit` it lands in the job's temporary copy "
                        "of the working dir; pass an absolute run.output_dir to keep the run", cfg.run.output_dir)
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
    else:
        _loopback_only()
        if cfg.run.device != "cpu":  # one machine: NCCL's bootstrap and socket transport stay on loopback too
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        # the actors' output (vLLM, DeepSpeed, Ray) stays in the session's log folder, linked from the run folder
        ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, runtime_env={"env_vars": env},
                 log_to_driver=False, logging_level=logging.WARNING, _node_ip_address=LOOPBACK)
        _require_token_auth()


LOOPBACK = "127.0.0.1"
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


def _loopback_only() -> None:
    """Make the local cluster Ray is about to start bind loopback only: its GCS, raylet, workers and agents listen
    on the node's address, and Ray 2.60 rewrites a loopback ``_node_ip_address`` to the host's routable one unless
    "clusters" are off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's switch for single-machine Windows and macOS,
    read by ``ray._private.services.get_node_ip_address``). Ray reads that variable once at import: the driver's
    copy of the constant is set too, and the variable goes to every process the cluster starts."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _require_token_auth() -> None:
    """The mode the started cluster really runs in (Ray's own report, not the environment): anything but token
    authentication is refused, the cluster shut down."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        ray.shutdown()
        raise InputError(f"Ray {ray.__version__} has no token authentication; the project needs Ray >= 2.52") from None
    if not is_token_auth_enabled():
        ray.shutdown()
        raise InputError("the local Ray cluster started without token authentication (Ray reports another mode); "
                         "check RAY_AUTH_MODE and ~/.ray/auth_token")


LOG_FILE = "train.log"


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


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
    transformers.utils.logging.disable_progress_bar()
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
        transformers.utils.logging.enable_progress_bar()


def _eval_brief(rec: dict) -> dict:
    """Exact match and searches per question by question kind (``all`` included) of one evaluation record."""
    return {k: {"exact_match": v["exact_match"], "searches_per_question": v["searches_per_question"], "n": v["n"]}
            for k, v in rec.items() if isinstance(v, dict) and "exact_match" in v}


def closing_lines(summary: dict, start: dict | None, end: dict | None, plots: list[Path], run_dir: Path) -> list[str]:
    """The run's last lines on the terminal: held-out exact match from the start to the end, by question kind, and
    where the results are."""
    failed = f", {summary['search_errors']} failed" if summary.get("search_errors") else ""
    lines = [f"[done] {summary['steps']} RL steps in {_duration(summary['train_seconds'])}; "
             f"{summary.get('searches', 0)} searches{failed}"]
    if start and end:
        for kind in [k for k in end if isinstance(end[k], dict) and "exact_match" in end[k]]:
            a, b = start.get(kind), end[kind]
            if not isinstance(a, dict):
                continue
            name = "held-out" if kind == "all" else f"  {kind}"
            lines.append(
                f"[done] {name:<14} exact match {a['exact_match']:.3f} -> {b['exact_match']:.3f} "
                f"({b['exact_match'] - a['exact_match']:+.3f})   searches/question {a['searches_per_question']:.2f} "
                f"-> {b['searches_per_question']:.2f}   (n={b['n']})")
    lines.append(f"[done] results in {run_dir}: summary.json, metrics.jsonl, eval.jsonl, final/, {LOG_FILE}")
    if plots:
        lines.append(f"[done] plots: {', '.join(str(p) for p in plots)}")
    return lines


class LearningSignals:
    """Per-step learning signals from the components' running totals: the share of completed groups whose rewards
    were all equal (no GRPO signal), and the rollout reward, exact match and searches by question kind over the
    episodes finished since the previous step. Warns when nearly every group has had equal rewards for several
    steps in a row: the policy is then too sure of itself (or too weak) for group-relative advantages."""

    FLAT_SHARE = 0.9  # this share of equal-reward groups or more ...
    FLAT_STEPS = 5  # ... for this many steps in a row: warn
    KIND_TOTALS = {"reward": "reward_sum", "exact_match": "exact_match_sum", "searches": "searches"}

    def __init__(self) -> None:
        self._groups = (0, 0)  # (completed, zero variance) at the previous step
        self._kinds = RunTotals()  # per actor, {(kind, total): value}
        self._previous: dict = {}  # the run's totals by (kind, total) at the previous step
        self._flat_steps = 0
        self._pending: list[str] = []

    def update(self, rollout: Sequence[RolloutStats], buffer: BufferStats, learner: LearnerStats) -> LearningStats:
        completed, flat = buffer.groups_completed, buffer.groups_zero_variance
        d_completed, d_flat = completed - self._groups[0], flat - self._groups[1]
        self._groups = (completed, flat)
        share = d_flat / d_completed if d_completed > 0 else None
        for stats in rollout:
            self._kinds.report(f"actor{stats.index}", stats.incarnation,
                               {(kind, key): v for kind, c in stats.by_kind.items() for key, v in c.items()})
        totals, prev = self._kinds.run(), self._previous
        by_kind = {}
        for kind in sorted({kind for kind, _ in totals}):
            n = totals.get((kind, "finished"), 0.0) - prev.get((kind, "finished"), 0.0)
            if n > 0:
                by_kind[kind] = {"episodes": int(n), **{
                    name: (totals.get((kind, total), 0.0) - prev.get((kind, total), 0.0)) / n
                    for name, total in self.KIND_TOTALS.items()}}
        self._previous = totals
        if share is not None:
            self._flat_steps = self._flat_steps + 1 if share >= self.FLAT_SHARE else 0
            if self._flat_steps == self.FLAT_STEPS:
                self._pending.append(
                    f"{share:.0%} of the groups completed in each of the last {self.FLAT_STEPS} steps had equal "
                    "rewards, so group-relative advantages are zero and RL learns nothing from them. Raise "
                    "rollout.temperature (more varied answers) or rollout.group_size (more chances of a spread), or "
                    "change the warm start (too weak: all wrong; too strong: all right)")
        return LearningStats(zero_variance_share=share, entropy=learner.entropy, by_kind=by_kind)

    def warnings(self) -> list[str]:
        out, self._pending = self._pending, []
        return out


def _link_ray_logs(link: Path) -> None:
    """``link`` -> this Ray session's log folder (every actor's stdout and stderr), replacing an older link."""
    node = getattr(global_worker, "node", None)
    logs = node.get_logs_dir_path() if node is not None else None
    if not logs or not Path(logs).is_dir():
        return
    if link.is_symlink():
        link.unlink()
    if not link.exists():
        link.symlink_to(Path(logs).resolve(), target_is_directory=True)


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path | None = None, quiet: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run_dir)
        self.log = RunLog(self.run_dir, quiet)
        self.policy_path = cfg.model.path
        self.version = 0
        self.step = 0
        self.published_step = 0  # the learner step whose weights are version ``self.version``
        self.history: list[dict] = []
        self.weights_ref = None  # the last published weights (a restarted actor gets them)
        self.restarts: dict[str, int] = {}
        self.publish_failures = 0  # weight publishes failed in a row
        self.retriever: ServerProcess | None = None  # the retrieval server the run started (None: the user's URL)
        self.mon: RunMonitoring | None = None
        self._pids: dict[int, int] = {}  # each rollout actor's process, as it last reported
        self._local_cluster = False  # the run started its own Ray cluster on this machine
        self._ray_restarts: dict[int, int] = {}  # restarts of the actors this process made (a resume's start from 0)
        self.lost_episodes = 0
        self.totals = RunTotals()  # the run's rollout totals (run_totals), restarted actors and a resume included
        self.resume_from: Path | None = None
        self.learning = LearningSignals()
        self.first_step: int | None = None  # the step the RL loop started from (a resumed run: its checkpoint's)
        self._search_warned_at = -SEARCH_WARN_EVERY_S
        self.watchdog = ProgressWatchdog(cfg.cluster.progress_timeout_s)
        self._pushes: dict[int, tuple[str, int, float]] = {}  # actor -> (incarnation, pushed, when it last rose)
        self._last_publish: tuple[int, float] | None = None  # (version, monotonic time)
        self.stop_signal: int | None = None  # SIGINT or SIGTERM received: stop at the next safe point
        self.in_warm_start = False

    # --------------------------------------------------------------------------------------------- the loop
    def run(self) -> dict:
        cfg = self.cfg
        cfg.save(self.run_dir / "config.yaml")
        closing = None
        with ExitStack() as stack:
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
                while self.step < cfg.learner.total_steps:
                    self.train_step(t0)
                    self._check_stop()
                    if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0 and self.step < cfg.learner.total_steps:
                        self.evaluate(f"step {self.step}")
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

    # ------------------------------------------------------------------------------------------------ steps
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
        self._local_cluster = not (cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS"))
        _ray_init(cfg)
        stack.callback(_shutdown_ray)
        if self._local_cluster:
            check_actors_fit(cfg, ray.cluster_resources())
        _link_ray_logs(self.run_dir / "ray_logs")
        # The slow starts overlap, each mostly one core: the learner ranks (DeepSpeed) start in a thread while the
        # retriever server builds its index and the rollout actors start their engines (which need its URL). On
        # the quickstart, one after the other took about 55 s.
        learner_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": self.policy_path})})
        with ThreadPoolExecutor(1, thread_name_prefix="start-learner") as pool:
            learner = pool.submit(create_learner_group, learner_cfg)
            if cfg.retriever.url:  # the user's server: theirs to keep up
                self.url, self.retriever = cfg.retriever.url, None
            else:  # a child process the run supervises (``_supervise_retriever``)
                self.retriever = stack.enter_context(
                    spawn_server(cfg.data.corpus_file, cfg.retriever, log_file=self.run_dir / "retriever.log"))
                self.url = self.retriever.url
            self.log.say(f"[start] retriever {self.url}")
            exposed = None if cfg.retriever.url else exposure_warning(cfg.retriever.host)  # a server the run started
            if exposed:
                log.warning(exposed)
                self.log.say(f"[warn] {exposed}")
            self.mon = self._start_monitoring(stack)
            self.pad_id = self._pad_id()
            self.buffer = create_buffer_actor(cfg, pad_id=self.pad_id)
            actor_model, actor_version = self.policy_path, 0
            if self.resume_from is not None:  # the actors start at the learner's restored version
                self.learner = self._started(learner.result)
                self._restore()
                actor_model, actor_version = str(self.resume_from / "policy"), self.version
            self.actors = create_rollout_actors(
                cfg, self.buffer, self.url, actor_model, actor_version, max_restarts=cfg.cluster.max_actor_restarts
            )
            infos = self._started(lambda: ray.get([a.setup.remote() for a in self.actors],
                                                  timeout=cfg.cluster.actor_setup_timeout_s), what="rollout")
            self.learner = self._started(learner.result)
        self.publisher = create_publisher(cfg.weight_sync.method, self.actors, self.learner,
                                          actor_timeout_s=cfg.cluster.actor_timeout_s,
                                          backend=backend_for(cfg.run.device, cfg.weight_sync.backend),
                                          timeout_s=cfg.weight_sync.timeout_s)
        stack.callback(self._close_publisher)
        self.log.say(f"[start] buffer, {cfg.learner.num_ranks} learner rank(s), rollout actors {infos}")

    def _started(self, start: Callable[[], Any], what: str = "learner") -> Any:
        """``start()``: the learner group or the rollout actors' set-up, each bounded by
        ``cluster.actor_setup_timeout_s``; past it, one error line naming what did not start and what it asks Ray
        for (a rank or an actor Ray cannot place waits forever otherwise)."""
        c = self.cfg.cluster
        try:
            return start()
        except GetTimeoutError:
            if what == "learner":
                n, asks = self.cfg.learner.num_ranks, f"cluster.learner_cpus={c.learner_cpus:g}, learner_gpus=" \
                                                     f"{c.learner_gpus:g}"
            else:
                n, asks = self.cfg.rollout.num_actors, f"cluster.rollout_actor_cpus={c.rollout_actor_cpus:g}, " \
                                                       f"rollout_actor_gpus={c.rollout_actor_gpus:g}"
            raise RunFailed(f"the {n} {what} actor(s) were not started within cluster.actor_setup_timeout_s="
                            f"{c.actor_setup_timeout_s:g} s (each asks Ray for {asks}; the cluster has "
                            f"{_resources(ray.cluster_resources())})") from None

    def _close_publisher(self) -> None:
        """The learner's side of the collective path's group, released before Ray shuts down (a learner that is
        already gone has nothing left to release)."""
        try:
            self.publisher.close()
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
        """``ray.get(ref)`` bounded by ``cluster.actor_timeout_s``: a component that stopped (SIGSTOP, a hang) never
        answers, and the driver must not wait for it forever; ``what`` names it in the run's one error line."""
        limit = self.cfg.cluster.actor_timeout_s
        try:
            return ray.get(ref, timeout=limit)
        except GetTimeoutError:
            raise RunFailed(f"{what} did not answer within cluster.actor_timeout_s={limit:g} s (hung or stopped)") \
                from None

    def _observe_components(self) -> None:
        self.mon.observe(rollout=ray.get([a.stats.remote() for a in self.actors], timeout=REPORT_TIMEOUT_S),
                         buffer=ray.get(self.buffer.stats.remote(), timeout=REPORT_TIMEOUT_S))

    def _pad_id(self) -> int:
        tok = AutoTokenizer.from_pretrained(self.policy_path)
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def start_rollouts(self) -> None:
        ray.get([a.start.remote() for a in self.actors])
        if self.mon is not None:
            self.mon.driver.update(self._driver_stats())  # every actor's restart count from 0 on
            self.mon.poll(self._observe_components, every_s=self.cfg.monitoring.log_every_s)

    def _driver_stats(self) -> DriverStats:
        restarts = {f"actor{i}": self.restarts.get(f"actor{i}", 0) for i in range(len(self.actors))}
        return DriverStats(self.lost_episodes, restarts)

    def train_step(self, t0: float) -> None:
        """One RL step: the learner samples a batch from the buffer and updates on it; the new weights are published
        to the rollout actors (every ``weight_sync.every_steps``); the step is recorded; a checkpoint when due.
        Evaluation runs between steps (``run``)."""
        metrics, wait_s = self._sample_and_update()
        self.step = metrics.step
        publish = self._publish_if_due()
        self._record_step(metrics, publish, wait_s, t0)
        if self.cfg.learner.checkpoint_every and self.step % self.cfg.learner.checkpoint_every == 0:
            self.checkpoint()  # after the step's metrics line: a resume keeps exactly the lines up to here

    def _sample_and_update(self) -> tuple[LearnerStats, float]:
        """The learner's step on the next batch, and the seconds until that batch reached the learner. While no
        batch comes, the actors are supervised (a dead one is restarted), a stop request is honoured and the
        watchdog is checked; once a minute a line says why there is no batch."""
        wait0 = time.monotonic()
        next_report = wait0 + 60.0
        self.watchdog.waiting()
        while True:
            # the batch goes from the buffer to the learner by reference; None: no batch within the timeout
            batch = self.buffer.sample_batch.remote(self.version, SUPERVISE_WHILE_WAITING_S)
            metrics = self._learner_step(batch)
            if metrics is not None:
                break
            # an actor that died while the buffer is short would otherwise never be restarted: no batch comes
            self.supervise()
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

    def _publish_if_due(self) -> PublishStats | None:
        """Bump the policy version and publish it when this step is a publishing step; None otherwise (or when the
        publish failed, see ``publish``)."""
        if self.step % self.cfg.weight_sync.every_steps:
            return None
        self.version, self.published_step = self.learner.bump_version(), self.step
        # the object-store path keeps the weights it published (a restarted actor gets them); the collective path
        # sends them from the learner and takes them again for a restarted actor only
        self.weights_ref = self.learner.state_dict_ref() if self.cfg.weight_sync.method == "object_store" else None
        return self.publish()

    def _record_step(self, metrics: LearnerStats, publish: PublishStats | None, wait_s: float, t0: float) -> None:
        """Everything a step reports: actors supervised and their stats, the monitor, the learning signals and their
        warnings, one metrics.jsonl record and the console line."""
        rollout = self.supervise()
        buffer = self._ask(self.buffer.stats.remote(), "the buffer actor")
        if self.mon is not None:
            healed = self.mon.heal()  # an exporter whose thread died serves again (not a reason to stop a run)
            if healed:
                self.log.say(f"[fault] {healed}")
            self.mon.observe(rollout=rollout, buffer=buffer, learner=metrics, publish=publish)
        record = self._record(metrics, publish, rollout, buffer, wait_s, time.monotonic() - t0)
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

    def _learner_step(self, batch: "ray.ObjectRef") -> LearnerStats | None:
        """``self.learner.train_step(batch)``, watched: it runs in a thread of its own while this one checks every
        few seconds that the step has not been going on for longer than the watchdog allows (a buffer that never
        answers ``sample_batch``, a learner whose step never ends)."""
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["stats"] = self.learner.train_step(batch)
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

    def _stalled(self, learner_state: str, healthy: bool) -> RunFailed:
        """What ends a run in which no step completed within the watchdog's limit: the state of every component in
        one line and, when the learner and the buffer can still save one, a checkpoint."""
        timeout = REPORT_TIMEOUT_S
        buffer: BufferStats | str
        try:
            buffer = ray.get(self.buffer.stats.remote(), timeout=timeout)
        except GetTimeoutError:
            buffer = f"not answering (stats() took more than {timeout:.0f} s)"
        except ray.exceptions.RayError as e:
            buffer = f"failed: {_cause(e)}"
        actors: list[RolloutStats | str] = []
        for i, actor in enumerate(self.actors):
            try:
                stats = ray.get(actor.stats.remote(), timeout=timeout)
                self._note_pushes(i, stats)
                actors.append(stats)
            except GetTimeoutError:
                actors.append(f"not answering (stats() took more than {timeout:.0f} s)")
            except ray.exceptions.RayError as e:
                actors.append(f"failed: {_cause(e)}")
        now = time.monotonic()
        pushes = [now - p[2] if (p := self._pushes.get(i)) and p[2] is not None else None
                  for i in range(len(self.actors))]
        publish = None if self._last_publish is None else (self._last_publish[0], now - self._last_publish[1])
        if healthy and not isinstance(buffer, str):
            try:
                checkpoint = f"checkpoint {self.checkpoint()}" if self.step > 0 else "no checkpoint (no step yet)"
            except Exception as e:  # noqa: BLE001 - the stall is what the line reports; the save is a bonus
                checkpoint = f"checkpoint failed: {_cause(e)}"
        else:
            checkpoint = "no checkpoint (the learner or the buffer is busy)"
        limit = self.watchdog.limit() or 0.0
        return RunFailed(stall_message(
            step=self.step, waited=self.watchdog.waited(), limit=limit,
            configured=self.cfg.cluster.progress_timeout_s is not None, learner=learner_state, buffer=buffer,
            actors=actors, last_push_s=pushes, last_publish=publish, checkpoint=checkpoint))

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
            f"{record['episodes_per_s']:.0f} ep/s  wait {record['sample_wait_s']:.1f}s  left {_duration(left)}"
        )

    def publish(self) -> PublishStats | None:
        """Publish the learner's weights as ``self.version`` (both paths); None when the publish failed.

        A failure (an engine's WeightsError, no room in /dev/shm for the fp32 copy, a refusal of the specs, a
        non-finite tensor, a dead actor) is printed with its cause; a dead or restarted actor is then restarted by
        ``supervise()`` with the newest weights. The engines that missed it stay on older weights while the learner's
        version climbs, so ``PUBLISH_FAILURES_FATAL`` failures in a row end the run with ``RunFailed`` naming the
        cause instead of training on ever staler episodes (the buffer's staleness bound would stall it)."""
        try:
            stats = self.publisher.publish(self.version, self.weights_ref)
        except (ray.exceptions.RayError, WeightsRefused, OSError) as e:
            self.publish_failures += 1
            cause = _cause(e)
            msg = f"weight publish of version {self.version} failed ({self.publish_failures} in a row): {cause}"
            log.warning(msg)
            self.log.say(f"[fault] {msg}")
            if self.publish_failures >= PUBLISH_FAILURES_FATAL:
                raise RunFailed(f"weight publish failed {self.publish_failures} times in a row (the engines keep older "
                                f"weights while the learner moves on); the last: {cause}") from None
            return None
        self.publish_failures = 0
        self._last_publish = (self.version, time.monotonic())
        return stats

    def supervise(self) -> list[RolloutStats]:
        """Every rollout actor's stats (folded into the run's totals); an actor that died (or stopped answering) is
        restarted, its in-flight episodes counted lost, and it gets the current weights before it runs again. One that stopped answering
        may still be alive: it is killed first (Ray restarts it), so ``setup()`` never builds a second engine in a live
        incarnation and it generates nothing more; a push it sent before dying is dropped by the buffer as late.

        One that is alive but stopped generating (``stats.done``: its push to the buffer failed, or its report of a
        lost episode, or admission) is killed and restarted the same way, its cause on the console. Once
        ``cluster.max_actor_restarts`` restarts of an actor are used up, the next problem ends the run with
        ``RunFailed`` naming the actor and the cause (one ``error:`` line), instead of a run that waits forever."""
        self._supervise_retriever()
        out = []
        for i, actor in enumerate(self.actors):
            kill = False
            try:
                stats = ray.get(actor.stats.remote(), timeout=self.cfg.cluster.actor_timeout_s)
                problem = None if stats.ready else "restarted by Ray, not set up"
                if stats.ready and stats.done:  # alive, but generates nothing more: the run would wait forever
                    cause = ray.get(actor.error.remote(), timeout=self.cfg.cluster.actor_timeout_s)
                    problem, kill = f"stopped generating: {cause}", True
            except (RayActorError, GetTimeoutError) as e:
                problem = type(e).__name__
                kill = isinstance(e, GetTimeoutError)  # silent, perhaps only slow: stop this incarnation first
            if problem:
                used, allowed = self._ray_restarts.get(i, 0), self.cfg.cluster.max_actor_restarts
                if used >= allowed and problem != "restarted by Ray, not set up":
                    raise RunFailed(f"rollout actor {i}: {problem} (restarted {used} time(s) already, "
                                    f"cluster.max_actor_restarts={allowed})")
                self.log.say(f"[fault] rollout actor {i}: {problem}; restarting it")
                if kill:
                    self._end_hung_process(i)
                    ray.kill(actor, no_restart=False)
                self._restart_actor(i)
                self.watchdog.waiting()  # a restart is bounded by actor_setup_timeout_s; it is not a stall
                stats = self._ask(actor.stats.remote(), f"rollout actor {i}, just restarted,")
            self.totals.report(f"actor{stats.index}", stats.incarnation, run_totals(stats))
            self._note_pushes(i, stats)
            out.append(stats)
        return out

    def _supervise_retriever(self) -> None:
        """The retrieval server the run started is restarted on its port (the actors' URL stays valid) when it
        exited or stopped answering ``/health`` (hung, SIGSTOP); a restart that fails ends the run in one error line.
        Searches made meanwhile failed and were counted (error observations), as in any outage."""
        if self.retriever is None:
            return
        problem = self.retriever.healthy(RETRIEVER_HEALTH_TIMEOUT_S)
        if problem is None:
            return
        try:
            url = self.retriever.restart()
        except Exception as e:  # noqa: BLE001 - reported as the run's end
            raise RunFailed(f"retrieval server {problem} and could not be restarted: {_cause(e)}") from None
        self.log.say(f"[fault] retrieval server {problem}; restarted on {url} ({self.retriever.restarts} restart(s))")

    def _end_hung_process(self, i: int) -> None:
        """SIGKILL rollout actor ``i``'s process when it runs on this machine (a local cluster): a stopped or hung
        process never acts on ``ray.kill``'s request, and Ray would not restart it."""
        pid = self._pids.get(i)
        if pid and self._local_cluster:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _note_pushes(self, i: int, stats: RolloutStats) -> None:
        if stats.pid:
            self._pids[i] = stats.pid
        prev = self._pushes.get(i)
        if prev is None or prev[0] != stats.incarnation or stats.pushed > prev[1]:
            when = time.monotonic() if stats.pushed > 0 else (prev[2] if prev else None)
            self._pushes[i] = (stats.incarnation, stats.pushed, when)

    def _restart_actor(self, i: int) -> None:
        actor, actor_id = self.actors[i], f"actor{i}"
        lost = self._ask(self.buffer.actor_lost.remote(actor_id), "the buffer actor")
        self.lost_episodes += lost
        self.restarts[actor_id] = self.restarts.get(actor_id, 0) + 1
        self._ray_restarts[i] = self._ray_restarts.get(i, 0) + 1
        limit = self.cfg.cluster.actor_setup_timeout_s
        deadline = time.monotonic() + limit
        while True:  # Ray re-runs __init__ in a new process (max_restarts); wait until it answers and is set up
            try:
                ray.get(actor.setup.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except (RayActorError, GetTimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise RunFailed(f"rollout actor {i} was not set up again within cluster.actor_setup_timeout_s="
                                    f"{limit:g} s after a restart ({type(e).__name__})") from None
                time.sleep(1.0)
        weights, republish = self.weights_ref, False
        if weights is None and self.version > 0:  # the collective path keeps no copy of what it published
            if self.step == self.published_step:  # the learner's weights are still those of self.version
                weights = self.learner.state_dict_ref()
            else:  # it stepped since (weight_sync.every_steps > 1): they are no published version, publish them
                republish = True
        if weights is not None:
            self._ask(actor.update_weights.remote(self.version, weights), f"rollout actor {i}, just restarted,")
        self.publisher.member_restarted()  # the collective path makes its group again before the next publish
        if republish:
            self.version, self.published_step = self.learner.bump_version(), self.step
            self.publish()  # every actor, the restarted one included
        self._ask(actor.start.remote(), f"rollout actor {i}, just restarted,")
        self.log.say(f"[fault] rollout actor {i} restarted at version {self.version}; {lost} in-flight episodes lost")
        if self.mon is not None:
            self.mon.driver.update(self._driver_stats())

    def _record(self, metrics: LearnerStats, publish: PublishStats | None, rollout: list[RolloutStats],
                buffer: BufferStats, wait_s: float, elapsed: float) -> dict:
        per_actor = {f"actor{r.index}": run_totals(r) for r in rollout}
        run = self.totals.run()
        finished, em_sum, generated = run.get("finished", 0), run.get("em_sum", 0.0), run.get("generated_tokens", 0)
        searches, search_errors = run.get("searches", 0), run.get("search_errors", 0)
        prev = self.history[-1] if self.history else {"episodes_total": 0, "em_sum_total": 0.0}
        new_eps = finished - prev["episodes_total"]
        return {
            "step": self.step,
            "version": self.version,
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
            "actor_restarts": dict(self.restarts),
            "lost_episodes": self.lost_episodes,
            "sample_wait_s": wait_s,
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
        scores = ray.get(self.actors[0].evaluate.remote(cfg.data.test_files, cfg.eval.num_questions))
        overall = scores["all"]
        rec = {"when": when, "step": self.step, "version": self.version, "seconds": time.monotonic() - t, **scores}
        self.log.write("eval.jsonl", rec)
        if self.mon is not None:
            self.mon.eval.update(scores, split="heldout", step=self.step)
        self.log.say(
            f"[eval {when}] held-out exact match {overall['exact_match']:.3f}  F1 {overall['f1']:.3f}  "
            f"searches/q {overall['searches_per_question']:.2f}  turns/q {overall['turns_per_question']:.2f}  "
            f"(n={overall['n']}, {rec['seconds']:.0f}s)"
        )
        return rec

    def stop_rollouts(self) -> list[RolloutStats]:
        return self._ask([a.stop.remote() for a in self.actors], "a rollout actor asked to stop")

    def checkpoint(self) -> str:
        """Learner checkpoint (policy, DeepSpeed state, RNG), buffer snapshot and the driver's counters, written
        into ``checkpoints/step_N``; ``train --resume RUN_DIR`` continues from the newest complete one."""
        final = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        tmp = final.with_name(f".{final.name}.tmp")  # written here, renamed into place once complete
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.learner.save_checkpoint(tmp)
            self._ask(self.buffer.snapshot.remote(str(tmp / SNAPSHOT_FILE)), "the buffer actor (snapshot)")
            state = {"step": self.step, "version": self.version, "restarts": self.restarts,
                     "lost_episodes": self.lost_episodes, "totals": self.totals.run()}  # fmt: skip
            (tmp / DRIVER_STATE).write_text(json.dumps(state))
            path = commit_checkpoint(tmp, final)  # checksum manifest last, then the rename
        except RunFailed:  # a component that stopped answering: the partial copy goes too
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
            why = "no space left on the device" if full else _cause(e)
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
        self.step, self.version = self.learner.load_checkpoint(ckpt)  # the learner owns both
        self.published_step = self.step  # the actors start from this checkpoint's policy, stamped its version
        ray.get(self.buffer.restore.remote(str(ckpt / SNAPSHOT_FILE)))
        self.restarts, self.lost_episodes = state["restarts"], state["lost_episodes"]
        metrics = self.run_dir / "metrics.jsonl"
        kept = []
        for line in metrics.read_text().splitlines() if metrics.is_file() else []:
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
        self.totals = RunTotals(base)
        self.log.say(f"[resume] {ckpt}: step {self.step}, version {self.version}")

    def save(self, directory: Path) -> str:
        return self.learner.save_checkpoint(directory)

    def summary(self, start: dict | None, end: dict | None, rollout: list[RolloutStats], seconds: float,
                final: str) -> dict:
        s: dict[str, Any] = {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "version": self.version,
            "train_seconds": seconds,
            "final_checkpoint": final,
            "final_policy": str(Path(final) / "policy"),
            "episodes": self.history[-1]["episodes_total"] if self.history else 0,
            "episodes_failed": sum(r.failed for r in rollout),
            "searches": self.history[-1]["searches_total"] if self.history else 0,
            "search_errors": self.history[-1]["search_errors_total"] if self.history else 0,
            "actor_restarts": dict(self.restarts),
            "lost_episodes": self.lost_episodes,
            "exporter_restarts": self.mon.exporter_restarts if self.mon is not None else 0,
            "retriever_restarts": self.retriever.restarts if self.retriever is not None else 0,
        }
        if start:
            s["exact_match_start"] = start["all"]["exact_match"]
            s["eval_start"] = _eval_brief(start)
        if end:
            s["exact_match_end"] = end["all"]["exact_match"]
            s["eval_end"] = _eval_brief(end)
        if s["search_errors"] > SEARCH_ERROR_WARN_RATE * s["searches"] > 0:
            self.log.say(f"[warn] {s['search_errors']} of {s['searches']} searches in this run failed")
        return s

    def plots(self) -> list[Path]:

        return list(plot_run(self.run_dir))


def train(cfg: Config, quiet: bool = False, resume: str | Path | None = None) -> dict:
    trainer = Trainer.resume(resume, quiet) if resume else Trainer(cfg, quiet=quiet)
    return trainer.run()
