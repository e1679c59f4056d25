"""``EvaluationBeside``'s ways to end (stand-in evaluator actors, real Ray): a result, an evaluator that fails, one
that passes its time limit, a second evaluation due while one runs, and the end of training stopped by the user.
The real evaluator (a rollout actor on the vLLM engine) is run end to end in tests/integration/test_train_faults.py."""

from __future__ import annotations

import time

import pytest
import ray

from async_agent_rl.config import load_config
from driver.evaluation import EvaluationBeside

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray")]  # Ray: not a unit test


@ray.remote(num_cpus=0)
class Evaluator:
    """Answers ``evaluate_weights`` as the rollout actor does, after ``delay`` seconds, or fails."""

    def __init__(self, delay: float = 0.0, fail: str | None = None):
        self.delay, self.fail = delay, fail

    def evaluate_weights(self, tag, weights, test_files, num_questions):
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError(self.fail)
        return {"em": 0.5, "tag": tag, "seconds": 1.25}

    def ping(self):
        return "pong"


def _beside(evaluator, lines):
    cfg = load_config(None, ["eval.num_questions=10"])
    return EvaluationBeside(cfg, evaluator, lines.append)


def _dead(actor, within_s: float = 30.0) -> bool:
    """True once the actor no longer answers (``ray.kill`` is asynchronous: a ping sent just after it may still be
    answered, so ask again until ``within_s``)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


def test_a_finished_evaluation_is_the_record_of_its_step_and_version():
    lines: list[str] = []
    ev = _beside(Evaluator.remote(), lines)
    assert ev.can_start(5)
    ev.start(5, 3, ray.put({}))
    rec = ev.finish()
    assert rec == {"when": "step 5", "step": 5, "version": 3, "beside": True, "seconds": 1.25, "em": 0.5, "tag": 3}
    assert ev.summary() == {"evals_beside": 1, "evals_skipped": 0, "evaluator_failed": None} and not lines


def test_an_unpublished_step_runs_under_a_tag_of_its_own():
    ev = _beside(Evaluator.remote(), [])
    ev.start(4, None, ray.put({}))
    assert ev.finish()["tag"] == -4  # never a policy version the engine's cache could mix it with


def test_an_evaluation_due_while_one_runs_is_skipped_and_said_once():
    lines: list[str] = []
    ev = _beside(Evaluator.remote(delay=3.0), lines)
    ev.start(5, 1, ray.put({}))
    assert not ev.can_start(10) and not ev.can_start(15)
    assert ev.skipped == 2 and len(lines) == 1 and "step 10 is skipped" in lines[0] and "step 5" in lines[0]
    assert ev.finish() is not None and ev.can_start(20)


def test_a_failing_evaluator_ends_the_evaluations_beside_in_one_warning_and_is_ended():
    lines: list[str] = []
    actor = Evaluator.remote(fail="engine core died")
    ev = _beside(actor, lines)
    ev.start(5, 1, ray.put({}))
    assert ev.finish() is None
    assert len(lines) == 1 and lines[0].startswith("[warn] the evaluator failed during the evaluation of step 5")
    assert "engine core died" in lines[0] and "engine core died" in ev.summary()["evaluator_failed"]
    assert not ev.can_start(10) and ev.skipped == 0  # no more starts, and not counted as skips
    assert _dead(actor)


def test_an_evaluator_past_its_time_limit_is_ended_and_the_run_goes_on():
    lines: list[str] = []
    now = [0.0]
    actor = Evaluator.remote(delay=60.0)
    cfg = load_config(None, ["eval.num_questions=10"])
    ev = EvaluationBeside(cfg, actor, lines.append, clock=lambda: now[0])
    ev.start(5, 1, ray.put({}))
    assert ev.poll() is None and ev.failed is None  # running, within its limit
    now[0] = ev.limit_s + 1
    assert ev.poll() is None and f"did not finish within {ev.limit_s:.0f} s" in ev.failed
    assert len(lines) == 1 and lines[0].startswith("[warn]") and ev.finish() is None
    assert _dead(actor)


def test_the_end_of_training_does_not_wait_for_an_evaluation_when_the_run_is_being_stopped():
    ev = _beside(Evaluator.remote(delay=60.0), [])
    ev.start(5, 1, ray.put({}))
    t = time.monotonic()
    assert ev.finish(stopping=lambda: True) is None
    assert time.monotonic() - t < 5
