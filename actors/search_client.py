"""The rollout actors' client for any Search-R1-compatible ``/retrieve`` server.

One :class:`SearchClient` per actor process shares one ``aiohttp`` session and its connection pool
(``SearchClientConfig.pool_size`` connections) across all in-flight episodes.

Failure contract: each attempt has ``timeout_s``; a timeout, a connection error, HTTP 5xx/408/429, or a reply that
is not valid JSON is retried after a full-jitter exponential backoff, ``uniform(0, min(backoff_max_s,
backoff_base_s * 2**(n-1))``) before retry ``n``, up to ``retries`` retries, and never past ``deadline_s`` after the
call started (the last attempt's timeout and every sleep are clipped to the deadline). A reply in the wrong shape
and any other 4xx are not retried (asking again gives the same answer). When no attempt succeeds the call raises
:class:`SearchError` with the kind of the last failure; the episode turns it into an observation instead of
crashing the actor. Callers that get a result never see the failed attempts, only the counters do.

The client always sends ``return_scores: true`` (Search-R1's ``false`` path is broken upstream) and accepts
documents without ``id`` (Search-R1's pyserini BM25 server omits it).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from async_agent_rl.config import SearchClientConfig
from async_agent_rl.episode import ErrorKind, SearchError
from async_agent_rl.stats import SearchStats
from async_agent_rl.search import Hit

ERROR_KINDS: tuple[ErrorKind, ...] = ("timeout", "connection", "http_status", "bad_reply")
RETRYABLE_STATUS = frozenset({408, 429})


def retrieve_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/retrieve``; a URL with a path is used as given."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"retriever URL must be http(s)://host:port[/path], got {url!r}")
    return url.rstrip("/") + "/retrieve" if parts.path in ("", "/") else url


def _bad(message: str) -> SearchError:
    return SearchError("bad_reply", message, status=200)  # a well-formed reply in the wrong shape: not retried


def parse_reply(payload: Any, num_queries: int) -> list[list[Hit]]:
    """Validate a ``return_scores=true`` reply; raises ``SearchError(kind="bad_reply")`` naming the first problem."""
    if not isinstance(payload, dict) or "result" not in payload:
        raise _bad(f"expected a JSON object with 'result', got {type(payload).__name__}")
    result = payload["result"]
    if not isinstance(result, list) or len(result) != num_queries:
        got = f"{len(result)} lists" if isinstance(result, list) else type(result).__name__
        raise _bad(f"'result' must be one list per query ({num_queries}), got {got}")
    rows: list[list[Hit]] = []
    for i, row in enumerate(result):
        if not isinstance(row, list):
            raise _bad(f"result[{i}] must be a list, got {type(row).__name__}")
        hits = []
        for j, item in enumerate(row):
            where = f"result[{i}][{j}]"
            doc = item.get("document") if isinstance(item, dict) else None
            if not isinstance(doc, dict):
                raise _bad(f"{where} must be {{'document': {{...}}, 'score': number}}, got {str(item)[:80]!r}")
            contents, pid, score = doc.get("contents"), doc.get("id", ""), item.get("score")
            if not isinstance(contents, str):
                raise _bad(f"{where}.document.contents must be a string, got {type(contents).__name__}")
            if isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise _bad(f"{where}.document.id must be a string, got {type(pid).__name__}")
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
                raise _bad(f"{where}.score must be a finite number, got {score!r}")
            hits.append(Hit(str(pid), contents, float(score)))
        rows.append(hits)
    return rows


class SearchClient:
    """Async client: ``await client.search(query)`` -> hits best first; ``search_many`` sends one batched request.

    Use as ``async with SearchClient(url, cfg) as client:`` (or call ``close()``); the session is created on first
    use inside the running event loop. ``counters()`` gives requests/attempts/retries/failures and per-kind errors.
    """

    def __init__(
        self,
        url: str,
        config: SearchClientConfig | None = None,
        topk: int | None = None,
        rng: random.Random | None = None,
    ):
        self.url = retrieve_url(url)
        self.config = config if config is not None else SearchClientConfig()
        self.topk = topk  # None: the server's default (Search-R1: 3)
        self._rng = rng if rng is not None else random.Random()
        self._session: aiohttp.ClientSession | None = None
        self._counts: Counter[str] = Counter()

    async def __aenter__(self) -> "SearchClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def counters(self) -> dict[str, int]:
        """Monotonic counts: requests (calls), attempts, retries, failures (calls that raised), errors_<kind>."""
        keys = ["requests", "attempts", "retries", "failures"] + [f"errors_{k}" for k in ERROR_KINDS]
        return {k: self._counts[k] for k in keys}

    def stats(self) -> SearchStats:
        c = self._counts
        return SearchStats(requests=c["requests"], attempts=c["attempts"], retries=c["retries"],
                           failures=c["failures"], errors={k: c[f"errors_{k}"] for k in ERROR_KINDS})

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.pool_size), raise_for_status=False
            )
        return self._session

    async def search(self, query: str, topk: int | None = None) -> list[Hit]:
        return (await self.search_many([query], topk))[0]

    async def search_many(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]:
        """One ``/retrieve`` request for all ``queries``; one hit list per query, in order."""
        if not queries:
            return []
        cfg = self.config
        payload = {"queries": list(queries), "topk": topk if topk is not None else self.topk, "return_scores": True}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.deadline_s
        self._counts["requests"] += 1
        attempt = 0
        while True:
            attempt += 1
            self._counts["attempts"] += 1
            try:
                return await self._attempt(payload, len(queries), min(cfg.timeout_s, deadline - loop.time()))
            except SearchError as e:
                self._counts[f"errors_{e.kind}"] += 1
                error = e
            delay = self._rng.uniform(0.0, min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempt - 1)))
            remaining = deadline - loop.time()
            if not error.retryable or attempt > cfg.retries or remaining <= delay:
                self._counts["failures"] += 1
                raise SearchError(
                    error.kind, f"{error.message} (after {attempt} attempt(s))", attempts=attempt, status=error.status
                ) from error
            self._counts["retries"] += 1
            await asyncio.sleep(delay)

    async def _attempt(self, payload: dict[str, Any], num_queries: int, timeout_s: float) -> list[list[Hit]]:
        try:
            async with self._get_session().post(
                self.url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                status, body = resp.status, await resp.read()
        except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
            raise SearchError("timeout", f"no reply from {self.url} within {timeout_s:.3g} s", retryable=True) from None
        except aiohttp.ClientError as e:
            raise SearchError("connection", f"{self.url}: {type(e).__name__}: {e}", retryable=True) from None
        if status != 200:
            text = body[:200].decode("utf-8", "replace")
            retryable = status >= 500 or status in RETRYABLE_STATUS
            raise SearchError(
                "http_status", f"{self.url} answered HTTP {status}: {text}", status=status, retryable=retryable
            )
        try:
            reply = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            # A cut-off body from a crashing server looks like this; asking again may succeed.
            raise SearchError(
                "bad_reply", f"{self.url} sent a reply that is not JSON: {e}", status=status, retryable=True
            ) from None
        return parse_reply(reply, num_queries)
