"""Fixtures of the integration tests: a REAL BM25 retrieval server on loopback (in a thread) over the session's
world, for the tests that drive the episode loop; an offline Wikipedia-summaries corpus and its passages, for the
retriever's tests."""

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


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    """400 offline Wikipedia summaries as a wiki-18-style corpus file."""
    from async_agent_rl.data.corpus import import_wiki_offline

    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    import_wiki_offline(path, limit=400)
    return path


@pytest.fixture(scope="module")
def passages(corpus_file):
    from async_agent_rl.data.corpus import read_corpus

    return read_corpus(corpus_file)
