"""Staleness arithmetic and the admission rule (async_agent_rl.staleness), with the replay buffer's eviction.

The property tests drive a small simulated system: rollout workers ask for admission at their engine's weight
version, episodes finish, and a learner consumes B trajectories per version.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from async_agent_rl.config import BufferConfig
from async_agent_rl.records import OBS_VERSION, EpisodeMeta, Trajectory, TurnSpan
from async_agent_rl.staleness import (
    AdmissionError,
    AdmissionState,
    admission_capacity,
    group_min_version,
    is_stale,
    staleness,
)
from buffer.replay_buffer import EVICT_STALE, ReplayBuffer

pytestmark = pytest.mark.unit


def test_staleness_is_learner_version_minus_oldest_token_version():
    assert staleness(7, 4) == 3
    assert staleness(4, 4) == 0
    assert staleness(9, OBS_VERSION) == 0  # generated nothing: nothing off-policy
    assert not is_stale(6, 4, max_staleness=2)
    assert is_stale(7, 4, max_staleness=2)
    assert is_stale(1, 0, max_staleness=0)
    assert group_min_version([5, OBS_VERSION, 3, 4]) == 3
    assert group_min_version([OBS_VERSION]) == OBS_VERSION


def test_capacity_formula_by_hand():
    # eta=1, B=4, v=0: (1 + 0 + 1) * 4 = 8 slots minus 3 accepted and 2 running -> 3; concurrency allows 10 - 2 = 8
    assert admission_capacity(0, max_staleness=1, batch_size=4, accepted=3, running=2, max_concurrent=10) == 3
    # the concurrency cap binds: 3 - 2 = 1
    assert admission_capacity(0, max_staleness=1, batch_size=4, accepted=3, running=2, max_concurrent=3) == 1
    # over budget: never negative
    assert admission_capacity(0, max_staleness=0, batch_size=4, accepted=5, running=2, max_concurrent=10) == 0
    # version 2, eta 0: (0 + 2 + 1) * 4 = 12 - 8 = 4
    assert admission_capacity(2, max_staleness=0, batch_size=4, accepted=8, running=0, max_concurrent=10) == 4


def test_admission_state_grants_whole_groups_and_frees_slots_on_reject_and_evict():
    st_ = AdmissionState(max_staleness=1, batch_size=4, max_concurrent=100, granule=2)
    assert st_.try_start(100, version=0) == 8  # (1 + 0 + 1) * 4
    assert st_.try_start(2, version=0) == 0
    st_.on_finished(3, accepted=True)
    st_.on_finished(1, accepted=False)  # a rejected episode frees its slot
    assert st_.running == 4 and st_.live == 3
    assert st_.try_start(5, version=0) == 2  # room 1: rounded up to one whole (replacement) group
    assert st_.try_start(5, version=0) == 0  # one over the bound now
    st_.on_evicted(3)  # evicted ones free their slots too
    assert st_.try_start(5, version=0) == 2
    assert st_.counters() == {"started": 12, "accepted": 3, "rejected": 1, "evicted": 3, "running": 8}


def test_admission_concurrency_cap():
    st_ = AdmissionState(max_staleness=10, batch_size=100, max_concurrent=3)
    assert st_.try_start(10, version=0) == 3
    st_.on_finished(1, accepted=True)
    assert st_.try_start(10, version=0) == 1


def test_admission_misuse_is_loud():
    st_ = AdmissionState(max_staleness=1, batch_size=4, max_concurrent=8)
    st_.try_start(2, version=0)
    with pytest.raises(AdmissionError, match="only 2 are running"):
        st_.on_finished(3, accepted=True)
    with pytest.raises(AdmissionError, match="evicted"):
        st_.on_evicted(1)
    with pytest.raises(AdmissionError):
        st_.try_start(0, version=0)
    with pytest.raises(ValueError):
        AdmissionState(max_staleness=-1, batch_size=4, max_concurrent=8)


def test_resumed_state_counts_lost_episodes_as_rejected():
    st_ = AdmissionState(max_staleness=1, batch_size=4, max_concurrent=8)
    st_.try_start(6, version=0)
    st_.on_finished(2, accepted=True)
    back = AdmissionState.resumed(st_.counters(), max_staleness=1, batch_size=4, max_concurrent=8)
    assert back.running == 0 and back.rejected == 4 and back.live == 2
    assert back.try_start(8, version=0) == 6


# ------------------------------------------------------------------------------------------- simulated system
# One round: ask for ``start`` episodes at the engine's weight version, end ``finish`` running ones (``pick`` chooses
# which when completion is out of order; with ``reject`` the first of them is thrown away), optionally give the
# engine the learner's weights (``sync``), optionally let the learner take a batch of B (``learn``).
rounds_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "start": st.integers(0, 12),
            "finish": st.integers(0, 12),
            "pick": st.integers(0, 1000),
            "reject": st.booleans(),
            "sync": st.booleans(),
            "learn": st.booleans(),
        }
    ),
    max_size=60,
)
# A schedule that goes stale without the capacity rule: 8 episodes at version 0, weights never synced.
NEVER_SYNCED = [dict(start=8, finish=8, pick=0, reject=False, sync=False, learn=True)] + [
    dict(start=0, finish=0, pick=0, reject=False, sync=False, learn=True)
] * 7


def _simulate(eta, batch, max_concurrent, rounds, in_order):
    """Admission alone, no eviction: returns the staleness of every consumed trajectory."""
    adm = AdmissionState(max_staleness=eta, batch_size=batch, max_concurrent=max_concurrent)
    learner_version = engine_version = 0
    running: list[int] = []  # start version of each running episode, in admission order
    finished: list[int] = []
    consumed: list[int] = []
    for r in rounds:
        if r["start"]:
            running += [engine_version] * adm.try_start(r["start"], engine_version)
        for j in range(min(r["finish"], len(running))):
            v = running.pop(0 if in_order else (r["pick"] + j) % len(running))
            accepted = not (r["reject"] and j == 0)
            adm.on_finished(1, accepted=accepted)
            if accepted:
                finished.append(v)
        if r["sync"]:
            engine_version = learner_version
        if r["learn"] and len(finished) >= batch:
            consumed += [learner_version - v for v in finished[:batch]]
            del finished[:batch]
            learner_version += 1
    return consumed


@settings(max_examples=150, deadline=None)
@example(eta=1, batch=2, max_concurrent=30, rounds=NEVER_SYNCED)
@given(eta=st.integers(0, 3), batch=st.integers(1, 6), max_concurrent=st.integers(1, 30), rounds=rounds_strategy)
def test_admission_alone_bounds_staleness_when_consumed_in_admission_order(eta, batch, max_concurrent, rounds):
    consumed = _simulate(eta, batch, max_concurrent, rounds, in_order=True)
    assert all(0 <= s <= eta for s in consumed)


@settings(max_examples=150, deadline=None)
@example(batch=1, max_concurrent=30, rounds=NEVER_SYNCED)
@given(batch=st.integers(1, 6), max_concurrent=st.integers(1, 30), rounds=rounds_strategy)
def test_eta_zero_is_synchronous_even_out_of_order(batch, max_concurrent, rounds):
    consumed = _simulate(0, batch, max_concurrent, rounds, in_order=False)
    assert all(s == 0 for s in consumed)


def _traj(tid: str, version: int) -> bytes:
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        loss_mask=[1, 1],
        behavior_logprobs=[-0.5, -0.5],
        versions=[version, version],
        turns=[TurnSpan("model", 0, 2)],
        meta=EpisodeMeta(group_id=tid, trajectory_id=tid),
    ).encode()


@settings(max_examples=100, deadline=None)
@example(eta=1, batch=2, max_concurrent=30, rounds=NEVER_SYNCED)
@given(eta=st.integers(0, 3), batch=st.integers(1, 6), max_concurrent=st.integers(1, 30), rounds=rounds_strategy)
def test_out_of_order_with_buffer_eviction_never_consumes_stale_and_counts_exactly(eta, batch, max_concurrent, rounds):
    """Stragglers finishing out of order can go stale; the buffer evicts exactly those, counts them, and gives
    their admission slots back. An independent model predicts every eviction and every consumed id."""
    adm = AdmissionState(max_staleness=eta, batch_size=batch, max_concurrent=max_concurrent)
    buf = ReplayBuffer(BufferConfig(max_staleness=eta), group_size=1, on_evict=adm.on_evicted)
    learner_version = engine_version = 0
    running: list[tuple[str, int]] = []
    model_buffer: list[tuple[str, int]] = []  # (id, version), FIFO
    model_evicted = pushed = started = 0
    for r in rounds:
        for _ in range(adm.try_start(r["start"], engine_version) if r["start"] else 0):
            running.append((f"t{started}", engine_version))
            started += 1
        for j in range(min(r["finish"], len(running))):
            tid, v = running.pop((r["pick"] + j) % len(running))
            if r["reject"] and j == 0:
                adm.on_finished(1, accepted=False)
                continue
            assert buf.push([_traj(tid, v)]).accepted == 1
            adm.on_finished(1, accepted=True)
            model_buffer.append((tid, v))
            pushed += 1
        if r["sync"]:
            engine_version = learner_version
        if r["learn"]:
            model_evicted += sum(1 for _, v in model_buffer if learner_version - v > eta)
            model_buffer = [x for x in model_buffer if learner_version - x[1] <= eta]
            got = buf.sample(batch, learner_version)
            if len(model_buffer) < batch:
                assert got is None
            else:
                want, model_buffer = model_buffer[:batch], model_buffer[batch:]
                assert [t.meta.trajectory_id for t in got] == [tid for tid, _ in want]
                assert all(learner_version - t.min_version <= eta for t in got)
                learner_version += 1
        stats = buf.stats()
        assert stats.evicted[EVICT_STALE] == model_evicted
        assert stats.pushed == stats.sampled + stats.evicted_total + stats.size == pushed
        assert adm.live == stats.sampled + stats.size
    assert all(s <= eta for s in buf.stats().staleness_histogram)
