"""vLLM's CPU engine serves a fixed set of attention head sizes. A model with another one (the tiny model with twice
the heads at hidden 128: head size 16) started, then died at the first request with an unexplained EngineDeadError.
It is refused before anything starts, in one line naming the head size: a model to build by its ``model.init``
(before it is built), a present one by its own config."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from async_agent_rl.config import ConfigError, load_config
from driver.check import dry_run
from driver.prepare import VLLM_CPU_HEAD_SIZES, engine_head_size_problem, prepare
from tests.helpers import world_overrides

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# Qwen2 with eight heads at width 128: each head 16 wide (the quickstart's own model is Qwen3 with head_dim 32)
HEADS_8 = ["model.init.architecture=qwen2", "model.init.head_dim=null", "model.init.num_attention_heads=8",
           "model.init.num_key_value_heads=4"]


def write_config(d: Path, **shape) -> Path:
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4, **shape}))
    return d


def test_the_list_is_the_installed_vllm_cpu_backends():
    backend = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    assert tuple(backend.CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_a_tiny_model_to_build_with_head_size_16_is_refused_before_it_is_built(tmp_path, world_dir):
    model = tmp_path / "model"
    cfg = load_config(REPO / "configs/quickstart.yaml", [*world_overrides(world_dir, model),
                                                         "model.build_if_missing=true", *HEADS_8])
    with pytest.raises(ConfigError, match=r"model.init \(hidden_size 128 / num_attention_heads 8\): attention head "
                                          r"size 16 is not one vLLM's CPU engine serves \(32, 64"):
        list(prepare(cfg))
    assert not model.exists()  # nothing built that a corrected config would then find "present"
    assert any("head size 16" in p and "model.init" in p for p in dry_run(cfg, gpus=[]).problems)
    fine = load_config(REPO / "configs/quickstart.yaml", [*world_overrides(world_dir, model), "model.build_if_missing=true"])
    assert engine_head_size_problem(fine, None) is None and not [p for p in dry_run(fine, gpus=[]).problems if "head" in p]


def test_a_qwen3_model_to_build_is_judged_by_its_head_dim(tmp_path, world_dir):
    """Eight heads at width 128 are served when Qwen3's head_dim makes each 32 wide; a head_dim of 16 is refused."""
    model = tmp_path / "model"
    base = [*world_overrides(world_dir, model), "model.build_if_missing=true", *HEADS_8, "model.init.architecture=qwen3"]
    cfg = load_config(REPO / "configs/quickstart.yaml", [*base, "model.init.head_dim=32"])
    assert engine_head_size_problem(cfg, None) is None
    cfg = load_config(REPO / "configs/quickstart.yaml", [*base, "model.init.head_dim=16"])
    assert "model.init.head_dim: attention head size 16" in engine_head_size_problem(cfg, None)


def test_a_present_model_is_judged_by_its_own_config(tmp_path, world_dir):
    model = tmp_path / "model"
    cfg = load_config(REPO / "configs/quickstart.yaml", world_overrides(world_dir, model))
    assert engine_head_size_problem(cfg, write_config(model)) is None  # 128 / 4 = 32
    write_config(model, num_attention_heads=8)
    problem = engine_head_size_problem(cfg, model)
    assert problem and f"model.path {model}: attention head size 16" in problem
    with pytest.raises(ConfigError, match="head size 16"):
        list(prepare(cfg))
    assert any("head size 16" in p for p in dry_run(cfg, gpus=[]).problems)
    built = load_config(REPO / "configs/quickstart.yaml", [*world_overrides(world_dir, model), "model.build_if_missing=true"])
    assert "delete the folder" in engine_head_size_problem(built, model)  # its model.init no longer says what it is
    write_config(model, num_attention_heads=8, head_dim=64)  # an explicit head_dim wins
    assert engine_head_size_problem(cfg, model) is None
    write_config(model, num_attention_heads=8)
    hf = load_config(REPO / "configs/quickstart.yaml", [*world_overrides(world_dir, model), "rollout.engine=hf"])
    assert engine_head_size_problem(hf, model) is None  # transformers' generate is not limited


def test_the_train_command_refuses_a_tiny_model_with_head_size_16_in_one_error_line(tmp_path, world_dir):
    r = subprocess.run([sys.executable, "-m", "driver.cli", "train", "--config", "configs/quickstart.yaml",
                        f"run.output_dir={tmp_path}", *world_overrides(world_dir, tmp_path / "model"),
                        "model.build_if_missing=true", *HEADS_8],
                       cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = r.stdout + r.stderr
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in out, out
    assert "head size 16" in errors[0] and "model.init" in errors[0], errors
    assert not (tmp_path / "model").exists()
