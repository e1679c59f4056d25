"""Fixtures of the integration tests that drive the episode loop: a REAL BM25 retrieval server on loopback (in a
thread) over the session's world."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def server(world_dir):
    from async_agent_rl.data.corpus import read_corpus
    from retriever.backends import BM25Backend
    from retriever.server import start_server_in_thread

    srv = start_server_in_thread(BM25Backend.build(read_corpus(world_dir / "corpus.jsonl")))
    yield srv
    srv.stop()
