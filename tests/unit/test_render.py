"""Search-R1 observation rendering and closing-tag-preserving truncation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from async_agent_rl.data.corpus import Passage
from async_agent_rl.search import Hit
from async_agent_rl.render import (
    INFORMATION_CLOSE,
    INFORMATION_OPEN,
    render_information,
    render_passages,
    truncate_observation,
)

pytestmark = pytest.mark.unit


def search_r1_observation(contents: list[str]) -> str:
    """Search-R1's rendering, restated from its code: title = first line, text = the other lines joined by \\n."""
    reference = ""
    for idx, content in enumerate(contents):
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        reference += f"Doc {idx + 1}(Title: {title}) {text}\n"
    return f"\n\n<information>{reference.strip()}</information>\n\n"


def test_two_hits_render_exactly():
    hits = [
        Hit("7", '"Ada Lovelace"\nAda Lovelace was an English mathematician.', 12.5),
        Hit("9", '"Analytical Engine"\nA proposed mechanical computer.', 3.0),
    ]
    assert render_information(hits) == (
        "\n\n<information>"
        'Doc 1(Title: "Ada Lovelace") Ada Lovelace was an English mathematician.\n'
        'Doc 2(Title: "Analytical Engine") A proposed mechanical computer.'
        "</information>\n\n"
    )


def test_zero_hits_render_an_empty_block():
    assert render_information([]) == "\n\n<information></information>\n\n"
    assert render_passages([]) == ""


@pytest.mark.parametrize(
    "contents",
    [
        ['"Multi-line"\nfirst paragraph\nsecond paragraph', '"Title only"'],
        ['"Trailing"\ntext ends with a newline\n', "\nno title at all"],
        ['"Ünïcödé \\"quoted\\" title"\nText with <tags> & symbols.', '""\n', ""],
        ['"Spaces"\n   leading spaces   ', '  "indented title"  \nbody'],
    ],
)
def test_rendering_matches_search_r1_on_unusual_passages(contents):
    hits = [Hit(str(i), c, 1.0) for i, c in enumerate(contents)]
    assert render_information(hits) == search_r1_observation(contents)
    # Passages (the corpus type) render the same way as hits.
    assert render_information([Passage(str(i), c) for i, c in enumerate(contents)]) == render_information(hits)


@given(st.lists(st.text(alphabet=st.characters(codec="utf-8"), max_size=40), max_size=6))
def test_rendering_matches_search_r1_on_random_passages(contents):
    hits = [Hit(str(i), c, 0.0) for i, c in enumerate(contents)]
    assert render_information(hits) == search_r1_observation(contents)


def test_block_starts_and_ends_with_the_tags():
    text = render_information([Hit("1", '"T"\nbody', 1.0)])
    assert text.startswith(INFORMATION_OPEN) and text.endswith(INFORMATION_CLOSE)


CLOSE = [901, 902, 903]  # stands for the tokens of "</information>\n\n"


def test_short_observation_is_unchanged():
    ids = [1, 2, 3] + CLOSE
    out = truncate_observation(ids, 6, CLOSE)
    assert out == ids and out is not ids


def test_long_observation_keeps_its_head_and_closing_tag():
    ids = list(range(100)) + CLOSE
    out = truncate_observation(ids, 10, CLOSE)
    assert out == list(range(7)) + CLOSE


def test_observation_not_ending_with_the_closing_ids_still_gets_them():
    # Tokenizing the whole block can merge the tag with what precedes it; the tag is still appended.
    ids = list(range(50))
    assert truncate_observation(ids, 8, CLOSE) == list(range(5)) + CLOSE


def test_budget_exactly_the_closing_tag():
    assert truncate_observation(list(range(20)) + CLOSE, 3, CLOSE) == CLOSE


def test_budget_smaller_than_the_closing_tag_is_an_error():
    with pytest.raises(ValueError, match="closing-tag"):
        truncate_observation(list(range(20)), 2, CLOSE)


@given(
    body=st.lists(st.integers(0, 50), max_size=60),
    closing=st.lists(st.integers(900, 910), min_size=1, max_size=4),
    ends_with_closing=st.booleans(),
    budget_extra=st.integers(0, 40),
)
def test_truncation_contract(body, closing, ends_with_closing, budget_extra):
    ids = body + closing if ends_with_closing else body
    max_len = len(closing) + budget_extra
    out = truncate_observation(ids, max_len, closing)
    if len(ids) <= max_len:
        assert out == ids
    else:
        assert len(out) == max_len
        assert out[len(out) - len(closing) :] == closing
        assert out[: max_len - len(closing)] == ids[: max_len - len(closing)]
