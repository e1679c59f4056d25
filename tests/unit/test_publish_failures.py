"""Until df0d743 (2026-11-25), a failed weight publish was swallowed (the driver printed the exception's type name only;
a refusal of the specs was not caught at all), and one that failed on every step left the engines on old weights while
the learner's version climbed. Now each failure is printed with its cause, and PUBLISH_FAILURES_FATAL in a row end the
run in one ``error:`` line naming it. A unit test of the caller: the publisher is a stand-in that fails as the real ones
do (tests/integration/test_weight_publish*.py run the real publishers)."""

from __future__ import annotations

import pytest

from async_agent_rl.config import load_config
from async_agent_rl.errors import error_line
from async_agent_rl.stats import PublishStats
from driver.limits import RunFailed
from driver.versions import PUBLISH_FAILURES_FATAL, PolicyVersions
from driver.weight_sync import WeightsRefused

pytestmark = pytest.mark.unit


class FlakyPublisher:
    """Fails the publishes whose version is in ``failing`` with ``error``."""

    def __init__(self, failing: set[int], error: Exception):
        self.failing, self.error, self.calls = failing, error, []

    def publish(self, version, state=None):
        self.calls.append(version)
        if version in self.failing:
            raise self.error
        return PublishStats(version, "object_store", 0.1, 0.0, 0, 1, [])


def versions_with(tmp_path, publisher) -> PolicyVersions:
    return PolicyVersions(load_config(None), None, publisher, lambda line: print(line, flush=True))


def test_a_failed_publish_is_printed_with_its_cause_and_a_success_resets_the_count(tmp_path, capsys):
    refused = WeightsRefused("rollout actor 0: no tensor model.norm.weight in the engine")
    t = versions_with(tmp_path, FlakyPublisher({1, 2, 4, 5}, refused))
    for version in range(1, 7):
        t.version = version
        assert (t.publish() is None) == (version in {1, 2, 4, 5})
    out = capsys.readouterr().out
    assert ("[fault] weight publish of version 2 failed (2 in a row): WeightsRefused: rollout actor 0: no tensor "
            "model.norm.weight in the engine") in out
    assert "version 5 failed (2 in a row)" in out and t.publish_failures == 0


def test_publishes_that_keep_failing_end_the_run_in_one_error_line(tmp_path):
    t = versions_with(tmp_path, FlakyPublisher(set(range(100)), OSError(28, "No space left on device")))
    for version in range(1, PUBLISH_FAILURES_FATAL):
        t.version = version
        assert t.publish() is None
    t.version = PUBLISH_FAILURES_FATAL
    with pytest.raises(RunFailed) as info:
        t.publish()
    assert error_line(info.value) == (f"error: weight publish failed {PUBLISH_FAILURES_FATAL} times in a row (the "
                                      "engines keep older weights while the learner moves on); the last: OSError: [Errno 28] "
                                      "No space left on device")


def test_a_restarted_actor_brought_up_to_date_mends_the_failures_before_it(tmp_path, monkeypatch):
    """Two rollout nodes lost one step apart (benchmarks/results/node_loss/): each loss fails one publish, and the
    actor of the first is restarted and given the current weights in between. The second failure counts from 1:
    the first was mended; before, it counted 2 "in a row" and a third loss ended the run."""
    import driver.versions as versions

    class Restarted:  # Ray's call shape: actor.update_weights.remote(version, weights)
        class update_weights:  # noqa: N801
            @staticmethod
            def remote(version, weights):
                return ("updated", version)

    class Publisher(FlakyPublisher):
        def member_restarted(self):
            pass

    asked = []
    monkeypatch.setattr(versions, "ask", lambda ref, timeout_s, what: asked.append(ref))
    t = versions_with(tmp_path, Publisher({1, 2, 3}, OSError("actor died")))
    t.weights_ref = "weights of the current version"
    t.version = 1
    assert t.publish() is None and t.publish_failures == 1
    t.catch_up(Restarted(), 0)  # the first lost actor, restarted with the current weights
    assert asked == [("updated", 1)] and t.publish_failures == 0
    for version in (2, 3):  # the next losses: counted from the mended one, the run goes on
        t.version = version
        assert t.publish() is None
    assert t.publish_failures == 2
