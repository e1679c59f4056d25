"""Bad inputs: config values that used to be accepted and then failed later (or silently) are rejected
when the config is loaded, with the dotted path in the message."""

from __future__ import annotations

import pytest

from async_agent_rl.config import ConfigError, load_config

pytestmark = pytest.mark.unit

BAD = [
    ("learner.lr=.inf", "learner.lr"),
    ("learner.lr=.nan", "learner.lr"),
    ("algorithm.clip_ratio_high=-.inf", "algorithm.clip_ratio_high"),
    ("learner.betas=[0.9, 1.0]", "learner.betas.1"),
    ("learner.betas=[-0.1, 0.999]", "learner.betas.0"),
    ("algorithm.dual_clip_c=1.0", "algorithm.dual_clip_c"),
    ("algorithm.dual_clip_c=0.5", "algorithm.dual_clip_c"),
    ("monitoring.host=0.0.0.0", "monitoring.host"),
    ("monitoring.host=192.0.2.7", "monitoring.host"),
    ("retriever.url=ftp://127.0.0.1:8000", "retriever.url"),
    ("retriever.url=127.0.0.1:8000", "retriever.url"),
    ("reward.terms=[]", "reward.terms"),
    ("learner.total_steps=true", "learner.total_steps"),
    ("rollout.num_actors=false", "rollout.num_actors"),
    ("learner.zero_stage=true", "learner.zero_stage"),
    ("learner.lr=true", "learner.lr"),
]


@pytest.mark.parametrize("override,path", BAD, ids=[b[0] for b in BAD])
def test_bad_value_is_rejected_naming_its_path(override, path):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert f"  {path}:" in str(e.value), str(e.value)


GOOD = [
    "learner.betas=[0.0, 0.95]",
    "algorithm.dual_clip_c=null",
    "algorithm.dual_clip_c=1.5",
    "monitoring.host=localhost",
    "monitoring.host=::1",
    "retriever.url=http://127.0.0.1:8000",
    "retriever.url=https://search.example.org/retrieve",
    "learner.lr=1",  # an integer where a float is expected is fine
    "sft.reading_max_rounds=0",  # the reading check alone, no rounds
]


@pytest.mark.parametrize("override", GOOD)
def test_edge_values_that_are_fine_still_load(override):
    load_config(None, [override])


def test_monitoring_on_a_public_interface_needs_the_explicit_opt_in():
    cfg = load_config(None, ["monitoring.host=0.0.0.0", "monitoring.allow_remote=true"])
    assert cfg.monitoring.host == "0.0.0.0"
