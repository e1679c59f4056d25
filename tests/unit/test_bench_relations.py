"""The learning report's by-relation numbers of an arm whose config does not load are not dropped unsaid."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_an_arm_whose_config_does_not_load_is_named_on_stderr_not_dropped_silently(tmp_path, capsys):
    from driver.bench.learning import relation_numbers

    # what a study's process older than a config key sees in a later arm's config.yaml
    (tmp_path / "config.yaml").write_text("learner:\n  a_key_added_later: []\n")
    assert relation_numbers(tmp_path, []) == {}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"[report] {tmp_path}: no by-relation numbers, its config or test "
                                               "files do not load (") and "a_key_added_later" in err[0], err
