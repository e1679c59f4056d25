"""What a training's start pays before anything runs: the driver's modules are imported first, alone, and every
second of it delays the whole run. transformers (with what it pulls in: scikit-learn, SciPy) took about 7 of the
12 s ``import driver.train`` took; the driver needs it only for the policy's tokenizer, which loads in a thread while
Ray starts (``Trainer.start_components``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_train_driver_does_not_import_transformers():
    code = "import sys, driver.train; print(sorted(m for m in ('transformers', 'sklearn', 'vllm') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_progress_bars_go_off_for_a_run_and_back_on_after_it_whether_transformers_is_loaded_or_not():
    code = """
import sys
from driver.console import progress_bars as _progress_bars
from huggingface_hub import utils as hub
_progress_bars(False)
import transformers.utils.logging as tl  # loaded during the run: it reads the hub's switch
seen = [hub.are_progress_bars_disabled(), tl.is_progress_bar_enabled()]
_progress_bars(True)
seen += [hub.are_progress_bars_disabled(), tl.is_progress_bar_enabled()]
_progress_bars(False)  # loaded before the run: its own switch too
seen += [tl.is_progress_bar_enabled()]
print(seen)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[True, False, False, True, False]", r.stdout
