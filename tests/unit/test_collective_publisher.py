"""``CollectivePublisher``'s protocol with its members (fakes of the learner group and the rollout actors, whose
calls it makes through Ray): the group is made before the first publish and again after a member restarted or a
publish failed; the specs are agreed by every engine before the learner sends, and a refusal sends nothing."""

from __future__ import annotations

import pytest
import ray

from driver.weight_sync import CollectivePublisher, WeightsRefused, create_publisher

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray")]  # Ray: not a unit test

SPECS = [("embed", "float32", (4, 2))]


class Call:
    """``handle.method.remote(*args)``: records the call, returns a reference to the answer."""

    def __init__(self, log, name, answer):
        self.log, self.name, self.answer = log, name, answer

    def remote(self, *args):
        self.log.append((self.name, args))
        answer = self.answer(*args) if callable(self.answer) else self.answer
        if isinstance(answer, Exception):
            raise answer
        return ray.put(answer)


@ray.remote
def _fails(message):
    raise RuntimeError(message)


class FailingCall(Call):
    """A call that is accepted and fails where it runs: the error comes through ``ray.get``."""

    def remote(self, *args):
        self.log.append((self.name, args))
        return _fails.remote(self.answer)


class FakeActor:
    def __init__(self, log, refuse=None):
        self.join_weight_group = Call(log, "join", None)
        self.check_weight_specs = Call(log, "check", refuse)
        self.update_weights_collective = Call(log, "update", {"seconds": 0.5})


class FakeLearner:
    def __init__(self, log):
        self.log = log

    def open_weight_group(self):
        self.log.append(("open", ()))
        return 1234

    def join_weight_group(self, *args):
        return Call(self.log, "learner_join", None).remote(*args)

    def prepare_publish(self):
        self.log.append(("prepare", ()))
        return SPECS

    def broadcast_weights(self, specs):
        return Call(self.log, "send", (32, 0.1)).remote(specs)

    def discard_prepared(self):
        self.log.append(("discard", ()))

    def close_weight_group(self):
        self.log.append(("close", ()))


def names(log):
    return [n for n, _ in log]


def test_group_made_once_specs_agreed_before_sending():
    log = []
    pub = CollectivePublisher([FakeActor(log), FakeActor(log)], FakeLearner(log), backend="gloo", timeout_s=5)
    stats = pub.publish(1)
    assert names(log) == ["open", "learner_join", "join", "join", "prepare", "check", "check", "update", "update",
                          "send"]
    assert [args for n, args in log if n == "join"] == [(1234, 1, 3, "gloo", 5, 1), (1234, 2, 3, "gloo", 5, 1)]
    assert stats.bytes == 32 and stats.put_seconds == 0.1 and stats.actor_seconds == [0.5, 0.5]
    log.clear()
    pub.publish(2)
    assert "open" not in names(log) and names(log)[0] == "prepare"


def test_a_restarted_member_or_a_failed_publish_makes_the_group_again():
    log = []
    actor = FakeActor(log)
    pub = CollectivePublisher([actor], FakeLearner(log), backend="gloo", timeout_s=5)
    pub.publish(1)
    pub.member_restarted()
    log.clear()
    pub.publish(2)
    assert names(log)[:3] == ["open", "learner_join", "join"] and log[2][1][-1] == 2  # generation 2
    actor.update_weights_collective = Call(log, "update", RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        pub.publish(3)
    assert not pub.connected
    actor.update_weights_collective = FailingCall(log, "update", "engine died while receiving")
    with pytest.raises(ray.exceptions.RayTaskError, match="engine died while receiving"):
        pub.publish(4)  # the group is made again, the send starts, then the engine's failure comes back
    assert not pub.connected and names(log)[-2:] == ["update", "send"]


def test_a_failed_spec_check_releases_the_prepared_weights():
    log = []
    actor = FakeActor(log)
    actor.check_weight_specs = FailingCall(log, "check", "actor died")
    pub = CollectivePublisher([actor], FakeLearner(log), backend="gloo", timeout_s=5)
    with pytest.raises(ray.exceptions.RayTaskError, match="actor died"):
        pub.publish(1)
    assert names(log)[-2:] == ["check", "discard"] and "send" not in names(log)


def test_close_releases_the_learners_side_even_of_a_broken_group():
    log = []
    actor = FakeActor(log)
    pub = CollectivePublisher([actor], FakeLearner(log), backend="gloo", timeout_s=5)
    pub.close()
    assert "close" not in names(log)  # never made: nothing to release
    actor.update_weights_collective = Call(log, "update", RuntimeError("engine died"))
    with pytest.raises(RuntimeError):
        pub.publish(1)
    pub.close()
    assert names(log)[-1] == "close" and not pub.connected


def test_a_refusal_sends_nothing():
    log = []
    pub = CollectivePublisher([FakeActor(log), FakeActor(log, refuse="rollout actor 1: missing 1 of 9 parameters")],
                              FakeLearner(log), backend="gloo", timeout_s=5)
    with pytest.raises(WeightsRefused, match="rollout actor 1: missing"):
        pub.publish(1)
    assert "send" not in names(log) and "update" not in names(log) and names(log)[-1] == "discard"


def test_methods_by_name():
    with pytest.raises(ValueError, match="needs the learner"):
        create_publisher("collective", [])
    with pytest.raises(ValueError, match="allowed: object_store, collective"):
        create_publisher("carrier_pigeon", [])


@ray.remote
def _never_answers(seconds):
    import time

    time.sleep(seconds)


class Stopped(Call):
    """A call to a rollout actor stopped by SIGSTOP: accepted, never answered."""

    def remote(self, *args):
        self.log.append((self.name, args))
        return _never_answers.remote(60)


def test_a_publish_to_a_stopped_actor_fails_within_the_collective_timeout():
    """Until e4918d9 (2026-11-26), the collective publish waited for its members with no limit (its ``ray.get`` calls),
    so an engine stopped between steps held the driver for good. Now each wait ends after ``weight_sync.timeout_s`` with
    a ``PublishTimeout`` (which the driver counts as a failed publish), the prepared copy released."""
    import time

    from driver.weight_sync import PublishTimeout

    log = []
    actor = FakeActor(log)
    actor.check_weight_specs = Stopped(log, "check", None)
    pub = CollectivePublisher([actor], FakeLearner(log), backend="gloo", timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(PublishTimeout, match=r"checking the specs of version 1: rollout actor 0 did not answer within "
                                             r"2 s, the publish's limit"):
        pub.publish(1)
    assert time.monotonic() - t0 < 10
    assert names(log)[-1] == "discard", log


class PublishingLearner(FakeLearner):
    def publishing(self, timeout_s, stops=None):
        self.log.append(("publishing", (timeout_s, stops)))


def test_the_publish_phase_limit_bounds_the_collective_waits_and_the_learners():
    """Until 2026-12-07 the collective path waited ``weight_sync.timeout_s`` (300 s by default) whatever
    ``cluster.progress_timeout_s`` the user set, and the learner's part of a publish the group's long limit. Now the
    publish phase's limit (``actor_timeout_s``) bounds both."""
    log = []
    stops = object()
    pub = create_publisher("collective", [FakeActor(log)], PublishingLearner(log), actor_timeout_s=60, stops=stops,
                           backend="gloo", timeout_s=300)
    assert pub.timeout_s == 60 and log == [("publishing", (60, stops))]
    pub = create_publisher("collective", [FakeActor(log)], PublishingLearner(log), actor_timeout_s=600,
                           backend="gloo", timeout_s=300)
    assert pub.timeout_s == 300, "weight_sync.timeout_s below the phase limit stands"
    log.clear()
    create_publisher("object_store", [FakeActor(log)], PublishingLearner(log), actor_timeout_s=60)
    assert log == [("publishing", (60, None))]


def test_a_broadcast_the_learner_does_not_send_names_the_learner():
    import time

    from driver.weight_sync import PublishTimeout

    log = []
    learner = FakeLearner(log)
    learner.broadcast_weights = lambda specs: Stopped(log, "send", None).remote(specs)
    pub = CollectivePublisher([FakeActor(log), FakeActor(log)], learner, backend="gloo", timeout_s=2)
    pub.connect()
    t0 = time.monotonic()
    with pytest.raises(PublishTimeout, match=r"the broadcast of version 1: the learner did not answer within 2 s"):
        pub.publish(1)
    assert time.monotonic() - t0 < 10 and not pub.connected
