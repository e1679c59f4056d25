"""A dead rollout actor's in-flight episodes are counted lost: admission slots come back, groups do not hang."""

import pytest

from async_agent_rl.config import BufferConfig
from buffer.actor import BufferActor
from tests.helpers import LONGEST, ids, traj

pytestmark = pytest.mark.unit


def make() -> BufferActor:
    return BufferActor(BufferConfig(max_staleness=0), group_size=2, consumed_per_version=4, max_concurrent=64,
                       batch_size=4, max_trajectory_tokens=LONGEST)


def test_actor_lost_frees_slots_and_releases_partial_groups():
    b = make()
    assert b.try_start(2, 0, "g1", "actor0") == 2
    assert b.try_start(2, 0, "g2", "actor0") == 2
    assert b.try_start(2, 0, "g3", "actor1") == 0  # capacity (0 + 0 + 1) * 4 reached
    b.push_many([traj("g1", 0)])  # one member of g1 arrived, three episodes of actor0 still running
    assert b.admission.running == 3

    assert b.actor_lost("actor0") == 3
    assert b.admission.running == 0
    stats = b.stats()
    assert stats.lost_episodes == {"actor0": 3}
    # g1 is released short with the member that arrived, g2 had none and vanishes: nothing waits forever
    assert stats.groups_released_short == 1 and stats.ready_groups == 1 and stats.pending_groups == 0
    assert stats.pushed == 1 and stats.rejected == 3
    assert b.actor_lost("actor0") == 0  # nothing left in flight


def test_finished_episodes_are_not_counted_lost():
    b = make()
    b.try_start(2, 0, "g1", "actor0")
    b.push_many([traj("g1", 0), traj("g1", 1)])
    assert b.actor_lost("actor0") == 0 and b.admission.running == 0
    assert len(b.sample(2, 0)) == 2


def test_filtered_groups_free_their_admission_slots_and_batches_stay_full():
    """A push that completes a zero-variance group evicts it at once; its members were accepted by that same push,
    so the admission accounting must take them as accepted first and then free their slots for refills."""
    b = BufferActor(BufferConfig(max_staleness=0, group_filter="zero_variance"), group_size=2,
                    consumed_per_version=4, max_concurrent=64, batch_size=4, max_trajectory_tokens=LONGEST)
    assert b.try_start(2, 0, "dull", "a0") == 2 and b.try_start(2, 0, "good", "a0") == 2
    assert b.try_start(2, 0, "more", "a0") == 0  # capacity (0 + 0 + 1) * 4 reached
    b.push_many([traj("dull", 0, reward=1.0), traj("dull", 1, reward=1.0)])  # filtered on arrival
    b.push_many([traj("good", 0, reward=1.0), traj("good", 1, reward=0.0)])
    assert b.sample(4, 0) is None  # one useful group: the batch waits for a second one
    assert b.try_start(2, 0, "more", "a0") == 2  # the filtered group's slots were given back
    b.push_many([traj("more", 0, reward=0.0), traj("more", 1, reward=0.5)])
    assert len(b.sample(4, 0)) == 4
    s = b.stats()
    assert s.evicted["filtered_zero_variance"] == 2 and s.admission.evicted == 2
    assert s.admission.running == 0


def test_eta0_goes_on_after_a_rejected_episode_and_keeps_the_bound():
    """eta = 0, groups of 4, batches of 8: one rejected episode leaves a group of 3. A batch is two whole groups, so
    the learner gets 7 trajectories of version 0 (padded to 8 by the learner) and nothing is thrown away; the next
    version admits its two groups."""
    b = BufferActor(BufferConfig(max_staleness=0), group_size=4, consumed_per_version=8, max_concurrent=64,
                    batch_size=8, max_trajectory_tokens=LONGEST)
    assert b.try_start(4, 0, "a", "actor0") == 4 and b.try_start(4, 0, "b", "actor0") == 4
    assert b.try_start(4, 0, "c", "actor0") == 0  # the bound binds: two groups per version at eta 0
    b.push_many([traj("a", i) for i in range(4)] + [traj("b", i) for i in range(3)])
    b.reject(["b"])
    batch = b.sample(8, 0)
    assert batch is not None and sorted(ids(batch)) == sorted([f"a/{i}" for i in range(4)] + [f"b/{i}" for i in range(3)])
    s = b.stats()
    assert s.evicted["stale"] == 0 and s.staleness_histogram == {0: 7}
    assert b.try_start(4, 0, "c", "actor0") == 0  # version 0's groups are spent ...
    assert b.try_start(4, 1, "c", "actor0") == 4 and b.try_start(4, 1, "d", "actor0") == 4  # ... version 1 admits


async def test_a_short_batch_is_packed_to_the_learners_rows_with_filler():
    b = BufferActor(BufferConfig(max_staleness=0), group_size=4, consumed_per_version=8, max_concurrent=64,
                    batch_size=8, max_trajectory_tokens=LONGEST)
    b.try_start(4, 0, "a", "actor0"), b.try_start(4, 0, "b", "actor0")
    b.push_many([traj("a", i) for i in range(4)] + [traj("b", i) for i in range(2)])
    b.reject(["b", "b"])
    batch = await b.sample_batch(0, timeout_s=1)
    assert batch.batch_size == 8 and batch.real_rows == 6
    assert float(batch.loss_mask[6:].sum()) == 0 and len(batch.min_versions()) == 6


def test_a_late_push_of_a_lost_episode_is_dropped_and_never_hurts_another_actor():
    """actor0 is declared dead while its last push is still on the way; the push arrives after ``actor_lost``.
    It must not take actor1's running slot: actor1's own push then goes through."""
    b = make()
    assert b.try_start(2, 0, "a0-g", "actor0") == 2 and b.try_start(2, 0, "a1-g", "actor1") == 2
    assert b.actor_lost("actor0") == 2
    late = b.push_many([traj("a0-g", 0), traj("a1-g", 0), traj("a0-g", 1)])
    assert late.accepted == 3 and not late.full
    b.push_many([traj("a1-g", 1)])  # before: AdmissionError, 3 pushed but 2 running
    s = b.stats()
    assert s.late_pushes == 2 and s.pushed == 2 and s.admission.running == 0
    assert ids(b.sample(2, 0)) == ["a1-g/0", "a1-g/1"]


def test_a_member_arriving_after_its_group_was_released_partial_is_late_not_a_second_group():
    """``partial_groups=release``: "g1" times out with one member of two and is released; its straggler arrives
    before a batch takes the group. It is dropped and counted late (its group is already a batch's unit), never a
    second group "g1": that one was consumed after the first had closed the group's admission (AdmissionError), or
    waited for the timeout, its slot running."""
    b = BufferActor(BufferConfig(max_staleness=1, partial_groups="release", partial_group_timeout_s=10), group_size=2,
                    consumed_per_version=4, max_concurrent=64, batch_size=4, max_trajectory_tokens=LONGEST)
    clock = [0.0]
    b.buffer._clock = lambda: clock[0]  # the test's time, as ReplayBuffer(clock=) takes it
    assert all(b.try_start(2, 0, g, "a0") == 2 for g in ("g1", "g2", "g3"))
    b.push_many([traj("g1", 0)])
    clock[0] = 11.0
    b.push_many([traj("g2", 0), traj("g2", 1)])  # "g1" is released partial on the way
    assert b.stats().groups_released_partial == 1 and b.stats().ready_groups == 2
    late = b.push_many([traj("g1", 1)])  # the straggler, before a batch takes "g1"
    assert late.accepted == 1 and not late.full
    s = b.stats()
    assert (s.pending_groups, s.ready_groups, s.late_pushes, s.pushed) == (0, 2, 1, 3)
    assert s.admission.running == 2 and s.admission.rejected == 1  # g3's two; g1/1 thrown away
    assert ids(b.sample(4, 0)) == ["g1/0", "g2/0", "g2/1"]
    b.push_many([traj("g3", 0), traj("g3", 1)])
    clock[0] = 30.0  # past a second "g1"'s timeout: it would be released now, and its consumption raise
    assert ids(b.sample(2, 1)) == ["g3/0", "g3/1"] and b.sample(2, 1) is None
    s = b.stats()
    assert (s.size, s.pending_groups, s.ready_groups, s.sampled) == (0, 0, 0, 5)
    assert s.pushed == s.sampled + s.evicted_total + s.size
    assert s.admission.running == 0 and s.admission.groups_open == 0 and s.admission.groups_consumed == 3
