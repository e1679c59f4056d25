"""A product's bits do not depend on torch's thread count. The warm start picks its thread count from its own step
times (``warm_start.sft.ThreadTuner``), so a product that rounds differently at 1 and at 2 threads makes a loaded
machine compute another warm start than an idle one. On AVX-512 processors MKL's default kernels split a weight
gradient's product (a long inner dimension) by thread; importing ``async_agent_rl`` first turns on MKL's strict
reproducible mode. Each check runs in a fresh interpreter, since MKL reads the setting once, at its first product."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PRODUCTS = """
import torch
torch.manual_seed(0)
x, g = torch.randn(2048, 128), torch.randn(2048, 512)  # activations and output gradients of a 16 x 128 batch
out = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    out[threads] = (x.T @ g, x @ torch.randn(128, 512, generator=torch.Generator().manual_seed(1)))
print(all(torch.equal(a, b) for a, b in zip(out[1], out[2])))
"""


def run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}  # the project's own default, not a test's
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_products_are_bitwise_equal_at_one_and_at_two_threads_after_importing_the_project():
    assert run("import async_agent_rl\n" + PRODUCTS) == "True"
    # a module that imports torch before the project (warm_start/sft.py does) is covered too: MKL reads the setting
    # at its first product, not when torch loads
    assert run("import torch\nimport warm_start.sft\n" + PRODUCTS) == "True"


def test_the_command_line_sets_it_and_a_users_own_setting_is_kept():
    out = run("import sys, os\nimport driver.cli\nprint(os.environ['MKL_CBWR'])")
    assert out == "AUTO,STRICT"
    assert run("import os\nos.environ['MKL_CBWR'] = 'COMPATIBLE'\nimport async_agent_rl\nprint(os.environ['MKL_CBWR'])") \
        == "COMPATIBLE"  # a user's own setting is kept
