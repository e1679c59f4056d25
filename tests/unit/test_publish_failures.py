"""Issue 22: a failed weight publish was swallowed (the driver printed the exception's type name only; a refusal of
the specs was not caught at all), and one that failed on every step left the engines on old weights while the
learner's version climbed. Now each failure is printed with its cause, and PUBLISH_FAILURES_FATAL in a row end the
run in one ``error:`` line naming it. A unit test of the caller: the publisher is a stand-in that fails as the real
ones do (tests/integration/test_weight_publish*.py run the real publishers)."""

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
