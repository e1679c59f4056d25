"""The per-relation reading check of a pretrained warm start (``warm_start.reading``)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from warm_start.reading import _encode, reading_items, reading_scores

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


class Predicts:
    """A stand-in language model: ``next(ids) -> token id`` at every position, as logits."""

    def __init__(self, vocab: int, next_token):
        self.vocab, self.next_token, self.training = vocab, next_token, False

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self

    def __call__(self, input_ids):
        b, n = input_ids.shape
        logits = torch.zeros(b, n, self.vocab)
        for r in range(b):
            for t in range(n):
                logits[r, t, self.next_token(input_ids[r], t)] = 1.0
        return SimpleNamespace(logits=logits)


def test_every_relation_is_asked_after_a_passage_that_shows_the_answer(world_dir):
    items = reading_items(world_dir / "world.json", seed=0, per_relation=5)
    relations = {it.relation for it in items}
    assert {"birth_year", "occupation", "birth_city", "employer", "country"} <= relations
    assert all(sum(it.relation == r for it in items) == 5 for r in relations)
    for it in items:  # the answer is in the observation the question follows (a shuffled copy's value)
        shown, question = it.context.rsplit("\n", 1)
        assert it.answer in shown and question.endswith("?")
    assert items == reading_items(world_dir / "world.json", seed=0, per_relation=5)


def test_reading_is_scored_on_exactly_the_answer_tokens(world_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    items = reading_items(world_dir / "world.json", seed=0, per_relation=3)
    vocab = len(tok)
    # a model that always predicts the true next token reads everything
    oracle = Predicts(vocab, lambda ids, t: int(ids[t + 1]) if t + 1 < len(ids) else 0)
    assert reading_scores(oracle, tok, items, batch_size=4)["all"] == 1.0
    # one that is right everywhere except the answer's first token reads nothing
    starts = {tuple(ids): s for ids, s in (_encode(tok, it) for it in items)}

    def all_but_answer(ids, t):
        n = next(s for k, s in starts.items() if list(k) == ids[: len(k)].tolist() and len(k) <= len(ids))
        return 0 if t == n - 1 else (int(ids[t + 1]) if t + 1 < len(ids) else 0)

    scores = reading_scores(Predicts(vocab, all_but_answer), tok, items, batch_size=4)
    assert scores["all"] == 0.0 and set(scores) >= {"birth_year", "occupation"}

    # nor one wrong only on the answer's last token (a year's last digit)
    def all_but_last(ids, t):
        n = next(len(k) for k in starts if list(k) == ids[: len(k)].tolist())
        return 0 if t == n - 2 else (int(ids[t + 1]) if t + 1 < len(ids) else 0)

    assert reading_scores(Predicts(vocab, all_but_last), tok, items, batch_size=4)["all"] == 0.0


def test_the_scored_tokens_are_the_answer_and_nothing_else(world_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for it in reading_items(world_dir / "world.json", seed=1, per_relation=3):
        ids, start = _encode(tok, it)
        assert tok.decode(ids[start:]).strip() == it.answer, it
        assert tok.decode(ids[:start]).rstrip().endswith("?")


# ---- reading in the episodes' own format (sft.reading_target) ------------------------------------------------------


@pytest.fixture(scope="module")
def episode_setup(world_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    from async_agent_rl.config import load_config
    from async_agent_rl.data.search_r1 import read_qa_parquet
    from tests.helpers import world_overrides

    cfg = load_config(REPO / "configs/quickstart.yaml", world_overrides(world_dir, tiny_model_dir))
    return cfg, AutoTokenizer.from_pretrained(tiny_model_dir), read_qa_parquet(world_dir / "train.parquet")


def test_the_episode_check_asks_every_relation_of_a_shuffled_copy_in_thorough_episodes(episode_setup, world_dir):
    from async_agent_rl.data.world import questions_about, read_entities
    from warm_start.reading import episode_reading_demos

    cfg, tok, train = episode_setup
    demos = episode_reading_demos(cfg, tok, train, seed=0, per_relation=6)
    relations = {d.meta.extra["relation"] for d in demos}
    assert {"birth_year", "occupation", "birth_city", "country", "birth_country", "employer_hq"} <= relations
    assert all(d.meta.extra["behaviour"] == "thorough" for d in demos)
    assert all(len(d.meta.extra["queries"]) == d.meta.extra["hops"] for d in demos)  # the second hop is taken
    train_subjects = {ex.extra["subject"] for ex in train}
    assert all(d.meta.extra["queries"][0] in train_subjects for d in demos)
    # the answers are the shuffled copy's, not the world's: a memorized answer is wrong in most of them
    world = read_entities(world_dir / "world.json")
    true = {(q.subject, q.relation): q.answers[0] for e in world.values()
            for q in questions_about(e, world, random.Random(0), 1.0)}
    same = [d.meta.extra["answer"] == true.get((d.meta.extra["queries"][0], d.meta.extra["relation"])) for d in demos]
    assert sum(same) < 0.3 * len(same), sum(same)


def test_episode_reading_is_scored_on_the_final_answer_tokens_only(episode_setup):
    from warm_start.demos import value_tokens
    from warm_start.reading import episode_reading_demos, episode_reading_scores

    cfg, tok, train = episode_setup
    demos = episode_reading_demos(cfg, tok, train, seed=1, per_relation=2)
    vocab = len(tok)
    full = {tuple(list(d.prompt_ids) + list(d.response_ids)): d for d in demos}

    def demo_of(ids):
        return next(d for k, d in full.items() if list(k) == ids[: len(k)].tolist())

    def oracle(ids, t):
        return int(ids[t + 1]) if t + 1 < len(ids) else 0

    assert episode_reading_scores(Predicts(vocab, oracle), tok, demos, batch_size=4)["all"] == 1.0

    def answer_at(ids):
        d = demo_of(ids)
        return [len(d.prompt_ids) + k for k in value_tokens(tok, d, d.turns[-1], d.meta.extra["answer"])]

    def wrong_on_last_answer_token(ids, t):
        return 0 if t == answer_at(ids)[-1] - 1 else oracle(ids, t)

    def wrong_on_the_first_query(ids, t):  # a turn before the answer: not what is scored
        d = demo_of(ids)
        return 0 if t == len(d.prompt_ids) + d.turns[0].start else oracle(ids, t)

    scores = episode_reading_scores(Predicts(vocab, wrong_on_last_answer_token), tok, demos, batch_size=4)
    assert scores["all"] == 0.0 and {"birth_year", "occupation"} <= set(scores)
    assert episode_reading_scores(Predicts(vocab, wrong_on_the_first_query), tok, demos, batch_size=4)["all"] == 1.0
    for d in demos:  # the scored tokens spell the answer
        at = value_tokens(tok, d, d.turns[-1], d.meta.extra["answer"])
        assert tok.decode([d.response_ids[k] for k in at]).strip() == d.meta.extra["answer"]


def test_reading_rounds_train_the_relations_below_the_target_until_none_is(episode_setup, monkeypatch):
    """The loop of ``read_every_relation`` (its check and its training stood in for): a relation below the target
    gets half of the next round's episodes, a round follows every check with one below it, and the rounds stop when
    none is below or when ``sft.reading_max_rounds`` are used up."""
    import warm_start.reading as reading
    import warm_start.sft as sft

    cfg, tok, train = episode_setup
    cfg = cfg.model_copy(deep=True)
    cfg.sft.reading_target, cfg.sft.reading_round_steps, cfg.sft.reading_max_rounds = 0.9, 4, 3
    checks = iter([{"birth_year": 0.1, "occupation": 0.5, "employer": 1.0},
                   {"birth_year": 0.95, "occupation": 0.6, "employer": 1.0},
                   {"birth_year": 0.95, "occupation": 0.92, "employer": 0.97}])
    monkeypatch.setattr(reading, "episode_reading_demos", lambda *a, **k: [])
    monkeypatch.setattr(reading, "episode_reading_scores", lambda *a, **k: {**(s := next(checks)),
                                                                          "all": sum(s.values()) / len(s)})
    trained = []
    monkeypatch.setattr(sft, "train_on_demos", lambda model, demos, plan, *a, **k: (
        trained.append(([d.meta.extra["relation"] for d in demos], len(plan))) or ([0.0], 0, 0)))
    records = []
    rounds = sft.read_every_relation(cfg, None, tok, 0, records.append, progress=False)
    assert [r["below"] for r in rounds] == [["birth_year", "occupation"], ["occupation"], []]
    assert [r["steps"] for r in rounds] == [4, 4, 0] and [n for _, n in trained] == [4, 4]
    first, second = (rels for rels, _ in trained)
    assert len(first) == len(second) == 4 * cfg.sft.batch_size
    assert sum(r in ("birth_year", "occupation") for r in first) >= len(first) // 2
    assert sum(r == "occupation" for r in second) >= len(second) // 2
    assert {"employer", "country"} & set(second)  # the other half: every relation, so what is read is kept

    checks = iter([{"birth_year": 0.1, "all": 0.1}] * 3)
    cfg.sft.reading_max_rounds = 2
    trained.clear()
    rounds = sft.read_every_relation(cfg, None, tok, 0, records.append, progress=False)
    assert [r["below"] for r in rounds] == [["birth_year"]] * 3 and len(trained) == 2  # rounds used up
