"""``sft.prebuilt``: a warm start made before is a run's only when it is what the run would make. Real short warm
starts (``run_sft``) on the test world and tiny model, and the run's real start (``prepare_inputs``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from async_agent_rl.config import load_config
from async_agent_rl.errors import error_line
from driver.start import prepare_inputs
from driver.stops import StopRequests
from tests.helpers import world_overrides
from warm_start.prebuilt import FINGERPRINT_FILE, run_fingerprint
from warm_start.sft import INPUTS_FILE, METRICS_FILE, SUMMARY_FILE, run_sft, warm_start_inputs

pytestmark = pytest.mark.integration

RECIPE = ["sft.enabled=true", "sft.num_demos=24", "sft.batch_size=4", "sft.epochs=1", "sft.pretrain_steps=2",
          "sft.warmup_steps=1", "sft.pretrain_questions=false"]


def config(tmp_path: Path, world_dir: Path, model_dir: Path, *extra: str):
    return load_config(None, [*world_overrides(world_dir, model_dir), *RECIPE, f"run.output_dir={tmp_path}",
                              "run.name=run", *extra])


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory, world_dir, tiny_model_dir) -> Path:
    """A warm start made by ``run_sft`` as ``async-agent-rl sft`` makes one, in a folder of its own."""
    tmp = tmp_path_factory.mktemp("prebuilt")
    out = tmp / "shipped"
    run_sft(config(tmp, world_dir, tiny_model_dir), tiny_model_dir, out, progress=False)
    return out


def start(cfg, run_dir: Path) -> tuple[str, list[str]]:
    lines: list[str] = []
    return prepare_inputs(cfg, run_dir, lines.append, StopRequests(lines.append, lambda: 0)), lines


def test_a_warm_start_records_what_a_run_would_compute_for_it(prebuilt, tmp_path, world_dir, tiny_model_dir):
    """The fingerprint ``run_sft`` writes beside its model equals the one computed for the same config without
    training (the demonstrations and pretraining texts made again): the condition for ever using a prebuilt one."""
    saved = json.loads((prebuilt / FINGERPRINT_FILE).read_text())
    assert saved == run_fingerprint(config(tmp_path, world_dir, tiny_model_dir), tiny_model_dir)
    assert saved["demonstrations"]["count"] == 24 and saved["pretraining_texts"]["count"] > 0
    assert "world_dir" not in saved["inputs"]["data"] and "model_dir" not in saved["inputs"], "no path in it"


def test_a_matching_prebuilt_warm_start_is_installed_and_not_trained_again(prebuilt, tmp_path, world_dir,
                                                                          tiny_model_dir):
    cfg = config(tmp_path, world_dir, tiny_model_dir, f"sft.prebuilt={prebuilt}")
    policy, lines = start(cfg, tmp_path / "run")
    sft = tmp_path / "run" / "sft"
    assert policy == str(sft)
    assert any(x.startswith(f"[sft] the prebuilt warm start {prebuilt} is this run's") for x in lines), lines
    assert not any("warm start on" in x for x in lines), "nothing trained"
    assert (sft / "model.safetensors").read_bytes() == (prebuilt / "model.safetensors").read_bytes()
    assert (sft / METRICS_FILE).read_bytes() == (prebuilt / METRICS_FILE).read_bytes()
    assert json.loads((sft / INPUTS_FILE).read_text()) == warm_start_inputs(cfg, cfg.model.path), \
        "the run's own paths, so that the next run finds it present"
    _, again = start(cfg, tmp_path / "run")
    assert f"[sft] warm start present: {sft}" in again


def test_a_prebuilt_warm_start_of_another_recipe_is_not_used_and_the_line_says_why(prebuilt, tmp_path, world_dir,
                                                                                  tiny_model_dir):
    cfg = config(tmp_path, world_dir, tiny_model_dir, f"sft.prebuilt={prebuilt}", "sft.seed=1")
    _, lines = start(cfg, tmp_path / "run")
    sft = tmp_path / "run" / "sft"
    why = [x for x in lines if x.startswith(f"[sft] the prebuilt warm start {prebuilt} is not this run's")]
    assert len(why) == 1 and "(inputs.sft.seed differ)" in why[0], lines
    assert any(x.startswith("[sft] warm start on 24 demonstrations") for x in lines), "made instead"
    assert (sft / SUMMARY_FILE).is_file()
    assert (sft / "model.safetensors").read_bytes() != (prebuilt / "model.safetensors").read_bytes()


def test_a_prebuilt_warm_start_of_other_demonstrations_under_the_same_settings_is_not_used(prebuilt, tmp_path,
                                                                                          world_dir, tiny_model_dir):
    """The settings agree but the demonstrations differ (as after a change to the code that makes them: here the
    recorded hash is changed): the demonstrations are made again and compared, and the warm start is made."""
    other = tmp_path / "other"
    shutil.copytree(prebuilt, other)
    fp = json.loads((other / FINGERPRINT_FILE).read_text())
    fp["demonstrations"]["sha256"] = "0" * 64
    (other / FINGERPRINT_FILE).write_text(json.dumps(fp))
    _, lines = start(config(tmp_path, world_dir, tiny_model_dir, f"sft.prebuilt={other}"), tmp_path / "run")
    assert any("is not this run's (demonstrations.sha256 differ)" in x for x in lines), lines
    assert any(x.startswith("[sft] warm start on 24 demonstrations") for x in lines), "made instead"


def test_a_missing_prebuilt_folder_is_said_and_the_warm_start_made(tmp_path, world_dir, tiny_model_dir):
    """A relative ``sft.prebuilt`` seen from another folder (the quickstart's, run from elsewhere) finds nothing."""
    missing = tmp_path / "nowhere"
    _, lines = start(config(tmp_path, world_dir, tiny_model_dir, f"sft.prebuilt={missing}"), tmp_path / "run")
    assert any(x.startswith(f"[sft] no prebuilt warm start at {missing} (sft.prebuilt, from ") for x in lines), lines
    assert (tmp_path / "run" / "sft" / SUMMARY_FILE).is_file()


def test_a_prebuilt_folder_with_no_warm_start_is_one_error_naming_the_setting(prebuilt, tmp_path, world_dir,
                                                                             tiny_model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    shutil.copytree(prebuilt, broken)
    (broken / FINGERPRINT_FILE).write_text("{not json")
    for folder, what in ((empty, f"no warm start with a {FINGERPRINT_FILE} there"), (broken, "is not JSON")):
        cfg = config(tmp_path, world_dir, tiny_model_dir, f"sft.prebuilt={folder}")
        with pytest.raises(ValueError) as err:
            start(cfg, tmp_path / "run")
        assert str(err.value).startswith(f"sft.prebuilt={folder}: ") and what in str(err.value)
        assert error_line(err.value) == f"error: {err.value}", "the CLI's one line for bad input"
        assert not (tmp_path / "run" / "sft" / SUMMARY_FILE).exists()
