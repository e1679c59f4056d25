"""What a search returns and who can answer one: the rollout's wire type and the search tools' interfaces.

``Hit`` is one retrieved passage (the retriever server's reply items, what ``actors.search_client`` decodes and
``async_agent_rl.render`` shows the model). ``SearchBackend`` is anything that answers a batch of queries with ranked
passages (the BM25 and dense backends in ``retriever/``). ``InProcessSearch`` puts a backend behind the search
client's interface without a server: the warm start's demonstrations use it.

Contract of :meth:`SearchBackend.search`: ``search(queries, topk)`` returns one list per query, in query order, each
with at most ``topk`` hits, best first (descending score). Fewer than ``topk`` hits, even none, is legal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from async_agent_rl.data.corpus import TitledContents


@dataclass(frozen=True)
class Hit(TitledContents):
    """One retrieved passage with its score; ``title``/``text`` split ``contents`` like :class:`Passage`."""

    id: str
    contents: str
    score: float


class SearchBackend(Protocol):
    """Anything that answers a batch of queries with ranked passages (see the module docstring)."""

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]: ...


class InProcessSearch:
    """A search tool with the ``actors.search_client.SearchClient`` interface (``await search(query)``,
    ``await search_many(queries)``) answered by a backend in this process, without a server.

    Results are cached per ``(query, topk)`` (backends are deterministic); :meth:`prefetch` fills the cache with one
    batched backend call. Backend exceptions propagate as they are (no ``SearchError``: nothing here is transient).
    """

    def __init__(self, backend: SearchBackend, topk: int):
        self.backend = backend
        self.topk = topk
        self._cache: dict[tuple[str, int], list[Hit]] = {}

    def prefetch(self, queries: Sequence[str], topk: int | None = None) -> None:
        k = self.topk if topk is None else topk
        missing = sorted({q for q in queries if q} - {q for q, kk in self._cache if kk == k})
        if missing:
            self._cache.update(((q, k), hits) for q, hits in zip(missing, self.backend.search(missing, k)))

    def search_now(self, query: str, topk: int | None = None) -> list[Hit]:
        """The hits for ``query`` (cached), synchronously."""
        k = self.topk if topk is None else topk
        if (query, k) not in self._cache:
            self._cache[(query, k)] = self.backend.search([query], k)[0]
        return self._cache[(query, k)]

    async def search(self, query: str, topk: int | None = None) -> list[Hit]:
        return self.search_now(query, topk)

    async def search_many(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]:
        self.prefetch(queries, topk)
        return [self.search_now(q, topk) for q in queries]

    async def close(self) -> None:
        pass
