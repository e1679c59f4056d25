"""Bad inputs (the corpus half): a reused index is refused when any passage of its corpus changed, not only
the first or last; duplicate passage ids are rejected and empty passages warned about."""

from __future__ import annotations

import json
import logging

import pytest

from async_agent_rl.data.corpus import CorpusError, Passage, read_corpus, write_corpus
from retriever.backends import BM25Backend, IndexMismatchError, open_backend

pytestmark = pytest.mark.unit


def passages(n: int = 50) -> list[Passage]:
    return [Passage(id=str(i), contents=f'"Title {i}"\nword{i} shared text about item {i}') for i in range(n)]


def test_an_index_is_refused_when_a_middle_passage_changed(tmp_path):
    corpus = passages()
    open_backend("bm25", corpus, tmp_path / "idx")  # builds and saves
    BM25Backend.load(tmp_path / "idx", corpus)  # the same corpus: fine
    changed = list(corpus)
    changed[25] = Passage(id="25", contents='"Title 25"\nsomething else entirely')
    with pytest.raises(IndexMismatchError, match="another corpus"):
        BM25Backend.load(tmp_path / "idx", changed)
    swapped = list(corpus)
    swapped[10], swapped[11] = swapped[11], swapped[10]  # reordered: hit ids would point at the wrong rows
    with pytest.raises(IndexMismatchError):
        open_backend("bm25", swapped, tmp_path / "idx")


def test_an_index_of_the_old_format_is_refused(tmp_path):
    corpus = passages()
    open_backend("bm25", corpus, tmp_path / "idx")
    meta = tmp_path / "idx" / "retriever_index.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 1}))
    with pytest.raises(IndexMismatchError, match="format 1"):
        BM25Backend.load(tmp_path / "idx", corpus)


def test_duplicate_ids_are_rejected_or_skipped_and_counted(tmp_path):
    rows = [*passages(3), Passage(id="1", contents='"Again"\ndup')]
    write_corpus(tmp_path / "c.jsonl", rows)
    with pytest.raises(CorpusError, match=r"c.jsonl:4: .*duplicate passage id '1' \(first on line 2\)"):
        read_corpus(tmp_path / "c.jsonl")
    kept = read_corpus(tmp_path / "c.jsonl", on_bad_row="skip")
    assert [p.id for p in kept] == ["0", "1", "2"] and kept.skipped_lines == [4]


def test_empty_passages_are_warned_about_once(tmp_path, caplog):
    write_corpus(tmp_path / "c.jsonl", [*passages(3), Passage(id="e1", contents=""), Passage(id="e2", contents=" ")])
    with caplog.at_level(logging.WARNING):
        assert len(read_corpus(tmp_path / "c.jsonl")) == 5
    warned = [r.getMessage() for r in caplog.records if "empty contents" in r.getMessage()]
    assert warned == [f"{tmp_path / 'c.jsonl'}: 2 passage(s) with empty contents (they can never be retrieved)"]
