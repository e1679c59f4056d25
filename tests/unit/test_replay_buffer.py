"""The plain ReplayBuffer: groups, ordering, staleness eviction, partial groups, backpressure, stats, snapshots."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_agent_rl.config import BufferConfig
from async_agent_rl.records import RecordError, EpisodeMeta, Trajectory, TurnSpan
from tests.helpers import LONGEST, Clock, ids, traj
from buffer.replay_buffer import (
    EVICT_PARTIAL_TIMEOUT,
    EVICT_STALE,
    EVICT_ZERO_VARIANCE,
    CapacityError,
    ReplayBuffer,
    SnapshotError,
)

pytestmark = pytest.mark.unit


def make(group_size=2, clock=None, longest=LONGEST, **cfg) -> ReplayBuffer:
    return ReplayBuffer(BufferConfig(**cfg), group_size, max_trajectory_tokens=longest, clock=clock or Clock())


def test_group_released_only_when_complete_and_comes_out_whole():
    buf = make(group_size=3)
    buf.push([traj("a", 0), traj("b", 0), traj("a", 1)])
    assert buf.sample_wire(3, 0) is None  # neither group complete
    buf.push([traj("b", 1), traj("b", 2)])
    assert ids(buf.sample_wire(3, 0)) == ["b/0", "b/1", "b/2"]
    buf.push([traj("a", 2)])
    assert ids(buf.sample_wire(3, 0)) == ["a/0", "a/1", "a/2"]
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        buf.sample_wire(4, 0)


def test_fifo_by_default_and_batch_is_several_groups():
    buf = make(group_size=1)
    buf.push([traj(g) for g in "abcde"])
    assert ids(buf.sample_wire(2, 0)) == ["a/0", "b/0"]
    assert ids(buf.sample_wire(3, 0)) == ["c/0", "d/0", "e/0"]
    assert buf.sample_wire(1, 0) is None


def test_priority_sampling_highest_first_ties_oldest_first():
    buf = make(group_size=2, sampling="priority")
    buf.push([traj("low", 0, priority=0.1), traj("low", 1)])
    buf.push([traj("hi", 0), traj("hi", 1, priority=5.0)])
    buf.push([traj("tie", 0, priority=0.1), traj("tie", 1)])
    assert ids(buf.sample_wire(6, 0)) == ["hi/0", "hi/1", "low/0", "low/1", "tie/0", "tie/1"]


def test_stale_groups_evicted_counted_and_logged(caplog):
    buf = make(group_size=2, max_staleness=1)
    buf.push([traj("old", 0, version=0), traj("old", 1, version=2)])  # group min version 0
    buf.push([traj("new", 0, version=2), traj("new", 1, version=2)])
    with caplog.at_level(logging.WARNING, logger="buffer.replay_buffer"):
        got = buf.sample_wire(2, learner_version=2)
    assert ids(got) == ["new/0", "new/1"]
    s = buf.stats()
    assert s.evicted == {EVICT_STALE: 2, EVICT_PARTIAL_TIMEOUT: 0, EVICT_ZERO_VARIANCE: 0}
    assert s.staleness_histogram == {0: 2}
    assert "evicted 2 trajectories of group 'old' (stale)" in caplog.text
    assert "staleness 2 > max_staleness 1" in caplog.text


def test_max_staleness_zero_is_on_policy_and_the_boundary_is_kept():
    buf = make(group_size=1, max_staleness=0)
    buf.push([traj("v3", version=3), traj("v2", version=2)])
    assert ids(buf.sample_wire(1, 3)) == ["v3/0"]
    assert buf.stats().evicted[EVICT_STALE] == 1
    buf = make(group_size=1, max_staleness=2)
    buf.push([traj("edge", version=1)])
    assert ids(buf.sample_wire(1, 3)) == ["edge/0"]  # staleness exactly eta is allowed
    assert buf.stats().staleness_histogram == {2: 1}


def test_trajectory_without_generated_tokens_is_never_stale():
    blob = Trajectory(
        prompt_ids=[1], response_ids=[9], loss_mask=[0], behavior_logprobs=[0.0], versions=[-1],
        turns=[TurnSpan("observation", 0, 1)], meta=EpisodeMeta(group_id="obs", trajectory_id="obs/0"),
    ).encode()
    buf = make(group_size=1, max_staleness=0)
    buf.push([blob])
    assert ids(buf.sample_wire(1, 50)) == ["obs/0"]


def test_rejected_members_release_a_short_group():
    buf = make(group_size=3)
    buf.reject(["a"])  # reported before any member arrived
    buf.push([traj("a", 0)])
    assert buf.sample_wire(3, 0) is None
    buf.push([traj("a", 1)])
    s = buf.stats()
    assert (s.groups_released_short, s.rejected, s.ready_groups) == (1, 1, 1)
    # a batch is batch_size / group_size whole groups: the short group fills one group's place, with 2 rows
    assert ids(buf.sample_wire(3, 0)) == ["a/0", "a/1"]
    buf.reject(["c", "c"])
    buf.push([traj("c", 0)])
    buf.push([traj("b", 0), traj("b", 1), traj("b", 2)])
    assert ids(buf.sample_wire(6, 0)) == ["c/0", "b/0", "b/1", "b/2"]


def test_short_groups_never_block_a_batch():
    """Regression: with batches of exactly batch_size rows, 15 full groups of 4 and two groups of 3 (66 rows)
    could never make a batch of 64, and at eta 0 admission had no room left: the run waited forever."""
    buf = make(group_size=4)
    for g in range(17):
        if g >= 15:
            buf.reject([f"g{g}"])
        buf.push([traj(f"g{g}", m) for m in range(4 if g < 15 else 3)])
    got = buf.sample_wire(64, 0)
    assert got is not None and len(got) == 15 * 4 + 3  # 16 groups, one of them short
    assert len(buf.sample_wire(4, 0)) == 3  # the other short group is a batch of one group on its own


def test_groups_are_served_oldest_version_first_then_by_arrival():
    """Completion order would serve a group with one long member last; oldest-first serves it by its version."""
    buf = make(group_size=1)
    buf.push([traj("new", version=3)])
    buf.push([traj("old-long", version=1, tokens=200)])
    buf.push([traj("mid", version=2)])
    buf.push([traj("old-short", version=1)])
    assert ids(buf.sample_wire(4, 3)) == ["old-long/0", "old-short/0", "mid/0", "new/0"]


def test_length_buckets_count_generated_consumed_and_evicted():
    buf = make(group_size=1, max_staleness=0)
    buf.push([traj("a", tokens=12), traj("b", tokens=102), traj("c", tokens=52, version=0)])
    buf.push([traj("d", tokens=600, version=5)])
    assert len(buf.sample_wire(1, 0)) == 1  # "a"
    buf.sample_wire(1, 5)  # b and c (version 0) are stale at version 5 and go; d is consumed
    s = buf.stats()
    assert s.length_tokens["generated"] == {"<32": 1, "64-127": 1, "32-63": 1, "512-1023": 1}
    assert s.length_tokens["consumed"] == {"<32": 1, "512-1023": 1}
    assert s.length_tokens["evicted"] == {"64-127": 1, "32-63": 1}
    assert s.length_turns["generated"] == {"0": 4}  # meta.num_turns is 0 in these records


def test_partial_group_wait_keeps_waiting_and_counts_overdue(caplog):
    clock = Clock()
    buf = make(group_size=2, clock=clock, partial_groups="wait", partial_group_timeout_s=10)
    buf.push([traj("a", 0)])
    clock.now += 11
    with caplog.at_level(logging.WARNING, logger="buffer.replay_buffer"):
        assert buf.sample_wire(2, 0) is None
        buf.stats()
    assert buf.stats().groups_overdue == 1  # counted once
    assert "group 'a' has 1/2 members after 11 s" in caplog.text
    buf.push([traj("a", 1)])
    assert ids(buf.sample_wire(2, 0)) == ["a/0", "a/1"]


def test_partial_group_release_after_timeout():
    clock = Clock()
    buf = make(group_size=3, clock=clock, partial_groups="release", partial_group_timeout_s=10)
    buf.push([traj("a", 0), traj("a", 1)])
    clock.now += 9
    assert buf.sample_wire(3, 0) is None
    clock.now += 2
    assert buf.stats().groups_released_partial == 1 and buf.stats().ready_groups == 1
    assert ids(buf.sample_wire(3, 0)) == ["a/0", "a/1"]  # released: a group's place in a batch, with 2 rows


def test_a_member_of_a_released_or_just_dropped_group_is_late_never_a_second_group():
    """A straggler of a group released partial and not yet consumed, or of one the same push's timeout check drops,
    is taken and dropped (``PushResult.late``), not stored as a new group with the same id."""
    for policy in ("release", "drop"):
        clock = Clock()
        buf = make(group_size=3, clock=clock, partial_groups=policy, partial_group_timeout_s=10)
        buf.push([traj("a", 0), traj("a", 1)])
        clock.now += 11
        res = buf.push([traj("a", 2), traj("b", 0)])  # the timeout check runs first: "a" is released or dropped
        buf.reject(["a"])  # a group already released waits for nothing: no empty group "a" either
        s = buf.stats()
        assert (s.pending_groups, s.late_pushes, s.pushed, s.size) == (1, 1, 3, 3 if policy == "release" else 1)
        assert s.pushed == s.sampled + s.evicted_total + s.size
        assert (res.accepted, res.refused, res.late) == (2, (), (0,)), policy
        if policy == "release":
            assert buf.push([traj("a", 2)]).late == (0,)  # later still, while "a" waits for a batch
            assert ids(buf.sample_wire(3, 0)) == ["a/0", "a/1"] and buf.stats().late_pushes == 2


def test_partial_group_drop_after_timeout_is_an_eviction():
    clock = Clock()
    evicted = []
    buf = ReplayBuffer(
        BufferConfig(partial_groups="drop", partial_group_timeout_s=10), 3, max_trajectory_tokens=LONGEST, clock=clock,
        on_evict=lambda n, gid: evicted.append(n)
    )
    buf.push([traj("a", 0), traj("a", 1)])
    clock.now += 10
    s = buf.stats()
    assert s.evicted[EVICT_PARTIAL_TIMEOUT] == 2 and s.size == 0 and evicted == [2]
    assert s.pushed == s.sampled + s.evicted_total + s.size


@pytest.mark.parametrize("policy", ["wait", "release", "drop"])
def test_a_rejection_before_any_member_arrived_is_kept_past_the_timeout(policy):
    """The timeout runs from a group's first member's arrival: a group with only a rejection (one member failed
    early) used to be forgotten once the timeout passed, and its other members, arriving later, then waited for the
    rejected one for ever (with partial_groups=wait the run stalled at the staleness bound)."""
    clock = Clock()
    buf = ReplayBuffer(BufferConfig(partial_groups=policy, partial_group_timeout_s=10), 4,
                       max_trajectory_tokens=LONGEST, clock=clock)
    buf.reject(["g"])
    clock.now += 11
    assert buf.stats().pending_groups == 0  # nothing arrived yet: no group waits for its timeout
    buf.push([traj("g", m) for m in range(3)])
    s = buf.stats()
    assert (s.ready_groups, s.groups_released_short, s.pending_groups) == (1, 1, 0)
    assert ids(buf.sample_wire(4, 0)) == ["g/0", "g/1", "g/2"]


def test_backpressure_on_trajectory_capacity_takes_what_fits():
    buf = make(group_size=1, capacity_trajectories=3)
    res = buf.push([traj(g) for g in "abcde"])
    assert (res.accepted, res.full, res.refused) == (3, True, (3, 4))
    assert len(buf) == 3 and buf.stats().push_refused == 2
    buf.sample_wire(2, 0)
    res = buf.push([traj(g) for g in "de"])
    assert (res.accepted, res.full) == (2, False)


def test_backpressure_on_token_capacity():
    buf = make(group_size=1, capacity_tokens=25, longest=10)
    res = buf.push([traj("a", tokens=10), traj("b", tokens=10), traj("c", tokens=10)])
    assert (res.accepted, res.full) == (2, True)
    assert buf.stats().tokens == 20
    with pytest.raises(CapacityError, match="can never fit"):
        buf.push([traj("huge", tokens=26)])


def test_new_groups_wait_so_pending_groups_can_complete():
    # room for 3 trajectories, groups of 2: once "a" is pending, a second group would need 2 more slots
    buf = make(group_size=2, capacity_trajectories=3)
    res = buf.push([traj("a", 0), traj("b", 0)])
    assert (res.accepted, res.full) == (1, True)
    assert buf.push([traj("a", 1)]).accepted == 1  # the promised slot is there
    assert buf.push([traj("b", 0)]).full  # 2 stored + 2 for "b" > 3
    buf.sample_wire(2, 0)
    assert buf.push([traj("b", 0), traj("b", 1)]).accepted == 2
    assert buf.stats().ready_groups == 1


def test_a_refused_trajectory_never_holds_back_the_ones_after_it():
    """A push is in finishing order: a new group's member refused for room must not stop the member behind it that
    completes a group the buffer holds (with only the longest prefix taken, "a" never completed: a stalled run,
    tests/unit/test_staleness.py)."""
    buf = make(group_size=2, capacity_trajectories=2)
    assert buf.push([traj("a", 0)]).accepted == 1  # "a" is promised the other slot
    res = buf.push([traj("b", 0), traj("a", 1)])
    assert res.refused == (0,) and res.rest(["b/0", "a/1"]) == ["b/0"] and res.taken(["b/0", "a/1"]) == ["a/1"]
    assert buf.stats().ready_groups == 1 and buf.stats().push_refused == 1
    assert ids(buf.sample_wire(2, 0)) == ["a/0", "a/1"]
    assert buf.push([traj("b", 0), traj("b", 1)]).accepted == 2


def test_token_promises_are_the_longest_trajectory_whatever_the_first_members_length():
    """A missing member is promised ``max_trajectory_tokens`` (10 here), never its group's mean so far: short
    first members must not let in groups whose long members then find no room."""
    buf = make(group_size=2, capacity_tokens=40, longest=10)
    assert buf.push([traj("a", 0, tokens=3)]).accepted == 1  # reserved: 3 + 10 for "a/1"
    assert buf.push([traj("b", 0, tokens=3)]).accepted == 1  # 13 + 2 x 10 = 33 <= 40
    assert buf.push([traj("c", 0, tokens=3)]).full  # 26 + 2 x 10 > 40 (a mean promise took it: 26 + 2 x 3)
    assert buf.push([traj("a", 1, tokens=10), traj("b", 1, tokens=10)]).accepted == 2  # the promises hold
    assert buf.stats().ready_groups == 2
    with pytest.raises(CapacityError, match="max_trajectory_tokens=10"):
        buf.push([traj("c", 0, tokens=11)])  # longer than promised: refused loudly, nothing stored
    assert len(buf) == 4


def test_invalid_records_are_refused_whole():
    buf = make(group_size=2)
    with pytest.raises(RecordError):
        buf.push([traj("a", 0), b"\x93garbage"])
    with pytest.raises(RecordError, match="no meta.group_id"):
        buf.push([traj("", 0)])
    assert len(buf) == 0


def test_stats_report_sizes_and_age():
    clock = Clock()
    buf = make(group_size=2, clock=clock)
    buf.push([traj("a", 0, tokens=6)])
    clock.now += 3
    buf.push([traj("b", 0, tokens=4), traj("b", 1, tokens=4)])
    clock.now += 2
    s = buf.stats()
    assert (s.size, s.tokens, s.ready_groups, s.pending_groups) == (3, 14, 1, 1)
    assert s.oldest_age_s == pytest.approx(5.0)
    assert (s.pushed, s.sampled, s.evicted_total) == (3, 0, 0)


# -------------------------------------------------------------------------------------------------- snapshots
def filled(clock: Clock) -> ReplayBuffer:
    buf = make(group_size=2, clock=clock, max_staleness=3)
    buf.push([traj("a", 0, version=1), traj("a", 1, version=1), traj("b", 0), traj("c", 0), traj("c", 1)])
    buf.reject(["d"])
    buf.sample_wire(2, 1)  # consumes c (version 0: older than a)
    return buf


def test_snapshot_round_trip(tmp_path):
    clock = Clock()
    buf = filled(clock)
    path = buf.snapshot(tmp_path / "buf.snap", extra={"note": "hi"})
    back, extra = ReplayBuffer.restore(path, buf.config, 2, max_trajectory_tokens=LONGEST, clock=clock)
    assert extra == {"note": "hi"}
    assert back.stats() == buf.stats()
    # pending groups and rejections survive: "b" completes, "d" is short by one and completes with one member
    for b in (buf, back):
        b.push([traj("b", 1), traj("d", 0)])
    # two groups, oldest version first: b and d (version 0) before a (version 1); d is short
    assert ids(back.sample_wire(4, 1)) == ids(buf.sample_wire(4, 1)) == ["b/0", "b/1", "d/0"]
    assert back.stats().ready_groups == buf.stats().ready_groups == 1  # "a" waits for the next batch


def test_snapshot_refuses_a_different_group_size(tmp_path):
    path = filled(Clock()).snapshot(tmp_path / "buf.snap")
    with pytest.raises(SnapshotError, match="group_size=2, this run has 3"):
        ReplayBuffer.restore(path, BufferConfig(), 3, max_trajectory_tokens=LONGEST)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[: len(d) // 2], "truncated"),
        (lambda d: d[:-1], "truncated"),
        (lambda d: d[:100] + bytes([d[100] ^ 0xFF]) + d[101:], "checksum mismatch"),
        (lambda d: b"PK\x03\x04" + d[4:], "not a replay buffer snapshot"),
        (lambda d: d[:5], "not a replay buffer snapshot"),
    ],
)
def test_corrupt_snapshot_is_refused_naming_the_file(tmp_path, damage, message):
    path = filled(Clock()).snapshot(tmp_path / "buf.snap")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SnapshotError, match=message) as err:
        ReplayBuffer.restore(path, BufferConfig(), 2, max_trajectory_tokens=LONGEST)
    assert str(path) in str(err.value)


def test_missing_snapshot_names_the_file(tmp_path):
    with pytest.raises(SnapshotError, match="nowhere.snap"):
        ReplayBuffer.restore(tmp_path / "nowhere.snap", BufferConfig(), 2, max_trajectory_tokens=LONGEST)


# ---------------------------------------------------------------------------------------------- random traffic
def test_zero_variance_groups_are_dropped_counted_and_the_batch_stays_full():
    evicted: list[int] = []
    buf = ReplayBuffer(BufferConfig(group_filter="zero_variance"), 2, max_trajectory_tokens=LONGEST, clock=Clock(),
                       on_evict=lambda n, gid: evicted.append(n))
    buf.push([traj("right", 0, reward=1.0, em=1.0), traj("right", 1, reward=1.0, em=1.0)])
    buf.push([traj("wrong", 0, reward=0.0, em=0.0), traj("wrong", 1, reward=0.0, em=0.0)])
    buf.push([traj("same", 0, reward=0.3), traj("same", 1, reward=0.3 + 1e-9)])  # within zero_variance_tol
    buf.push([traj("mixed", 0, reward=1.0, em=1.0), traj("mixed", 1, reward=0.0, em=0.0)])
    # 4 trajectories asked: the 3 equal-reward groups are gone, so one group is not enough yet
    assert buf.sample_wire(4, 0) is None
    buf.push([traj("close", 0, reward=0.5), traj("close", 1, reward=0.5 + 1e-3)])  # a real difference: kept
    assert ids(buf.sample_wire(4, 0)) == ["mixed/0", "mixed/1", "close/0", "close/1"]
    s = buf.stats()
    assert s.evicted[EVICT_ZERO_VARIANCE] == 6 and evicted == [2, 2, 2]  # admission slots freed for refills
    assert s.filtered_groups == {"all_correct": 1, "all_wrong": 1, "all_equal": 1}
    assert s.pushed == s.sampled + s.evicted_total + s.size


def test_without_the_filter_equal_reward_groups_are_trained_on():
    buf = make(group_size=2)
    buf.push([traj("wrong", 0), traj("wrong", 1), traj("right", 0, reward=1.0), traj("right", 1, reward=1.0)])
    assert ids(buf.sample_wire(4, 0)) == ["wrong/0", "wrong/1", "right/0", "right/1"]
    assert buf.stats().evicted[EVICT_ZERO_VARIANCE] == 0


def test_zero_variance_filter_applies_to_short_and_timed_out_groups():
    clock = Clock()
    buf = make(group_size=3, clock=clock, group_filter="zero_variance", partial_groups="release",
               partial_group_timeout_s=10)
    buf.push([traj("short", 0, reward=1.0), traj("short", 1, reward=1.0)])
    buf.reject(["short"])  # released short with equal rewards: filtered
    buf.push([traj("late", 0, reward=0.0), traj("late", 1, reward=1.0)])
    clock.now += 11
    s = buf.stats()
    assert s.evicted[EVICT_ZERO_VARIANCE] == 2 and s.groups_released_partial == 1 and s.ready_groups == 1
    assert ids(buf.sample_wire(3, 0)) == ["late/0", "late/1"]  # released partial (2 of 3): one group's place


def test_group_filter_needs_groups():
    with pytest.raises(ValueError, match="group_size >= 2"):
        make(group_size=1, group_filter="zero_variance")


@settings(max_examples=80, deadline=None)
@given(
    group_size=st.integers(1, 4),
    cap=st.integers(4, 16),
    policy=st.sampled_from(["wait", "release", "drop"]),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(0, 7), st.integers(0, 3)),  # group, version
            st.tuples(st.just("reject"), st.integers(0, 7)),
            st.tuples(st.just("sample"), st.integers(1, 3), st.integers(0, 5)),  # groups, learner version
            st.tuples(st.just("tick"), st.floats(0, 6)),
        ),
        max_size=120,
    ),
)
def test_random_traffic_keeps_groups_whole_memory_bounded_and_nothing_lost(group_size, cap, policy, ops):
    clock = Clock()
    cfg = BufferConfig(
        max_staleness=1, capacity_trajectories=cap, capacity_tokens=6 * cap, partial_groups=policy,
        partial_group_timeout_s=10,
    )
    evictions: list[int] = []
    buf = ReplayBuffer(cfg, group_size, max_trajectory_tokens=6, clock=clock,
                       on_evict=lambda n, gid: evictions.append(n))
    # group ids are reused for a new prompt once every member of the previous one was pushed or rejected
    generation = {g: 0 for g in range(8)}
    arrived = {g: 0 for g in range(8)}
    rejected = {g: 0 for g in range(8)}
    expected_size: dict[str, int] = {}

    def settle(g: int) -> None:
        if arrived[g] + rejected[g] >= group_size:
            expected_size[f"{g}.{generation[g]}"] = arrived[g]
            generation[g], arrived[g], rejected[g] = generation[g] + 1, 0, 0

    for op in ops:
        if op[0] == "push":
            g = op[1]
            if buf.push([traj(f"{g}.{generation[g]}", arrived[g], version=op[2])]).accepted:
                arrived[g] += 1
                settle(g)
        elif op[0] == "reject":
            g = op[1]
            buf.reject([f"{g}.{generation[g]}"])
            rejected[g] += 1
            settle(g)
        elif op[0] == "sample":
            got = buf.sample_wire(op[1] * group_size, op[2])
            if got is not None:
                trajs = [Trajectory.decode(b) for b in got]
                runs = [t.meta.group_id for t in trajs]
                # the asked number of whole groups (short ones have fewer rows), members adjacent, no group twice
                starts = [gid for i, gid in enumerate(runs) if i == 0 or runs[i - 1] != gid]
                assert len(starts) == len(set(starts)) == op[1] and len(trajs) <= op[1] * group_size
                if policy == "wait":  # nothing is released early: every group has all its non-rejected members
                    assert all(runs.count(gid) == expected_size[gid] for gid in starts)
                assert all(op[2] - t.min_version <= 1 for t in trajs)
        else:
            clock.now += op[1]
        s = buf.stats()
        assert s.size <= cap and s.tokens <= 6 * cap
        assert s.pushed == s.sampled + s.evicted_total + s.size
        assert sum(evictions) == s.evicted_total


def test_the_filter_stands_aside_after_a_streak_so_a_policy_without_signal_cannot_stall_the_run(caplog):
    buf = make(group_size=2, group_filter="zero_variance", group_filter_max_streak=2)
    for g in ("a", "b"):  # filtered: the streak reaches the limit
        buf.push([traj(g, 0), traj(g, 1)])
    assert buf.sample_wire(2, 0) is None
    with caplog.at_level(logging.WARNING, logger="buffer.replay_buffer"):
        buf.push([traj("c", 0), traj("c", 1), traj("d", 0), traj("d", 1)])  # kept: nothing else would ever come
    assert "all had equal rewards" in caplog.text
    assert ids(buf.sample_wire(4, 0)) == ["c/0", "c/1", "d/0", "d/1"]
    buf.push([traj("mixed", 0, reward=1.0), traj("mixed", 1)])  # a reward spread: the filter is back
    buf.push([traj("e", 0), traj("e", 1)])
    assert ids(buf.sample_wire(2, 0)) == ["mixed/0", "mixed/1"] and buf.sample_wire(2, 0) is None
    s = buf.stats()
    assert s.zero_variance_kept == 2 and s.evicted[EVICT_ZERO_VARIANCE] == 6
