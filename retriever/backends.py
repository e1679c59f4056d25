"""Search backends: BM25 (default) and dense (optional extra), each a ``SearchBackend`` (``async_agent_rl.search``,
which states the contract of ``search(queries, topk)``: one ranked list per query, best first, possibly empty).
Backends are read-only after construction, so ``search`` may be called from a worker thread while the event loop
keeps serving.

Index directories hold a ``retriever_index.json`` that records the backend, the number of passages and a fingerprint
of the corpus; loading an index against a different corpus fails with :class:`IndexMismatchError` instead of
silently returning wrong passages. Nothing is unpickled when loading.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import bm25s
import numpy as np
import Stemmer

from async_agent_rl.data.corpus import Passage
from async_agent_rl.errors import InputError
from async_agent_rl.optional import import_optional
from async_agent_rl.search import Hit, SearchBackend

logger = logging.getLogger(__name__)

INDEX_META_FILE = "retriever_index.json"
INDEX_FORMAT_VERSION = 2  # 2: the fingerprint hashes the whole corpus (1: only its size, first and last rows)


class IndexMismatchError(InputError):
    """An index directory does not belong to the given corpus or backend, or is not an index at all."""


def corpus_fingerprint(passages: Sequence[Passage]) -> str:
    """The identity of a corpus: a streaming sha256 (hex) over every passage's id and contents, in order, and
    the count. Any changed, added, removed or reordered passage changes it."""
    h = hashlib.sha256(str(len(passages)).encode())
    for p in passages:
        h.update(b"\0" + p.id.encode() + b"\0" + p.contents.encode() + b"\1")
    return h.hexdigest()


def _write_meta(index_dir: Path, backend: str, passages: Sequence[Passage], **extra: Any) -> None:
    meta = {
        "format": INDEX_FORMAT_VERSION,
        "backend": backend,
        "num_passages": len(passages),
        "corpus_fingerprint": corpus_fingerprint(passages),
        **extra,
    }
    (index_dir / INDEX_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_index_meta(index_dir: str | Path) -> dict[str, Any]:
    """The metadata of an index directory; :class:`IndexMismatchError` if it is not one."""
    path = Path(index_dir) / INDEX_META_FILE
    if not path.is_file():
        raise IndexMismatchError(f"{index_dir} is not a retriever index (no {INDEX_META_FILE})")
    return json.loads(path.read_text())


def _check_meta(index_dir: Path, backend: str, passages: Sequence[Passage]) -> dict[str, Any]:
    meta = read_index_meta(index_dir)
    if meta.get("format") != INDEX_FORMAT_VERSION:
        raise IndexMismatchError(f"{index_dir} is an index of format {meta.get('format')}, this version reads "
                                 f"format {INDEX_FORMAT_VERSION}; rebuild it with `retriever index`")
    if meta.get("backend") != backend:
        raise IndexMismatchError(f"{index_dir} holds a {meta.get('backend')!r} index, not {backend!r}")
    if meta.get("num_passages") != len(passages) or meta.get("corpus_fingerprint") != corpus_fingerprint(passages):
        raise IndexMismatchError(
            f"{index_dir} was built for another corpus ({meta.get('num_passages')} passages, "
            f"this corpus has {len(passages)}); rebuild it with `retriever index`"
        )
    return meta


def _require_nonempty(passages: Sequence[Passage]) -> None:
    if not passages:
        raise ValueError("the corpus is empty: a retriever needs at least one passage")


# ------------------------------------------------------------------------------------------------------------ BM25
class BM25Backend:
    """Okapi BM25 (bm25s, Lucene variant, k1=1.5, b=0.75) over ``contents``, English stop words, Snowball stemming.

    Scoring uses bm25s's numba kernel on a corpus of ``NUMBA_MIN_PASSAGES`` or more when numba is importable (a
    256-query batch on 10k passages in 15 ms, but its JIT compile costs about 10 s of one core in every server
    process); a smaller corpus, or no numba, takes the numpy path (a 256-query batch on 532 passages in 36 ms, but a
    single query on 2,000 passages ~2 ms of server CPU against numba's ~0.3 ms: benchmarks/RESULTS.md, "Retriever").
    Hits with score 0 (no query term in the passage) are dropped.

    Equal scores rank by corpus position (the passage indexed first comes first), whichever kernel scored them: the
    kernels break ties each their own way, and in a corpus of templated passages many scores tie, so which tied
    passage a query gets would otherwise change with the corpus size, and every demonstration and observation with it.
    """

    name = "bm25"
    TIES = "corpus_position"  # the tie rule, named in a warm start's inputs: a warm start made before it differs
    STOPWORDS = "en"
    STEMMER = "english"

    def __init__(self, passages: Sequence[Passage], model: bm25s.BM25):
        _require_nonempty(passages)
        self.passages = passages
        self._model = model
        self._stemmer = Stemmer.Stemmer(self.STEMMER)

    NUMBA_MIN_PASSAGES = 10_000  # below, numba's ~10 s compile is not paid at every server start

    @classmethod
    def scoring_backend(cls, num_passages: int) -> str:
        """``numba`` for a corpus of ``NUMBA_MIN_PASSAGES`` or more (when numba is importable), else ``numpy``."""
        return "numba" if bm25s.NUMBA_AVAILABLE and num_passages >= cls.NUMBA_MIN_PASSAGES else "numpy"

    @classmethod
    def build(cls, passages: Sequence[Passage]) -> "BM25Backend":
        """Index ``passages`` in memory (about 0.6 s for 10k summaries, plus numba's one-off compile)."""
        _require_nonempty(passages)
        stemmer = Stemmer.Stemmer(cls.STEMMER)
        tokens = bm25s.tokenize(
            [p.contents for p in passages], stopwords=cls.STOPWORDS, stemmer=stemmer, show_progress=False
        )
        model = bm25s.BM25(backend=cls.scoring_backend(len(passages)))
        model.index(tokens, show_progress=False)
        backend = cls(passages, model)
        backend.warm_up()
        return backend

    def save(self, index_dir: str | Path) -> Path:
        """Write the index (numpy arrays + JSON, no pickle) and its metadata to ``index_dir``."""
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        self._model.save(index_dir, show_progress=False)
        _write_meta(index_dir, self.name, self.passages, stopwords=self.STOPWORDS, stemmer=self.STEMMER)
        return index_dir

    @classmethod
    def load(cls, index_dir: str | Path, passages: Sequence[Passage], mmap: bool = True) -> "BM25Backend":
        """Load a saved index for ``passages`` (memory-mapped by default: tens of ms for 100k passages)."""
        index_dir = Path(index_dir)
        _require_nonempty(passages)
        _check_meta(index_dir, cls.name, passages)
        model = bm25s.BM25.load(
            index_dir, mmap=mmap, allow_pickle=False, show_progress=False, backend=cls.scoring_backend(len(passages))
        )
        backend = cls(passages, model)
        backend.warm_up()
        return backend

    def warm_up(self) -> None:
        """Score one indexed term so numba's JIT compile (seconds, once per process), if numba scores, happens now,
        not on a request."""
        any_term = next(iter(self._model.vocab_dict.values()))
        self._model.retrieve([[any_term]], k=1, show_progress=False, n_threads=1)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        results: list[list[Hit]] = [[] for _ in queries]
        tokens = bm25s.tokenize(
            queries, stopwords=self.STOPWORDS, stemmer=self._stemmer, return_ids=False, show_progress=False
        )
        # bm25s rejects queries with no known term; they simply have no hits.
        ids = [self._model.get_tokens_ids(t) for t in tokens]
        live = [i for i, q in enumerate(ids) if q]
        if not live:
            return results
        n = len(self.passages)
        k = min(topk, n)
        probe = min(k + 1, n)  # one hit past the cut shows whether a tie crosses it
        docs, scores = self._model.retrieve(
            [ids[i] for i in live], k=probe, show_progress=False, n_threads=1
        )
        for row, qi in enumerate(live):
            d, s = docs[row], scores[row]
            if probe > k and s[k - 1] > 0 and s[k] == s[k - 1]:  # a tie crosses the cut: rank the whole corpus
                full = self._model.get_scores(ids[qi])
                d = top_by_score_then_position(full, k)
                s = full[d]
            else:  # the top k are set; order their ties by position
                order = np.lexsort((d[:k], -s[:k]))
                d, s = d[:k][order], s[:k][order]
            results[qi] = [
                Hit(self.passages[j].id, self.passages[j].contents, float(v))
                for j, v in zip(d.tolist(), s.tolist())
                if v > 0
            ]
        return results


def top_by_score_then_position(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest ``scores``, highest first, equal scores by index (lowest first)."""
    cut = len(scores) - k
    kth = np.partition(scores, cut)[cut]
    candidates = np.flatnonzero(scores >= kth)
    return candidates[np.lexsort((candidates, -scores[candidates]))][:k]


# ----------------------------------------------------------------------------------------------------------- dense
def check_encoder_dir(model_dir: str | Path | None) -> Path:
    """``model_dir`` as a Path; ``InputError`` if it is unset or not a folder (checked before anything loads)."""
    if model_dir is None:
        raise InputError("the dense backend needs an encoder folder (retriever.dense_model, --dense-model)")
    if not Path(model_dir).is_dir():
        raise InputError(f"encoder folder {model_dir} does not exist (retriever.dense_model, --dense-model)")
    return Path(model_dir)


def check_faiss_file(path: str | Path) -> Path:
    """``path`` as a Path; ``InputError`` if no such file (retriever.faiss_index)."""
    if not Path(path).is_file():
        raise InputError(f"FAISS index file {path} does not exist (retriever.faiss_index, --faiss-index)")
    return Path(path)


def _load_encoder(model_dir: str | Path | None) -> Any:
    # Imported here, not at the top: torch and transformers take seconds to import, and only the dense backend
    # needs them (a BM25 server starts without).
    from retriever.encoders import load_encoder

    return load_encoder(check_encoder_dir(model_dir))


class DenseBackend:
    """Inner-product search over L2-normalized embeddings in a flat faiss index.

    ``model_dir`` is a local encoder folder (``retriever.encoders``): a sentence-transformers model (e.g.
    all-MiniLM-L6-v2 from an offline package) or a plain Hugging Face model pooled by the attention-masked mean
    (e.g. e5). e5-style models expect ``query_prefix="query: "`` and ``passage_prefix="passage: "``. Encoding is the
    cost on CPU (tens to hundreds of passages/s), so build once with ``retriever index`` and load afterwards, or
    load an index someone else built (:meth:`from_faiss_file`, Search-R1's ``e5_Flat.index``).
    """

    name = "dense"
    INDEX_FILE = "faiss.index"

    def __init__(
        self, passages: Sequence[Passage], index: Any, encoder: Any, query_prefix: str = "", passage_prefix: str = ""
    ):
        _require_nonempty(passages)
        self.passages = passages
        self._index = index
        self._encoder = encoder
        self.query_prefix = query_prefix
        self.passage_prefix = passage_prefix

    def _encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return self._encoder.encode(texts, batch_size)

    @classmethod
    def build(
        cls,
        passages: Sequence[Passage],
        model_dir: str | Path,
        query_prefix: str = "",
        passage_prefix: str = "",
        batch_size: int = 64,
    ) -> "DenseBackend":
        """Encode every passage's ``contents`` and put the vectors in an exact inner-product index."""
        _require_nonempty(passages)
        faiss = import_optional("faiss", "faiss-cpu")
        backend = cls(passages, None, _load_encoder(model_dir), query_prefix, passage_prefix)
        emb = backend._encode([passage_prefix + p.contents for p in passages], batch_size)
        index = faiss.IndexFlatIP(emb.shape[1])
        index.add(emb)
        backend._index = index
        return backend

    def save(self, index_dir: str | Path) -> Path:
        faiss = import_optional("faiss", "faiss-cpu")
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self._index, str(index_dir / self.INDEX_FILE))
        _write_meta(
            index_dir, self.name, self.passages, query_prefix=self.query_prefix, passage_prefix=self.passage_prefix
        )
        return index_dir

    @classmethod
    def load(
        cls,
        index_dir: str | Path,
        passages: Sequence[Passage],
        model_dir: str | Path,
        query_prefix: str = "",
        passage_prefix: str = "",
        mmap: bool = True,
    ) -> "DenseBackend":
        """Load an index saved by :meth:`save` for ``passages``; the prefixes must be those it was built with."""
        index_dir = Path(index_dir)
        meta = _check_meta(index_dir, cls.name, passages)
        built = (meta.get("query_prefix", ""), meta.get("passage_prefix", ""))
        if built != (query_prefix, passage_prefix):
            raise IndexMismatchError(
                f"{index_dir} was built with query/passage prefixes {built!r}, the config asks for "
                f"{(query_prefix, passage_prefix)!r}; set retriever.query_prefix/passage_prefix to match or rebuild it"
            )
        return cls._from_file(index_dir / cls.INDEX_FILE, passages, model_dir, query_prefix, passage_prefix, mmap)

    @classmethod
    def from_faiss_file(
        cls,
        path: str | Path,
        passages: Sequence[Passage],
        model_dir: str | Path,
        query_prefix: str = "",
        mmap: bool = True,
    ) -> "DenseBackend":
        """Serve an existing FAISS index file whose row i is the embedding of ``passages[i]`` (Search-R1's
        ``e5_Flat.index`` over its wiki-18 corpus). Nothing records which corpus or encoder it was built from: the
        row count, the vector size and the inner-product metric are what can be checked, and are."""
        check_faiss_file(path)
        check_encoder_dir(model_dir)
        return cls._from_file(Path(path), passages, model_dir, query_prefix, "", mmap)

    @classmethod
    def _from_file(
        cls,
        path: Path,
        passages: Sequence[Passage],
        model_dir: str | Path,
        query_prefix: str,
        passage_prefix: str,
        mmap: bool,
    ) -> "DenseBackend":
        _require_nonempty(passages)
        faiss = import_optional("faiss", "faiss-cpu")
        try:
            index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP if mmap else 0)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise IndexMismatchError(f"{path} is not a readable FAISS index: {first[0] if first else e}") from None
        if index.ntotal != len(passages):
            raise IndexMismatchError(
                f"FAISS index {path} holds {index.ntotal} vectors but the corpus has {len(passages)} passages: "
                "row i of the index must be passage i of the corpus"
            )
        if index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise IndexMismatchError(f"FAISS index {path} does not use inner product (metric {index.metric_type}); "
                                     "the dense backend ranks by inner product of normalized vectors")
        encoder = _load_encoder(model_dir)
        if encoder.dim != index.d:
            raise IndexMismatchError(
                f"FAISS index {path} holds {index.d}-dimensional vectors but the encoder {model_dir} makes "
                f"{encoder.dim}-dimensional ones: it was built with another encoder"
            )
        return cls(passages, index, encoder, query_prefix, passage_prefix)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if not queries:
            return []
        k = min(topk, len(self.passages))
        scores, docs = self._index.search(self._encode([self.query_prefix + q for q in queries]), k)
        return [
            [
                Hit(self.passages[d].id, self.passages[d].contents, float(s))
                for d, s in zip(row_docs.tolist(), row_scores.tolist())
                if d >= 0
            ]
            for row_docs, row_scores in zip(docs, scores)
        ]


# ------------------------------------------------------------------------------------------------------- selection
def build_backend(
    kind: str,
    passages: Sequence[Passage],
    dense_model: str | Path | None = None,
    query_prefix: str = "",
    passage_prefix: str = "",
) -> SearchBackend:
    """Index ``passages`` in memory with the ``bm25`` or ``dense`` backend (the prefixes: dense only)."""
    if kind == "bm25":
        return BM25Backend.build(passages)
    if kind == "dense":
        return DenseBackend.build(passages, check_encoder_dir(dense_model), query_prefix, passage_prefix)
    raise ValueError(f"unknown retriever backend {kind!r}; expected 'bm25' or 'dense'")


def open_backend(
    kind: str,
    passages: Sequence[Passage],
    index_dir: str | Path | None = None,
    dense_model: str | Path | None = None,
    faiss_index: str | Path | None = None,
    query_prefix: str = "",
    passage_prefix: str = "",
) -> SearchBackend:
    """The backend a retriever config describes: the FAISS file ``faiss_index`` (dense) if set; else the index in
    ``index_dir`` if it holds one; else built (and saved in ``index_dir`` when it is set)."""
    if faiss_index is not None:
        if kind != "dense":
            raise ValueError(f"a FAISS index file needs the dense backend, not {kind!r}")
        return DenseBackend.from_faiss_file(faiss_index, passages, check_encoder_dir(dense_model), query_prefix)
    if index_dir is not None and (Path(index_dir) / INDEX_META_FILE).is_file():
        if kind == "bm25":
            return BM25Backend.load(index_dir, passages)
        if kind == "dense":
            return DenseBackend.load(index_dir, passages, check_encoder_dir(dense_model), query_prefix, passage_prefix)
    backend = build_backend(kind, passages, dense_model, query_prefix, passage_prefix)
    if index_dir is not None:
        backend.save(index_dir)
        logger.info("built a %s index of %d passages in %s", kind, len(passages), index_dir)
    return backend
