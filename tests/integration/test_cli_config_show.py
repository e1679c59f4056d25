"""``async-agent-rl config show`` as a user runs it: the CLI in a subprocess of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from async_agent_rl.config import Config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "driver.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_cli_config_show_prints_resolved_config():
    r = _cli("config", "show", "--config", "configs/quickstart.yaml", "algorithm.clip_ratio_high=0.28")
    assert r.returncode == 0, r.stderr
    shown = Config.model_validate(yaml.safe_load(r.stdout))
    assert shown.algorithm.clip_ratio_high == pytest.approx(0.28)


def test_cli_config_show_rejects_unknown_key_with_path():
    r = _cli("config", "show", "--config", "configs/quickstart.yaml", "rollout.max_turn=3")
    assert r.returncode != 0
    assert "rollout.max_turn" in r.stderr
