"""A warm start folder is reused only by runs whose inputs match the ones it was made from."""

from __future__ import annotations

import json

import pytest

from async_agent_rl.config import load_config
from async_agent_rl.errors import error_line
from warm_start.sft import INPUTS_FILE, SUMMARY_FILE, check_warm_start, warm_start_inputs

pytestmark = pytest.mark.unit


def fake_warm_start(folder, inputs) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / SUMMARY_FILE).write_text("{}")
    (folder / INPUTS_FILE).write_text(json.dumps(inputs))


def test_same_inputs_reuse_other_inputs_are_named(tmp_path):
    cfg = load_config("configs/quickstart.yaml")
    inputs = warm_start_inputs(cfg, cfg.model.path)
    assert not check_warm_start(tmp_path / "none", inputs)
    fake_warm_start(tmp_path / "ws", inputs)
    assert check_warm_start(tmp_path / "ws", inputs)
    # settings the warm start does not depend on: still reusable
    rl_only = load_config("configs/quickstart.yaml", ["learner.lr=0.5", "buffer.max_staleness=0", "sft.enabled=false"])
    assert check_warm_start(tmp_path / "ws", warm_start_inputs(rl_only, rl_only.model.path))
    # settings it does depend on: refused, naming them
    other = load_config("configs/quickstart.yaml", ["retriever.topk=5", "data.apply_chat_template=false"])
    with pytest.raises(ValueError, match=r"data\.apply_chat_template, retriever\.topk") as err:
        check_warm_start(tmp_path / "ws", warm_start_inputs(other, other.model.path))
    # the CLI's one line for bad input (it said "error: unexpected ValueError: ... (rerun with -v ...)" before)
    assert error_line(err.value) == f"error: {err.value}"
    with pytest.raises(ValueError, match="model_dir"):
        check_warm_start(tmp_path / "ws", warm_start_inputs(cfg, "elsewhere"))


def test_a_folder_without_inputs_is_refused(tmp_path):
    cfg = load_config("configs/quickstart.yaml")
    fake_warm_start(tmp_path / "old", {})
    (tmp_path / "old" / INPUTS_FILE).unlink()
    with pytest.raises(ValueError, match=INPUTS_FILE) as err:
        check_warm_start(tmp_path / "old", warm_start_inputs(cfg, cfg.model.path))
    assert error_line(err.value) == f"error: {err.value}"
