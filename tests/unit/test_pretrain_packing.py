"""How pretraining cuts its batches (``sft.pretrain_packing``): whole texts as rows, right-padded."""

from __future__ import annotations

from collections import Counter

import pytest

from warm_start.sft import padded_rows, pretrain_rows

pytestmark = pytest.mark.unit


def test_whole_text_rows_show_every_text_once_per_pass_in_a_seeded_order():
    texts = [[1, 2, 3]] * 10
    steps = list(pretrain_rows(texts, steps=5, batch_size=4, seed=7))  # 20 rows: two passes over 10 texts
    assert all(len(r) == 4 for r in steps)
    flat = [i for r in steps for i in r]
    assert Counter(flat[:10]) == Counter(range(10)) and Counter(flat[10:]) == Counter(range(10))
    assert steps == list(pretrain_rows(texts, steps=5, batch_size=4, seed=7))
    assert steps != list(pretrain_rows(texts, steps=5, batch_size=4, seed=8))


def test_a_batch_larger_than_the_texts_draws_from_several_passes():
    rows = list(pretrain_rows([[1, 2]] * 3, steps=2, batch_size=5, seed=0))
    assert [len(r) for r in rows] == [5, 5] and set(i for r in rows for i in r) == {0, 1, 2}


def test_padding_is_never_a_target_and_every_real_next_token_is():
    x, targets, w = padded_rows([[5, 6, 7, 8], [9, 10]], pad_id=0)
    assert x.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert targets.tolist() == [[6, 7, 8], [10, -100, -100]]
    assert w.tolist() == [[1, 1, 1], [1, 0, 0]]
    # a target's weight is that of the token it predicts
    _, _, w = padded_rows([[5, 6, 7, 8], [9, 10]], pad_id=0, weights=[[1, 1, 4, 4], [1, 4]])
    assert w.tolist() == [[1, 4, 4], [4, 0, 0]]


def test_only_the_reading_exercises_answers_are_weighted():
    from warm_start.sft import answer_weights

    text = ('\n\n<information>Doc 1(Title: "Ann Lee") Ann Lee is a poet born in 1939 in Paris.</information>\n\n'
            "\nIn what year was Ann Lee born? 1939\nWhat is the occupation of Ann Lee? poet")
    (w,) = answer_weights([text], [[(i, i + 1) for i in range(len(text))]], 5.0)  # one token per character
    weighted = "".join(ch for ch, x in zip(text, w) if x == 5.0)
    assert weighted == "1939poet"  # the answers only: not the year and occupation the passage shows


def test_no_text_is_an_error_not_an_endless_loop():
    with pytest.raises(ValueError, match="at least one text"):
        next(pretrain_rows([], steps=1, batch_size=2, seed=0))


def test_an_answer_weight_without_whole_texts_is_a_config_error():
    from async_agent_rl.config import ConfigError, load_config

    for without in (["sft.pretrain_questions=true"], ["sft.pretrain_packing=texts"]):  # windows; no exercises
        with pytest.raises(ConfigError, match="pretrain_answer_weight needs pretrain_packing: texts and "):
            load_config(None, ["sft.pretrain_answer_weight=4", *without])
    ok = ["sft.pretrain_answer_weight=4", "sft.pretrain_packing=texts", "sft.pretrain_questions=true"]
    assert load_config(None, ok).sft.pretrain_answer_weight == 4


def test_progress_counts_the_texts_tokens_not_the_padding(tok, tiny_model_dir):
    """With whole texts as rows a batch is padded to its longest text; the progress line's token count (and so its
    tokens/s) counts the texts' own tokens."""
    from transformers import AutoModelForCausalLM

    from warm_start.sft import encode_texts, pretrain_on_texts

    texts = ["a short one", "a text that is quite a bit longer than the short one, by many tokens"]
    lengths = [len(ids) for ids in encode_texts(tok, texts)]
    assert lengths[0] < lengths[1]

    class Seen:
        tokens = 0

        def update(self, step, tokens=0, loss=None):
            self.tokens = tokens

    seen = Seen()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    pretrain_on_texts(model, tok, texts, steps=3, batch_size=2, lr=1e-4, warmup_steps=0, seed=0, packing="texts",
                      progress=seen)
    assert seen.tokens == 3 * sum(lengths)  # every step holds both texts once; padded it would be 3 * 2 * max
