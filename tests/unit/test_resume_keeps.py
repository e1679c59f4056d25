"""A resume that loses nothing it promised, on the plain classes.

Before: the checkpoint's buffer snapshot kept the ready and pending groups and the counters, but the episodes in
flight became rejections at restore (admission ``rejected`` rose by ``running``, ``running`` fell to 0, a group none
of whose members had arrived was dropped, a partly arrived one released short), their prompts were never generated
again, and every rollout actor's prompt stream started over from its first prompt. Here: the prompt stream's position
round-trips (``PromptSource.state``/``restore``), the snapshot records each group in flight with its prompt and
actor and each actor's stream position, a restore keeps every count as it was and hands both back (``claim``), and
the worker starts the groups in flight before anything new (``RolloutWorker.resume``). A snapshot of an older
version (neither recorded) still resumes, as before, said in one ``[resume]`` line."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from types import SimpleNamespace

import msgpack
import pytest

from actors.rollout_actor import RolloutActor
from actors.rollout_worker import PromptSource, RolloutWorker
from async_agent_rl.config import BufferConfig
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.records import Trajectory
from buffer.actor import BufferActor
from buffer.replay_buffer import ReplayBuffer
from tests.helpers import LONGEST, ids, traj

pytestmark = pytest.mark.unit

EXAMPLES = [QAExample(id=f"q{i}", question=f"question {i}", gold_answers=["x"]) for i in range(10)]
G = 4  # group size


# ------------------------------------------------------------------------------------------------ PromptSource
def reference_stream(examples, shard, num_shards, seed, n):
    """The order the stream always had (one seeded shuffle per pass): a resumed stream must not change it."""
    mine = [ex for i, ex in enumerate(examples) if i % num_shards == shard]
    rng, out = random.Random(seed * 7919 + shard), []
    while len(out) < n:
        order = list(mine)
        rng.shuffle(order)
        out += order
    return [ex.id for ex in out[:n]]


@pytest.mark.parametrize("drawn", [0, 1, 4, 5, 11, 23])  # a shard of 5: unstarted, mid-pass, pass ends, later
def test_a_prompt_stream_continues_from_its_saved_position(drawn):
    source = PromptSource(EXAMPLES, shard=1, num_shards=2, seed=3)
    first = [next(source).id for _ in range(drawn)]
    state = msgpack.unpackb(msgpack.packb(source.state()))  # as it travels to the buffer and into the snapshot
    again = PromptSource(EXAMPLES, shard=1, num_shards=2, seed=3)
    again.restore(state)
    rest = [next(again).id for _ in range(17)]
    assert first + rest == reference_stream(EXAMPLES, 1, 2, 3, drawn + 17)
    assert [next(source).id for _ in range(17)] == rest and again.epoch == source.epoch


def test_a_position_that_does_not_fit_the_prompts_is_refused_and_the_stream_starts_over():
    source = PromptSource(EXAMPLES, seed=3)
    for _ in range(4):
        next(source)
    other = PromptSource(list(reversed(EXAMPLES)), seed=3)  # the data changed under the run
    with pytest.raises(ValueError, match="does not fit"):
        other.restore(source.state())
    with pytest.raises(ValueError, match="outside a pass"):
        other.restore({"epoch": 0, "index": 99, "last": "q1"})
    with pytest.raises(ValueError, match="not a prompt stream position"):
        other.restore({"index": 1})
    assert [next(other).id for _ in range(3)] == reference_stream(list(reversed(EXAMPLES)), 0, 1, 3, 3)


# -------------------------------------------------------------------------------------------- the buffer actor
def make() -> BufferActor:
    return BufferActor(BufferConfig(max_staleness=1), group_size=G, consumed_per_version=2 * G, max_concurrent=64,
                       batch_size=2 * G, max_trajectory_tokens=LONGEST)


def prompt(pid: str, index: int) -> dict:
    return {"id": pid, "cursor": {"epoch": 0, "index": index, "last": pid}}


def busy(b: BufferActor) -> BufferActor:
    """Ready ``a``; ``b`` half arrived; ``c`` none arrived; ``d`` one rejected, one arrived (actor1's)."""
    for k, gid in enumerate("abc"):
        assert b.try_start(G, 0, gid, "actor0", prompt(f"q{k}", k + 1)) == G
    assert b.try_start(G, 0, "d", "actor1", prompt("q7", 1)) == G
    b.push_many([traj("a", m, reward=m) for m in range(G)] + [traj("b", m) for m in range(2)] + [traj("d", 0)])
    b.reject(["d"])
    return b


def held(s):
    """What a restore keeps of ``stats()``: everything but the incarnation and the ages."""
    return dataclasses.replace(s, incarnation="", oldest_age_s=0.0)


def test_a_restore_keeps_every_count_and_hands_back_the_groups_in_flight_and_the_positions(tmp_path):
    from driver.restore import kept_line

    old = busy(make())
    before = old.stats()
    assert (before.admission.running, before.ready_groups, before.pending_groups) == (2 + 4 + 2, 1, 2)
    path = old.snapshot(str(tmp_path / "snap"))

    new = make()
    after = new.restore(path, actors=["actor0", "actor1"])
    assert held(after) == held(before)  # buffer counters, staleness histogram, admission: as they were
    assert new.resume_report() == {"groups": 3, "episodes": 8, "rejected": 0, "cursors": 2, "recorded": True,
                                   "cursors_recorded": True}
    assert kept_line(new.resume_report()) == ("[resume] 3 group(s) in flight at the checkpoint (8 episode(s)) are "
                                              "generated again first")
    assert new.claim("actor0") == {"groups": [["b", "q1", 2], ["c", "q2", 4]],
                                   "cursor": {"epoch": 0, "index": 3, "last": "q2"}}
    assert new.claim("actor0")["groups"] == []  # handed out once
    assert new.claim("actor1") == {"groups": [["d", "q7", 2]], "cursor": {"epoch": 0, "index": 1, "last": "q7"}}

    # the episodes generated again complete their groups whole (d: one rejection before, as before); the ready
    # group goes first, then the oldest
    assert not new.push_many([traj("b", m) for m in (2, 3)] + [traj("c", m) for m in range(G)]
                             + [traj("d", m) for m in (1, 2)]).refused
    stats = new.stats()
    assert stats.admission.running == 0 and stats.ready_groups == 4 and stats.groups_released_short == 1
    assert ids(new.sample(2 * G, 0)) == [f"a/{m}" for m in range(G)] + [f"b/{m}" for m in range(G)]
    assert ids(new.sample(2 * G, 0)) == [f"c/{m}" for m in range(G)] + [f"d/{m}" for m in range(3)]


def test_the_snapshot_of_a_resumed_buffer_still_records_what_was_not_claimed(tmp_path):
    new = make()
    new.restore(busy(make()).snapshot(str(tmp_path / "snap")), actors=["actor0", "actor1"])
    again = make()
    again.restore(new.snapshot(str(tmp_path / "snap2")), actors=["actor0", "actor1"])  # a crash before the claim
    assert again.resume_report()["groups"] == 3 and len(again.claim("actor0")["groups"]) == 2


def test_groups_of_an_actor_the_run_no_longer_has_go_to_one_it_has(tmp_path):
    new = make()
    new.restore(busy(make()).snapshot(str(tmp_path / "snap")), actors=["actor0"])  # rollout.num_actors 2 -> 1
    assert [g[0] for g in new.claim("actor0")["groups"]] == ["b", "c", "d"]
    assert new.claim("actor1")["groups"] == []


def test_an_actor_lost_before_it_took_up_its_groups_loses_them_as_any_in_flight(tmp_path):
    new = make()
    new.restore(busy(make()).snapshot(str(tmp_path / "snap")), actors=["actor0", "actor1"])
    assert new.actor_lost("actor0") == 6  # b's 2 and c's 4
    assert new.claim("actor0")["groups"] == [] and new.stats().admission.running == 2  # d's, actor1's


def test_a_group_admitted_without_its_prompt_counts_its_running_members_rejected_as_before(tmp_path):
    from driver.restore import kept_line

    old = make()
    assert old.try_start(G, 0, "x", "actor0") == G  # no prompt given: nothing to generate again
    assert old.try_start(G, 0, "y", "actor0", prompt("q3", 1)) == G
    new = make()
    after = new.restore(old.snapshot(str(tmp_path / "snap")))
    assert after.admission.running == G and after.admission.rejected == G
    assert new.resume_report()["rejected"] == G and new.claim("actor0")["groups"] == [["y", "q3", G]]
    assert "4 episode(s) whose prompt was not recorded count as rejected" in kept_line(new.resume_report())


def test_a_snapshot_of_an_older_version_resumes_with_nothing_taken_up_said_once(tmp_path):
    from driver.restore import kept_line

    old = busy(make())
    path = tmp_path / "old.snap"
    old.buffer.snapshot(path, extra={"admission": old.admission.state()})  # what older versions wrote
    new = make()
    after = new.restore(str(path), actors=["actor0", "actor1"])
    assert after.admission.running == 0 and after.admission.rejected == 1 + 8  # the in-flight ones: rejected
    report = new.resume_report()
    assert (report["recorded"], report["cursors_recorded"], report["groups"]) == (False, False, 0)
    assert new.claim("actor0") == {"groups": [], "cursor": None}
    line = kept_line(report)
    assert line.startswith("[resume] the checkpoint did not record the groups in flight or the prompt stream positions "
                           "(an older version's): nothing recorded is taken up; 8 episode(s) in flight count as")


def test_the_resume_line_names_only_what_the_checkpoint_did_not_record():
    from driver.restore import kept_line

    line = kept_line({"recorded": True, "cursors_recorded": False, "groups": 2, "episodes": 3})
    assert line.startswith("[resume] the checkpoint did not record the prompt stream positions (an older")
    line = kept_line({"recorded": False, "cursors_recorded": True})
    assert line.startswith("[resume] the checkpoint did not record the groups in flight (an older")


def test_the_zero_variance_streak_survives_a_snapshot(tmp_path):
    buf = ReplayBuffer(BufferConfig(group_filter="zero_variance", group_filter_max_streak=2), 2,
                       max_trajectory_tokens=LONGEST)
    for g in range(3):
        buf.push([traj(f"g{g}", m) for m in range(2)])  # equal rewards: two filtered, then the filter stands aside
    back, _ = ReplayBuffer.restore(buf.snapshot(tmp_path / "s"), buf.config, 2, max_trajectory_tokens=LONGEST)
    back.push([traj("h", m) for m in range(2)])
    assert back.stats().zero_variance_kept == buf.stats().zero_variance_kept + 1  # it still stands aside


# ------------------------------------------------------------------------------------------------ the worker
class Runner:
    """Every episode takes 5 ms and succeeds; records (prompt id, group id) in start order."""

    def __init__(self):
        self.engine = SimpleNamespace(version=3)
        self.search = self.tokenizer = self.s = self.timers = None
        self.started: list[tuple[str, str]] = []

    async def run(self, ex, group_id="", seed=None):
        self.started.append((ex.id, group_id))
        await asyncio.sleep(0.005)
        return Trajectory.decode(traj(group_id, len(self.started)))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_worker_starts_the_groups_in_flight_first_then_continues_its_stream(mode, monkeypatch):
    from actors import rollout_worker

    runner, asked = Runner(), []
    monkeypatch.setattr(rollout_worker, "EpisodeRunner", lambda engine, *parts: runner)  # a wave's: the same runner
    source = PromptSource(EXAMPLES, seed=1)
    source.restore({"epoch": 0, "index": 2, "last": reference_stream(EXAMPLES, 0, 1, 1, 2)[1]})

    async def admit(n, version, group_id, prompt):
        asked.append((group_id, prompt))
        return n

    async def sink(batch):
        return None

    w = RolloutWorker(runner, source, sink, group_size=2, max_concurrent=4, admit=admit, actor_id="actor0", mode=mode)
    w.resume([(EXAMPLES[7], "actor1-old", 1), (EXAMPLES[8], "actor0-old", 2)])
    asyncio.run(asyncio.wait_for(w.run(num_groups=4), 10))
    assert runner.started[:3] == [("q7", "actor1-old"), ("q8", "actor0-old"), ("q8", "actor0-old")]
    stream = reference_stream(EXAMPLES, 0, 1, 1, 4)[2:]  # where it stood: the third prompt on
    assert [p["id"] for _, p in asked] == stream  # no admission asked for the groups in flight: they have theirs
    assert [p["cursor"] for _, p in asked] == [{"epoch": 0, "index": 3, "last": stream[0]},
                                               {"epoch": 0, "index": 4, "last": stream[1]}]
    assert [pid for pid, gid in runner.started[3:]] == [stream[0]] * 2 + [stream[1]] * 2
    assert {gid for _, gid in runner.started[3:]} == {gid for gid, _ in asked}


def test_a_prompt_admission_refused_is_offered_again_not_skipped():
    runner, asked = Runner(), []

    async def admit(n, version, group_id, prompt):
        asked.append(prompt["id"])
        return n if len(asked) > 2 else 0

    async def sink(batch):
        return None

    w = RolloutWorker(runner, PromptSource(EXAMPLES, seed=1), sink, group_size=2, max_concurrent=4, admit=admit,
                      admission_poll_s=0.001)
    asyncio.run(asyncio.wait_for(w.run(num_groups=2), 10))
    first, second = reference_stream(EXAMPLES, 0, 1, 1, 2)
    assert asked == [first, first, first, second] and [p for p, _ in runner.started] == [first] * 2 + [second] * 2


# ------------------------------------------------------------------------------------------- the actor shell
class FakeBuffer:
    """The buffer actor's ``claim`` and ``reject`` as Ray would call them (``.remote`` returns an awaitable)."""

    def __init__(self, claim):
        self.rejected: list[str] = []

        async def claim_(actor_id):
            return claim

        async def reject(gids):
            self.rejected += gids

        self.claim = SimpleNamespace(remote=claim_)
        self.reject = SimpleNamespace(remote=reject)


def shell(buffer, source) -> RolloutActor:
    actor = RolloutActor.__new__(RolloutActor)
    actor.index, actor.actor_id, actor.buffer, actor.prompts = 0, "actor0", buffer, source
    actor.cfg = SimpleNamespace(cluster=SimpleNamespace(actor_timeout_s=5))
    actor.by_id = {ex.id: ex for ex in EXAMPLES}
    actor.worker = SimpleNamespace(resume=lambda groups: setattr(actor, "resumed_groups", groups))
    return actor


def test_the_actor_shell_restores_its_stream_and_hands_the_groups_to_its_worker():
    from driver.restore import taken_up_lines

    source = PromptSource(EXAMPLES, seed=1)
    cursor = {"epoch": 1, "index": 3, "last": reference_stream(EXAMPLES, 0, 1, 1, 13)[-1]}
    buffer = FakeBuffer({"groups": [["g1", "q4", 2], ["g2", "gone", 3]], "cursor": cursor})
    actor = shell(buffer, source)
    taken = asyncio.run(actor._take_up(asyncio.run(buffer.claim.remote("actor0"))))
    assert taken == {"groups": [["g1", "q4", 2]], "cursor": cursor, "unknown": ["gone"], "note": None}
    assert actor.resumed_groups == [(EXAMPLES[4], "g1", 2)] and buffer.rejected == ["g2"] * 3
    assert next(source).id == reference_stream(EXAMPLES, 0, 1, 1, 14)[-1]
    lines = taken_up_lines([taken])
    assert lines[0] == ("[resume] rollout actors: 1 group(s) in flight at the checkpoint restarted (2 episode(s)); "
                        "prompt streams continue at actor0 pass 1 prompt 3")
    assert "1 prompt(s) in flight are not in the training data" in lines[1]

    wrong = FakeBuffer({"groups": [], "cursor": {"epoch": 0, "index": 2, "last": "nope"}})
    taken = asyncio.run(shell(wrong, PromptSource(EXAMPLES, seed=1))._take_up({"groups": [], "cursor": {
        "epoch": 0, "index": 2, "last": "nope"}}))
    assert taken["cursor"] is None and "does not fit" in taken["note"]
    assert "starts from its beginning" in taken_up_lines([taken])[1]
