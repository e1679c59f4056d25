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
    x, targets = padded_rows([[5, 6, 7, 8], [9, 10]], pad_id=0)
    assert x.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert targets.tolist() == [[6, 7, 8], [10, -100, -100]]


def test_no_text_is_an_error_not_an_endless_loop():
    with pytest.raises(ValueError, match="at least one text"):
        next(pretrain_rows([], steps=1, batch_size=2, seed=0))
