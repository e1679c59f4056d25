"""The wiki-18 corpus format: parsing, bad rows, round trips, and the Wikipedia-summary importer."""

from __future__ import annotations

import json
import logging

import pytest

from async_agent_rl.data.corpus import (
    CorpusError,
    Passage,
    import_wiki_offline,
    iter_corpus,
    read_corpus,
    wiki_offline_data_file,
    write_corpus,
)

pytestmark = pytest.mark.unit


def write_lines(path, lines: list[str | bytes]) -> None:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))


def test_title_and_text_split_on_the_first_newline_keeping_quotes():
    p = Passage("3", '"Paris"\nParis is the capital.\nIt is in France.')
    assert p.title == '"Paris"'
    assert p.text == "Paris is the capital.\nIt is in France."
    assert Passage("4", '"Title only"').text == ""


def test_write_then_read_round_trips(tmp_path):
    passages = [Passage("0", '"Zürich"\nA city — in Switzerland.'), Passage("1", '"B"\nline one\nline two')]
    path = tmp_path / "sub" / "corpus.jsonl"
    assert write_corpus(path, passages) == 2
    assert read_corpus(path) == passages
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert first == {"id": "0", "contents": '"Zürich"\nA city — in Switzerland.'}


def test_blank_lines_are_not_rows_and_integer_ids_become_strings(tmp_path):
    path = tmp_path / "c.jsonl"
    write_lines(path, ['{"id": 5, "contents": "\\"T\\"\\nx"}', "", "   ", '{"id": "6", "contents": "\\"U\\""}'])
    corpus = read_corpus(path)
    assert [p.id for p in corpus] == ["5", "6"]
    assert corpus.skipped_lines == []


BAD_ROWS = [
    ("{not json", "not JSON"),
    ('["a", "b"]', "expected a JSON object"),
    ('{"id": "1"}', "missing key(s) contents"),
    ('{"contents": "x"}', "missing key(s) id"),
    ('{"id": true, "contents": "x"}', "'id' must be a string"),
    ('{"id": "1", "contents": 7}', "'contents' must be a string"),
    (b'{"id": "1", "contents": "\xff"}', "not UTF-8"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_row_is_an_error_naming_file_and_line(tmp_path, row, message):
    path = tmp_path / "corpus.jsonl"
    write_lines(path, ['{"id": "0", "contents": "\\"A\\"\\nok"}', "", row])
    with pytest.raises(CorpusError) as e:
        read_corpus(path)
    assert f"{path}:3:" in str(e.value)
    assert message in str(e.value)


def test_skip_mode_counts_and_logs_every_bad_row(tmp_path, caplog):
    path = tmp_path / "corpus.jsonl"
    good = ['{"id": "0", "contents": "\\"A\\"\\nok"}', '{"id": "1", "contents": "\\"B\\"\\nok"}']
    write_lines(path, [good[0], BAD_ROWS[0][0], good[1], BAD_ROWS[2][0]])
    with caplog.at_level(logging.WARNING, logger="async_agent_rl.data.corpus"):
        corpus = read_corpus(path, on_bad_row="skip")
    assert [p.id for p in corpus] == ["0", "1"]
    assert corpus.skipped_lines == [2, 4] and corpus.num_skipped == 2
    logged = caplog.text
    assert f"{path}:2" in logged and f"{path}:4" in logged and "skipped 2 bad row(s)" in logged


def test_iter_corpus_streams_and_reports_skips(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_lines(path, ['{"id": "0", "contents": "x"}', "oops"])
    skipped: list[int] = []
    assert [p.id for p in iter_corpus(path, "skip", skipped)] == ["0"]
    assert skipped == [2]


def test_missing_file_and_bad_mode(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        read_corpus(tmp_path / "nope.jsonl")
    (tmp_path / "c.jsonl").write_text("")
    with pytest.raises(ValueError, match="on_bad_row"):
        read_corpus(tmp_path / "c.jsonl", on_bad_row="ignore")


def test_import_wiki_offline_writes_the_corpus_format(tmp_path):
    out = tmp_path / "wiki.jsonl"
    assert import_wiki_offline(out, limit=50) == 50
    corpus = read_corpus(out)
    assert [p.id for p in corpus] == [str(i) for i in range(50)]
    source = json.loads(wiki_offline_data_file().read_text(encoding="utf-8"))
    first = next(iter(source.values()))
    assert corpus[0].contents == f'"{first["title"]}"\n{first["extract"].strip()}'
    assert corpus[0].title == f'"{first["title"]}"'
    assert all(p.title.startswith('"') and p.title.endswith('"') and p.text for p in corpus)


def test_import_wiki_offline_full_corpus(tmp_path):
    out = tmp_path / "wiki.jsonl"
    n = import_wiki_offline(out)
    assert n == len(read_corpus(out)) >= 10_000
