"""The packages form layers, and this file is their graph: every edge between the project's packages is listed in
``ALLOWED``, and the test fails both on an import that is not listed and on a listed edge that no import uses (so the
list stays the real graph, not a permission slip)::

    async_agent_rl (the Ray-free core)
      < retriever                      search backends and the /retrieve server
      < buffer                         replay buffer, admission (Ray shell)
      < actors, learner, warm_start    rollout; the DeepSpeed learner; SFT warm start (none imports another)
      < monitoring                     metrics, dashboard
      < driver                         the commands: train loop, weight publishing (where learner and actors meet)
      < benchmarks

Heavy libraries are kept where they belong (``FORBIDDEN``): the core imports no Ray, vLLM, DeepSpeed or search
engine; the warm start is plain torch. Checked on the source with ``ast`` (imports inside functions included), so this
test imports none of the libraries it is about.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

ALLOWED = {
    "async_agent_rl": set(),
    "retriever": {"async_agent_rl"},
    "buffer": {"async_agent_rl"},
    "actors": {"async_agent_rl", "retriever", "buffer"},  # stack.py spawns the retriever; the actor feeds the buffer
    "learner": {"async_agent_rl"},
    "warm_start": {"async_agent_rl", "retriever"},  # demonstrations search the configured backend in process
    "monitoring": {"async_agent_rl"},
    "driver": {"async_agent_rl", "retriever", "buffer", "actors", "learner", "warm_start", "monitoring"},
    "benchmarks": {"async_agent_rl", "retriever", "buffer", "actors", "learner", "warm_start", "driver"},
}
HEAVY = {"ray", "vllm", "deepspeed", "bm25s", "Stemmer", "faiss", "sentence_transformers", "aiohttp"}
FORBIDDEN = {
    "async_agent_rl": HEAVY,
    "retriever": {"ray", "vllm", "deepspeed"},
    "buffer": {"vllm", "deepspeed", "bm25s", "faiss"},
    "actors": {"deepspeed"},
    "learner": {"vllm", "bm25s", "faiss"},
    "warm_start": {"ray", "vllm", "deepspeed"},
    "monitoring": {"vllm", "deepspeed"},
}


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


def edges() -> dict[str, dict[str, list[str]]]:
    """package -> imported top-level module -> the ``file:line`` places that import it."""
    found: dict[str, dict[str, list[str]]] = {}
    for top in ALLOWED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO)
            package = ".".join(rel.with_suffix("").parts[:-1])
            for line, module in imported_modules(ast.parse(path.read_text(), str(rel)), package):
                root = module.split(".")[0]
                if root != top:
                    found.setdefault(top, {}).setdefault(root, []).append(f"{rel}:{line}")
    return found


def test_every_import_between_packages_is_an_allowed_edge():
    bad = [f"{where}: {top} -> {root}" for top, imports in edges().items() for root, places in imports.items()
           if (root in ALLOWED and root not in ALLOWED[top]) or root in FORBIDDEN.get(top, set())
           for where in places]
    assert not bad, "imports outside the layer graph (tests/unit/test_layers.py ALLOWED, FORBIDDEN):\n" + \
        "\n".join(bad)


def test_every_allowed_edge_is_used():
    found = edges()
    unused = [f"{top} -> {dep}" for top, deps in ALLOWED.items() for dep in deps if dep not in found.get(top, {})]
    assert not unused, "edges listed in ALLOWED that no import uses (remove them):\n" + "\n".join(unused)


def test_every_package_is_in_the_graph():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} | {"benchmarks"}
    assert packages <= set(ALLOWED), f"packages missing from ALLOWED: {sorted(packages - set(ALLOWED))}"


def test_the_check_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from driver.train import Trainer\n    import ray\n")
    assert imported_modules(tree, "async_agent_rl") == [(2, "driver.train"), (3, "ray")]
