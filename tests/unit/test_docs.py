"""The docs hold together: every ``benchmarks/results/...`` path that README.md, benchmarks/RESULTS.md, the dated
notes in benchmarks/history/ and docs/*.md name exists in the repo; every relative markdown link in them resolves
to a file or folder, and a link with a ``#anchor`` to a heading of its target (GitHub's slugs); README.md stays a
front page (at most 8,000 characters) and RESULTS.md current results (at most 40,000); each index lists its
folder's documents. Read from the files alone, nothing imported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
README_MAX_CHARS = 8_000
RESULTS_MAX_CHARS = 40_000
HISTORY = REPO / "benchmarks" / "history"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
RESULTS_PATH = re.compile(r"benchmarks/results/[^\s`'\")\]|,;]*")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
# A mention standing for many paths (a glob, a placeholder, a shell brace list) names no one path to check.
PATTERN_CHARS = ("*", "<", ">", "{", "}", "?", "[", "$")


def doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "benchmarks" / "RESULTS.md"]
    files += sorted(HISTORY.glob("*.md")) + sorted((REPO / "docs").glob("*.md"))
    return [f for f in files if f.is_file()]


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def without_code(text: str) -> str:
    """The text with fenced blocks and code spans blanked out (links inside code are not links)."""
    text = FENCE.sub("", text)
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, every character that is not a letter, digit,
    space, ``-`` or ``_`` dropped, spaces turned into ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags render as nothing
    text = text.lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, repeated headings numbered as GitHub does (``x``, ``x-1``, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(text: str) -> list[str]:
    prose = without_code(text)
    return [m.group(1) for m in INLINE_LINK.finditer(prose)] + [m.group(1) for m in REFERENCE_DEF.finditer(prose)]


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in links(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto: ...: not a file of this repo
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{rel(path)}: link {target!r}: no such file {file_part!r}")
            continue
        if anchor:
            if dest.suffix != ".md" or not dest.is_file():
                problems.append(f"{rel(path)}: link {target!r}: an anchor into a file that is not markdown")
            elif anchor not in anchors(dest):
                problems.append(f"{rel(path)}: link {target!r}: {rel(dest)} has no heading with anchor #{anchor}")
    return problems


def results_paths(text: str) -> list[str]:
    """Every ``benchmarks/results/...`` path the text names (prose, code spans, links, code blocks), trailing
    punctuation off; mentions standing for many paths (``*``, ``<...>``, ``{a,b}``, ``$VAR``) left out."""
    out = []
    for match in RESULTS_PATH.finditer(text):
        path = match.group(0).rstrip(".:")
        if any(c in path for c in PATTERN_CHARS):
            continue
        out.append(path)
    return out


def test_the_documents_checked_are_there():
    names = {rel(f) for f in doc_files()}
    assert {"README.md", "benchmarks/RESULTS.md", "docs/README.md", "benchmarks/history/README.md"} <= names
    assert len([n for n in names if n.startswith("benchmarks/history/")]) > 1, "no dated note in benchmarks/history/"


def test_every_results_path_named_exists():
    missing = [f"{rel(f)}: {p}" for f in doc_files() for p in results_paths(f.read_text(encoding="utf-8"))
               if not (REPO / p).exists()]
    assert not missing, "benchmarks/results/ paths named but not in the repo:\n" + "\n".join(missing)


def test_every_relative_link_resolves():
    problems = [p for f in doc_files() for p in broken_links(f)]
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page_and_results_current_results():
    readme = len((REPO / "README.md").read_bytes())  # bytes (never fewer than characters), as `wc -c` counts
    results = len((REPO / "benchmarks" / "RESULTS.md").read_bytes())
    assert readme <= README_MAX_CHARS, f"README.md is {readme:,} characters, more than {README_MAX_CHARS:,}"
    assert results <= RESULTS_MAX_CHARS, f"benchmarks/RESULTS.md is {results:,} characters, more than {RESULTS_MAX_CHARS:,}"


def test_history_notes_are_dated_and_indexed():
    notes = sorted(p for p in HISTORY.glob("*.md") if p.name != "README.md")
    assert notes, "no dated note in benchmarks/history/"
    bad = [p.name for p in notes if not re.fullmatch(r"\d{4}-\d{2}-\d{2}_[a-z0-9-]+\.md", p.name)]
    assert not bad, f"history notes not named YYYY-MM-DD_topic.md: {bad}"
    index = set(links((HISTORY / "README.md").read_text(encoding="utf-8")))
    unlisted = [p.name for p in notes if p.name not in {t.partition("#")[0] for t in index}]
    assert not unlisted, f"history notes missing from benchmarks/history/README.md: {unlisted}"


def test_docs_index_lists_every_document():
    index = {t.partition("#")[0] for t in links((REPO / "docs" / "README.md").read_text(encoding="utf-8"))}
    unlisted = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.name != "README.md" and p.name not in index]
    assert not unlisted, f"documents missing from docs/README.md: {unlisted}"


@pytest.mark.parametrize(("heading", "anchor"), [
    ("The main job's time", "the-main-jobs-time"),
    ("Running `bench`", "running-bench"),
    ("Learning: RL against its warm start and against more SFT for the same time",
     "learning-rl-against-its-warm-start-and-against-more-sft-for-the-same-time"),
    ("Weight sync: object store against collective broadcast, by model size",
     "weight-sync-object-store-against-collective-broadcast-by-model-size"),
    ("GPU machines and Search-R1's assets", "gpu-machines-and-search-r1s-assets"),
    ("Async against sync (measured 2026-11-25, commit 1a8eaa6)", "async-against-sync-measured-2026-11-25-commit-1a8eaa6"),
])
def test_slug_follows_github(heading, anchor):
    assert slug(heading) == anchor


def test_the_checks_find_what_they_look_for(tmp_path):
    """The checkers on a made-up document: a missing file, a missing anchor, a link inside code (ignored), a
    results path in a code span and a glob-like one (skipped)."""
    (tmp_path / "other.md").write_text("# A heading\n\ntext\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text("# Top\n\n[ok](other.md#a-heading) [self](#top) [gone](missing.md) [bad](other.md#nope)\n"
                   "`[in code](missing2.md)`\n\n```\n[fenced](missing3.md)\n```\n\n[r]: other.md\n[s]: nowhere.md\n"
                   "files in `benchmarks/results/q3h8/` and benchmarks/results/main_job/<date>_<commit>/ and "
                   "`benchmarks/results/*/report.md`.\n", encoding="utf-8")
    problems = broken_links(doc)
    assert len(problems) == 3, problems
    assert any("missing.md" in p for p in problems) and any("#nope" in p for p in problems)
    assert any("nowhere.md" in p for p in problems)
    assert results_paths(doc.read_text(encoding="utf-8")) == ["benchmarks/results/q3h8/"]
