"""vLLM's CPU engine serves a fixed set of attention head sizes. A model with another one (the tiny model with twice
the heads at hidden 128: head size 16) started, then died at the first request with an unexplained EngineDeadError.
It is refused before anything starts, in one line naming the head size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from async_agent_rl.config import ConfigError, load_config
from driver.check import dry_run
from driver.prepare import engine_head_size_problem, prepare
from tests.helpers import world_overrides

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def model_folder(tmp_path: Path, **shape) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4, **shape}))
    return d


def test_head_size_16_is_refused_on_the_cpu_engine_and_32_is_served(tmp_path, world_dir):
    cfg = load_config(REPO / "configs/quickstart.yaml", world_overrides(world_dir, tmp_path / "model"))
    assert engine_head_size_problem(cfg, model_folder(tmp_path)) is None  # 128 / 4 = 32
    (tmp_path / "model" / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 8}))
    problem = engine_head_size_problem(cfg, tmp_path / "model")
    assert problem and "head size 16" in problem and "32, 64" in problem
    with pytest.raises(ConfigError, match="head size 16"):
        list(prepare(cfg))
    assert any("head size 16" in p for p in dry_run(cfg, gpus=[]).problems)
    # an explicit head_dim wins; the transformers engine and GPUs are not limited
    (tmp_path / "model" / "config.json").write_text(
        json.dumps({"hidden_size": 128, "num_attention_heads": 8, "head_dim": 64})
    )
    assert engine_head_size_problem(cfg, tmp_path / "model") is None
    (tmp_path / "model" / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 8}))
    hf = load_config(
        REPO / "configs/quickstart.yaml", [*world_overrides(world_dir, tmp_path / "model"), "rollout.engine=hf"]
    )
    assert engine_head_size_problem(hf, tmp_path / "model") is None


def test_the_train_command_refuses_a_tiny_model_with_head_size_16_in_one_error_line(tmp_path, world_dir):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "driver.cli",
            "train",
            "--config",
            "configs/quickstart.yaml",
            f"run.output_dir={tmp_path}",
            *world_overrides(world_dir, tmp_path / "model"),
            "model.build_if_missing=true",
            "model.init.num_attention_heads=8",
            "model.init.num_key_value_heads=4",
            "model.init.vocab_size=512",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in out, out
    assert "head size 16" in errors[0] and "model.init" in errors[0], errors
