"""The rollout worker's scheduling, driven by a scripted engine with varied latencies against a REAL retrieval
server: asynchronous mode has no barrier (episodes overlap across turns and groups), sync mode runs waves in
lockstep (Search-R1's loop), and both deliver every episode."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from actors.engine import TurnOutput, TurnRequest
from actors.rollout_worker import RolloutWorker
from actors.search_client import SearchClient
from async_agent_rl.config import SearchClientConfig
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode import EpisodeRunner
from async_agent_rl.episode_settings import EpisodeSettings

pytestmark = pytest.mark.integration


class TimedEngine:
    """Episode ``i`` (known by its prompt) searches ``i % 3`` times, then answers. Each generation sleeps a
    random 1-15 ms; every call is logged as (episode, turn, start, end)."""

    def __init__(self, tok, prompts: dict[tuple[int, ...], int]):
        self.tok, self.prompts, self.version = tok, prompts, 0
        self.log: list[tuple[int, int, float, float]] = []
        self.rng = random.Random(0)

    async def generate(self, req: TurnRequest) -> TurnOutput:
        key = next(k for k in self.prompts if tuple(req.prompt_ids[: len(k)]) == k)
        ep = self.prompts[key]
        turn = self.tok.decode(req.prompt_ids[len(key):]).count("</information>")  # searches so far
        t0 = time.monotonic()
        await asyncio.sleep(self.rng.uniform(0.001, 0.015))
        self.log.append((ep, turn, t0, time.monotonic()))
        text = "<search> Alpha </search>" if turn < ep % 3 else "<answer> x </answer>"
        ids = self.tok.encode(text, add_special_tokens=False)
        return TurnOutput(ids, [-0.5] * len(ids), [0] * len(ids), text, "stop")


def run_worker(server, tok, mode: str, groups: int, group_size: int, concurrent: int):
    settings = EpisodeSettings(max_turns=4, max_tokens_per_turn=32, max_response_length=512, max_obs_length=64,
                               max_model_len=1024, prompt_template="minimal")  # fmt: skip
    examples = [QAExample(id=f"q{i}", question=f"question number {i} ?", gold_answers=["x"]) for i in range(groups)]

    async def go():
        async with SearchClient(server.url, SearchClientConfig(timeout_s=2, retries=0, deadline_s=3)) as sc:
            probe = EpisodeRunner(None, sc, tok, settings)
            engine = TimedEngine(tok, {tuple(probe.prompt_ids_for(ex)): i for i, ex in enumerate(examples)})
            out = []

            async def sink(batch):
                out.extend(batch)

            worker = RolloutWorker(EpisodeRunner(engine, sc, tok, settings), iter(examples), sink,
                                   group_size=group_size, max_concurrent=concurrent, seed=None, mode=mode)
            stats = await worker.run(num_groups=groups)
            return out, stats, engine.log

    return asyncio.run(go())


def test_sync_mode_runs_each_wave_turn_by_turn_in_lockstep(server, tok):
    out, stats, log = run_worker(server, tok, "sync", groups=6, group_size=2, concurrent=6)
    assert len(out) == 12 and stats.finished == 12 and stats.waves == 2
    waves = [[e for e in log if e[0] // 3 == w] for w in range(2)]  # groups 0-2 then 3-5 (3 groups of 2 per wave)
    # the second wave starts after every episode of the first has finished
    assert min(e[2] for e in waves[1]) >= max(e[3] for e in waves[0])
    for wave in waves:
        for turn in range(1, 3):
            # every turn-k generation of the wave starts after all its turn-(k-1) generations ended
            assert min(e[2] for e in wave if e[1] == turn) >= max(e[3] for e in wave if e[1] == turn - 1)


def test_async_mode_has_no_barrier_between_turns_or_groups(server, tok):
    out, stats, log = run_worker(server, tok, "async", groups=6, group_size=2, concurrent=6)
    assert len(out) == 12 and stats.finished == 12 and stats.waves == 0
    # an episode moves to its next turn while others are still generating their previous one ...
    assert any(a[1] == b[1] + 1 and a[2] < b[3] for a in log for b in log)
    # ... and a later group starts before an earlier one has finished (a freed slot is reused at once)
    first_done = min(max(e[3] for e in log if e[0] == ep) for ep in range(3))
    assert min(e[2] for e in log if e[0] >= 3) < max(e[3] for e in log if e[0] < 3)
    assert first_done < max(e[3] for e in log)


def test_bad_mode_is_refused(tok):
    with pytest.raises(ValueError, match="mode must be"):
        RolloutWorker(None, iter([]), None, group_size=1, max_concurrent=1, mode="lockstep")
