"""The replay buffer as a real Ray actor on a local cluster: concurrent producers and a learner lose nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray

from async_agent_rl.batch import TrainBatch
from async_agent_rl.config import build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from async_agent_rl.stats import AdmissionStats, BufferStats
from buffer.actor import create_buffer_actor, push_all, push_all_async
from buffer.replay_buffer import EVICT_STALE, SnapshotError

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray")]

GROUP = 4
BATCH = 8  # two groups per learner step
ETA = 1


def config(**buffer):
    return build_config(
        {
            "rollout": {"group_size": GROUP, "num_actors": 3, "max_concurrent_episodes": 8},
            "learner": {"batch_size": BATCH, "mini_batch_size": BATCH, "micro_batch_size": BATCH},
            "buffer": {"max_staleness": ETA, **buffer},
            "cluster": {"buffer_cpus": 0},
        }
    )


def episode(gid: str, member: int, version: int) -> bytes:
    """A small two-turn episode: prompt | model (3) | observation (2) | model (2)."""
    return Trajectory(
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 20, 21, 13, 14],
        loss_mask=[1, 1, 1, 0, 0, 1, 1],
        behavior_logprobs=[-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5],
        versions=[version] * 3 + [-1, -1] + [version] * 2,
        turns=[TurnSpan("model", 0, 3), TurnSpan("observation", 3, 5), TurnSpan("model", 5, 7)],
        reward=float(member % 2),
        meta=EpisodeMeta(group_id=gid, trajectory_id=f"{gid}/{member}"),
    ).encode()


@ray.remote(num_cpus=0)
class Producer:
    """A rollout actor stand-in: asks for admission, 'generates' a group, pushes it (or rejects a member)."""

    async def run(self, buffer, name: str, groups: int) -> list[str]:
        pushed: list[str] = []
        for g in range(groups):
            version = (await buffer.stats.remote()).learner_version
            gid = f"{name}-{g}"
            while await buffer.try_start.remote(GROUP, version, gid, name) == 0:
                await asyncio.sleep(0.005)
                version = (await buffer.stats.remote()).learner_version
            members = list(range(GROUP))
            if g % 5 == 4:  # the producer throws one episode away
                await buffer.reject.remote([gid])
                members = members[1:]
            await push_all_async(buffer, [episode(gid, m, version) for m in members], poll_s=0.005, timeout_s=30)
            pushed += [f"{gid}/{m}" for m in members]
        return pushed


def test_concurrent_producers_and_a_learner_lose_nothing():
    buffer = create_buffer_actor(config(capacity_trajectories=24), pad_id=0)
    # a straggler: admitted at version 0, it finishes only when the learner can go no further without it
    assert ray.get(buffer.try_start.remote(GROUP, 0, "late", "s")) == GROUP
    straggler = [episode("late", m, 0) for m in range(GROUP)]
    producers = [Producer.remote() for _ in range(3)]
    runs = [p.run.remote(buffer, f"p{i}", 10) for i, p in enumerate(producers)]

    sampled: list[str] = []
    version = 0
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, ray.get(buffer.stats.remote())
        blobs = ray.get(buffer.sample.remote(BATCH, version))
        if blobs is not None:
            sampled += [Trajectory.decode(b).meta.trajectory_id for b in blobs]
            version += 1
            continue
        if straggler and version == ETA and ray.get(buffer.stats.remote()).admission.running == GROUP:
            # pacing: the open straggler held admission back, so the producers wait and the learner at version
            # eta cannot fill a batch without it; it arrives now and is trained on, not thrown away
            push_all(buffer, straggler, timeout_s=10)
            straggler = []
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        if len(done) == len(runs) and not straggler:
            break
        time.sleep(0.002)
    # drain what is left, one group at a time
    while (blobs := ray.get(buffer.sample.remote(GROUP, version))) is not None:
        sampled += [Trajectory.decode(b).meta.trajectory_id for b in blobs]
    assert ray.get(buffer.sample.remote(GROUP, version + ETA + 1)) is None

    pushed = [tid for ids in ray.get(runs) for tid in ids] + [f"late/{m}" for m in range(GROUP)]
    stats = ray.get(buffer.stats.remote())
    assert len(sampled) == len(set(sampled)) and set(sampled) <= set(pushed)
    assert len(pushed) == stats.pushed == len(sampled) + stats.evicted_total + stats.size
    assert stats.size == 0
    assert stats.evicted[EVICT_STALE] == 0 and all(f"late/{m}" in sampled for m in range(GROUP))
    assert max(stats.staleness_histogram) <= ETA
    assert stats.admission.running == 0
    assert stats.admission.accepted - stats.admission.evicted == len(sampled)
    assert stats.rejected == stats.admission.rejected == 6  # groups 4 and 9 of three producers
    for p in producers:
        ray.kill(p)
    ray.kill(buffer)


def test_backpressure_through_the_actor_and_a_packed_batch():
    buffer = create_buffer_actor(config(capacity_trajectories=8), pad_id=0)
    assert all(ray.get(buffer.try_start.remote(GROUP, 0, f"g{g}", "p")) == GROUP for g in range(3))
    blobs = [episode(f"g{g}", m, 0) for g in range(3) for m in range(GROUP)]
    first = ray.get(buffer.push_many.remote(blobs))
    assert (first.accepted, first.full) == (8, True)
    batch = ray.get(buffer.sample_batch.remote(0))
    assert isinstance(batch, TrainBatch) and batch.input_ids.shape == (8, 10)
    assert batch.group_index.tolist() == [0] * 4 + [1] * 4
    assert first.rest(blobs) == blobs[8:]  # g2's members: no room for a third group
    assert push_all(buffer, first.rest(blobs), poll_s=0.005, timeout_s=10) == 0
    assert ray.get(buffer.stats.remote()).size == 4
    ray.kill(buffer)


def test_sample_batch_waits_for_a_batch_while_the_actor_serves_other_calls():
    buffer = create_buffer_actor(config(), pad_id=0)
    t0 = time.monotonic()
    assert ray.get(buffer.sample_batch.remote(0, 0.5)) is None  # nothing to sample: None once the timeout is over
    assert time.monotonic() - t0 >= 0.5
    waiting = buffer.sample_batch.remote(0, 60.0)
    # served while sample_batch waits
    assert all(ray.get(buffer.try_start.remote(GROUP, 0, g, "p"), timeout=10) == GROUP for g in "ab")
    ray.get(buffer.push_many.remote([episode("a", m, 0) for m in range(GROUP)]), timeout=10)
    assert not ray.wait([waiting], timeout=0.5)[0]  # one group of the two: still waiting
    t1 = time.monotonic()
    ray.get(buffer.push_many.remote([episode("b", m, 0) for m in range(GROUP)]), timeout=10)
    batch = ray.get(waiting, timeout=30)
    assert isinstance(batch, TrainBatch) and batch.batch_size == BATCH and time.monotonic() - t1 < 10
    ray.kill(buffer)


def test_snapshot_round_trip_and_corrupt_snapshot_refused(tmp_path):
    buffer = create_buffer_actor(config(snapshot_dir=str(tmp_path)), pad_id=0)
    assert all(ray.get(buffer.try_start.remote(GROUP, 0, g, "p")) == GROUP for g in "ab")
    ray.get(buffer.push_many.remote([episode("a", m, 0) for m in range(GROUP)] + [episode("b", 0, 0)]))
    path = ray.get(buffer.snapshot.remote())
    assert path == str(tmp_path / "replay_buffer.snapshot")
    before = ray.get(buffer.stats.remote())
    ray.kill(buffer)

    resumed = create_buffer_actor(config(snapshot_dir=str(tmp_path)), pad_id=0)
    after = ray.get(resumed.restore.remote())
    def held(s: BufferStats) -> BufferStats:  # what the snapshot keeps
        return dataclasses.replace(s, admission=AdmissionStats(), oldest_age_s=0.0, incarnation="")

    # the 3 episodes of group "b" still running at snapshot time did not survive the restart: b is released short
    assert held(after) == held(dataclasses.replace(
        before, rejected=before.rejected + 3, groups_released_short=before.groups_released_short + 1,
        groups_completed=before.groups_completed + 1, groups_zero_variance=before.groups_zero_variance + 1,
        ready_groups=2, pending_groups=0))  # a group of one has no reward spread
    assert after.incarnation != before.incarnation
    assert after.admission == dataclasses.replace(before.admission, rejected=3, running=0)
    assert [Trajectory.decode(b).meta.trajectory_id for b in ray.get(resumed.sample.remote(GROUP, 0))] == [
        f"a/{m}" for m in range(GROUP)
    ]

    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"\xde\xad\xbe\xef")
    with pytest.raises(SnapshotError, match="checksum mismatch") as err:
        ray.get(resumed.restore.remote())
    assert path in str(err.value)
    ray.kill(resumed)
