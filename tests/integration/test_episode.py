"""The episode loop's bookkeeping, driven by a scripted engine (the engine is the loop's collaborator here; the
real vLLM engine runs the same loop in tests/integration/test_rollout_vllm.py) against a REAL retrieval server."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from actors.engine import TurnOutput, TurnRequest
from async_agent_rl.episode import (
    INVALID_ACTION_OBSERVATION,
    EmptyEpisodeError,
    EpisodeRunner,
    parse_action,
)
from actors.rollout_worker import RolloutWorker
from actors.search_client import SearchClient
from actors.stack import score_episodes
from async_agent_rl.config import SearchClientConfig
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.render import INFORMATION_CLOSE

pytestmark = pytest.mark.integration


class ScriptedEngine:
    """Returns the given turn texts in order, tokenized; records every request it got."""

    def __init__(self, tokenizer, turns: list[str], version: int = 3):
        self.tok, self.turns, self.version, self.requests = tokenizer, list(turns), version, []

    async def generate(self, req: TurnRequest) -> TurnOutput:
        self.requests.append(req)
        text = self.turns.pop(0)
        ids = self.tok.encode(text, add_special_tokens=False)[: req.max_tokens]
        text = self.tok.decode(ids, skip_special_tokens=True)
        return TurnOutput(ids, [-0.5] * len(ids), [self.version] * len(ids), text, "stop")


@pytest.fixture(scope="module")
def person(world_dir):
    table = json.loads((world_dir / "world.json").read_text())
    name, attrs = next((n, a) for n, a in table.items() if a["kind"] == "person")
    return name, attrs


def settings(**kw) -> EpisodeSettings:
    base = dict(max_turns=4, max_tokens_per_turn=64, max_response_length=512, max_obs_length=200,
                max_model_len=1024, prompt_template="minimal")  # fmt: skip
    return EpisodeSettings(**{**base, **kw})


async def _episode(url, tok, turns, ex, **kw):
    async with SearchClient(url, SearchClientConfig(timeout_s=2, retries=0, deadline_s=3)) as sc:
        engine = ScriptedEngine(tok, turns)
        traj = await EpisodeRunner(engine, sc, tok, settings(**kw)).run(ex, group_id="g", trajectory_id="t")
        return traj, engine


def test_parse_action_takes_the_first_tag():
    assert parse_action("x <search> a </search> <answer> b </answer>") == ("search", "a")
    assert parse_action("<answer>\nb\n</answer>") == ("answer", "b")
    assert parse_action("no tags </search>") == (None, "")


def test_search_then_answer_lines_up_tokens_mask_and_turns(server, tok, person):
    name, attrs = person
    ex = QAExample(id="q", question=f"In which city was {name} born?", gold_answers=[attrs["birth_city"]])
    turns = [f"<search> {name} </search>", f"<answer> {attrs['birth_city']} </answer>"]
    traj, engine = asyncio.run(_episode(server.url, tok, turns, ex))
    kinds = [t.kind for t in traj.turns]
    assert kinds == ["model", "observation", "model"]
    obs = traj.turns[1]
    # the observation is exactly the rendered real hits, tokenized on its own, loss 0, no version
    assert traj.response_ids[obs.start : obs.end][-len(tok.encode(INFORMATION_CLOSE, add_special_tokens=False)):] == \
        tok.encode(INFORMATION_CLOSE, add_special_tokens=False)
    obs_text = tok.decode(traj.response_ids[obs.start : obs.end])
    assert obs_text.startswith("\n\n<information>Doc 1(Title: \"" + name + "\")")
    assert traj.loss_mask[obs.start : obs.end] == [0] * obs.length
    assert set(traj.versions[obs.start : obs.end]) == {-1}
    for span in (traj.turns[0], traj.turns[2]):
        assert traj.loss_mask[span.start : span.end] == [1] * span.length
        assert set(traj.versions[span.start : span.end]) == {3}
    # the second turn was generated from prompt + everything so far, token for token
    assert engine.requests[1].prompt_ids == traj.prompt_ids + traj.response_ids[: traj.turns[2].start]
    assert traj.reward == 1.0 and traj.meta.finish_reason == "answer" and traj.meta.num_searches == 1


def test_invalid_action_gets_search_r1_observation(server, tok, person):
    ex = QAExample(id="q", question="?", gold_answers=["x"])
    traj, _ = asyncio.run(_episode(server.url, tok, ["I am not sure", "<answer> y </answer>"], ex))
    obs = traj.turns[1]
    assert tok.decode(traj.response_ids[obs.start : obs.end]) == INVALID_ACTION_OBSERVATION
    assert traj.reward == 0.0


def test_max_turns_ends_on_a_model_turn(server, tok, person):
    name, _ = person
    ex = QAExample(id="q", question="?", gold_answers=["x"])
    traj, _ = asyncio.run(_episode(server.url, tok, [f"<search> {name} </search>"] * 3, ex, max_turns=3))
    assert [t.kind for t in traj.turns] == ["model", "observation", "model", "observation", "model"]
    assert traj.meta.finish_reason == "max_turns" and traj.loss_mask[-1] == 1


def test_response_budget_never_leaves_a_trailing_observation(server, tok, person):
    name, _ = person
    ex = QAExample(id="q", question="?", gold_answers=["x"])
    traj, _ = asyncio.run(_episode(server.url, tok, [f"<search> {name} </search>"] * 4, ex, max_response_length=60))
    assert traj.turns[-1].kind == "model" and traj.meta.finish_reason == "response_budget"
    assert len(traj.response_ids) <= 60


def test_per_turn_cap_and_budget_reach_the_engine(server, tok):
    ex = QAExample(id="q", question="?", gold_answers=["x"])
    _, engine = asyncio.run(_episode(server.url, tok, ["a b c"] * 4, ex, max_tokens_per_turn=5))
    assert all(r.max_tokens <= 5 for r in engine.requests)


def test_long_observation_is_truncated_keeping_closing_tag(server, tok, person):
    name, _ = person
    ex = QAExample(id="q", question="?", gold_answers=["x"])
    traj, _ = asyncio.run(_episode(server.url, tok, [f"<search> {name} </search>", "<answer> x </answer>"], ex,
                                   max_obs_length=20))
    obs = traj.turns[1]
    assert obs.length == 20
    assert tok.decode(traj.response_ids[obs.start : obs.end]).endswith("</information>\n\n")


def test_dead_retriever_gives_masked_error_observation_not_a_crash(tok, person):
    name, _ = person
    ex = QAExample(id="q", question="?", gold_answers=["x"])
    # a port nothing listens on: connection refused on loopback
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    traj, _ = asyncio.run(_episode(f"http://127.0.0.1:{port}", tok, [f"<search> {name} </search>", "<answer> x </answer>"], ex))
    obs = traj.turns[1]
    assert "Search failed (connection)" in tok.decode(traj.response_ids[obs.start : obs.end])
    assert traj.meta.num_search_errors == 1 and traj.loss_mask[obs.start : obs.end] == [0] * obs.length
    assert traj.reward == 1.0  # the episode went on to its answer


def test_overlong_prompt_is_refused_with_a_clear_error(server, tok):
    from async_agent_rl.episode import PromptTooLongError

    ex = QAExample(id="long", question="word " * 400, gold_answers=["x"])
    with pytest.raises(PromptTooLongError, match="question long: prompt has"):
        asyncio.run(_episode(server.url, tok, ["<answer> x </answer>"], ex, max_prompt_length=64))


@pytest.mark.parametrize("topk", [1, 3, 5])
def test_topk_switch_sets_the_passages_per_observation(server, tok, person, topk):
    """``retriever.topk`` (Search-R1's top-k study) reaches the episode through the client: k documents. The query
    is a city, which many passages mention (a person's name matches one passage only)."""
    city = person[1]["birth_city"]
    ex = QAExample(id="q", question="?", gold_answers=["x"])

    async def go():
        async with SearchClient(server.url, SearchClientConfig(timeout_s=2, retries=0, deadline_s=3), topk=topk) as sc:
            engine = ScriptedEngine(tok, [f"<search> {city} </search>", "<answer> x </answer>"])
            return await EpisodeRunner(engine, sc, tok, settings(max_obs_length=400)).run(ex, group_id="g")

    traj = asyncio.run(go())
    obs = tok.decode(traj.response_ids[traj.turns[1].start : traj.turns[1].end])
    assert f"Doc {topk}(Title:" in obs and f"Doc {topk + 1}(Title:" not in obs


def test_chat_template_switch_gives_an_instruct_or_a_plain_prompt(server, tok):
    """``data.apply_chat_template`` (instruct vs base study): the chat-formatted prompt or the bare instruction."""
    ex = QAExample(id="q", question="Who founded Zeishou Works?", gold_answers=["x"])
    chat = tok.decode(EpisodeRunner(None, None, tok, settings(apply_chat_template=True)).prompt_ids_for(ex))
    plain = tok.decode(EpisodeRunner(None, None, tok, settings(apply_chat_template=False)).prompt_ids_for(ex))
    assert chat.startswith("<|im_start|>user") and chat.rstrip().endswith("<|im_start|>assistant")
    assert "<|im_start|>" not in plain and "Who founded Zeishou Works?" in plain
    assert plain.strip() in chat


class PassageSearch:
    """A search tool returning one fixed passage (the episode loop is the caller under test here)."""

    def __init__(self, contents: str):
        self.contents = contents

    async def search(self, query):
        return [SimpleNamespace(contents=self.contents)]


async def _episode_with(search, tok, turns, ex, **kw):
    return await EpisodeRunner(ScriptedEngine(tok, turns), search, tok, settings(**kw)).run(ex, group_id="g")


SCORES = [("exact_match", 1.0), ("f1", 1.0), ("substring_match", 1.0)]


def test_an_invalid_turn_that_never_answers_scores_nothing(server, tok):
    """The invalid-action observation names ``<answer> and </answer>``: it is not the model's answer."""
    ex = QAExample(id="q", question="?", gold_answers=["Trinidad and Tobago"])
    traj, _ = asyncio.run(_episode(server.url, tok, ["I am not sure", "still not sure"], ex, max_turns=2,
                                   reward_terms=SCORES))
    assert [t.kind for t in traj.turns] == ["model", "observation", "model"]
    assert traj.reward_components == {"exact_match": 0.0, "f1": 0.0, "substring_match": 0.0}
    assert score_episodes([traj], tok)["all"]["f1"] == 0.0  # evaluation reads the same view


def test_an_answer_tag_inside_an_observation_is_not_the_models_answer(tok):
    ex = QAExample(id="q", question="?", gold_answers=["Zolgon"])
    search = PassageSearch('"Zolgon"\nSome say <answer> Zolgon </answer> is the place.')
    traj = asyncio.run(_episode_with(search, tok, ["<search> where </search>", "<think> hmm </think>"], ex,
                                     max_turns=2, reward_terms=SCORES + [("retrieval_hit", 1.0)]))
    assert [t.kind for t in traj.turns] == ["model", "observation", "model"]
    assert traj.reward_components == {"exact_match": 0.0, "f1": 0.0, "substring_match": 0.0, "retrieval_hit": 1.0}
    scores = score_episodes([traj], tok)["all"]
    assert scores["exact_match"] == 0.0 and scores["f1"] == 0.0


def test_retrieval_hit_only_credits_passages_the_model_saw(tok):
    """The search returns the gold, but its observation does not fit the response budget and is dropped."""
    ex = QAExample(id="q", question="?", gold_answers=["Zolgon"])
    search = PassageSearch('"Zolgon"\nZolgon is a city ' + "with many streets " * 10)
    traj = asyncio.run(_episode_with(search, tok, ["<search> where </search>"], ex, max_response_length=24,
                                     reward_terms=[("retrieval_hit", 1.0)]))
    assert [t.kind for t in traj.turns] == ["model"] and traj.meta.finish_reason == "response_budget"
    assert traj.reward_components == {"retrieval_hit": 0.0}


@pytest.mark.parametrize("case", ["no_context", "abort"])
def test_an_episode_without_a_model_token_fails_and_is_never_pushed(server, tok, case):
    """A prompt that fills the context, or an abort before the first token: the worker counts it failed and
    reports it lost; nothing reaches the sink (the learner cannot train on a trajectory without an action)."""
    ex = QAExample(id="q", question="In which city?", gold_answers=["x"])

    class AbortingEngine(ScriptedEngine):
        async def generate(self, req):
            self.requests.append(req)
            return TurnOutput([], [], [], "", "abort")

    async def go():
        async with SearchClient(server.url, SearchClientConfig(timeout_s=2, retries=0, deadline_s=3)) as sc:
            probe = EpisodeRunner(None, sc, tok, settings())
            n_prompt = len(probe.prompt_ids_for(ex))
            kw = {"max_model_len": n_prompt} if case == "no_context" else {}
            engine = (ScriptedEngine if case == "no_context" else AbortingEngine)(tok, ["<answer> x </answer>"])
            runner = EpisodeRunner(engine, sc, tok, settings(**kw))
            with pytest.raises(EmptyEpisodeError):
                await runner.run(ex)
            pushed, lost = [], []

            async def sink(batch):
                pushed.extend(batch)

            async def on_lost(gids):
                lost.extend(gids)

            worker = RolloutWorker(runner, iter([ex] * 4), sink, group_size=2, max_concurrent=4, on_lost=on_lost)
            stats = await worker.run(num_groups=1)
            return pushed, lost, stats

    pushed, lost, stats = asyncio.run(go())
    assert pushed == [] and stats.failed == 2 and stats.finished == 0 and len(lost) == 2
