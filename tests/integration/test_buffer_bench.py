"""``benchmarks/buffer_bench.py`` runs to its end on the real buffer actor (real Ray, its own process, as a user runs
it). It had stopped running unnoticed: its 2,048-token trajectories were longer than the buffer's default
``max_trajectory_tokens`` (1,024) and its two producers shared group ids, which admission refuses; the benchmark
table then could not be re-measured. Small counts here: the phases, not the rates, are what is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_the_buffer_benchmark_runs_every_phase_with_its_default_trajectories_and_two_producers():
    run = subprocess.run([sys.executable, "benchmarks/buffer_bench.py", "--steady", "200", "--repeats", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("trajectory: 2048 tokens"), run.stdout
    for phase in ("push ", "sample ", "steady ", "step ", "stats "):
        assert any(x.startswith(phase) for x in lines), (phase, run.stdout)
