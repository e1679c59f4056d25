"""Nothing stalls in silence: when no learner step completes for ``cluster.progress_timeout_s`` (unset:
max(600 s, 10 x the slowest step so far); 0: never), the driver ends the run in one ``error:`` line naming the
blocked component and the state of every component. The decision (``ProgressWatchdog``, on a fake clock) and the
line (``stall_message``, on the stats messages the components send), whose ``blocked:`` clause must blame the part at
fault (``blocked_component``) with the other parts' signals around it. A real stalled training:
tests/integration/test_train_stall_and_stop.py; each component's fault: tests/integration/test_fault_injection.py."""

from __future__ import annotations

import pytest

from async_agent_rl.config import ConfigError, load_config
from async_agent_rl.errors import error_line
from async_agent_rl.stats import AdmissionStats, BufferStats, RolloutStats
from driver.fleet import (
    ACTORS_SILENT, ADMISSION, BLAMED, BUFFER, GENERATION, LEARNER, PUSHES, blocked_component, stall_message,
)
from driver.limits import PROGRESS_FLOOR_S, ProgressWatchdog, RunFailed

from tests.helpers import Clock

pytestmark = pytest.mark.unit


def test_the_default_limit_is_ten_slowest_steps_with_a_floor():
    clock = Clock()
    w = ProgressWatchdog(None, clock)
    assert w.limit() == PROGRESS_FLOOR_S == 600
    clock.now += 599
    assert not w.expired()
    clock.now += 2
    assert w.expired()  # the first step never came within 600 s
    for took in (30.0, 90.0, 45.0):  # steps (waiting for the batch included)
        w.waiting()
        clock.now += took
        assert w.step_done() == took
    assert w.slowest == 90 and w.limit() == 900  # 10 x the slowest, above the floor
    w.waiting()
    clock.now += 899
    assert not w.expired()
    clock.now += 2
    assert w.expired() and w.waited() == 901


def test_a_configured_limit_is_used_as_is_and_zero_never_fires():
    clock = Clock()
    w = ProgressWatchdog(20, clock)
    w.waiting()
    clock.now += 19
    assert not w.expired()
    clock.now += 2
    assert w.expired()
    off = ProgressWatchdog(0, clock)
    clock.now += 10**7
    assert off.limit() is None and not off.expired()


def test_the_config_key_takes_seconds_and_refuses_negatives():
    assert load_config(None).cluster.progress_timeout_s is None
    assert load_config(None, ["cluster.progress_timeout_s=0"]).cluster.progress_timeout_s == 0
    assert load_config(None, ["cluster.progress_timeout_s=90"]).cluster.progress_timeout_s == 90
    with pytest.raises(ConfigError, match="progress_timeout_s"):
        load_config(None, ["cluster.progress_timeout_s=-1"])


def buffer(**admission) -> BufferStats:
    return BufferStats(size=12, ready_groups=1, pending_groups=2, learner_version=3,
                       admission=AdmissionStats(**admission))


def actor(i: int, **kw) -> RolloutStats:
    return RolloutStats(index=i, ready=True, **kw)


def test_an_admission_that_grants_nothing_is_named_with_every_components_state():
    msg = stall_message(
        step=3, waited=612.4, limit=600, configured=True, learner="waiting for a batch (idle)",
        buffer=buffer(running=0, groups_open=4, oldest_open_version=1),
        actors=[actor(0, running=0, pushed=48, failed=1), actor(1, running=0, pushed=0)],
        last_push_s=[400.2, None], last_publish=(3, 420.0), checkpoint="checkpoint runs/x/checkpoints/step_000003",
        batch_groups=4)
    line = error_line(RunFailed(msg))
    assert line == (
        "error: no learner step completed for 612 s (step 4; limit 600 s, cluster.progress_timeout_s); "
        "blocked: admission (no episode running: 4 groups open, the oldest admitted at version 1, learner version 3); "
        "learner: waiting for a batch (idle); "
        "buffer: 12 rows, 1 ready groups, 2 pending groups; admission: 0 running, 4 groups open, oldest open version 1; "
        "actor0: running, 0 episodes running, 48 pushed, last push 400 s ago, 1 failed; "
        "actor1: running, 0 episodes running, 0 pushed, never pushed, 0 failed; "
        "last publish: version 3, 420 s ago; checkpoint runs/x/checkpoints/step_000003")
    assert "\n" not in line


@pytest.mark.parametrize("learner, buf, actors, blocked", [
    ("computing step 5 for up to 700 s (its batch has arrived)", buffer(), [actor(0, running=3)],
     "blocked: the learner (computing step 5"),
    ("waiting 700 s for the buffer's answer to sample_batch", "not answering (stats() took more than 10 s)",
     [actor(0, running=3)], "blocked: the replay buffer (not answering"),
    ("waiting for a batch (idle)", buffer(running=2), ["not answering (stats() took more than 10 s)", actor(1)],
     "blocked: rollout actor 0 (not answering)"),
    ("waiting for a batch (idle)", buffer(running=5), [actor(0, running=5)],
     "blocked: the rollout actors (5 episodes running, no batch completed)"),
    # finished episodes that were not pushed are the actors' pushes, not admission (running counts none)
    ("waiting for a batch (idle)", buffer(running=4), [actor(0, running=0, started=12, finished=12, pushed=8)],
     "blocked: the rollout actors' pushes (4 finished episodes not pushed to the buffer)"),
])  # fmt: skip
def test_the_blocked_component_is_named(learner, buf, actors, blocked):
    msg = stall_message(step=4, waited=700, limit=600, configured=False, learner=learner, buffer=buf, actors=actors,
                        last_push_s=[None] * len(actors), last_publish=None, checkpoint="no checkpoint",
                        batch_groups=4)
    assert blocked in msg, msg
    assert "cluster.progress_timeout_s unset: max(600, 10 x the slowest step)" in msg and "last publish: none" in msg


def blamed(clause: str) -> str:
    """Which of ``BLAMED`` a ``blocked:`` clause names (the longest that starts it: "the rollout actors' pushes" is
    not "the rollout actors")."""
    names = [name for name in BLAMED if clause.startswith(name)]
    assert names, clause
    return max(names, key=len)


IDLE = "waiting for a batch (idle)"
SILENT = "not answering (stats() took more than 10 s)"


# Each fault with the signals of the others around it, so blaming the wrong part fails: the stats a stalled run's
# components would send when that one part is at fault (batch: 4 groups).
@pytest.mark.parametrize("learner, buf, actors, expected", [
    # a learner step that never ends, while the buffer and an actor are slow to answer their stats as well
    ("computing step 5 for up to 700 s (its batch has arrived)", SILENT, [SILENT], LEARNER),
    # the learner got "no batch" and then never answered again; a batch is ready meanwhile
    ("not answering for 90 s after the buffer answered sample_batch with no batch",
     buffer(running=0), [actor(0, running=0)], LEARNER),
    # the buffer answers stats() but never sample_batch; the actors are idle (admission has nothing to grant)
    ("waiting 70 s for the buffer's answer to sample_batch (asked with a 5 s timeout)", buffer(running=0),
     [actor(0, running=0)], BUFFER),
    # the buffer stopped (SIGSTOP) or died: its stats() are not answered or failed
    (IDLE, SILENT, [actor(0, running=3)], BUFFER),
    (IDLE, "failed: the Ray actor BufferActor died: The actor died unexpectedly", [actor(0, running=0)], BUFFER),
    # a batch's worth of ready groups, yet the learner got none: the buffer's sampling, not admission
    (IDLE, BufferStats(ready_groups=4, admission=AdmissionStats(groups_open=8)), [actor(0, running=0)], BUFFER),
    # an actor that does not answer while the other runs: that actor, not the running ones
    (IDLE, buffer(running=2), [actor(0, running=2), SILENT], ACTORS_SILENT),
    # nothing runs, finished episodes not pushed: the pushes, not admission
    (IDLE, buffer(running=0, groups_open=3), [actor(0, running=0, finished=12, pushed=8)], PUSHES),
    # nothing runs, everything pushed, fewer ready groups than a batch: admission grants nothing
    (IDLE, buffer(running=0, groups_open=3), [actor(0, running=0, finished=12, pushed=12)], ADMISSION),
    # episodes run and none completes a batch (a slow engine, a hung search): the rollout actors
    (IDLE, buffer(running=6), [actor(0, running=6, finished=4, pushed=4)], GENERATION),
])  # fmt: skip
def test_each_stall_is_blamed_on_the_part_at_fault(learner, buf, actors, expected):
    clause = blocked_component(learner=learner, buffer=buf, actors=actors, batch_groups=4)
    assert blamed(clause) == expected, clause
    msg = stall_message(step=4, waited=700, limit=600, configured=True, learner=learner, buffer=buf, actors=actors,
                        last_push_s=[None] * len(actors), last_publish=None, checkpoint="no checkpoint",
                        batch_groups=4)
    assert f"; blocked: {clause}; learner: {learner}; " in msg


def test_every_blamed_part_is_reachable():
    """Each name a stall report can give is given by some case above (a new one needs a case)."""
    cases = test_each_stall_is_blamed_on_the_part_at_fault.pytestmark[0].args[1]
    assert {case[-1] for case in cases} == set(BLAMED)
