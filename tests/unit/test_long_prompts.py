"""Bad inputs: over-long prompts are skipped and counted per example (never aborting an evaluation), and a
failure that repeats every episode is logged as a few lines with counts, not one traceback per episode. (The
"no training prompt fits" error of a real run is in tests/integration/test_bad_inputs_run.py.)"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from async_agent_rl.episode import EpisodeRunner, PromptTooLongError
from actors.rollout_worker import RolloutWorker
from actors.stack import score_episodes
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode_settings import EpisodeSettings

pytestmark = pytest.mark.unit


def settings(max_prompt_length: int) -> EpisodeSettings:
    return EpisodeSettings(max_turns=2, max_tokens_per_turn=16, max_response_length=64, max_obs_length=16,
                           max_model_len=1024, prompt_template="minimal", max_prompt_length=max_prompt_length)  # fmt: skip


def test_split_by_prompt_length_counts_the_long_ones_in_one_line(tok, caplog):
    short = [QAExample(id=f"s{i}", question=f"Who is {i}?", gold_answers=["x"]) for i in range(3)]
    long = [QAExample(id=f"l{i}", question="word " * 400, gold_answers=["x"]) for i in range(2)]
    runner = EpisodeRunner(None, None, tok, settings(128))
    with caplog.at_level(logging.WARNING):
        fitting, too_long = runner.split_by_prompt_length([short[0], long[0], *short[1:], long[1]])
    assert [e.id for e in fitting] == ["s0", "s1", "s2"] and [e.id for e in too_long] == ["l0", "l1"]
    lines = [r.getMessage() for r in caplog.records if r.name == "async_agent_rl.episode"]
    assert len(lines) == 1 and lines[0].startswith("skipping 2 of 5 prompts longer than data.max_prompt_length=128")
    assert score_episodes([], tok, skipped_too_long=2) == {}  # nothing scored: the caller reports it as an error


class FailingRunner:
    """Fails every episode: odd questions with an over-long prompt, even ones with an engine error."""

    def __init__(self):
        self.engine = SimpleNamespace(version=0)

    async def run(self, ex, group_id="", trajectory_id="", seed=None):
        await asyncio.sleep(0)
        if int(ex.id[1:]) % 2:
            raise PromptTooLongError(f"question {ex.id}: prompt has 900 tokens, data.max_prompt_length is 256")
        raise RuntimeError("engine core died")


def test_repeated_episode_failures_are_counted_by_kind_in_a_few_lines(caplog):
    examples = [QAExample(id=f"q{i}", question="q", gold_answers=["x"]) for i in range(200)]
    lost = []

    async def sink(batch):
        raise AssertionError("no episode finishes")

    async def on_lost(group_ids):
        lost.extend(group_ids)

    worker = RolloutWorker(FailingRunner(), iter(examples), sink, group_size=1, max_concurrent=8, seed=None,
                           on_lost=on_lost)  # fmt: skip
    # the log thinning under a long run of failures; that such a run stops the worker (a dead engine) is
    # tests/unit/test_rollout_failures.py's
    worker.failures_in_a_row_limit = 10**9
    with caplog.at_level(logging.WARNING, logger="actors.rollout_worker"):
        stats = asyncio.run(worker.run(num_groups=200))
    assert stats.failed == 200 and len(lost) == 200
    assert stats.message().failures == {"PromptTooLongError": 100, "RuntimeError": 100}
    records = [r for r in caplog.records if r.name == "actors.rollout_worker"]
    # 1, 2, 4, ..., 64 of each kind: 7 lines each instead of 200 tracebacks; one traceback per kind
    assert len(records) == 14, [r.getMessage() for r in records]
    assert sum(r.exc_info is not None for r in records) == 2
    assert records[-1].getMessage().startswith("64 episode(s) failed with")
