"""Staleness arithmetic and the pacing admission rule (async_agent_rl.staleness), with the replay buffer.

The property tests drive a model of the whole system through the real ``BufferActor`` (admission + replay buffer,
no Ray): rollout actors ask for admission at their engine's weight version, episodes finish in any order, are lost
or whole actors die, engines reload, and a learner consumes a batch per version. A ``rush`` finishes (or loses)
everything but the oldest few episodes, lets the learner take every batch it can and the actors ask again, so
stragglers stay in flight across learner steps while newer versions' groups overtake them: without the oldest open
group in the admission rule the generated cases alone find a straggler evicted as stale (3 runs of 3 at 300 cases,
without the pinned examples). Each actor pushes through one outbox, as ``RolloutWorker`` does: the buffer takes
every trajectory that fits and the refused ones wait in the outbox, sent again with the next push. The generated
cases choose the buffer's capacity too, from one batch (the least a config allows) up, so a full buffer refuses
pushes; with in-order pushes, where a refused trajectory held back the ones behind it, that found a stall (pinned
below: ``test_a_full_buffer_never_stalls_an_actors_pushes``).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from async_agent_rl.config import BufferConfig
from async_agent_rl.records import OBS_VERSION, EpisodeMeta, Trajectory, TurnSpan
from async_agent_rl.staleness import (
    AdmissionError,
    AdmissionState,
    admission_room,
    group_min_version,
    is_stale,
    staleness,
)
from buffer.actor import BufferActor
from buffer.replay_buffer import EVICT_STALE
from tests.helpers import LONGEST

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


def test_room_formula_by_hand():
    # eta=1, N=4 groups per version, nothing open, asking at v=0: (1 + 0 + 1) * 4 - 3 live = 5
    assert admission_room(0, max_staleness=1, groups_per_version=4, live_groups=3, oldest_open_version=None) == 5
    # the oldest open group (version 0) holds back an engine already at version 3: (1 + 0 + 1) * 4 - 6 = 2
    assert admission_room(3, max_staleness=1, groups_per_version=4, live_groups=6, oldest_open_version=0) == 2
    # version 2, eta 0, 8 live (consumed ones included), nothing open: (0 + 2 + 1) * 4 - 8 = 4
    assert admission_room(2, max_staleness=0, groups_per_version=4, live_groups=8, oldest_open_version=None) == 4
    assert admission_room(0, max_staleness=0, groups_per_version=4, live_groups=9, oldest_open_version=0) == 0


def test_admission_grants_one_group_and_frees_units_on_drop_not_on_consume():
    adm = AdmissionState(max_staleness=0, batch_size=4, max_concurrent=100, granule=2)  # N = 2 groups
    assert adm.try_start(2, 0, "a") == 2 and adm.try_start(2, 0, "b") == 2
    assert adm.try_start(2, 0, "c") == 0  # (0 + 0 + 1) * 2 reached
    adm.on_finished("a", 2, accepted=False)  # every member of a thrown away: a is dropped, its unit is free
    assert adm.try_start(2, 0, "c") == 2
    adm.on_finished("b", 1, accepted=True)
    adm.on_finished("b", 1, accepted=False)  # b keeps one member: still open, a (short) group
    adm.on_finished("c", 2, accepted=True)
    adm.on_consumed("b")
    adm.on_consumed("c")  # consumed groups still count: no room at version 0 ...
    assert adm.try_start(2, 0, "d") == 0
    assert adm.try_start(2, 1, "d") == 2  # ... and the next version admits its groups
    assert adm.counters() == {"started": 8, "accepted": 3, "rejected": 3, "evicted": 0, "running": 2,
                              "groups_started": 4, "groups_dropped": 1, "groups_consumed": 2, "groups_open": 1,
                              "oldest_open_version": 1}


def test_the_oldest_open_group_paces_admission():
    adm = AdmissionState(max_staleness=1, batch_size=2, max_concurrent=100, granule=1)  # N = 2
    for g in "abcd":
        assert adm.try_start(1, 0, g) == 1  # (1 + 0 + 1) * 2 = 4
    for g in "bcd":
        adm.on_finished(g, 1, accepted=True)
    adm.on_consumed("b"), adm.on_consumed("c")  # learner at version 1; "a" (version 0) still runs
    assert adm.try_start(1, 1, "e") == 0  # admitting at version 1 would let "a" be overtaken past eta
    adm.on_finished("a", 1, accepted=True)
    adm.on_consumed("a"), adm.on_consumed("d")
    assert adm.try_start(1, 2, "e") == 1


def test_admission_misuse_is_loud():
    adm = AdmissionState(max_staleness=1, batch_size=4, max_concurrent=8, granule=2)
    adm.try_start(2, 0, "a")
    with pytest.raises(AdmissionError, match="only 2"):
        adm.on_finished("a", 3, accepted=True)
    with pytest.raises(AdmissionError, match="not open"):
        adm.on_finished("zzz", 1, accepted=True)
    with pytest.raises(AdmissionError, match="already admitted"):
        adm.try_start(2, 0, "a")
    with pytest.raises(AdmissionError, match="one group"):
        adm.try_start(4, 0, "b")
    with pytest.raises(ValueError):
        AdmissionState(max_staleness=-1, batch_size=4, max_concurrent=8)
    with pytest.raises(ValueError, match="multiple of the group size"):
        AdmissionState(max_staleness=0, batch_size=6, max_concurrent=8, granule=4)


def test_resumed_state_counts_running_episodes_as_rejected():
    adm = AdmissionState(max_staleness=1, batch_size=4, max_concurrent=8, granule=2)
    adm.try_start(2, 0, "a"), adm.try_start(2, 0, "b")
    adm.on_finished("a", 1, accepted=True)
    back = AdmissionState.resumed(adm.state(), max_staleness=1, batch_size=4, max_concurrent=8, granule=2)
    assert back.running == 0 and back.rejected == 3 and back.live == 1
    assert list(back.open) == ["a"] and back.groups_dropped == 1  # b had nothing: dropped, its unit free
    assert back.try_start(2, 0, "c") == 2


# ------------------------------------------------------------------------------------------- the whole system
def _blob(gid: str, member: int, version: int, reward: float) -> bytes:
    return Trajectory(
        prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], behavior_logprobs=[-0.5, -0.5],
        versions=[version, version], turns=[TurnSpan("model", 0, 2)], reward=reward,
        meta=EpisodeMeta(group_id=gid, trajectory_id=f"{gid}/{member}"),
    ).encode()


class Model:
    """Rollout actors, their engines and a learner around one real ``BufferActor``. Each actor pushes its finished
    episodes through one outbox, as ``RolloutWorker`` does: the buffer takes what fits, the refused ones wait in
    the outbox (still running for admission) and are sent again, in front of what finishes later; a killed actor's
    outbox dies with it."""

    def __init__(self, eta: int, group: int, batch_groups: int, max_concurrent: int, filt: bool, seed: int,
                 capacity: int | None = None):
        self.eta, self.G, self.B = eta, group, batch_groups * group
        cfg = BufferConfig(max_staleness=eta, group_filter="zero_variance" if filt else "none",
                           **({} if capacity is None else {"capacity_trajectories": capacity}))
        self.buf = BufferActor(cfg, group_size=group, consumed_per_version=self.B, max_concurrent=max_concurrent,
                               batch_size=self.B, max_trajectory_tokens=LONGEST)
        self.rng = random.Random(seed)
        self.learner_version = 0
        self.engine = {"a0": 0, "a1": 0}  # actor -> weight version of its engine
        self.running: list[tuple[str, str, int, int]] = []  # (actor, group id, member, version at admission)
        self.outbox: dict[str, list[bytes]] = {"a0": [], "a1": []}  # finished, not yet taken by the buffer
        self.consumed_staleness: list[int] = []
        self.steps = 0
        self.k = 0
        self.refused = 0  # pushes the full buffer turned away (each retry counts)
        self.learned_over_stragglers = 0  # learner steps taken while an episode of an older version ran

    def admit(self, actor: str) -> bool:
        self.k += 1
        gid = f"{actor}-g{self.k}"
        if self.buf.try_start(self.G, self.engine[actor], gid, actor) == 0:
            return False
        self.running += [(actor, gid, m, self.engine[actor]) for m in range(self.G)]
        return True

    def fill(self, actor: str) -> bool:
        moved = False
        while self.admit(actor):
            moved = True
        return moved

    def finish(self, i: int, lose: bool, newer: bool) -> None:
        actor, gid, m, v = self.running.pop(i)
        if lose:
            self.buf.reject([gid])
        else:  # tokens of an admitted episode are never older than its admission version
            version = self.engine[actor] if newer else v
            self.outbox[actor].append(_blob(gid, m, version, reward=float(m % 2)))
            self.flush(actor)

    def flush(self, actor: str) -> bool:
        """Send the actor's outbox; the buffer takes what it has room for, the refused ones stay."""
        box = self.outbox[actor]
        if not box:
            return False
        result = self.buf.push_many(list(box))
        box[:] = result.rest(box)
        self.refused += len(box)
        return result.accepted > 0

    def flush_all(self) -> bool:
        return any([self.flush(actor) for actor in self.outbox])

    def kill(self, actor: str) -> None:
        self.running = [r for r in self.running if r[0] != actor]
        self.outbox[actor] = []  # its unsent pushes die with it (still running for admission: counted lost)
        self.buf.actor_lost(actor)
        self.engine[actor] = self.learner_version  # the restarted actor loads the newest weights

    def learn(self) -> bool:
        got = self.buf.sample(self.B, self.learner_version)
        if got is None:
            return False
        if any(v < self.learner_version for _, _, _, v in self.running):
            self.learned_over_stragglers += 1
        for blob in got:
            t = Trajectory.decode(blob)
            self.consumed_staleness.append(staleness(self.learner_version, t.min_version))
        self.learner_version += 1
        self.steps += 1
        return True

    def sync(self, actor: str) -> None:
        self.engine[actor] = self.learner_version

    def rush(self, keep: int, lose_share: float) -> None:
        """Everything but the ``keep`` oldest running episodes (the stragglers) finishes, some lost (across groups
        and versions); the learner takes every batch it can, the engines reload and the actors ask again: the
        stragglers are overtaken by newer versions' groups for as long as admission lets them."""
        stragglers, rest = self.running[:keep], self.running[keep:]
        self.running = stragglers + rest
        while len(self.running) > len(stragglers):
            self.finish(len(self.running) - 1, lose=self.rng.random() < lose_share, newer=False)
        while self.learn() or self.flush_all():
            pass
        for actor in self.engine:
            self.sync(actor)
            self.fill(actor)


events = st.lists(
    st.tuples(st.sampled_from(["admit", "fill", "finish", "lose", "kill", "sync", "learn", "rush"]),
              st.integers(0, 1), st.integers(0, 10_000), st.booleans()),
    max_size=60,
)


def _check(eta, group, batch_groups, extra, max_concurrent, filt, script, capacity=None):
    """Random traffic, then a fair drain (engines reload, actors ask, episodes finish, the learner samples): the
    learner must make progress, every consumed trajectory must be within eta, and nothing may go stale.
    ``capacity``: buffer room in trajectories beyond one batch (the least a config allows); None: the default
    (4096), which these cases never fill."""
    m = Model(eta, group, batch_groups, max(group, max_concurrent), filt and group > 1, seed=extra,
              capacity=None if capacity is None else batch_groups * group + capacity)
    actors = ["a0", "a1"]
    for kind, a, pick, flag in script:
        actor = actors[a]
        if kind == "admit":
            m.admit(actor)
        elif kind == "fill":
            m.fill(actor)
        elif kind in ("finish", "lose") and m.running:
            m.finish(pick % len(m.running), lose=kind == "lose", newer=flag)
        elif kind == "kill" and flag:
            m.kill(actor)
        elif kind == "sync":
            m.sync(actor)
        elif kind == "learn":
            m.learn()
        elif kind == "rush":
            m.rush(keep=1 + pick % 3, lose_share=0.2 if flag else 0.0)
        m.flush_all()
    target = m.steps + 2 * (eta + 2)
    while m.steps < target:  # drain, with no losses now: it must keep making batches
        moved = False
        for actor in actors:
            m.sync(actor)
            moved = m.fill(actor) or moved
        while m.running:
            m.finish(m.rng.randrange(len(m.running)), lose=False, newer=False)
            moved = True
        moved = m.flush_all() or moved
        moved = m.learn() or moved
        assert moved, (f"deadlock: learner stuck at version {m.learner_version}; outboxes "
                       f"{ {a: len(b) for a, b in m.outbox.items()} }; buffer {m.buf.stats()}")
    assert all(0 <= s <= eta for s in m.consumed_staleness)
    stats = m.buf.stats()
    assert stats.evicted[EVICT_STALE] == 0, "admission started episodes that were then thrown away as stale"
    assert stats.pushed == stats.sampled + stats.evicted_total + stats.size
    return m


@settings(max_examples=300, deadline=None)
# a pinned case: groups of 4, batch 64, eta 0, one lost episode in each of two groups
@example(eta=0, group=4, batch_groups=16, extra=0, max_concurrent=64, filt=False, room=None,
         script=[("admit", 0, 0, False)] * 17 + [("lose", 0, 0, False), ("lose", 0, 3, False)]
         + [("finish", 0, 0, False)] * 66 + [("learn", 0, 0, False)])
# groups of 4, batch 8: two groups per version
@example(eta=0, group=4, batch_groups=2, extra=0, max_concurrent=64, filt=False, room=None,
         script=[("admit", 0, 0, False)] * 3 + [("lose", 0, 0, False)] + [("finish", 0, 0, False)] * 11)
# out of order at eta 1: a straggler overtaken by a later version's groups
@example(eta=1, group=1, batch_groups=1, extra=0, max_concurrent=30, filt=False, room=None,
         script=[("admit", 0, 0, False), ("admit", 0, 0, False), ("finish", 0, 1, False), ("learn", 0, 0, False),
                 ("sync", 0, 0, False), ("admit", 0, 0, False), ("finish", 0, 1, False), ("learn", 0, 0, False),
                 ("finish", 0, 0, False), ("learn", 0, 0, False)])
# a full buffer (one batch of room, the least a config allows) with a new group's member finishing before the last
# member of a group the buffer holds: test_a_full_buffer_never_stalls_an_actors_pushes
@example(eta=1, group=2, batch_groups=1, extra=0, max_concurrent=4, filt=False, room=0,
         script=[("fill", 0, 0, False), ("finish", 0, 0, False), ("finish", 0, 1, False), ("finish", 0, 0, False)])
@given(eta=st.integers(0, 8), group=st.integers(1, 8), batch_groups=st.integers(1, 6), extra=st.integers(0, 99),
       max_concurrent=st.integers(1, 64), filt=st.booleans(), script=events,
       room=st.none() | st.integers(0, 8))
def test_the_whole_system_never_deadlocks_never_exceeds_eta_and_discards_nothing(
        eta, group, batch_groups, extra, max_concurrent, filt, script, room):
    """``room``: the buffer's capacity beyond one batch, in trajectories (None: the default capacity, never full).
    Below ``(eta + 1)`` batches a full buffer refuses pushes while admitted episodes run."""
    _check(eta, group, batch_groups, extra, max_concurrent, filt, script, capacity=room)


def test_a_full_buffer_never_stalls_an_actors_pushes():
    """A full buffer with the least capacity a config allows (one batch): eta 1, groups of 2, batch 2 (one group),
    room for 2 trajectories, one actor. Admission lets two groups run (eta + 1 versions' worth); X's first member
    arrives and reserves room for X, Y's first member is refused (no room for a new group), and X's second member
    is in the outbox behind it. When the buffer took only the longest prefix that fitted (and the worker resent
    the refused rest before anything else), X's second member never arrived: no batch, for ever. The buffer now
    takes every trajectory that fits: X completes, the learner takes it, Y's members find room."""
    m = Model(eta=1, group=2, batch_groups=1, max_concurrent=4, filt=False, seed=0, capacity=2)
    assert m.fill("a0") and len(m.running) == 4  # groups X and Y, both at version 0
    for i in (0, 1, 0, 0):  # running is [X/0, X/1, Y/0, Y/1]: they finish as X/0, Y/0, X/1, Y/1
        m.finish(i, lose=False, newer=False)
    for _ in range(3):
        m.flush_all()
    assert m.learn(), f"no batch: outbox {len(m.outbox['a0'])} waiting, buffer {m.buf.stats().size} stored"
    assert m.refused > 0  # the buffer was full: Y's first member was refused at least once
    m.flush_all()
    assert m.learn() and not m.outbox["a0"] and m.consumed_staleness == [0, 0, 1, 1]


@pytest.mark.parametrize("group, batch", [(4, 6), (3, 8), (8, 4), (2, 5)])
def test_a_batch_that_is_not_whole_groups_is_refused_up_front(group, batch):
    """A batch size that is not a multiple of the group size could never be made of whole groups: refused when the
    buffer is built (before any episode runs), naming both numbers."""
    with pytest.raises(ValueError, match=rf"\({batch}\).*multiple of the group size \({group}\)"):
        BufferActor(BufferConfig(max_staleness=0), group_size=group, consumed_per_version=batch, max_concurrent=64,
                    batch_size=batch, max_trajectory_tokens=LONGEST)
