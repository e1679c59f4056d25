"""The pieces of a run's start that are not the loop's: its inputs (world, tiny model, SFT warm start), a component's
bounded start, the monitor, and the policy's pad id for the buffer."""

from __future__ import annotations

from concurrent.futures import Future, wait
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import ray
from ray.exceptions import GetTimeoutError

from async_agent_rl.config import Config
from async_agent_rl.waits import bounded
from driver.cluster import resources_line
from driver.limits import REPORT_TIMEOUT_S, SLICE_S, PhaseTimeout, RunFailed, wait_phase
from driver.prepare import prepare
from driver.stops import StopRequests
from monitoring.exporter import RunMonitoring
from warm_start.prebuilt import differences as prebuilt_differences
from warm_start.prebuilt import install
from warm_start.sft import INPUTS_FILE, SUMMARY_FILE, check_warm_start, run_sft, warm_start_inputs


def prepare_inputs(cfg: Config, run_dir: Path, say: Callable[[str], None], stops: StopRequests) -> str:
    """The world and tiny model when the config asks for them, then the SFT warm start when ``sft.enabled`` (made
    unless an intact one for the same inputs is there); returns the policy the run starts from."""
    for line in prepare(cfg):
        say(f"[prepare] {line}")
    if not cfg.sft.enabled:
        return cfg.model.path
    sft_dir = Path(cfg.sft.output_dir) if cfg.sft.output_dir else run_dir / "sft"
    inputs = warm_start_inputs(cfg, cfg.model.path)
    if check_warm_start(sft_dir, inputs):
        say(f"[sft] warm start present: {sft_dir}")
    elif cfg.sft.prebuilt and prebuilt_matches(cfg, say):
        install(cfg.sft.prebuilt, sft_dir, inputs, INPUTS_FILE, SUMMARY_FILE)
        say(f"[sft] the prebuilt warm start {cfg.sft.prebuilt} is this run's (same settings, base model, "
            f"demonstrations and pretraining texts) -> {sft_dir}")
    else:
        say(f"[sft] warm start on {cfg.sft.num_demos} demonstrations -> {sft_dir}")
        # prints progress and a readable closing line; a stop signal ends it at the next step, unsaved (a folder
        # without its summary is not a warm start: the next run makes it again)
        with stops.warm_start():
            run_sft(cfg, cfg.model.path, sft_dir, on_step=lambda _: stops.check())
    return str(sft_dir)


def prebuilt_matches(cfg: Config, say: Callable[[str], None]) -> bool:
    """``sft.prebuilt`` is the warm start this run would make; if not, one line says what differs or that there is
    no such folder (a folder with no warm start in it is bad input: ``InputError``)."""
    diff = prebuilt_differences(cfg.sft.prebuilt, cfg, cfg.model.path)
    if diff is None:
        say(f"[sft] no prebuilt warm start at {cfg.sft.prebuilt} (sft.prebuilt, from {Path.cwd()}): making one")
        return False
    if diff:
        shown = ", ".join(diff[:4]) + (f" and {len(diff) - 4} more" if len(diff) > 4 else "")
        say(f"[sft] the prebuilt warm start {cfg.sft.prebuilt} is not this run's ({shown} differ): making one")
    return not diff


def started(cfg: Config, start: Callable[[], Any], what: str = "learner") -> Any:
    """``start()``: the learner group or the rollout actors' set-up, each bounded by
    ``cluster.actor_setup_timeout_s``; past it, one error line naming what did not start and what it asks Ray
    for (a rank or an actor Ray cannot place waits forever otherwise)."""
    c = cfg.cluster
    try:
        return start()
    except (GetTimeoutError, PhaseTimeout):
        if what == "learner":
            whom = f"{cfg.learner.num_ranks} learner actor(s)"
            asks = f"cluster.learner_cpus={c.learner_cpus:g}, learner_gpus={c.learner_gpus:g}"
            custom = c.learner_resources
        else:
            whom = f"{cfg.rollout.num_actors} {what} actor(s)" + (" and the evaluator" if cfg.evaluators else "")
            asks = f"cluster.rollout_actor_cpus={c.rollout_actor_cpus:g}, rollout_actor_gpus={c.rollout_actor_gpus:g}"
            custom = c.rollout_resources
        if custom:
            asks += f", {'learner' if what == 'learner' else 'rollout'}_resources={custom}"
        raise RunFailed(f"the {whom} were not started within cluster.actor_setup_timeout_s="
                        f"{c.actor_setup_timeout_s:g} s (each asks Ray for {asks}; the cluster has "
                        f"{resources_line(ray.cluster_resources())})") from None


def learner_started(cfg: Config, start: Future, stops: StopRequests) -> Any:
    """The learner group whose start runs in a thread (``start``; it is bounded by ``cluster.actor_setup_timeout_s``
    there), waited for in slices that look at ``stops``: a stop request during the start ends it at once
    (``StopRequested``; Ray's shutdown then ends the ranks' start)."""
    while not start.done():
        wait([start], timeout=SLICE_S)
        stops.check()
    return started(cfg, start.result)


def set_up(cfg: Config, actors: list[Any], buffer: Any, stops: StopRequests) -> list[Any]:
    """Every rollout actor (and the evaluator) set up, their infos: waited for within
    ``cluster.actor_setup_timeout_s`` (``started``'s error line past it) in slices that look at ``stops``: a stop
    request during the start ends it at once (``StopRequested``)."""
    return started(cfg, lambda: wait_phase([a.setup.remote(buffer) for a in actors], cfg.cluster.actor_setup_timeout_s,
                                           "the rollout actors' setup", "cluster.actor_setup_timeout_s", stops,
                                           on_stop="abandon"), what="rollout")


def start_monitoring(cfg: Config, run_dir: Path, url: str, stack: ExitStack,
                     say: Callable[[str], None]) -> RunMonitoring | None:
    """One exporter for the run (driver-side view of every component) plus the retriever's own /metrics, both
    listed in ``run_dir/prometheus/targets.json`` for Prometheus' file-based discovery (None: monitoring off)."""
    mon = RunMonitoring.from_config(cfg.monitoring, run_dir)
    if mon is None:
        return None
    stack.callback(mon.close, cfg.monitoring.final_scrape_timeout_s)
    mon.set_targets("retriever", [urlsplit(url).netloc])
    say(f"[start] metrics on {mon.exporter.url}; prometheus --config.file={mon.config_file}")
    return mon


def observe_components(mon: RunMonitoring, actors: Callable[[], list[Any]], buffer: Any) -> Callable[[], None]:
    """The monitor's poll between steps: every rollout actor's stats and the buffer's."""
    def observe() -> None:
        mon.observe(rollout=bounded(ray.get, [a.stats.remote() for a in actors()], timeout_s=REPORT_TIMEOUT_S,
                                    what="the rollout actors' stats()"),
                    buffer=bounded(ray.get, buffer.stats.remote(), timeout_s=REPORT_TIMEOUT_S, what="the buffer actor"))
    return observe


def pad_id(policy_path: str) -> int:
    """The policy's pad id (its tokenizer's; the end-of-sequence id when it has none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_path)
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
