"""Demonstration episodes have exactly a rollout's token structure, real BM25 observations, and correct answers.

Demonstrations are made by the rollouts' own ``EpisodeRunner``; the replay test below checks that independently:
another scripted engine and an uncached search rebuild every demonstration token for token."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from async_agent_rl.config import load_config
from async_agent_rl.data.corpus import read_corpus
from async_agent_rl.data.search_r1 import read_qa_parquet
from async_agent_rl.episode import EpisodeRunner, TurnOutput, TurnRequest, parse_action
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.records import OBS_VERSION
from async_agent_rl.render import INFORMATION_CLOSE, render_information, truncate_observation
from async_agent_rl.rewards import exact_match, is_valid_format
from warm_start.demos import (
    DEMO_VERSION,
    DemoError,
    DemoExpert,
    DemoReport,
    make_demonstrations,
    shuffled_world_observations,
)
from retriever.backends import BM25Backend
from tests.helpers import world_overrides

pytestmark = pytest.mark.unit

N = 120


@pytest.fixture(scope="module")
def setup(world_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    cfg = load_config(
        None,
        [
            *world_overrides(world_dir, tiny_model_dir),
            "rollout.max_turns=4",
            "rollout.max_tokens_per_turn=48",
            "rollout.max_response_length=384",
            "rollout.max_obs_length=160",
        ],
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    train = read_qa_parquet(world_dir / "train.parquet")
    test = read_qa_parquet(world_dir / "test.parquet")
    backend = BM25Backend.build(read_corpus(world_dir / "corpus.jsonl"))
    report = DemoReport()
    demos = make_demonstrations(cfg, tok, train, backend, N, seed=0, report=report)
    return cfg, tok, train, test, backend, demos, report


class ReplayEngine:
    """A scripted policy: emits the given model turns (token ids) in order, as an engine would return them."""

    version = 0

    def __init__(self, tokenizer, turns: list[list[int]]):
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate(self, req: TurnRequest) -> TurnOutput:
        ids = self.turns.pop(0)
        assert len(ids) <= req.max_tokens, "a demo turn exceeds the rollout's token budget for that turn"
        return TurnOutput(ids, [0.0] * len(ids), [0] * len(ids), self.tokenizer.decode(ids), "stop")


class BackendSearch:
    def __init__(self, backend, topk):
        self.backend, self.topk = backend, topk

    async def search(self, query):
        return self.backend.search([query], self.topk)[0]


def model_turn_ids(t):
    return [t.response_ids[s.start : s.end] for s in t.turns if s.kind == "model"]


def test_demos_replay_identically_through_the_rollout_loop(setup):
    """The real EpisodeRunner, fed the demo's model turns and real BM25 search, rebuilds the demo token for token."""
    cfg, tok, train, _, backend, demos, _ = setup
    by_id = {ex.id: ex for ex in train}
    settings = EpisodeSettings.from_config(cfg)
    hops = set()
    for d in demos[:40]:
        ex = by_id[d.meta.question_id]
        search = BackendSearch(backend, cfg.retriever.topk)
        runner = EpisodeRunner(ReplayEngine(tok, model_turn_ids(d)), search, tok, settings)
        got = asyncio.run(runner.run(ex))
        assert got.prompt_ids == d.prompt_ids
        assert got.response_ids == d.response_ids
        assert got.loss_mask == d.loss_mask
        assert got.turns == d.turns
        assert got.meta.num_searches == d.meta.num_searches and got.meta.num_turns == d.meta.num_turns
        assert d.versions == [DEMO_VERSION if m else OBS_VERSION for m in d.loss_mask]
        assert d.behavior_logprobs == [0.0] * len(d.response_ids)
        assert got.meta.finish_reason == "answer" and got.reward == d.reward == 1.0
        hops.add(d.meta.extra["hops"])
    assert hops == {1, 2}, "the sample should hold both single-hop and bridge demonstrations"


def test_mask_is_one_exactly_on_model_turns_and_observations_are_real_bm25(setup):
    cfg, tok, _, _, backend, demos, _ = setup
    closing = tok.encode(INFORMATION_CLOSE, add_special_tokens=False)
    for d in demos:
        assert d.turns[0].kind == "model" and d.turns[-1].kind == "model"
        assert [s.kind for s in d.turns] == ["model", "observation"] * d.meta.num_searches + ["model"]
        query = None
        for s in d.turns:
            ids = d.response_ids[s.start : s.end]
            if s.kind == "model":
                assert d.loss_mask[s.start : s.end] == [1] * len(ids)
                text = tok.decode(ids)
                # tokenized on its own; ends at the stop string, no EOS
                assert tok.encode(text, add_special_tokens=False) == ids
                assert text.endswith(("</search>", "</answer>")) and tok.eos_token_id not in ids
                assert len(ids) <= cfg.rollout.max_tokens_per_turn
                action, query = parse_action(text)
            else:
                assert d.loss_mask[s.start : s.end] == [0] * len(ids)
                hits = backend.search([query], cfg.retriever.topk)[0]
                want = tok.encode(render_information(hits), add_special_tokens=False)
                assert ids == truncate_observation(want, cfg.rollout.max_obs_length, closing)
        assert len(d.response_ids) <= cfg.rollout.max_response_length


def test_prompt_is_the_rollout_prompt(setup):
    cfg, tok, train, _, backend, demos, _ = setup
    by_id = {ex.id: ex for ex in train}
    from async_agent_rl.prompts import prompt_ids, render_question_prompt

    for d in demos[:20]:
        msg = render_question_prompt(by_id[d.meta.question_id].question, "minimal")
        assert d.prompt_ids == prompt_ids(tok, [{"role": "user", "content": msg}], True)


def test_expert_searches_subject_then_bridge_and_answers_correctly(setup):
    _, tok, train, _, _, demos, report = setup
    by_id = {ex.id: ex for ex in train}
    for d in demos:
        ex = by_id[d.meta.question_id]
        turns = [tok.decode(ids) for ids in model_turn_ids(d)]
        searches = [parse_action(t)[1] for t in turns[:-1]]
        want = [ex.extra["subject"]] + ([ex.extra["bridge"]] if ex.extra["hops"] == 2 else [])
        assert searches == want
        assert parse_action(turns[-1])[0] == "answer"
        assert exact_match(turns[-1], ex.gold_answers) == 1.0
        assert turns[0].startswith("<think>")
        full = tok.decode(d.response_ids)
        assert is_valid_format(full)
        assert d.reward == 1.0 and d.meta.extra["demo"] is True
    assert report.made == len(demos) == N and report.single_hop + report.bridge == N and report.bridge > 0


def test_only_train_questions(setup):
    cfg, tok, train, test, backend, demos, _ = setup
    train_ids = {ex.id for ex in train}
    assert {d.meta.question_id for d in demos} <= train_ids
    with pytest.raises(ValueError, match="train questions only"):
        make_demonstrations(cfg, tok, train[:5] + test[:1], backend, 3)
    with pytest.raises(DemoError, match="test_question"):
        DemoExpert(cfg, tok, backend).demonstrate(test[0])


def test_unsurfaced_answer_is_a_counted_logged_demo_error(setup, caplog):
    cfg, tok, train, _, backend, _, _ = setup
    single = next(ex for ex in train if ex.extra["hops"] == 1)
    bridge = next(ex for ex in train if ex.extra["hops"] == 2)
    wrong = dataclasses.replace(single, id="bad-answer", gold_answers=["Nowhereland"])
    bad_bridge = dataclasses.replace(bridge, id="bad-bridge", extra={**bridge.extra, "bridge": "Nowhereland"})
    expert = DemoExpert(cfg, tok, backend)
    with pytest.raises(DemoError) as e:
        expert.demonstrate(wrong)
    assert e.value.reason == "answer_not_retrieved"
    with pytest.raises(DemoError) as e:
        expert.demonstrate(bad_bridge)
    assert e.value.reason == "bridge_not_retrieved"

    report = DemoReport()
    with caplog.at_level(logging.INFO, logger="warm_start.demos"):
        demos = make_demonstrations(cfg, tok, [wrong, bad_bridge, *train[:10]], backend, 10, report=report)
    assert len(demos) == 10 and {d.meta.question_id for d in demos}.isdisjoint({"bad-answer", "bad-bridge"})
    assert report.failed == {"answer_not_retrieved": 1, "bridge_not_retrieved": 1} and report.num_failed == 2
    assert "bad-answer" in caplog.text and "bad-bridge" in caplog.text


def test_budget_violations_are_demo_errors(setup):
    cfg, tok, train, _, backend, _, _ = setup
    tight = cfg.model_copy(deep=True)
    tight.rollout.max_tokens_per_turn = 6
    with pytest.raises(DemoError) as e:
        DemoExpert(tight, tok, backend).demonstrate(train[0])
    assert e.value.reason == "turn_too_long"
    short = cfg.model_copy(deep=True)
    short.rollout.max_response_length = 40
    with pytest.raises(DemoError) as e:
        DemoExpert(short, tok, backend).demonstrate(train[0])
    assert e.value.reason == "response_budget"
    few = cfg.model_copy(deep=True)
    few.rollout.max_turns = 1
    with pytest.raises(DemoError) as e:
        DemoExpert(few, tok, backend).demonstrate(train[0])
    assert e.value.reason == "too_many_turns"


def test_a_demonstration_can_be_made_inside_a_running_event_loop(setup):
    """The expert's episode never waits (scripted engine, in-process search), so it needs no event loop of its own."""
    cfg, tok, train, _, backend, _, _ = setup

    async def inside():
        return DemoExpert(cfg, tok, backend).demonstrate(train[0])

    got, want = asyncio.run(inside()), DemoExpert(cfg, tok, backend).demonstrate(train[0])
    assert got.response_ids == want.response_ids and got.turns == want.turns and got.reward == want.reward


def test_sampling_is_seeded_and_repeats_when_n_exceeds_questions(setup):
    cfg, tok, train, _, backend, _, _ = setup
    a = make_demonstrations(cfg, tok, train[:30], backend, 12, seed=1)
    b = make_demonstrations(cfg, tok, train[:30], backend, 12, seed=1)
    c = make_demonstrations(cfg, tok, train[:30], backend, 12, seed=2)
    ids = lambda ds: [d.meta.question_id for d in ds]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)
    many = make_demonstrations(cfg, tok, train[:5], backend, 12)
    assert len(many) == 12 and len(set(ids(many))) == 5
    assert len({d.meta.trajectory_id for d in many}) == 12


def test_shuffled_world_observations_use_every_name_and_teach_no_true_fact(world_dir):
    import json
    import re

    from async_agent_rl.data.world import Entity, describe

    table = json.loads((world_dir / "world.json").read_text())
    texts = shuffled_world_observations(world_dir / "world.json", copies=2, seed=0)
    assert texts == shuffled_world_observations(world_dir / "world.json", copies=2, seed=0)
    assert all(t.startswith("\n\n<information>Doc 1(Title: ") and t.endswith("</information>\n\n") for t in texts)
    doc = re.compile(r'Doc \d+\(Title: "(.*?)"\) (.*?)(?=\nDoc \d+\(|</information>)', re.S)
    docs = [d for t in texts for d in doc.findall(t)]
    assert len(docs) == 2 * len(table)
    assert {name for name, _ in docs} == set(table)  # every entity, test subjects included, appears
    truth = {n: describe(Entity(r["kind"], n, {k: v for k, v in r.items() if k != "kind"})) for n, r in table.items()}
    true_docs = sum(body == truth[name] for name, body in docs)
    assert true_docs <= 0.02 * len(docs)  # a full true description only by chance
    first, second = docs[: len(table)], docs[len(table) :]
    assert dict(first) != dict(second)  # every copy is shuffled anew


def test_pretraining_questions_are_answered_by_the_documents_just_above_them(world_dir):
    import re

    texts = shuffled_world_observations(world_dir / "world.json", copies=1, seed=0, questions=True)
    asked = 0
    for t in texts:
        block, _, tail = t.partition("</information>")
        lines = [x for x in tail.split("\n") if x.strip()]
        docs = re.findall(r'Doc \d+\(Title: "(.*?)"\)', block)
        assert 1 <= len(lines) <= len(docs)
        for line in lines:
            question, answer = line.rsplit("? ", 1)
            assert any(name in question for name in docs)  # about a document shown
            assert answer in block  # and answered by it (shuffled facts: only reading gets it)
            asked += 1
    assert asked >= len(texts)


def test_more_reading_exercises_per_document_ask_more_facts_and_one_per_document_stays_as_it_was(world_dir):
    """``sft.pretrain_questions_per_doc``: the default (1) gives the texts the warm starts of 457b8a3 were made from
    (same draws, so their warm starts stay valid); 4 asks up to four questions per document, none twice."""
    from warm_start.sft import SFT_DEFAULTS

    world = world_dir / "world.json"
    one = shuffled_world_observations(world, copies=1, seed=0, questions=True)
    assert shuffled_world_observations(world, copies=1, seed=0, questions=True, questions_per_doc=1) == one
    four = shuffled_world_observations(world, copies=1, seed=0, questions=True, questions_per_doc=4)
    asked = {n: sum(len(t.partition("</information>")[2].strip().splitlines()) for t in texts)
             for n, texts in ((1, one), (4, four))}
    assert asked[4] > 2.5 * asked[1]
    for t in four:
        lines = t.partition("</information>")[2].strip().splitlines()
        assert len(lines) == len(set(lines))
    assert ("pretrain_questions_per_doc", 1) in SFT_DEFAULTS  # the default names no warm start of its own


def test_without_guess_value_loss_a_guess_trains_the_decision_and_not_the_value(setup):
    """``sft.guess_value_loss: false``: in a guess demonstration exactly the tokens that spell the guessed value are
    out of the loss (the relation's one constant answer is not taught); the decision to answer at once, the tags and
    every other demonstration's tokens stay targets, and the sequences are the same as with the loss on."""
    from warm_start.demos import GUESS, THOROUGH, DemoExpert

    cfg, tok, train, _, backend, _, _ = setup
    on, off = cfg.model_copy(deep=True), cfg.model_copy(deep=True)
    on.sft.expert_search_prob = off.sft.expert_search_prob = 0.5
    off.sft.guess_value_loss = False
    experts = {}
    for name, c in (("on", on), ("off", off)):
        experts[name] = DemoExpert(c, tok, backend)
        experts[name].set_guesses(train)
    checked = 0
    for ex in train[:20]:
        g_on, g_off = (experts[n].demonstrate(ex, behaviour=GUESS) for n in ("on", "off"))
        assert g_on.response_ids == g_off.response_ids and all(g_on.loss_mask[t.start : t.end] for t in g_on.turns)
        last = g_off.turns[-1]
        ids, mask = g_off.response_ids[last.start : last.end], g_off.loss_mask[last.start : last.end]
        untrained = tok.decode([i for i, m in zip(ids, mask) if not m]).strip()
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        guess = experts["off"].guesses[ex.extra["relation"]]
        assert untrained == guess and guess not in trained and "<answer>" in trained and "</answer>" in trained
        assert sum(1 - m for m in g_off.loss_mask) == sum(1 - m for m in g_on.loss_mask) + len(ids) - sum(mask)
        t_on, t_off = (experts[n].demonstrate(ex, behaviour=THOROUGH) for n in ("on", "off"))
        assert t_on.loss_mask == t_off.loss_mask  # a read answer is a target either way
        checked += 1
    assert checked == 20


def test_an_imperfect_expert_mixes_guesses_and_one_hop_answers_independently_of_the_question(setup):
    """``sft.expert_search_prob`` / ``expert_second_hop_prob``: a share of the demonstrations answers without
    searching (the relation's most common answer) or stops a bridge question after one search (answering the bridge
    entity); these are wrong and rewarded 0, the thorough ones right and rewarded 1."""
    from warm_start.demos import GUESS, ONE_HOP, THOROUGH

    cfg, tok, train, _, backend, _, _ = setup
    mixed = cfg.model_copy(deep=True)
    mixed.sft.expert_search_prob = 0.5
    mixed.sft.expert_second_hop_prob = 0.5
    report = DemoReport()
    demos = make_demonstrations(mixed, tok, train, backend, 400, seed=3, report=report)
    by = {b: [d for d in demos if d.meta.extra["behaviour"] == b] for b in (THOROUGH, GUESS, ONE_HOP)}
    assert dict(report.behaviours) == {b: len(ds) for b, ds in by.items() if ds}
    assert 0.4 < len(by[GUESS]) / len(demos) < 0.6  # drawn per demonstration with the configured share
    bridges_searched = sum(d.meta.extra["hops"] == 2 for d in demos if d.meta.extra["behaviour"] != GUESS)
    assert 0.3 < len(by[ONE_HOP]) / bridges_searched < 0.7
    questions = {ex.id: ex for ex in train}
    for d in by[GUESS]:
        assert d.meta.num_searches == 0 and d.reward_components.get("exact_match", d.reward) <= 1.0
        text = tok.decode(d.response_ids)
        assert "<search>" not in text and "I know the answer" in text
    for d in by[ONE_HOP]:
        ex = questions[d.meta.question_id]
        assert d.meta.num_searches == 1 and ex.extra["hops"] == 2 and d.reward == 0.0
        assert f"<answer> {ex.extra['bridge']} </answer>" in tok.decode(d.response_ids)
    assert all(d.reward == 1.0 for d in by[THOROUGH])
    # the guess is the same for every question of a relation: nothing about the question picks it
    guesses: dict[str, set[str]] = {}
    for d in by[GUESS]:
        answer = tok.decode(d.response_ids).split("<answer>")[1].split("</answer>")[0].strip()
        guesses.setdefault(questions[d.meta.question_id].extra["relation"], set()).add(answer)
    assert guesses and all(len(g) == 1 for g in guesses.values())
    # the perfect expert (the defaults) never guesses
    assert all(d.meta.extra["behaviour"] == THOROUGH for d in make_demonstrations(cfg, tok, train, backend, 50))
