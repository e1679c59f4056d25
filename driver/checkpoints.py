"""A run's checkpoints: when one is due, what it holds, how it is written, and which is the newest intact one.

``checkpoints/step_N`` is due every ``learner.checkpoint_every`` learner steps (0: never; a stopped or stalled run
writes one of its step too). It holds the learner's checkpoint (policy, DeepSpeed state, RNG; the learner keeps its
step and policy version there), the replay buffer's snapshot and the driver's counters (``driver_state.json``: each
rollout actor's restarts, the episodes lost with them, the run's rollout totals and, with ``eval.beside``, the
evaluations beside training done and skipped). It is written into ``.step_N.tmp`` and renamed into place once
complete, its checksum manifest last (``commit_checkpoint``): a crash mid-checkpoint leaves no ``step_N``, and
``train --resume RUN_DIR`` continues from the newest intact one (``latest_checkpoint``).

The driver waits for the learner ranks' saves within the checkpoint's phase limit (``driver.limits.phase_limit``:
the policy's size, bounded by ``cluster.progress_timeout_s`` when the user set it), in slices that look at the stop
requests: a learner stopped (SIGSTOP) mid-save is named in one ``error:`` line within that limit, and a stop asked
for meanwhile gets the save ``driver.limits.stop_s`` more at most.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import ray

from async_agent_rl.config import Config
from async_agent_rl.errors import InputError
from buffer.actor import SNAPSHOT_FILE
from driver.limits import RunFailed, ask, cause, model_bytes, phase_limit, stop_s, wait_phase
from learner.actor import LearnerTimeout
from learner.checkpoint import CheckpointError, commit_checkpoint, newest_intact

DRIVER_STATE = "driver_state.json"
DISK_FULL_BYTES = 64 << 20  # a checkpoint that failed with less free space than this failed for lack of space


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


class Checkpoints:
    """The checkpoints of the run in ``run_dir`` (see the module docstring). ``say``: the run's console; ``stops``:
    the run's ``StopRequests`` (None: no signal looked at)."""

    def __init__(self, cfg: Config, run_dir: Path, say: Callable[[str], None], stops: Any = None):
        self.cfg, self.folder, self.say, self.stops = cfg, run_dir / "checkpoints", say, stops
        self.policy_bytes: Optional[int] = None  # the policy's weights, for the checkpoint's limit (read once)

    def limit(self) -> tuple[float, str]:
        """The checkpoint's limit and how to say it (``phase_limit`` of the policy's size)."""
        if self.policy_bytes is None:
            self.policy_bytes = model_bytes(self.cfg.model.path)
        return phase_limit(self.cfg, "checkpoint", self.policy_bytes)

    def learner_save(self, learner: Any, folder: Path, what: str) -> str:
        """Every learner rank saves into ``folder``, waited for within the checkpoint's limit; rank 0's path."""
        limit, said = self.limit()
        refs = [rank.save_checkpoint.remote(str(folder)) for rank in learner.actors]
        return wait_phase(refs, limit, f"the learner ({what})", said, self.stops, stop_s(self.cfg))[0]

    def due(self, step: int) -> bool:
        every = self.cfg.learner.checkpoint_every
        return bool(every) and step % every == 0

    def existing(self, step: int) -> str | None:
        """The checkpoint of ``step`` when it was written already (a stop right after a due one)."""
        path = self.folder / f"step_{step:06d}"
        return str(path) if path.is_dir() else None

    def save(self, step: int, learner: Any, buffer: Any, fleet: Any, beside: Any = None) -> str:
        """Learner checkpoint, buffer snapshot and the driver's counters (``fleet``'s; ``beside``: the evaluations
        beside training, None without them) of ``step``, written into ``checkpoints/step_N``. A failure removes the
        partial copy and ends the run in one line (a full disk said as such); the complete ones stay."""
        final = self.folder / f"step_{step:06d}"
        tmp = final.with_name(f".{final.name}.tmp")  # written here, renamed into place once complete
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.learner_save(learner, tmp, f"checkpoint of step {step}")
            ask(buffer.snapshot.remote(str(tmp / SNAPSHOT_FILE)), self.cfg.cluster.actor_timeout_s,
                "the buffer actor (snapshot)")
            # the step and the policy version are the learner's checkpoint's (``load_checkpoint``): not kept here
            state = {"restarts": fleet.restarts, "lost_episodes": fleet.lost_episodes, "totals": fleet.totals.run()}
            if beside is not None:  # an evaluation running now is not redone by a resume
                state["evals_beside"], state["evals_skipped"] = beside.finished, beside.skipped
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
            raise RunFailed(f"the checkpoint of step {step} could not be written in {final.parent}: {why}; "
                            f"{f'the last complete one is {kept[-1]}' if kept else 'no complete checkpoint'}") \
                from None
        self.say(f"[checkpoint] {path}")
        return str(path)
