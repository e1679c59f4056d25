"""The model's text, as the episode's rewards read it, is the decoding of the model's tokens.

vLLM cuts its output TEXT at the end of a stop string but keeps every sampled TOKEN: with a real BPE a stop string
often ends inside a token (Qwen: ``</search>\\n\\n`` ends with the one token ``>\\n\\n``, ``</answer>.`` with ``>.``),
so the text vLLM returns is shorter than what the tokens (trained on, and read by the next turn) say. Rewards read
from that text disagreed with the trajectory's own tokens (and with evaluation, which decodes them).
"""

from __future__ import annotations

import asyncio

import pytest

from actors.stack import model_text
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode import EpisodeRunner, TurnOutput, TurnRequest
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.prompts import STOP_STRINGS
from async_agent_rl.rewards import compute_rewards

pytestmark = pytest.mark.unit


class StopCuttingEngine:
    """Returns ``text``'s tokens and, as vLLM's detokenizer does, text cut right after the first stop string."""

    version = 0

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        end = min(text.find(s) + len(s) for s in STOP_STRINGS if s in text)
        self.text = text[:end]

    async def generate(self, req: TurnRequest) -> TurnOutput:
        return TurnOutput(self.ids, [-1.0] * len(self.ids), [0] * len(self.ids), self.text, "stop", "</answer>")


class NoSearch:
    async def search(self, query):
        raise AssertionError("no search in this episode")


def test_rewards_read_the_models_tokens_when_a_stop_string_ends_inside_a_token(qwen_tokenizer):
    tok = qwen_tokenizer
    said = "<think> easy </think>\n<answer> Paris </answer>."
    assert tok.decode(tok.encode(said, add_special_tokens=False)[-1:]) == ">."  # the stop string ends mid-token
    terms = [("search_r1_em", 1.0)]
    s = EpisodeSettings(max_turns=2, max_tokens_per_turn=32, max_response_length=64, max_obs_length=64,
                        max_model_len=512, reward_terms=terms, prompt_template="minimal")
    ex = QAExample(id="q", question="Capital of France?", gold_answers=["Paris"])
    traj = asyncio.run(EpisodeRunner(StopCuttingEngine(tok, said), NoSearch(), tok, s).run(ex))
    assert model_text(traj, tok) == said
    # text after </answer> breaks Search-R1's format: correct but invalid scores 0.8 (the cut text scored 1.0)
    assert traj.reward == compute_rewards(terms, model_text(traj, tok), ex.gold_answers)[0] == 0.8
