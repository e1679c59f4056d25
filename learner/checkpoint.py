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
``MANIFEST.json`` (size and sha256 of every file) is written last, and the folder is renamed into place
(``commit_checkpoint``). A step that already has a checkpoint (the stall report's, after a resume) is replaced
without a moment in which neither is on disk whole: the old one is renamed aside to ``step_N.old`` (which a reader
still finds), the new one renamed in, and only then is the old one removed. ``verify_manifest`` re-reads every file
against the manifest; ``newest_intact`` picks the newest checkpoint that passes it and whose policy weights are
whole (``weights_problems``: weights damaged and then resealed into the manifest pass the checksums), with one
warning per damaged one skipped; ``config_differences`` names the keys where a checkpoint's config and a run's
config disagree on something the saved state depends on.

``weights_problems`` is the one check of a model folder's safetensors weights: a resume runs it on each
checkpoint's ``policy/``, ``eval --checkpoint``, ``rollout --model`` and ``train --dry-run`` on the model they are
given (``driver.check``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

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


ASIDE_SUFFIX = ".old"  # step_N.old: a checkpoint being replaced (still a step_* a reader finds)
_after: Callable[[str], None] | None = None  # tests: called after each step of commit_checkpoint, with its name


def _step(name: str) -> None:
    if _after is not None:
        _after(name)


def commit_checkpoint(tmp_dir: str | Path, final_dir: str | Path) -> Path:
    """Seal a checkpoint written into ``tmp_dir``: manifest last, then renamed to ``final_dir``. A folder already
    there (the same step written again) is replaced with the new one whole on disk at every moment: it is renamed
    aside to ``final_dir.old``, the new one renamed in, then the old one removed. A crash between any two of these
    leaves a checkpoint of the step that ``newest_intact`` picks: the old one (``step_N.old``) until the new one is
    in, the new one after."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    write_manifest(tmp_dir)
    _step("manifest")
    aside = final_dir.with_name(final_dir.name + ASIDE_SUFFIX)
    if final_dir.exists():
        if aside.exists():  # an older replace's leftover, no longer needed: final_dir is there
            shutil.rmtree(aside)
        os.rename(final_dir, aside)
        _fsync_dir(final_dir.parent)
        _step("aside")
    os.rename(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    _step("in")
    if aside.exists():
        shutil.rmtree(aside)
        _step("removed")
    return final_dir


def _fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable (a power cut after a rename must not undo it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def _order(ckpt: Path) -> tuple[str, int]:
    """Sort key: by the step's name, ``step_N`` after its own ``step_N.old`` (the replaced one)."""
    name = ckpt.name
    if name.endswith(ASIDE_SUFFIX):
        return name[: -len(ASIDE_SUFFIX)], 0
    return name, 1


def newest_intact(candidates: Iterable[Path]) -> tuple[Path | None, list[str]]:
    """The newest checkpoint (last in sort order, ``step_N`` before a ``step_N.old`` that a crash in the middle of a
    replace left) that passes ``verify_manifest`` and whose ``policy/`` weights pass ``weights_problems``, and one
    line per damaged newer one that was skipped (each also logged as a warning)."""
    skipped: list[str] = []
    for ckpt in sorted(candidates, key=_order, reverse=True):
        try:
            verify_manifest(ckpt)
            problems = weights_problems(ckpt / POLICY_DIR, required=True)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise CheckpointError(problems[0] + more)
            return ckpt, skipped
        except CheckpointError as e:
            skipped.append(str(e))
            log.warning("skipping damaged checkpoint %s: %s", ckpt.name, e)
    return None, skipped


# ----------------------------------------------------------------------------------------------------- weights
INDEX_FILE = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def safetensors_problem(path: str | Path) -> str | None:
    """Why the safetensors file ``path`` cannot be loaded, naming it, or None. Reads the header only: 8 bytes of
    little-endian length, that many bytes of a JSON object giving each tensor's ``dtype``, ``shape`` and
    ``data_offsets`` into the data that follows, which the tensors must fill exactly, one after the other (what
    the safetensors library checks when it opens the file; an engine failing to open it names no file)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: truncated safetensors file: {size} bytes, not even the 8-byte header length"
            header_len = int.from_bytes(head, "little")
            if 8 + header_len > size:
                return f"{path}: truncated safetensors file: {size} bytes, its header alone says {8 + header_len}"
            raw = f.read(header_len)
    except OSError as e:
        return f"{path}: unreadable ({e.strerror or e})"
    try:
        header = json.loads(raw)
    except ValueError as e:
        return f"{path}: not a safetensors file: its header is not JSON ({e})"
    if not isinstance(header, dict):
        return f"{path}: not a safetensors file: its header is a JSON {type(header).__name__}, not an object of tensors"
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(v) for v in entry["data_offsets"])
            shape = [int(d) for d in entry["shape"]]
            dtype = str(entry["dtype"])
        except (TypeError, KeyError, ValueError, AttributeError):
            return f"{path}: not a safetensors file: tensor {name!r} has no dtype, shape and two data offsets"
        width = DTYPE_BYTES.get(dtype)
        n = width * math.prod(shape) if width is not None else None
        if start < 0 or end < start or (n is not None and end - start != n):
            return (f"{path}: damaged safetensors file: tensor {name!r} ({dtype} {shape}) lies at bytes "
                    f"{start}-{end} of its data")
        tensors.append((start, end, name))
    if not tensors:
        return f"{path}: not a safetensors file: its header describes no tensors"
    at = 0
    for start, end, name in sorted(tensors):
        if start != at:
            return (f"{path}: damaged safetensors file: tensor {name!r} starts at byte {start} of its data, the "
                    f"tensor before it ends at {at}")
        at = end
    expected = 8 + header_len + at
    if size != expected:
        what = "truncated" if size < expected else "damaged (padded)"
        return f"{path}: {what} safetensors file: {size} bytes, its header describes {expected}"
    return None


def weights_problems(model_dir: str | Path, required: bool = False) -> list[str]:
    """What is wrong with a model folder's safetensors weights, one line each naming the file: every shard its
    ``model.safetensors.index.json`` names present, each ``*.safetensors`` file whole (``safetensors_problem``).
    A folder without safetensors files is a problem only when ``required`` (a checkpoint's ``policy/``, always saved
    as safetensors); else it is not judged here (another format)."""
    model_dir = Path(model_dir)
    problems = []
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            shards = [str(s) for s in shards]
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            problems.append(f"{index}: not a safetensors index ({type(e).__name__})")
            shards = []
        problems += [f"{model_dir / s}: missing (named by {index.name})" for s in shards
                     if not (model_dir / s).is_file()]
    files = sorted(model_dir.glob("*.safetensors"))
    if required and not files and not problems:
        problems.append(f"{model_dir}: no *.safetensors weights")
    for f in files:
        why = safetensors_problem(f)
        if why is not None:
            problems.append(why)
    return problems


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
