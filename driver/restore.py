"""Resuming a run (``train --resume RUN_DIR``): which checkpoint, the checks before anything starts, and the restore.

``resume_inputs`` reads the run's config and finds its newest intact checkpoint (damaged newer ones are skipped,
each said in one line); a checkpoint whose config differs from the run's on anything the saved state depends on, a
``metrics.jsonl`` that is not UTF-8 or a policy file that is not safetensors is an error line before anything starts.
``restore`` loads the checkpoint into the started learner and buffer: the learner's step and policy version (the
one holder of both, which ``PolicyVersions.restored`` takes up), the buffer's groups in flight and prompt streams
(``kept_line``), and the driver's counters; the metrics lines of steps that will be redone are dropped. The rollout
actors then take up what the buffer kept when they start (``taken_up_lines``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from async_agent_rl.config import Config, load_config
from async_agent_rl.errors import InputError
from async_agent_rl.stats import BufferStats, RunTotals
from buffer.actor import SNAPSHOT_FILE
from driver.checkpoints import DRIVER_STATE, latest_checkpoint
from driver.limits import ask, model_bytes, phase_limit, wait_phase
from driver.run_folder import check_safetensors, read_metrics_lines
from driver.versions import PolicyVersions
from learner.checkpoint import CONFIG_FILE, CheckpointError, check_model_matches, config_differences


def resume_inputs(run_dir: Path) -> tuple[Config, Path, list[str]]:
    """The run's config, its newest intact checkpoint and one line per damaged newer checkpoint skipped; an error
    (``InputError``, ``CheckpointError``) when the run cannot be resumed from it."""
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
    return cfg, ckpt, [f"[resume] warning: skipped a damaged checkpoint: {line}" for line in skipped]


@dataclass
class Restored:
    """What the driver's parts take up from a checkpoint: the run's records up to its step (``history``), the
    buffer's counts as restored (the learning signals count from there), and the driver's counters."""

    history: list[dict]
    buffer: BufferStats
    restarts: dict[str, int]
    lost_episodes: int
    totals: RunTotals
    evals_beside: int = 0
    evals_skipped: int = 0


def restore(ckpt: Path, cfg: Config, run_dir: Path, policy_path: str, learner: Any, buffer: Any,
            versions: PolicyVersions, say: Callable[[str], None], stops: Any = None) -> Restored:
    """Load the checkpoint ``ckpt`` into the learner and buffer; drop the metrics of steps that will be redone. The
    learner ranks' load is waited for within the restore's phase limit (``phase_limit``: the policy's size, bounded by
    ``cluster.progress_timeout_s`` when set), and a stop request (``stops``) ends it at once."""
    state = json.loads((ckpt / DRIVER_STATE).read_text())
    check_model_matches(ckpt, policy_path)
    limit, said = phase_limit(cfg, "restore", model_bytes(ckpt / "policy"))
    loads = [rank.load_checkpoint.remote(str(ckpt)) for rank in learner.actors]
    step, version = wait_phase(loads, limit, f"the learner (restore of {ckpt.name})", said, stops,
                               on_stop="abandon")[0]  # the learner owns both
    versions.restored(step, version)  # the actors start from this checkpoint's policy, its version
    actor_ids = [f"actor{i}" for i in range(cfg.rollout.num_actors)]  # RolloutActor.actor_id
    limit = cfg.cluster.actor_timeout_s
    stats = ask(buffer.restore.remote(str(ckpt / SNAPSHOT_FILE), actor_ids), limit, "the buffer actor (restore)")
    line = kept_line(ask(buffer.resume_report.remote(), limit, "the buffer actor (restore)"))
    if line:
        say(line)
    metrics = run_dir / "metrics.jsonl"
    kept = []
    for line in read_metrics_lines(metrics):
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut off by the crash: its step is redone anyway
            say(f"[resume] dropped an unreadable line of {metrics}")
    metrics.write_text("".join(line + "\n" for line in kept))
    history = [json.loads(line) for line in kept]
    # episodes counted before the crash are history now: the new actors count from zero
    base = state.get("totals", state.get("retired", {}))  # "retired": checkpoints of older versions
    if history:
        last = history[-1]
        base = {"finished": last["episodes_total"], "em_sum": last["em_sum_total"],
                "generated_tokens": last.get("generated_tokens_total", 0),
                "searches": last.get("searches_total", 0),
                "search_errors": last.get("search_errors_total", 0)}  # fmt: skip
    say(f"[resume] {ckpt}: step {step}, version {version}")
    return Restored(history, stats, state["restarts"], state["lost_episodes"], RunTotals(base),
                    state.get("evals_beside", 0), state.get("evals_skipped", 0))


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
