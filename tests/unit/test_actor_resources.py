"""What the run's actors ask of a local Ray cluster it starts: all of them must fit at once, or the run is refused
before anything starts (Ray leaves an actor it cannot place pending for ever)."""

from __future__ import annotations

import pytest

from async_agent_rl.config import load_config
from async_agent_rl.errors import InputError, error_line
from driver.cluster import check_actors_fit

pytestmark = pytest.mark.unit


def test_actors_that_cannot_all_fit_on_the_local_cluster_are_refused_before_they_start():
    """A learner or rollout actor asking for more than the local cluster has stayed pending for ever."""
    cfg = load_config(None, ["rollout.num_actors=2", "learner.num_ranks=2"])  # 2 x 0.5 + 2 x 0.5 CPUs
    check_actors_fit(cfg, {"CPU": 2.0})
    with pytest.raises(InputError) as err:
        check_actors_fit(cfg, {"CPU": 1.0})
    assert error_line(err.value) == (
        "error: the run's actors ask the local Ray cluster for 2 CPUs (rollout actors 2 x 0.5, learner ranks 2 x 0.5) "
        "and it has 1: raise cluster.num_cpus or lower cluster.*_cpus")
    with pytest.raises(InputError, match=r"for 1 GPUs \(learner ranks 1 x 1\) and it has 0: lower cluster\.\*_gpus"):
        check_actors_fit(load_config(None, ["cluster.learner_gpus=1"]), {"CPU": 8.0})
