"""Every test file declares its tier: a module-level ``pytestmark`` with exactly one of the markers ``unit``,
``integration`` and ``slow`` (``bash scripts/test.sh`` deselects ``slow``; a file with no tier would run in the
fast tier whatever it costs). Read from the files' source with ``ast``, so nothing here imports a test module."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TIERS = ("unit", "integration", "slow")


def marks(node: ast.expr) -> list[str]:
    """The ``pytest.mark.<name>`` names in a ``pytestmark`` value (one mark, called or not, or a list/tuple)."""
    if isinstance(node, ast.List | ast.Tuple):
        return [m for elt in node.elts for m in marks(elt)]
    if isinstance(node, ast.Call):
        node = node.func
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"):
        return [node.attr]
    return []


def tiers_of(source: str) -> list[str]:
    """The tier markers a test module's source declares at module level."""
    found: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            found += [m for m in marks(node.value) if m in TIERS]
    return found


def tier_files() -> list[Path]:
    return sorted((REPO / "tests").rglob("test_*.py"))


def test_every_test_file_declares_exactly_one_tier():
    files = tier_files()
    assert len(files) > 50, files
    wrong = {str(f.relative_to(REPO)): tiers_of(f.read_text()) for f in files}
    wrong = {f: t for f, t in wrong.items() if len(t) != 1}
    assert not wrong, f"test files without exactly one tier marker {TIERS} in their module-level pytestmark: {wrong}"


def test_no_test_or_class_adds_a_second_tier():
    """A tier is the file's: a ``@pytest.mark.slow`` on one test of an integration file would give it two."""
    extra = []
    for f in tier_files():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                extra += [f"{f.name}::{node.name} @{m}" for d in node.decorator_list for m in marks(d) if m in TIERS]
    assert not extra, extra


def test_unit_tests_live_in_tests_unit():
    """tests/integration holds no unit-tier file (tests/unit may hold integration-tier ones: Ray or sockets)."""
    integration = sorted((REPO / "tests" / "integration").glob("test_*.py"))
    misplaced = [f.name for f in integration if tiers_of(f.read_text()) == ["unit"]]
    assert not misplaced


def test_the_tiers_are_registered_and_markers_strict():
    opts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert {m.split(":")[0] for m in opts["markers"]} >= set(TIERS)
    assert "--strict-markers" in opts["addopts"].split()


@pytest.mark.parametrize(("source", "expected"), [
    ("pytestmark = pytest.mark.unit", ["unit"]),
    ("pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]", ["slow"]),
    ('pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]', ["integration"]),
    ("pytestmark = (pytest.mark.integration, pytest.mark.slow)", ["integration", "slow"]),
    ("import pytest\n\ndef test_x():\n    pass\n", []),
    ('pytestmark = pytest.mark.asyncio(loop_scope="module")', []),
    ("def f():\n    pytestmark = pytest.mark.unit\n", []),  # not at module level
])  # fmt: skip
def test_tiers_of_reads_the_module_level_pytestmark(source, expected):
    assert tiers_of(source) == expected


def test_no_two_test_files_share_a_name():
    """pytest imports test modules by their file name (rootdir-relative ``prepend`` import mode, no packages):
    two files of one name in different folders stop the whole collection ("import file mismatch")."""
    names: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}
