"""A tiny model folder built from one ``model.init`` is not used as if it were another's. A run with
``model.build_if_missing`` builds the model once and reuses the folder; when the config's model changed since (the
quickstart's default shape did), the old folder was trained under the new config's name, and a warm start made from
it recorded the new shape as its input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from async_agent_rl.config import ConfigError, load_config
from async_agent_rl.tiny_model import TINY_MODEL_FILE
from driver.check import dry_run
from driver.prepare import prepare
from tests.helpers import world_overrides

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# a model.init other than the session model's (Qwen2, 4 heads, vocabulary 2048)
QWEN3_8 = ["model.build_if_missing=true", "model.init.architecture=qwen3", "model.init.head_dim=32",
           "model.init.num_attention_heads=8", "model.init.num_key_value_heads=4"]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_model_built_from_another_init_is_refused_naming_what_differs(tmp_path, world_dir, tiny_model_dir):
    model = copy_model(tiny_model_dir, tmp_path / "model")  # Qwen2, 4 heads, vocabulary 2048
    cfg = load_config(REPO / "configs/quickstart.yaml", [*world_overrides(world_dir, model), *QWEN3_8])
    assert json.loads((model / TINY_MODEL_FILE).read_text()) != cfg.model.init.model_dump()
    with pytest.raises(ConfigError, match=rf"model.path {model} holds a tiny model built from another model.init: "
                                          r".*num_attention_heads 4 \(model.init: 8\).*delete the folder"):
        list(prepare(cfg))
    assert any("built from another model.init" in p for p in dry_run(cfg, gpus=[]).problems)  # train --dry-run too
    # the same folder under the init it was built from is reused as before
    (model / TINY_MODEL_FILE).write_text(json.dumps(cfg.model.init.model_dump()))
    assert any(line.startswith("model present") for line in prepare(cfg))
    assert not [p for p in dry_run(cfg, gpus=[]).problems if "model.init" in p]
    # a model folder named by the user (no build) is not judged by model.init, nor is one without the recipe file
    (model / TINY_MODEL_FILE).unlink()
    assert any(line.startswith("model present") for line in prepare(cfg))
    own = load_config(REPO / "configs/quickstart.yaml", world_overrides(world_dir, copy_model(tiny_model_dir,
                                                                                                tmp_path / "own")))
    assert any(line.startswith("model present") for line in prepare(own))


def test_prepare_force_rebuilds_it_and_an_unreadable_recipe_is_one_error(tmp_path, world_dir, tiny_model_dir):
    model = copy_model(tiny_model_dir, tmp_path / "model")
    (model / TINY_MODEL_FILE).write_text('{"num_attention_heads": "many"}')
    cfg = load_config(REPO / "configs/quickstart.yaml", [*world_overrides(world_dir, model), *QWEN3_8])
    with pytest.raises(ConfigError, match=f"{TINY_MODEL_FILE} is not a tiny model's recipe"):
        list(prepare(cfg))
    r = subprocess.run([sys.executable, "-m", "driver.cli", "prepare", "--config", "configs/quickstart.yaml",
                        *world_overrides(world_dir, model), *QWEN3_8],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        line for line in r.stderr.splitlines() if line.strip()]
    assert any(line.startswith("built a tiny qwen3 model") for line in prepare(cfg, force=True))
    assert json.loads((model / TINY_MODEL_FILE).read_text()) == cfg.model.init.model_dump()
    assert any(line.startswith("model present") for line in prepare(cfg))
