"""No length bias: the episodes trained on have the lengths of the episodes generated, though short ones finish first.

A heavy-tailed workload (response lengths Pareto-distributed, an episode's time proportional to its length: a
long, multi-search episode finishes last) runs through the real ``BufferActor`` (admission + replay buffer, no Ray)
on a simulated clock: one rollout actor with 32 episode slots whose engine reloads every published version, and a
learner that takes a batch as soon as one is ready. Serving in completion order and evicting by the oldest token
(the old design) dropped the groups with a long member; pacing admission and serving oldest-first must not.
"""

from __future__ import annotations

import heapq
import random

import pytest

from async_agent_rl.config import BufferConfig
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from buffer.actor import BufferActor

pytestmark = pytest.mark.unit

BUCKETS = (64, 128, 256, 512)  # response-token bucket bounds
TOLERANCE = 0.02  # total variation distance between the generated and the consumed length distributions
# measured with the old design (completion order, eviction of stale groups), eta 1/2/4: TV 0.042/0.050/0.049, long
# episodes (>= 256 tokens) trained on at 0.40/0.38/0.24 of their generated share; with pacing: TV 0.000, 1.00


def _bucket(n: int) -> int:
    return sum(n >= b for b in BUCKETS)


def _tv(a: list[int], b: list[int]) -> float:
    pa = [sum(_bucket(x) == k for x in a) / len(a) for k in range(len(BUCKETS) + 1)]
    pb = [sum(_bucket(x) == k for x in b) / len(b) for k in range(len(BUCKETS) + 1)]
    return 0.5 * sum(abs(x - y) for x, y in zip(pa, pb))


def _blob(gid: str, member: int, version: int, tokens: int) -> bytes:
    return Trajectory(
        prompt_ids=[1, 2], response_ids=[3] * tokens, loss_mask=[1] * tokens, behavior_logprobs=[-0.5] * tokens,
        versions=[version] * tokens, turns=[TurnSpan("model", 0, tokens)], reward=float(member % 2),
        meta=EpisodeMeta(group_id=gid, trajectory_id=f"{gid}/{member}", num_turns=1 + tokens // 128),
    ).encode()


def simulate(eta: int, seed: int, steps: int = 60) -> tuple[list[int], list[int], dict]:
    """Returns the response lengths generated (arrived at the buffer) and consumed, and the buffer's stats."""
    rng = random.Random(seed)
    group, batch, slots = 4, 16, 32
    buf = BufferActor(BufferConfig(max_staleness=eta, capacity_trajectories=4096), group_size=group,
                      consumed_per_version=batch, max_concurrent=slots, batch_size=batch)
    now, version, running, learner_free_at, k = 0.0, 0, 0, 0.0, 0
    events: list[tuple[float, int, str, int, int, int]] = []  # (time, seq, group id, member, version, tokens)
    generated: list[int] = []
    consumed: list[int] = []
    while version < steps and now < 10_000:
        while running + group <= slots:  # the actor fills its free slots with whole groups
            k += 1
            gid = f"g{k}"
            if buf.try_start(group, version, gid, "actor0") == 0:
                break
            running += group
            for m in range(group):
                tokens = min(1000, int(24 * rng.paretovariate(1.1)))
                heapq.heappush(events, (now + 0.01 * tokens, rng.random(), gid, m, version, tokens))
        if now >= learner_free_at:
            got = buf.sample(batch, version)
            if got is not None:
                consumed += [len(Trajectory.decode(b).response_ids) for b in got]
                version += 1  # published at once; the engine reloads before its next admission
                learner_free_at = now + 0.5
        if not events:
            now = max(now, learner_free_at)
            continue
        now = max(now, min(events[0][0], learner_free_at)) if now < learner_free_at else events[0][0]
        while events and events[0][0] <= now:
            _, _, gid, m, v, tokens = heapq.heappop(events)
            running -= 1
            generated.append(tokens)
            buf.push_many([_blob(gid, m, v, tokens)])
    return generated, consumed, buf.stats()


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_trained_on_lengths_match_generated_lengths_under_a_heavy_tail(eta):
    generated, consumed, stats = simulate(eta, seed=eta)
    assert len(consumed) >= 60 * 16 * 0.95  # the run went on: short groups aside, 60 batches of 16
    share_long = sum(n >= 256 for n in generated) / len(generated)
    assert share_long > 0.05, "the workload must have a real tail"
    tv = _tv(generated, consumed)
    assert tv <= TOLERANCE, (f"eta {eta}: consumed lengths differ from generated ones by {tv:.3f} (TV); "
                             f"evicted {stats.evicted}")
    long_generated = sum(n >= 256 for n in generated) / len(generated)
    long_consumed = sum(n >= 256 for n in consumed) / len(consumed)
    assert 0.8 <= long_consumed / long_generated <= 1.25, (long_generated, long_consumed)
    assert stats.evicted["stale"] == 0
