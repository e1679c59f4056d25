"""The per-relation reading check of a pretrained warm start (``warm_start.reading``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from warm_start.reading import _encode, reading_items, reading_scores

pytestmark = pytest.mark.unit


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
