"""Where a pretraining text's reading exercises and their answers are, in characters and in tokens."""

from __future__ import annotations

import pytest

from warm_start.exercises import exercises, token_span

pytestmark = pytest.mark.unit

TEXT = ('\n\n<information>Doc 1(Title: "Ann Lee") Ann Lee is a poet born in 1939 in Paris. Is she? yes</information>'
        "\n\nIn what year was Ann Lee born? 1939\nWhat is the occupation of Ann Lee? poet")


def test_only_the_lines_after_the_observation_are_exercises():
    found = exercises(TEXT)
    assert [e.question for e in found] == ["In what year was Ann Lee born", "What is the occupation of Ann Lee"]
    assert [TEXT[e.answer_start:e.answer_end] for e in found] == ["1939", "poet"]


def test_the_token_span_covers_every_token_that_touches_the_characters():
    offsets = [(0, 3), (3, 4), (4, 8), (8, 9)]  # "abc" "," "defg" "."
    assert token_span(offsets, 0, 3) == (0, 1)
    assert token_span(offsets, 5, 6) == (2, 3)  # inside one token
    assert token_span(offsets, 2, 5) == (0, 3)  # from the middle of one token into another
    assert token_span(offsets, 9, 12) == (4, 4)  # past the end: empty, at the end


def test_the_tiny_models_tokenizer_spans_the_answer_and_nothing_else(tok):
    from warm_start.exercises import encode_with_offsets

    ((ids, offsets),) = encode_with_offsets(tok, [TEXT])
    e = exercises(TEXT)[0]
    first, end = token_span(offsets, e.answer_start, e.answer_end)
    assert tok.decode(ids[first:end]).strip() == "1939"
