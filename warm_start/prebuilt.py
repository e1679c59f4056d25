"""A warm start made once and shipped with a config (``sft.prebuilt``), used by a run only when it is what that run
would make: same settings, same base model, same demonstrations and pretraining texts.

Why: the warm start is a deterministic function of its inputs (on one processor, bit for bit), and it is most of
the main job's time (6 of its 8 minutes on 2 cores, measured at 49d7232); every fresh clone made the same one
again. It stands where a pretrained model stands in a real Search-R1 run: what RL starts from. A run whose world,
model, recipe or code of the demonstrations differs from the shipped one's builds its own, as before, and says why.

``fingerprint`` is what a warm start is made of, with no path in it: ``warm_start_inputs`` (the settings) without
the folders and files, sha256 of the base model's weights and tokenizer, of every demonstration (tokens, loss mask)
and of the pretraining texts. ``run_sft`` writes it beside every warm start (``FINGERPRINT_FILE``); ``differences``
computes it for a run (about 11 s: the demonstrations are made again, not trained on) and compares."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Sequence

from async_agent_rl.config import Config
from async_agent_rl.errors import InputError
from async_agent_rl.records import Trajectory

FINGERPRINT_FILE = "warm_start_fingerprint.json"
PATH_KEYS = {"data": ("world_dir", "train_files", "test_files", "corpus_file"), "retriever": ("index_dir",)}
MODEL_FILES = ("model.safetensors", "tokenizer.json")


def _sha(chunks: Any) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk if isinstance(chunk, bytes) else str(chunk).encode())
    return h.hexdigest()


def settings(cfg: Config) -> dict[str, Any]:
    """``warm_start_inputs`` with no folder or file in it."""
    from warm_start.sft import warm_start_inputs

    inputs = warm_start_inputs(cfg, "")
    inputs.pop("model_dir")
    for section, keys in PATH_KEYS.items():
        for k in keys:
            inputs.get(section, {}).pop(k, None)
    return inputs


def base_model(model_dir: str | Path) -> dict[str, str | None]:
    model = Path(model_dir)
    return {name: _sha([(model / name).read_bytes()]) if (model / name).is_file() else None for name in MODEL_FILES}


def fingerprint(cfg: Config, model_dir: str | Path, demos: Sequence[Trajectory],
                texts: Sequence[str] | None) -> dict[str, Any]:
    """What the warm start made from ``model_dir`` with ``demos`` and pretraining ``texts`` (None: no pretraining)
    under ``cfg`` depends on, with no path in it (JSON-able)."""
    return {
        "inputs": settings(cfg),
        "base_model": base_model(model_dir),
        "demonstrations": {"count": len(demos), "sha256": _sha(
            json.dumps([d.prompt_ids, d.response_ids, d.loss_mask]) for d in demos)},
        "pretraining_texts": None if texts is None else {"count": len(texts), "sha256": _sha(texts)},
    }


def write_fingerprint(out: Path, fp: dict[str, Any]) -> None:
    (out / FINGERPRINT_FILE).write_text(json.dumps(fp, indent=1, sort_keys=True) + "\n")


def run_fingerprint(cfg: Config, model_dir: str | Path) -> dict[str, Any]:
    """``fingerprint`` of the warm start ``run_sft(cfg, model_dir, ...)`` would make: its demonstrations and
    pretraining texts made as it makes them (not trained on)."""
    from transformers import AutoTokenizer

    from warm_start.sft import PRETRAIN_SEQ_LEN, _pretrain_texts, build_demonstrations

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    demos, _ = build_demonstrations(cfg, tokenizer)
    s = cfg.sft
    texts = _pretrain_texts(cfg, s.pretrain_steps, s.batch_size, PRETRAIN_SEQ_LEN, tokenizer) \
        if s.pretrain_steps else None
    return fingerprint(cfg, model_dir, demos, texts)


def differences(prebuilt: str | Path, cfg: Config, model_dir: str | Path) -> list[str] | None:
    """What differs between the warm start in ``prebuilt`` and the one this run would make (dotted fingerprint
    paths: ``inputs.sft.seed``, ``demonstrations.sha256``, ...): empty when it is the same, None when ``prebuilt``
    is no folder. The settings and the base model are compared first; the demonstrations and texts are made only
    when those agree. Raises ``InputError`` when the folder holds no finished warm start with a fingerprint."""
    from warm_start.sft import _differences

    folder = Path(prebuilt)
    if not folder.is_dir():
        return None
    saved = folder / FINGERPRINT_FILE
    if not (folder / "model.safetensors").is_file() or not saved.is_file():
        raise InputError(f"sft.prebuilt={prebuilt}: no warm start with a {FINGERPRINT_FILE} there (make one with "
                         f"`async-agent-rl sft --config CONFIG --out {prebuilt}`)")
    try:
        shipped = json.loads(saved.read_text())
    except ValueError as e:
        raise InputError(f"sft.prebuilt={prebuilt}: {FINGERPRINT_FILE} is not JSON ({e})") from None
    if not isinstance(shipped, dict):
        raise InputError(f"sft.prebuilt={prebuilt}: {FINGERPRINT_FILE} is not a JSON object")
    cheap = {"inputs": settings(cfg), "base_model": base_model(model_dir)}
    diff = _differences({k: shipped.get(k) for k in cheap}, cheap)
    return diff or _differences(shipped, run_fingerprint(cfg, model_dir))


def install(prebuilt: str | Path, out: str | Path, inputs: dict[str, Any], inputs_file: str, done_file: str) -> None:
    """Copy the warm start in ``prebuilt`` into ``out`` with this run's ``inputs`` (its paths) in ``inputs_file``,
    so that the next run finds it as its own; ``done_file`` (what marks a finished warm start) last, so that an
    interrupted copy is no warm start. Nothing in ``out`` is deleted (a build would write into it the same way)."""
    src, out = Path(prebuilt), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in (done_file, inputs_file):
            shutil.copyfile(f, out / f.name)
    (out / inputs_file).write_text(json.dumps(inputs, indent=1, sort_keys=True) + "\n")
    shutil.copyfile(src / done_file, out / done_file)
