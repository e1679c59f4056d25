"""The warm start shipped with the quickstart (``configs/warm_starts/quickstart``, its ``sft.prebuilt``) is the one the
quickstart would make: same settings, base model, demonstrations and pretraining texts. When a change to the
quickstart's world, model, recipe or the code that makes demonstrations made it stale, this says so at once (the main
job would otherwise make its own warm start, correct but 7 minutes longer). About 20 s: the world, the tiny model and
the 40,000 demonstrations are made again in a temporary folder; nothing is trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_agent_rl.config import load_config
from driver.prepare import prepare
from warm_start.prebuilt import differences

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAKE = ("async-agent-rl prepare --config configs/quickstart.yaml && async-agent-rl sft --config "
        "configs/quickstart.yaml --out configs/warm_starts/quickstart")


def test_the_shipped_warm_start_is_what_the_quickstart_would_make(tmp_path):
    cfg = load_config(REPO / "configs/quickstart.yaml", [f"run.output_dir={tmp_path}"])
    shipped = REPO / cfg.sft.prebuilt
    assert cfg.sft.enabled and cfg.sft.prebuilt == "configs/warm_starts/quickstart"
    w, m = tmp_path / "world", tmp_path / "model"
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        f"run.output_dir={tmp_path}", f"data.world_dir={w}", f"data.train_files=[\"{w}/train.parquet\"]",
        f"data.test_files=[\"{w}/test.parquet\"]", f"data.corpus_file={w}/corpus.jsonl", f"model.path={m}"])
    list(prepare(cfg))
    diff = differences(shipped, cfg, m)
    assert diff == [], f"configs/warm_starts/quickstart is stale ({', '.join(diff)} differ): make it again with `{MAKE}`"
