"""Learner checkpoints: a policy that transformers and vLLM load, plus everything needed to resume.

Layout of ``save_checkpoint(learner, directory)``::

    directory/
      policy/                 save_pretrained weights (training dtype) + config + tokenizer        (rank 0)
      deepspeed/policy/       DeepSpeed engine state: module, optimizer (ZeRO shards per rank)   (all ranks)
      deepspeed/critic/       the same for the critic (``gae`` only)
      learner_state.json      step, version                                                        (rank 0)
      config.yaml             the resolved config                                                  (rank 0)
      rng/rank{r}.json        python, numpy, torch (and CUDA) RNG states of rank r                 (each rank)

``load_checkpoint(learner, directory)`` on a ``Learner`` built from the same config (every rank) restores the engines,
step, version and RNG states, so the next ``train_step`` continues where the saved learner stopped. The learning
rate is a function of the step and the shuffle of (seed, step, epoch), so neither has state of its own. The reference
model is not saved: it is the model at ``model.path``, which a resumed learner loads again.

Everything this module writes itself is JSON or safetensors; DeepSpeed's own files are torch pickles that it writes
and reads locally.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from learner.learner import require_finite

if TYPE_CHECKING:
    from learner.learner import Learner

POLICY_DIR = "policy"
ENGINE_DIR = "deepspeed"
STATE_FILE = "learner_state.json"
CONFIG_FILE = "config.yaml"
RNG_DIR = "rng"


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as JSON-able lists."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _engines(learner: "Learner") -> dict[str, Any]:
    engines = {"policy": learner.policy.engine}
    if learner.critic is not None:
        engines["critic"] = learner.critic.engine
    return engines


def save_policy(learner: "Learner", directory: str | Path) -> Path:
    """``save_pretrained`` of the policy in its training dtype (the dtype its saved config names) and the tokenizer
    of ``model.path`` into ``directory``. Gathers under ZeRO-3, so call on every rank; rank 0 writes."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    state = {name: t.detach().to("cpu", copy=True) for name, t in learner.full_parameters()}
    require_finite(learner.step, "parameters", iter(state.items()))  # never save a diverged policy
    if learner.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        learner.policy.engine.module.save_pretrained(directory, state_dict=state, safe_serialization=True)
        AutoTokenizer.from_pretrained(learner.model_path).save_pretrained(directory)
    return directory


def save_checkpoint(learner: "Learner", directory: str | Path) -> Path:
    """Write the layout of the module docstring; call on every rank (the engine saves are collective)."""
    directory = Path(directory)
    save_policy(learner, directory / POLICY_DIR)
    for name, engine in _engines(learner).items():
        engine.save_checkpoint(str(directory / ENGINE_DIR), tag=name, save_latest=False)
    rng_file = directory / RNG_DIR / f"rank{learner.rank}.json"
    rng_file.parent.mkdir(parents=True, exist_ok=True)
    rng_file.write_text(json.dumps(rng_state()))
    if learner.rank == 0:
        (directory / STATE_FILE).write_text(json.dumps({"step": learner.step, "version": learner.version}))
        learner.cfg.save(directory / CONFIG_FILE)
    torch.distributed.barrier()  # the checkpoint is complete on every rank before anyone returns
    return directory


def load_checkpoint(learner: "Learner", directory: str | Path) -> None:
    """Restore a ``save_checkpoint`` into ``learner`` (same config and number of ranks; call on every rank)."""
    directory = Path(directory)
    for name, engine in _engines(learner).items():
        path, _ = engine.load_checkpoint(str(directory / ENGINE_DIR), tag=name, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {name!r} under {directory / ENGINE_DIR}")
    state = json.loads((directory / STATE_FILE).read_text())
    learner.step, learner.version = int(state["step"]), int(state["version"])
    set_rng_state(json.loads((directory / RNG_DIR / f"rank{learner.rank}.json").read_text()))
