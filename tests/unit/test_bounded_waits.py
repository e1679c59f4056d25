"""No wait without a bound: every wait on another Ray process in ``driver/``, ``actors/``, ``learner/`` and
``buffer/`` has a limit. A stopped component (SIGSTOP, a hang) never answers, and a wait without a limit held the
driver for good (a checkpoint to a stopped learner, a collective publish to a stopped actor, a rollout actor's push
to a stopped buffer).

Checked on the source with ``ast``: every ``ray.get`` and ``ray.wait`` passes a ``timeout`` (not ``None``), and no
``await`` waits on an actor call (``await x.method.remote(...)``) except inside ``asyncio.wait_for``. A new unbounded
wait fails this test with its place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("driver", "actors", "learner", "buffer")


def _is_ray_call(node: ast.Call, name: str) -> bool:
    f = node.func
    return isinstance(f, ast.Attribute) and f.attr == name and isinstance(f.value, ast.Name) and f.value.id == "ray"


def _is_remote_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"


def unbounded_waits(tree: ast.AST, where: str) -> list[str]:
    """``where:line what`` of every wait on Ray without a limit in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (_is_ray_call(node, "get") or _is_ray_call(node, "wait")):
            limit = next((k.value for k in node.keywords if k.arg == "timeout"), None)
            if limit is None or (isinstance(limit, ast.Constant) and limit.value is None):
                found.append(f"{where}:{node.lineno} ray.{node.func.attr} without a timeout")
        elif isinstance(node, ast.Await) and _is_remote_call(node.value):
            found.append(f"{where}:{node.lineno} await of an actor call without asyncio.wait_for")
    return found


def remote_waits(tree: ast.AST) -> int:
    """How many waits on Ray (``ray.get``, ``ray.wait``, awaited actor calls) ``tree`` has, bounded or not."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (_is_ray_call(node, "get") or _is_ray_call(node, "wait")):
            n += 1
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait_for" \
                and node.args and _is_remote_call(node.args[0]):
            n += 1
    return n


def sources() -> list[tuple[str, ast.AST]]:
    out = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            out.append((rel, ast.parse(path.read_text(), rel)))
    return out


def test_every_wait_on_ray_in_the_runs_processes_has_a_limit():
    found = [line for rel, tree in sources() for line in unbounded_waits(tree, rel)]
    assert not found, "waits without a limit (bound them: ray.get(..., timeout=...), asyncio.wait_for):\n" + \
        "\n".join(found)
    assert sum(remote_waits(tree) for _, tree in sources()) >= 20, "the scan sees the waits it checks"


def test_the_scan_finds_each_kind_of_unbounded_wait():
    code = ("async def f(a, r):\n"
            "    ray.get(r)\n"
            "    ray.get(r, timeout=None)\n"
            "    ray.wait([r], num_returns=1)\n"
            "    await a.stats.remote()\n"
            "    ray.get(r, timeout=3)\n"
            "    ray.wait([r], timeout=0)\n"
            "    await asyncio.wait_for(a.stats.remote(), 3)\n")
    assert unbounded_waits(ast.parse(code), "x.py") == [
        "x.py:2 ray.get without a timeout", "x.py:3 ray.get without a timeout", "x.py:4 ray.wait without a timeout",
        "x.py:5 await of an actor call without asyncio.wait_for"]
    assert remote_waits(ast.parse(code)) == 6


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
