"""An evaluation the loop waits for (at the start, every ``eval.every_steps`` on rollout actor 0) is a phase between
steps: its limit comes from ``driver.limits.phase_limit``, ``cluster.progress_timeout_s`` set by the user bounds it,
and a stop request ends the wait at once (the end's evaluation excepted: the loop is over)."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from async_agent_rl.config import load_config
from async_agent_rl.errors import error_line
from driver.evaluation import Evaluations
from driver.limits import RunFailed
from driver.stops import StopRequested, StopRequests

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray")]


@ray.remote(num_cpus=0)
class StoppedEvaluator:
    """Rollout actor 0 stopped (SIGSTOP) during an evaluation: it never answers."""

    def ping(self) -> bool:
        return True

    def evaluate(self, files, questions):
        time.sleep(120)


def test_a_stopped_evaluation_is_named_within_the_progress_timeout():
    cfg = load_config(None, ["cluster.progress_timeout_s=3", "eval.num_questions=10"])
    actor = StoppedEvaluator.remote()
    ray.get(actor.ping.remote(), timeout=120)
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as err:
        Evaluations(cfg, lambda rec, step: None).waited(actor, "step 2", 2, 1)
    assert time.monotonic() - t0 < 10
    assert error_line(err.value) == ("error: rollout actor 0 (the evaluation at step 2) did not answer within "
                                     "cluster.progress_timeout_s=3 s (hung or stopped)")


def test_a_stop_request_ends_the_wait_for_an_evaluation_at_once():
    cfg = load_config(None, ["eval.num_questions=10"])
    actor = StoppedEvaluator.remote()
    ray.get(actor.ping.remote(), timeout=120)
    stops = StopRequests(lambda line: None, lambda: 0)
    threading.Timer(1.0, stops._handle, (15, None)).start()  # SIGTERM, as its handler takes it
    t0 = time.monotonic()
    with pytest.raises(StopRequested):
        Evaluations(cfg, lambda rec, step: None, stops).waited(actor, "start", 0, 0)
    assert time.monotonic() - t0 < 10
