"""The arms of the bench studies: one short training each, as config overrides (the staleness sweep, async against
sync, the ablations of the seeds' studies, one RL arm per seed for ``bench learning``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class Arm:
    """One short training: ``overrides`` on top of the base config; ``own_warm_start`` when its prompts differ."""

    study: str
    name: str
    label: str
    overrides: tuple[str, ...]
    own_warm_start: bool = False


def _arms(study: str, key: str, values: Sequence[Any], labels: Sequence[str] | None = None,
          own_warm_start: bool = False) -> list[Arm]:
    labels = labels or [f"{key.rsplit('.', 1)[-1]}={v}" for v in values]
    return [Arm(study, f"{study}-{str(v).lower()}", lab, (f"{key}={v}",), own_warm_start)
            for v, lab in zip(values, labels)]


# The seeds' studies (Search-R1's PPO vs GRPO, masking, top-k, group size; chat vs base template; max turns) and the
# group filter. Each is one config key; the first value is the quickstart's.
STUDIES: dict[str, list[Arm]] = {
    "masking": _arms("masking", "algorithm.mask_observations", ["true", "false"],
                     ["observations masked", "observations in the loss"]),
    "estimator": _arms("estimator", "algorithm.advantage_estimator", ["grpo", "gae"], ["GRPO", "PPO (GAE, critic)"]),
    "topk": _arms("topk", "retriever.topk", [3, 1, 5]),
    "group_size": _arms("group_size", "rollout.group_size", [4, 2, 8]),
    "template": _arms("template", "data.apply_chat_template", ["true", "false"],
                      ["chat template (instruct)", "plain prompt (base)"], own_warm_start=True),
    "max_turns": _arms("max_turns", "rollout.max_turns", [4, 2]),
    "group_filter": _arms("group_filter", "buffer.group_filter", ["zero_variance", "none"]),
}


DEFAULT_STUDIES = ("masking", "estimator", "topk", "group_size")


def staleness_arms(etas: Sequence[int], ppo: bool = False) -> list[Arm]:
    """One arm per eta with the decoupled loss; with ``ppo``, one more at the largest eta with the standard PPO loss
    (the behaviour policy taken as the proximal one: no correction for staleness)."""
    arms = [Arm("staleness", f"eta{e}", f"eta={e}", (f"buffer.max_staleness={e}",)) for e in etas]
    if ppo:
        e = max(etas)
        arms.append(Arm("staleness", f"eta{e}-ppo", f"eta={e}, standard PPO",
                        (f"buffer.max_staleness={e}", "algorithm.policy_loss=ppo")))
    return arms


def sync_arms(eta: int) -> list[Arm]:
    """Asynchronous RL (the config's rollout, ``max_staleness=eta``) against synchronous RL: waves of episodes in
    lockstep and on-policy batches (``rollout.mode=sync``, ``max_staleness=0``), as Search-R1 and verl train."""
    return [
        Arm("sync", "async", f"asynchronous, eta={eta}", ("rollout.mode=async", f"buffer.max_staleness={eta}")),
        Arm("sync", "sync", "synchronous (lockstep waves, eta=0)", ("rollout.mode=sync", "buffer.max_staleness=0")),
    ]


@dataclass
class ArmRun:
    """An arm's run: its folder and overrides, and what came of it (``result`` from ``results.arm_result``)."""

    arm: Arm
    run_dir: Path
    overrides: list[str]
    seconds: float = 0.0
    reused: bool = False
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    warm_start: Path | None = None


SEED_KEYS = ("model.init.seed", "sft.seed", "data.seed", "rollout.seed", "learner.seed")


def seed_overrides(seed: int, world: Path) -> tuple[str, ...]:
    """One seed of the learning bench: its own world (``data.world.seed=seed``, generated into ``world``), its own
    tiny model (the BPE tokenizer is trained on that world's corpus) and its own training seeds."""
    return (
        f"data.world.seed={seed}", f"data.world_dir={world}", "data.make_world_if_missing=true",
        f"data.train_files={json.dumps([str(world / 'train.parquet')])}",
        f"data.test_files={json.dumps([str(world / 'test.parquet')])}", f"data.corpus_file={world / 'corpus.jsonl'}",
        f"model.path={world / 'model'}", "model.build_if_missing=true", *(f"{key}={seed}" for key in SEED_KEYS),
    )  # fmt: skip


def learning_arms(seeds: Sequence[int], out: Path, warm_start_seeds: Sequence[int] = (),
                  sft_threads: Sequence[int] = ()) -> list[Arm]:
    """The RL arms of ``bench learning``, each with its own warm start:

    - one per world seed (``seeds``): its own world, tiny model, warm start and training seeds (``seed_overrides``);
    - one per warm-start seed (``warm_start_seeds``): the config's own world and model, only ``sft.seed`` differs,
      so the arms differ by their warm start alone;
    - one per pinned warm-start thread count (``sft_threads``) for the first warm-start seed (or seed 0): the same
      warm start computed at 1 and at 2 threads, as different processors' rounding would make it differ.
    """
    arms = [Arm("learning", f"seed{s}-rl", f"world {s}", seed_overrides(s, out / "worlds" / f"seed_{s}"),
                own_warm_start=True) for s in seeds]  # fmt: skip
    arms += [Arm("learning", f"ws{s}-rl", f"warm start {s}", (f"sft.seed={s}",), own_warm_start=True)
             for s in warm_start_seeds]
    first = warm_start_seeds[0] if warm_start_seeds else 0
    arms += [Arm("learning", f"ws{first}-threads{t}-rl", f"warm start {first}, {t} thread{'s' * (t > 1)}",
                 (f"sft.seed={first}", f"sft.threads={t}"), own_warm_start=True) for t in sft_threads]
    return arms
