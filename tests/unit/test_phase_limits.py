"""Every phase between learner steps (checkpoint, publish, evaluation, restore) has a limit derived in one place
(``driver.limits.phase_limit``) from the config and the work's size, and ``cluster.progress_timeout_s`` set by the user
bounds every one of them; ``Fleet.supervise`` asks every rollout actor at once and waits for all of them within one
limit (before: one after another, each allowed ``cluster.actor_timeout_s``). The real-process behaviour (a learner
stopped mid-checkpoint named within the progress timeout): tests/integration/test_supervision.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import GetTimeoutError

import driver.fleet as fleet_module
from async_agent_rl.config import load_config
from async_agent_rl.errors import error_line
from async_agent_rl.stats import RolloutStats
from driver.fleet import Fleet
import driver.limits as limits
from driver.limits import PHASES, SLICE_S, PhaseTimeout, RunFailed, phase_limit, wait_phase
from driver.stops import StopRequested

pytestmark = pytest.mark.unit

GB = 1e9


@pytest.mark.parametrize("phase", PHASES)
def test_the_progress_timeout_a_user_set_bounds_every_phase(phase):
    free = load_config(None)
    bounded_by_user = load_config(None, ["cluster.progress_timeout_s=7"])
    size = 200 if phase == "evaluation" else 6 * GB
    assert phase_limit(free, phase, size)[0] > 7
    assert phase_limit(bounded_by_user, phase, size) == (7.0, "cluster.progress_timeout_s=7 s")
    off = load_config(None, ["cluster.progress_timeout_s=0"])  # the watchdog off: no bound from it either
    assert phase_limit(off, phase, size) == phase_limit(free, phase, size)


@pytest.mark.parametrize("phase, small, large", [("checkpoint", 0.1 * GB, 6 * GB), ("restore", 0.1 * GB, 6 * GB),
                                                 ("publish", 0.1 * GB, 60 * GB), ("evaluation", 10, 100_000)])
def test_larger_work_gets_a_larger_limit_and_small_work_the_floor(phase, small, large):
    cfg = load_config(None)
    low, high = phase_limit(cfg, phase, small)[0], phase_limit(cfg, phase, large)[0]
    assert high > low >= min(cfg.cluster.actor_timeout_s, 600)
    if phase != "evaluation":
        assert phase_limit(cfg, phase, 0) == (cfg.cluster.actor_timeout_s,
                                              f"cluster.actor_timeout_s={cfg.cluster.actor_timeout_s:g} s")


def test_the_collective_publish_keeps_its_own_timeout_under_the_users_progress_timeout():
    cfg = load_config(None, ["weight_sync.method=collective", "weight_sync.timeout_s=50"])
    assert phase_limit(cfg, "publish", 6 * GB) == (50.0, "weight_sync.timeout_s=50 s")
    cfg = load_config(None, ["weight_sync.method=collective", "weight_sync.timeout_s=50",
                             "cluster.progress_timeout_s=20"])
    assert phase_limit(cfg, "publish", 6 * GB)[0] == 20.0
    with pytest.raises(ValueError, match="phase 'nap'"):
        phase_limit(cfg, "nap")


# ------------------------------------------------------------------------------------------------ supervise
class StandIn:
    """A rollout actor handle: ``stats.remote()`` returns a reference (a string) the fake Ray below resolves."""

    def __init__(self, index: int, events: list, answers: bool):
        self.index, self.events, self.answers = index, events, answers
        self.stats = SimpleNamespace(remote=self._stats)
        self.error = SimpleNamespace(remote=lambda: f"error{index}")

    def _stats(self) -> str:
        self.events.append(("asked", self.index))
        return f"stats{self.index}" if self.answers else f"silent{self.index}"


class FakeRay:
    """``ray.wait`` / ``ray.get`` on the stand-ins' references: the ``silent`` ones never become ready."""

    def __init__(self, events: list):
        self.events = events

    def wait(self, refs, num_returns=1, timeout=None, fetch_local=True):
        self.events.append(("wait", tuple(refs), timeout))
        ready = [r for r in refs if not r.startswith("silent")]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref, timeout=None):
        self.events.append(("get", ref, timeout))
        if isinstance(ref, str) and ref.startswith("silent"):
            raise GetTimeoutError()
        return RolloutStats(index=int(ref[-1]), incarnation="a", ready=True)


def test_supervise_asks_every_actor_at_once_and_waits_within_one_limit(monkeypatch):
    """Before: actor 0 was asked and waited for (up to ``cluster.actor_timeout_s``), then actor 1, and so on: N
    silent actors held the loop N times the limit before the watchdog looked again."""
    events: list = []
    monkeypatch.setattr(fleet_module, "ray", FakeRay(events))
    monkeypatch.setattr(fleet_module, "actor_node", lambda actor: None)
    cfg = load_config(None, ["cluster.actor_timeout_s=30", "cluster.max_actor_restarts=0"])
    actors = [StandIn(0, events, True), StandIn(1, events, False), StandIn(2, events, False)]
    fleet = Fleet(cfg, lambda line: None, buffer=None, actors=actors, versions=None)
    with pytest.raises(RunFailed) as err:
        fleet.supervise()
    assert events[:3] == [("asked", 0), ("asked", 1), ("asked", 2)], events  # all asked before any wait
    waits = [e for e in events if e[0] in ("wait", "get")]
    assert waits[0][:2] == ("wait", ("stats0", "silent1", "silent2")) and 29 < waits[0][2] <= 30, waits
    assert [e[:2] for e in waits[1:]] == [("get", "stats0")], "only the ready answer is fetched"
    # a silent actor is handled as before: with no restart left, the run ends naming it
    assert error_line(err.value) == ("error: rollout actor 1: GetTimeoutError (restarted 0 time(s) already, "
                                     "cluster.max_actor_restarts=0)")


# ------------------------------------------------------------------------------------------------ stop requests
class NeverReady:
    """``ray.wait`` on references that never become ready: sleeps the slice it is given, as Ray's would."""

    def __init__(self):
        self.slices: list[float] = []

    def wait(self, refs, num_returns=1, timeout=None, fetch_local=True):
        self.slices.append(timeout)
        time.sleep(timeout)
        return [], list(refs)


class Stops:
    def __init__(self, after_s: float | None):
        self.signal, self.at = None, 0.0
        if after_s is not None:
            threading.Timer(after_s, self.request).start()

    def request(self):
        self.signal, self.at = 15, time.monotonic()


def test_a_phases_wait_is_sliced_and_ends_at_its_limit_naming_what_did_not_answer(monkeypatch):
    fake = NeverReady()
    monkeypatch.setattr(limits, "ray", fake)
    t0 = time.monotonic()
    with pytest.raises(PhaseTimeout) as err:
        wait_phase(["a", "b"], 2.5, "the learner (checkpoint of step 2)", "cluster.progress_timeout_s=2.5 s")
    assert 2.4 < time.monotonic() - t0 < 4
    assert error_line(err.value) == ("error: the learner (checkpoint of step 2) did not answer within "
                                     "cluster.progress_timeout_s=2.5 s (hung or stopped)")
    assert err.value.pending == [0, 1] and max(fake.slices) <= SLICE_S and len(fake.slices) >= 3


def test_a_stop_request_ends_a_publish_or_a_start_at_once(monkeypatch):
    monkeypatch.setattr(limits, "ray", NeverReady())
    t0 = time.monotonic()
    with pytest.raises(StopRequested):
        wait_phase(["a"], 60, "the publish of version 3", "60 s", Stops(after_s=0.5), on_stop="abandon")
    assert time.monotonic() - t0 < 0.5 + SLICE_S + 1


def test_a_checkpoint_under_way_when_a_stop_comes_gets_the_stop_limit_at_most(monkeypatch):
    monkeypatch.setattr(limits, "ray", NeverReady())
    t0 = time.monotonic()
    with pytest.raises(PhaseTimeout) as err:
        wait_phase(["a"], 60, "the learner (checkpoint of step 4)", "60 s", Stops(after_s=0.5), stop_limit=1.5)
    assert time.monotonic() - t0 < 0.5 + 1.5 + SLICE_S + 1
    assert "did not answer within 1.5 s of the stop request" in str(err.value)
