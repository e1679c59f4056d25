"""No wait without a bound: every wait on another process in ``driver/``, ``actors/``, ``learner/`` and ``buffer/``
goes through ``async_agent_rl.waits`` (``bounded(ray.get, ...)``, ``bounded(ray.wait, ...)``, ``await within(...)``,
``await all_within(...)``, ``alarm_within(ray.init, ...)``), whose limit is checked before the wait starts. A stopped
component (SIGSTOP, a hang) never answers, and a wait without a limit held the driver for good (a checkpoint to a
stopped learner, a collective publish to a stopped actor, a rollout actor's push to a stopped buffer).

Checked on the source with ``ast``. What the scan finds (``unbounded_waits``; each kind has a case in
``test_the_scan_finds_each_kind_of_unbounded_wait``):

- ``ray.get`` / ``ray.wait`` called directly (without a timeout, with ``None``, or with one: the helper is the one
  way), ``ray.get`` / ``ray.wait`` used as a value other than ``bounded``'s first argument (an alias the scan would
  not follow), ``from ray import get``, ``import ray as r``, and ``ray.init`` outside ``alarm_within`` (or ``call_within``);
- ``await`` of an actor call (``await a.m.remote()``) or of a name, attribute or item that holds an object
  reference (``ref = a.m.remote(); await ref``), and ``asyncio.wait_for`` on one: a remote result is waited for
  with ``within`` / ``all_within``;
- ``asyncio.gather(...)`` outside a bound (``within``, ``asyncio.wait_for``), ``asyncio.wait(...)`` without a
  ``timeout``, ``asyncio.wait_for(x, None)``, ``from asyncio import wait_for`` (the scan reads qualified names), a
  ``.join()`` without a timeout;
- a limit that is ``None``, or a parameter of the enclosing function that may be ``None`` (default ``None`` or an
  ``Optional`` annotation: ``def ready(self, timeout_s=None): ... bounded(ray.get, r, timeout_s=timeout_s)``). A
  limit held anywhere else that turns out ``None`` is refused by the helper when the wait starts (``limit_s``).

``driver/`` is being restructured: what its code still does of the above is listed in ``DRIVER_ALLOWED`` (file,
function, finding: how many), so the suite stays green while that list is emptied. A driver finding not listed
fails, and so does a listed one the driver no longer has (remove it from the list)."""

from __future__ import annotations

import ast
import asyncio
import math
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from async_agent_rl.waits import WaitTimeout, all_within, bounded, call_within, limit_s, within

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("driver", "actors", "learner", "buffer")
HELPERS = {"within": 1, "all_within": 1}  # async helper -> the position of its limit argument
KEYWORD_HELPERS = {"bounded", "call_within", "alarm_within"}  # limit given as timeout_s=

# Not a wait on another process but a worker's own lifetime: the rollout worker runs until ``stop()`` or a failure
# (the waits inside it, on its episodes, its pushes and its cancelled tasks, are bounded).
LIFETIME: dict[tuple[str, str, str], int] = {
    ("actors/rollout_worker.py", "RolloutWorker.run", "asyncio.wait without a limit"): 1,
}

# To be emptied: the driver's waits that do not go through async_agent_rl.waits yet, (file, function, finding) ->
# how many. Each entry is a site to move onto the helper (bounded(ray.get, ...), alarm_within(ray.init, ...)).
DRIVER_ALLOWED: dict[tuple[str, str, str], int] = {}


# ------------------------------------------------------------------------------------------------ the scan
def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _is_remote_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"


def _may_be_none(arg: ast.arg, default: ast.expr | None) -> bool:
    if isinstance(default, ast.Constant) and default.value is None:
        return True
    text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    return "None" in text or "Optional" in text


def _may_yield_none(expr: ast.expr) -> bool:
    """Whether ``expr`` may evaluate to the constant ``None`` (``x if c else None``, ``x or None``)."""
    if isinstance(expr, ast.Constant):
        return expr.value is None
    if isinstance(expr, ast.IfExp):
        return _may_yield_none(expr.body) or _may_yield_none(expr.orelse)
    if isinstance(expr, ast.BoolOp):
        return any(_may_yield_none(v) for v in expr.values)
    return False


def _params_maybe_none(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    pairs = [*zip(positional, defaults), *zip(a.kwonlyargs, a.kw_defaults)]
    return {arg.arg for arg, d in pairs if _may_be_none(arg, d)}


class _Scan(ast.NodeVisitor):
    """One module: collects ``(line, function, finding)`` and counts the waits it sees (bounded or not)."""

    def __init__(self, tree: ast.AST):
        self.found: list[tuple[int, str, str]] = []
        self.waits = 0
        self.scope: list[str] = []
        self.maybe_none: list[set[str]] = [set()]
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.tainted_attrs = self._tainted_attributes(tree)
        self.tainted: list[set[str]] = [set()]  # names holding references, per function (no await outside)

    # --- where object references are held
    def _holds_ref(self, node: ast.AST, names: set[str]) -> bool:
        for n in ast.walk(node):
            if _is_remote_call(n):
                return True
            if isinstance(n, ast.Name) and n.id in names:
                return True
            if isinstance(n, ast.Attribute) and _dotted(n) in self.tainted_attrs:
                return True
        return False

    def _tainted_attributes(self, tree: ast.AST) -> set[str]:
        out: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(_is_remote_call(m) for m in ast.walk(n.value)):
                    for t in targets:
                        for m in ast.walk(t):
                            if isinstance(m, ast.Attribute) and _dotted(m):
                                out.add(_dotted(m))
        return out

    def _tainted_names(self, scope: ast.AST) -> set[str]:
        """Names bound in function ``scope`` to a value holding a reference, through assignments, ``for`` targets
        and comprehensions, to a fixed point."""
        nodes = list(ast.walk(scope))
        names: set[str] = set()
        while True:
            before = len(names)
            for n in nodes:
                pairs: list[tuple[ast.AST, ast.AST]] = []
                if isinstance(n, ast.Assign):
                    pairs = [(t, n.value) for t in n.targets]
                elif isinstance(n, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and n.value is not None:
                    pairs = [(n.target, n.value)]
                elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                    pairs = [(n.target, n.iter)]
                for target, value in pairs:
                    if self._holds_ref(value, names):
                        names |= {m.id for m in ast.walk(target) if isinstance(m, ast.Name)}
            if len(names) == before:
                return names

    # --- scopes
    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.maybe_none.append(self.maybe_none[-1] | _params_maybe_none(node))
        self.tainted.append(self.tainted[-1] | self._tainted_names(node))
        self.generic_visit(node)
        self.scope.pop()
        self.maybe_none.pop()
        self.tainted.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def _add(self, node: ast.AST, what: str) -> None:
        self.found.append((node.lineno, ".".join(self.scope) or "<module>", what))

    def _bad_limit(self, node: ast.AST, limit: ast.expr | None, call: str) -> bool:
        """Reports a missing, ``None`` or maybe-``None`` limit of ``call``; True when it did."""
        if limit is None or (isinstance(limit, ast.Constant) and limit.value is None):
            self._add(node, f"{call} without a limit")
            return True
        if isinstance(limit, ast.Name) and limit.id in self.maybe_none[-1]:
            self._add(node, f"{call} with a limit that may be None ({limit.id})")
            return True
        if _may_yield_none(limit):
            self._add(node, f"{call} with a limit that may be None ({ast.unparse(limit)})")
            return True
        return False

    # --- imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "ray" and alias.asname not in (None, "ray"):
                self._add(node, f"import ray as {alias.asname} (the scan reads ray.get, ray.wait)")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        waits = {"ray": {"get", "wait", "init", "*"}, "asyncio": {"gather", "wait", "wait_for", "*"}}
        for alias in node.names:
            if node.module in waits and alias.name in waits[node.module]:
                self._add(node, f"from {node.module} import {alias.name} (the scan reads {node.module}.X)")

    # --- waits
    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = _dotted(node)
        if name in ("ray.get", "ray.wait", "ray.init"):
            parent = self.parents.get(node)
            called = isinstance(parent, ast.Call) and parent.func is node
            passed = isinstance(parent, ast.Call) and parent.args and parent.args[0] is node \
                and _dotted(parent.func) in (KEYWORD_HELPERS | {f"waits.{h}" for h in KEYWORD_HELPERS})
            if not called and not passed:
                self._add(node, f"{name} used as a value (an alias the scan does not follow)")
        self.generic_visit(node)

    def visit_Await(self, node: ast.Await) -> None:
        v = node.value
        if _is_remote_call(v):
            self._add(node, "await of an actor call (use within)")
        elif isinstance(v, (ast.Name, ast.Attribute, ast.Subscript)) and self._holds_ref(v, self.tainted[-1]):
            self._add(node, "await of an object reference (use within)")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        short = name.rsplit(".", 1)[-1] if name else None
        if name in ("ray.get", "ray.wait"):
            self.waits += 1
            if not self._bad_limit(node, kw.get("timeout"), name):
                self._add(node, f"{name} not through async_agent_rl.waits.bounded")
        elif name == "ray.init":
            self._add(node, "ray.init without a bound (use alarm_within)")
        elif name == "asyncio.gather":
            parent = self.parents.get(node)
            inside = isinstance(parent, ast.Call) and parent.args and parent.args[0] is node and \
                (_dotted(parent.func) or "").rsplit(".", 1)[-1] in ("within", "wait_for")
            if not inside:
                self._add(node, "asyncio.gather outside a bound (use all_within)")
        elif name == "asyncio.wait":
            self.waits += 1
            if not self._bad_limit(node, kw.get("timeout"), "asyncio.wait") \
                    and node.args and self._holds_ref(node.args[0], self.tainted[-1]):
                self._add(node, "asyncio.wait on object references (use all_within)")
        elif name == "asyncio.wait_for":
            self.waits += 1
            limit = node.args[1] if len(node.args) > 1 else kw.get("timeout")
            if not self._bad_limit(node, limit, "asyncio.wait_for") \
                    and node.args and self._holds_ref(node.args[0], self.tainted[-1]):
                self._add(node, "asyncio.wait_for on an object reference (use within)")
        elif short in HELPERS and name in (short, f"waits.{short}"):
            self.waits += 1
            i = HELPERS[short]
            self._bad_limit(node, node.args[i] if len(node.args) > i else kw.get("timeout_s"), short)
        elif short in KEYWORD_HELPERS and name in (short, f"waits.{short}"):
            self.waits += 1
            self._bad_limit(node, kw.get("timeout_s"), short)
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "join" and not node.args \
                and not node.keywords:
            self._add(node, ".join() without a timeout")
        self.generic_visit(node)


def unbounded_waits(tree: ast.AST, where: str) -> list[str]:
    """``where:line finding`` of every wait in ``tree`` that bypasses a bound (module docstring)."""
    return [f"{where}:{line} {what}" for line, _, what in scan(tree)[0]]


def scan(tree: ast.AST) -> tuple[list[tuple[int, str, str]], int]:
    """``([(line, function, finding), ...], waits seen)`` of ``tree``."""
    s = _Scan(tree)
    s.visit(tree)
    return sorted(s.found), s.waits


def sources() -> list[tuple[str, ast.AST]]:
    out = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            out.append((rel, ast.parse(path.read_text(), rel)))
    return out


# ------------------------------------------------------------------------------------------------ the source
def test_every_wait_in_the_runs_processes_has_a_limit():
    outside, driver, waits = [], Counter(), 0
    for rel, tree in sources():
        found, n = scan(tree)
        waits += n
        for line, function, what in found:
            if rel.startswith("driver/"):
                driver[(rel, function, what)] += 1
                if driver[(rel, function, what)] > DRIVER_ALLOWED.get((rel, function, what), 0):
                    outside.append(f"{rel}:{line} ({function}) {what}")
            elif not LIFETIME.get((rel, function, what)):
                outside.append(f"{rel}:{line} ({function}) {what}")
    assert not outside, "waits without a bound (wait through async_agent_rl.waits):\n" + "\n".join(outside)
    gone = [f"{k}: {n} allowed, {driver[k]} found" for k, n in DRIVER_ALLOWED.items() if driver[k] < n]
    assert not gone, "DRIVER_ALLOWED lists driver waits that are gone (lower or remove the entries):\n" + \
        "\n".join(gone)
    assert waits >= 20, f"the scan sees the waits it checks ({waits})"


# ------------------------------------------------------------------------------------------------ the scan itself
def _one(body: str) -> list[str]:
    code = "import asyncio\nimport ray\n\n\nasync def f(a, r, t: float, maybe=None):\n" + \
        "".join(f"    {line}\n" for line in body.splitlines())
    return [what for _, _, what in scan(ast.parse(code))[0]]


UNBOUNDED = {
    "ray.get(x)": ("ray.get(r)", "ray.get without a limit"),
    "ray.get(x, timeout=None)": ("ray.get(r, timeout=None)", "ray.get without a limit"),
    "ray.get(x, timeout=t): bounded, not the helper": ("ray.get(r, timeout=t)",
                                                       "ray.get not through async_agent_rl.waits.bounded"),
    "ray.wait(xs)": ("ray.wait([r], num_returns=1)", "ray.wait without a limit"),
    "await a.m.remote()": ("await a.stats.remote()", "await of an actor call (use within)"),
    "ref = a.m.remote(); await ref": ("ref = a.stats.remote()\nawait ref", "await of an object reference (use within)"),
    "refs = [...remote()]; await refs[0]": ("refs = [b.m.remote() for b in a]\nawait refs[0]",
                                            "await of an object reference (use within)"),
    "self._ref = a.m.remote(); await self._ref": ("self._ref = a.m.remote()\nawait self._ref",
                                                  "await of an object reference (use within)"),
    "await asyncio.gather(...)": ("await asyncio.gather(a.m.remote(), a.n.remote())",
                                  "asyncio.gather outside a bound (use all_within)"),
    "asyncio.wait(...)": ("await asyncio.wait({r})", "asyncio.wait without a limit"),
    "asyncio.wait(..., timeout=None)": ("await asyncio.wait({r}, timeout=None)", "asyncio.wait without a limit"),
    "wait_for(x, None)": ("await asyncio.wait_for(r, None)", "asyncio.wait_for without a limit"),
    "wait_for(x, timeout=None)": ("await asyncio.wait_for(r, timeout=None)", "asyncio.wait_for without a limit"),
    "wait_for on a reference": ("await asyncio.wait_for(a.m.remote(), 3)",
                                "asyncio.wait_for on an object reference (use within)"),
    "a limit that may be None (bounded)": ("bounded(ray.get, r, timeout_s=maybe, what='x')",
                                           "bounded with a limit that may be None (maybe)"),
    "a limit that may be None (within)": ("await within(a.m.remote(), maybe, 'x')",
                                          "within with a limit that may be None (maybe)"),
    "a limit that may be None (wait_for)": ("await asyncio.wait_for(r, maybe)",
                                            "asyncio.wait_for with a limit that may be None (maybe)"),
    "a limit that may be None (an expression)": ("await asyncio.wait_for(r, min(a) if a else None)",
                                                 "asyncio.wait_for with a limit that may be None "
                                                 "(min(a) if a else None)"),
    "within(x, None)": ("await within(a.m.remote(), None, 'x')", "within without a limit"),
    "from ray import get": ("from ray import get", "from ray import get (the scan reads ray.X)"),
    "from asyncio import wait_for": ("from asyncio import wait_for",
                                     "from asyncio import wait_for (the scan reads asyncio.X)"),
    "import ray as r": ("import ray as rr", "import ray as rr (the scan reads ray.get, ray.wait)"),
    "g = ray.get": ("g = ray.get", "ray.get used as a value (an alias the scan does not follow)"),
    "ray.init()": ("ray.init(address='auto')", "ray.init without a bound (use alarm_within)"),
    "thread.join()": ("a.join()", ".join() without a timeout"),
}


@pytest.mark.parametrize("case", list(UNBOUNDED), ids=list(UNBOUNDED))
def test_the_scan_finds_each_kind_of_unbounded_wait(case):
    body, finding = UNBOUNDED[case]
    assert _one(body) == [finding]


def test_the_scan_sees_the_learner_groups_ready_with_its_old_default_none():
    """``LearnerGroup.ready(timeout_s=None)`` passed the old scan: a keyword timeout, not the constant None."""
    code = ("class G:\n"
            "    def ready(self, timeout_s: float | None = None):\n"
            "        return ray.get([a.rank.remote() for a in self.actors], timeout=timeout_s)\n")
    assert [what for _, _, what in scan(ast.parse(code))[0]] == ["ray.get with a limit that may be None (timeout_s)"]


def test_bounded_waits_pass_the_scan():
    body = ("bounded(ray.get, r, timeout_s=t, what='x')\n"
            "bounded(ray.wait, [r], timeout_s=0, what='x', fetch_local=False)\n"
            "await within(a.m.remote(), t, 'x')\n"
            "ref = a.m.remote()\n"
            "await within(ref, 3, 'x')\n"
            "await all_within([b.m.remote() for b in a], t, 'x')\n"
            "await asyncio.wait_for(asyncio.gather(*a), 3)\n"
            "await asyncio.wait({a}, timeout=t)\n"
            "await asyncio.wait_for(a.event.wait(), t)\n"
            "call_within(ray.init, timeout_s=t, what='x', address='auto')\n"
            "alarm_within(ray.init, timeout_s=t, what='x', address='auto')\n"
            "a.join(timeout=t)\n"
            "', '.join(a)\n"
            "await a.cond.wait_for(lambda: True)\n")
    assert _one(body) == []
    assert scan(ast.parse("async def f(a, t):\n    await within(a.m.remote(), t, 'x')\n"))[1] == 1


# ------------------------------------------------------------------------------------------------ the helper
@pytest.mark.parametrize("bad", [None, -1, math.inf, math.nan, "3", True])
def test_a_wait_refuses_a_missing_or_meaningless_limit_before_it_starts(bad):
    calls = []

    def wait(*args, timeout):
        calls.append(timeout)

    with pytest.raises(ValueError, match="the learner"):
        bounded(wait, "ref", timeout_s=bad, what="the learner")
    with pytest.raises(ValueError, match="the buffer"):
        asyncio.run(within(asyncio.sleep(10), bad, "the buffer"))
    with pytest.raises(ValueError, match="the actors"):
        asyncio.run(all_within([asyncio.sleep(10)], bad, "the actors"))
    with pytest.raises(ValueError, match="ray.init"):
        call_within(time.sleep, 10, timeout_s=bad, what="ray.init")
    assert calls == []
    assert limit_s(0, "x") == 0.0 and limit_s(2, "x") == 2.0


def test_a_wait_ends_at_its_limit():
    assert bounded(lambda ref, timeout: (ref, timeout), "r", timeout_s=2, what="x") == ("r", 2.0)

    async def never():
        await asyncio.Event().wait()

    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match="the buffer actor did not answer within 0.2 s"):
        asyncio.run(within(never(), 0.2, "the buffer actor"))
    with pytest.raises(asyncio.TimeoutError):  # what callers of asyncio.wait_for caught still catches it
        asyncio.run(all_within([never(), asyncio.sleep(0)], 0.2, "the actors"))
    hung = threading.Event()
    with pytest.raises(WaitTimeout, match="ray.init did not answer within 0.2 s"):
        call_within(hung.wait, 30, timeout_s=0.2, what="ray.init")
    assert time.monotonic() - t0 < 5
    hung.set()  # the thread left behind ends
    assert asyncio.run(all_within([asyncio.sleep(0, "a"), asyncio.sleep(0, "b")], 1, "x")) == ["a", "b"]
    assert call_within(lambda x, y: x + y, 1, y=2, timeout_s=1, what="x") == 3
    with pytest.raises(KeyError):
        call_within({}.__getitem__, "k", timeout_s=1, what="x")


def test_the_first_steps_limit_grows_with_the_config_and_a_small_config_keeps_the_floor():
    """Until e4918d9 (2026-11-26), the first step always got a flat 600 s, and the GPU config (2,560 trajectories of up
    to 4,096 tokens, a 3B model) sets no ``cluster.progress_timeout_s``: its first step would be reported as a stall."""
    from async_agent_rl.config import load_config
    from driver.limits import PROGRESS_FLOOR_S, first_step_s, stop_s

    gpu = load_config(REPO / "configs/search_r1_nq_gpu.yaml")
    assert gpu.cluster.progress_timeout_s is None
    assert first_step_s(gpu) >= 3600, first_step_s(gpu)
    assert first_step_s(load_config(REPO / "configs/quickstart.yaml")) == PROGRESS_FLOOR_S
    assert stop_s(gpu) > 120, "stopping may wait for one wave of the longest episodes"
