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
and reads locally: loading a checkpoint unpickles them, so resume only from checkpoints you wrote yourself.

Integrity (the driver's ``checkpoints/step_N``): the whole folder is written under a temporary name, then
``MANIFEST.json`` (size and sha256 of every file) is written last, and the folder is renamed into place.
``verify_manifest`` re-reads every file against it; ``newest_intact`` picks the newest checkpoint that passes,
with one warning per damaged one skipped; ``config_differences`` names the keys where a checkpoint's config and a
run's config disagree on something the saved state depends on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import torch

from async_agent_rl.errors import InputError
from learner.learner import require_finite

if TYPE_CHECKING:
    from learner.learner import Learner

log = logging.getLogger(__name__)

POLICY_DIR = "policy"
ENGINE_DIR = "deepspeed"
STATE_FILE = "learner_state.json"
CONFIG_FILE = "config.yaml"
RNG_DIR = "rng"
MANIFEST = "MANIFEST.json"


class CheckpointError(InputError):
    """A checkpoint is incomplete, damaged or does not match the run; the message names the file or keys."""


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


# --------------------------------------------------------------------------------------------------- integrity
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: str | Path) -> Path:
    """Size and sha256 of every file under ``directory`` into ``MANIFEST.json``, written (and synced) last."""
    directory = Path(directory)
    files = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}  # fmt: skip
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return directory / MANIFEST


def verify_manifest(directory: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first file that is missing or differs from ``MANIFEST.json``."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST} (incomplete, or written by an older version)")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest}: unreadable ({e})") from None
    for rel, want in files.items():
        path = directory / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated or replaced)")
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (the file is damaged)")


def commit_checkpoint(tmp_dir: str | Path, final_dir: str | Path) -> Path:
    """Seal a checkpoint written into ``tmp_dir``: manifest last, then one rename to ``final_dir`` (a stale or
    damaged folder of that name, e.g. from before a resume, is replaced)."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    write_manifest(tmp_dir)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)
    return final_dir


def newest_intact(candidates: Iterable[Path]) -> tuple[Path | None, list[str]]:
    """The newest (last in sort order) checkpoint that passes ``verify_manifest``, and one line per damaged newer
    one that was skipped (each also logged as a warning)."""
    skipped: list[str] = []
    for ckpt in sorted(candidates, reverse=True):
        try:
            verify_manifest(ckpt)
            return ckpt, skipped
        except CheckpointError as e:
            skipped.append(str(e))
            log.warning("skipping damaged checkpoint %s: %s", ckpt.name, e)
    return None, skipped


# keys the saved state depends on: a difference here fails inside DeepSpeed with dozens of size mismatches
STATE_KEYS = ("model.init", "model.dtype", "learner.zero_stage", "learner.num_ranks", "learner.dtype",
              "algorithm.advantage_estimator", "rollout.group_size")  # fmt: skip


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def config_differences(saved: dict[str, Any], current: dict[str, Any], keys: Iterable[str] = STATE_KEYS) -> list[str]:
    """``"key: checkpoint X, run Y"`` for every key under ``keys`` where the two config trees differ."""
    a, b = _flatten(saved), _flatten(current)
    out = []
    for k in sorted(set(a) | set(b)):
        if any(k == key or k.startswith(key + ".") for key in keys) and a.get(k) != b.get(k):
            out.append(f"{k}: checkpoint {a.get(k)!r}, run {b.get(k)!r}")
    return out


ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim")  # fmt: skip


def check_model_matches(ckpt: str | Path, model_path: str | Path) -> None:
    """The checkpoint's policy and the run's starting model have the same architecture, else a
    :class:`CheckpointError` naming the differing ``config.json`` keys."""
    saved = json.loads((Path(ckpt) / POLICY_DIR / "config.json").read_text())
    current = json.loads((Path(model_path) / "config.json").read_text())
    diff = [f"{k}: checkpoint {saved.get(k)!r}, model {current.get(k)!r}" for k in ARCH_KEYS if saved.get(k) != current.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint {ckpt} does not fit the model at {model_path}: {'; '.join(diff)}")
