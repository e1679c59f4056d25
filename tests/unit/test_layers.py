"""The packages form layers and every import goes down (or sideways within a package), never up:

    async_agent_rl (the Ray-free core) < retriever < buffer < actors, learner < monitoring < driver

``actors`` and ``learner`` share a level but neither imports the other; nothing but tests, benchmarks and scripts
imports ``driver``; the core imports no ``ray``. Checked on the source with ``ast`` (imports inside functions
included), so this test imports none of the heavy libraries it is about.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

LEVEL = {"async_agent_rl": 0, "retriever": 1, "buffer": 2, "actors": 3, "learner": 3, "monitoring": 4, "driver": 5}
# Besides a higher level: packages each one must not import although they are not above it.
FORBIDDEN = {"async_agent_rl": {"ray"}, "actors": {"learner"}, "learner": {"actors"}}


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree``, relative ones resolved against ``package``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node.lineno, ".".join([*base, *([node.module] if node.module else [])])))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def upward_imports() -> list[str]:
    bad = []
    for top, level in LEVEL.items():
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO)
            package = ".".join(rel.with_suffix("").parts[:-1])
            for line, module in imported_modules(ast.parse(path.read_text(), str(rel)), package):
                root = module.split(".")[0]
                if LEVEL.get(root, -1) > level or root in FORBIDDEN.get(top, set()):
                    bad.append(f"{rel}:{line}: {module}")
    return bad


def test_no_package_imports_a_layer_above_it():
    bad = upward_imports()
    assert not bad, "imports that go up the layers (core < retriever < buffer < actors, learner < monitoring < " \
                    "driver):\n" + "\n".join(bad)


def test_the_check_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from driver.train import Trainer\n    import ray\n")
    assert imported_modules(tree, "async_agent_rl") == [(2, "driver.train"), (3, "ray")]
