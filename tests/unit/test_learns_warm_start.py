"""The learning test's committed warm start (tests/data/learns_warm_start) is used only while it matches the test's
world and recipe; this fast check says at once when a change to the world or the recipe made it stale (the slow
test would then train one in its own run: correct, 5-6 minutes slower)."""

import pytest

from tests.integration.test_train_learns import WARM_START, committed_warm_start, learn_config

pytestmark = pytest.mark.unit


def test_the_committed_warm_start_matches_the_test_world_and_recipe(tmp_path, world_dir, tiny_model_dir):
    cfg = learn_config(tmp_path, world_dir, tiny_model_dir)
    assert committed_warm_start(cfg, world_dir) == WARM_START, (
        "tests/data/learns_warm_start is stale: make it again with `python -m tests.integration.test_train_learns`"
    )
    assert (WARM_START / "model.safetensors").is_file() and (WARM_START / "tokenizer.json").is_file()


def test_another_recipe_or_world_is_not_matched(tmp_path, world_dir, tiny_model_dir):
    assert (
        committed_warm_start(learn_config(tmp_path, world_dir, tiny_model_dir, "sft.pretrain_steps=299"), world_dir)
        is None
    )
    other = tmp_path / "world"
    other.mkdir()
    for f in world_dir.iterdir():
        other.joinpath(f.name).write_bytes(f.read_bytes())
    with (other / "corpus.jsonl").open("a") as fh:
        fh.write("\n")
    assert committed_warm_start(learn_config(tmp_path, other, tiny_model_dir), other) is None
