"""The bench command's pure parts: every study's arms are valid configs, and the async-vs-sync comparison."""

from __future__ import annotations

import pytest

from async_agent_rl.bench import STUDIES, Arm, ArmRun, staleness_arms, sync_arms, sync_summary, time_to_em
from async_agent_rl.config import load_config


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_every_study_arm_is_a_valid_quickstart_config_that_changes_its_key(study):
    base = load_config("configs/quickstart.yaml").to_dict()
    for arm in STUDIES[study]:
        cfg = load_config("configs/quickstart.yaml", list(arm.overrides)).to_dict()
        key, value = arm.overrides[0].split("=")
        section, name = key.split(".")
        assert str(cfg[section][name]).lower() == value.lower()
        changed = {f"{s}.{k}" for s in base for k in base[s] if base[s][k] != cfg[s][k]}
        assert changed <= {key}, changed
    # the first arm is the quickstart's own value: the shared baseline run stands for it
    first = STUDIES[study][0]
    assert load_config("configs/quickstart.yaml", list(first.overrides)).to_dict() == base


def test_staleness_and_sync_arms():
    assert [a.overrides for a in staleness_arms([0, 4])] == [("buffer.max_staleness=0",), ("buffer.max_staleness=4",)]
    a, s = sync_arms(2)
    assert load_config("configs/quickstart.yaml", list(s.overrides)).rollout.mode == "sync"
    assert load_config("configs/quickstart.yaml", list(s.overrides)).buffer.max_staleness == 0
    assert load_config("configs/quickstart.yaml", list(a.overrides)).buffer.max_staleness == 2


def result(curve, samples_per_s):
    return {"eval_curve": [{"step": i, "train_s": t, "exact_match": em} for i, (t, em) in enumerate(curve)],
            "em_best": max(em for _, em in curve), "samples_per_s": samples_per_s}


def test_time_to_em_is_the_first_evaluation_at_or_above_the_target():
    r = result([(0, 0.2), (50, 0.3), (100, 0.25), (150, 0.35)], 1.0)
    assert time_to_em(r, 0.3) == 50 and time_to_em(r, 0.35) == 150 and time_to_em(r, 0.4) is None


def test_sync_summary_compares_at_the_lower_best():
    fast = result([(0, 0.2), (40, 0.3), (80, 0.32)], 4.0)
    slow = result([(0, 0.2), (100, 0.28), (200, 0.3)], 2.0)
    runs = [ArmRun(Arm("sync", "async", "a", ()), None, [], result=fast),
            ArmRun(Arm("sync", "sync", "s", ()), None, [], result=slow)]
    text, d = sync_summary(runs)
    assert d["target_em"] == 0.3 and d["async_time_to_em_s"] == 40 and d["sync_time_to_em_s"] == 200
    assert d["time_to_em_ratio"] == 5.0 and d["samples_per_s_ratio"] == 2.0
    assert "2.00x" in text and "5.00x" in text
    text, d = sync_summary(runs[:1])
    assert d == {} and "failed" in text
