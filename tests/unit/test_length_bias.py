"""No length bias: the episodes trained on have the lengths of the episodes generated, though short ones finish first.

A heavy-tailed workload (response lengths Pareto-distributed, an episode's time proportional to its length: a
long, multi-search episode finishes last) runs through the real ``BufferActor`` (admission + replay buffer, no Ray)
on a simulated clock: one rollout actor with 32 episode slots whose engine reloads every published version, and a
learner that takes a batch as soon as one is ready. Serving in completion order and evicting by the oldest token
(the old design) dropped the groups with a long member; pacing admission and serving oldest-first must not.

Pacing alone makes the length distributions agree (everything admitted is consumed, none goes stale), so the test
also checks the serving order: no batch takes a group of a newer version while a whole group of an older one
waits. Completion order breaks that at eta 4 (1-4 batches of 60 in each of 8 seeds) and eta 8 (7-15); at eta 1
pacing rules it out (with the learner past version ``a`` at most ``eta * N`` groups are open, the old one
included, so a batch of ``N`` groups cannot pass it by) and at eta 2 this workload never shows it.
"""

from __future__ import annotations

import heapq
import random

import pytest

from async_agent_rl.config import BufferConfig
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from buffer.actor import BufferActor
from tests.helpers import LONGEST

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


def simulate(eta: int, seed: int, steps: int = 60) -> tuple[list[int], list[int], dict, list[str]]:
    """Returns the response lengths generated (arrived at the buffer) and consumed, the buffer's stats, and the
    batches served out of version order: a batch that took a group of version ``v`` while a whole group of an
    older version (a long member made it complete late) waited in the buffer."""
    rng = random.Random(seed)
    group, batch, slots = 4, 16, 32
    buf = BufferActor(BufferConfig(max_staleness=eta, capacity_trajectories=4096), group_size=group,
                      consumed_per_version=batch, max_concurrent=slots, batch_size=batch,
                      max_trajectory_tokens=LONGEST)
    now, version, running, learner_free_at, k = 0.0, 0, 0, 0.0, 0
    events: list[tuple[float, int, str, int, int, int]] = []  # (time, seq, group id, member, version, tokens)
    generated: list[int] = []
    consumed: list[int] = []
    arrived: dict[str, int] = {}  # group id -> members pushed
    complete: dict[str, int] = {}  # whole groups not yet served -> their version
    out_of_order: list[str] = []
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
                trajs = [Trajectory.decode(b) for b in got]
                consumed += [len(t.response_ids) for t in trajs]
                served = {t.meta.group_id: t.min_version for t in trajs}
                for gid in served:
                    complete.pop(gid, None)
                if complete and max(served.values()) > min(complete.values()):
                    out_of_order.append(f"batch {version}: served versions {sorted(set(served.values()))} while "
                                        f"whole groups of version {min(complete.values())} waited")
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
            arrived[gid] = arrived.get(gid, 0) + 1
            if arrived[gid] == group:
                complete[gid] = v
    return generated, consumed, buf.stats(), out_of_order


@pytest.mark.parametrize("eta", [0, 1, 2, 4, 8])
def test_trained_on_lengths_match_generated_lengths_under_a_heavy_tail(eta):
    generated, consumed, stats, out_of_order = simulate(eta, seed=eta)
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
    # the lengths above match whatever the serving order (pacing consumes everything in the end); the order is what
    # keeps a group with a long member from waiting behind newer ones: served by version, never by completion
    assert out_of_order == [], f"eta {eta}: {len(out_of_order)} batches out of version order, e.g. {out_of_order[0]}"
