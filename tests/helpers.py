"""Plain helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path


def world_overrides(world_dir: Path, model_dir: Path) -> list[str]:
    """Dotted overrides that point any config at the session's world and a model folder, so nothing reads or
    writes the repository's runs/ folder."""
    return [
        f"model.path={model_dir}", "model.max_model_len=1024", f"data.world_dir={world_dir}",
        f"data.train_files={json.dumps([str(world_dir / 'train.parquet')])}",
        f"data.test_files={json.dumps([str(world_dir / 'test.parquet')])}",
        f"data.corpus_file={world_dir / 'corpus.jsonl'}", "data.prompt_template=minimal",
    ]
