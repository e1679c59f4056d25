"""A Search-R1-compatible retrieval server (aiohttp) with server-side batching, limits and Prometheus metrics.

Protocol (Search-R1 ``retrieval_server.py``; their own client and verl's search tool work unchanged):

- ``POST /retrieve`` with ``{"queries": [str, ...], "topk": int|null, "return_scores": bool}``. A missing, null or 0
  ``topk`` means the server default (``RetrieverConfig.topk``, 3); ``return_scores`` defaults to false; other keys are
  ignored. Reply ``{"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}``: one list per query,
  in request order, best first, at most ``topk`` hits (fewer, even none, is legal). With ``return_scores=false``
  each inner list holds the plain documents. JSON is written like Starlette's (UTF-8, compact separators).
- ``GET /health`` -> ``{"status": "ok", "backend": ...}``; ``GET /metrics`` -> Prometheus text format.
- Errors are JSON ``{"error": "..."}`` naming the problem: 400 for malformed JSON, wrong types and a ``topk`` over the
  cap; 413 for a body, a query count or a query length over the caps (``RetrieverConfig.limits``); 500 if the backend
  fails. No request can crash the server.

Batching: with ``batch_window_ms > 0`` the queries of concurrent requests are coalesced into one backend call, up to
``max_batch_queries`` queries per call. A call waits at most the window after the first query arrives (less once the
batch is full), and only one call runs at a time, so under load the batch grows to whatever arrived during the
previous call. Backend calls run in a worker thread so the event loop keeps accepting requests. ``0`` turns batching
off: every request makes its own backend call. A request whose client disconnected before its backend call started
is dropped unsearched (counted as ``client_gone``), so clients that time out and retry do not pile up dead work.

Slow tools (``retriever/latency.py``, ``retriever/tool_limits.py``; both off by default): every request passes a
:class:`ToolGate` before its search. The gate draws each query's latency from the configured model
(``retriever.latency``, seeded, in arrival order), waits first come first served for the tool limits
(``retriever.tool_limits``: concurrency cap, token bucket; a query over a limit waits, it is never refused), then
holds its slots while it sleeps the longest latency of its queries (``asyncio.sleep``, never blocking other
requests) and the search runs. A hung call is held ``latency_hang_s`` or until its client disconnects. A client that
disconnects while waiting or sleeping frees its place at once (counted as ``client_gone``). ``create_proxy_app``
puts the same gate in front of another Search-R1-compatible server (``retriever proxy --upstream URL``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from async_agent_rl.config import RetrieverConfig, RetrieverLimits, is_loopback
from async_agent_rl.errors import InputError
from async_agent_rl.search import Hit, SearchBackend
from retriever.latency import LatencySampler, latency_model
from retriever.tool_limits import ClientGone, ToolLimiter

logger = logging.getLogger(__name__)

# Metric names, defined once.
REQUESTS = "retriever_requests"  # counter, label code
QUERIES = "retriever_queries"  # counter
BATCH_QUERIES = "retriever_batch_queries"  # histogram: queries per backend call
REQUEST_LATENCY = "retriever_request_latency_seconds"  # histogram
BACKEND_LATENCY = "retriever_backend_latency_seconds"  # histogram: one backend call
ERRORS = "retriever_errors"  # counter, label kind
TOOL_LIMIT_WAITS = "retriever_tool_limit_waits"  # counter: queries that waited for a slot or a token
TOOL_LIMIT_WAIT = "retriever_tool_limit_wait_seconds"  # histogram: one request's wait at the limits
TOOL_INFLIGHT = "retriever_tool_inflight"  # gauge: queries in flight to the tool (past the limits)
ADDED_LATENCY = "retriever_added_latency_seconds"  # histogram: the latency model's delay of one query (no hangs)
SIMULATED_TIMEOUTS = "retriever_simulated_timeouts"  # counter: queries the latency model made hang

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    """The server's Prometheus metrics, in their own registry (one per server, so tests can run several)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(REQUESTS, "HTTP requests to /retrieve by status code", ["code"], registry=r)
        self.queries = Counter(QUERIES, "queries answered", registry=r)
        self.batch_queries = Histogram(BATCH_QUERIES, "queries per backend call", buckets=BATCH_BUCKETS, registry=r)
        self.request_latency = Histogram(
            REQUEST_LATENCY, "time from request to reply for /retrieve", buckets=LATENCY_BUCKETS, registry=r
        )
        self.backend_latency = Histogram(
            BACKEND_LATENCY, "duration of one backend search call", buckets=LATENCY_BUCKETS, registry=r
        )
        self.errors = Counter(ERRORS, "failed /retrieve requests by kind", ["kind"], registry=r)
        self.tool_limit_waits = Counter(
            TOOL_LIMIT_WAITS, "queries that waited for a slot or a token of retriever.tool_limits", registry=r
        )
        self.tool_limit_wait = Histogram(
            TOOL_LIMIT_WAIT, "one request's wait at the tool limits (0 when it went at once)", buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.tool_inflight = Gauge(TOOL_INFLIGHT, "queries in flight to the tool, past the limits", registry=r)
        self.added_latency = Histogram(
            ADDED_LATENCY, "delay the latency model drew for one query (hangs not included)", buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.simulated_timeouts = Counter(SIMULATED_TIMEOUTS, "queries the latency model made hang", registry=r)


# ------------------------------------------------------------------------------------------------ request parsing
class RequestError(Exception):
    """A bad request: HTTP ``status``, a message for the client, and a metric ``kind``."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class RetrieveRequest:
    queries: list[str]
    topk: int
    return_scores: bool


def parse_retrieve_request(body: bytes, default_topk: int, limits: RetrieverLimits) -> RetrieveRequest:
    """Validate a ``/retrieve`` body (already within the size cap); raises :class:`RequestError`."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, "malformed_json", f"request body is not valid JSON: {e}") from None
    except RecursionError:  # the parser recurses per nesting level: tens of thousands of "[" exhaust the stack
        raise RequestError(400, "malformed_json", "request body is JSON nested too deeply to parse") from None
    if not isinstance(payload, dict):
        raise RequestError(400, "bad_type", f"request body must be a JSON object, got {type(payload).__name__}")
    queries = payload.get("queries")
    if not isinstance(queries, list):
        raise RequestError(400, "bad_type", f"'queries' must be a list of strings, got {type(queries).__name__}")
    if len(queries) > limits.max_queries_per_request:
        raise RequestError(
            413, "too_many_queries",
            f"{len(queries)} queries in one request exceed the limit of {limits.max_queries_per_request}",
        )
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(400, "bad_type", f"queries[{i}] must be a string, got {type(q).__name__}")
        if len(q) > limits.max_query_chars:
            raise RequestError(
                413,
                "query_too_long",
                f"queries[{i}] has {len(q)} characters, over the limit of {limits.max_query_chars}",
            )
    topk = payload.get("topk")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int)):
        raise RequestError(400, "bad_type", f"'topk' must be an integer or null, got {type(topk).__name__}")
    if topk is not None and topk < 0:
        raise RequestError(400, "bad_value", f"'topk' must be >= 0, got {topk}")
    topk = topk or default_topk  # Search-R1: a missing, null or 0 topk means the server default
    if topk > limits.max_topk:
        raise RequestError(400, "topk_too_large", f"'topk' {topk} exceeds the limit of {limits.max_topk}")
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError(400, "bad_type", f"'return_scores' must be a boolean, got {type(return_scores).__name__}")
    return RetrieveRequest(queries, topk, return_scores)


def format_result(hits: list[list[Hit]], return_scores: bool) -> dict[str, Any]:
    """The ``/retrieve`` reply for per-query hit lists."""
    def document(h: Hit) -> dict[str, str]:
        return {"id": h.id, "contents": h.contents}

    if return_scores:
        return {"result": [[{"document": document(h), "score": h.score} for h in row] for row in hits]}
    return {"result": [[document(h) for h in row] for row in hits]}


def _dumps(obj: Any) -> str:
    # Byte-compatible with Starlette's JSONResponse, which Search-R1's FastAPI server uses.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status, dumps=_dumps)


# ------------------------------------------------------------------------------------------------------- batching
def _always_alive() -> bool:
    return True


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    alive: Callable[[], bool]
    future: asyncio.Future = field(repr=False)


class QueryBatcher:
    """Turns concurrent ``search`` calls into few backend calls (see the module docstring for the policy).

    ``alive`` tells whether the caller still wants the answer: requests whose client went away before their backend
    call started are dropped with :class:`ClientGone`, so clients that time out and retry cannot pile abandoned work
    onto an overloaded server.
    """

    def __init__(
        self,
        backend: SearchBackend,
        executor: ThreadPoolExecutor,
        metrics: ServerMetrics,
        window_s: float,
        max_batch_queries: int,
    ):
        self.backend = backend
        self.executor = executor
        self.metrics = metrics
        self.window_s = window_s
        self.max_batch_queries = max_batch_queries
        self._pending: list[_Pending] = []
        self._pending_queries = 0
        self._arrived = asyncio.Event()
        self._window_closed: asyncio.Future | None = None  # resolved by the window's timer, or early by a full batch
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.window_s > 0:
            self._task = asyncio.create_task(self._run(), name="retriever-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(RuntimeError("retrieval server is shutting down"))

    async def search(
        self, queries: list[str], topk: int, alive: Callable[[], bool] = _always_alive
    ) -> list[list[Hit]]:
        if not queries:
            return []
        if self._task is None:
            return await self._call(queries, topk, alive)
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(queries, topk, alive, future))
        self._pending_queries += len(queries)
        self._arrived.set()
        if self._pending_queries >= self.max_batch_queries and self._window_closed is not None:
            _resolve(self._window_closed)
        return await future

    async def _call(
        self, queries: list[str], topk: int, alive: Callable[[], bool] = _always_alive
    ) -> list[list[Hit]]:
        def work() -> list[list[Hit]] | None:
            if not alive():  # checked in the worker thread, right before the work would start
                return None
            start = time.perf_counter()
            hits = self.backend.search(queries, topk)
            self.metrics.batch_queries.observe(len(queries))
            self.metrics.backend_latency.observe(time.perf_counter() - start)
            return hits

        hits = await asyncio.get_running_loop().run_in_executor(self.executor, work)
        if hits is None:
            raise ClientGone()
        return hits

    def _take_batch(self) -> list[_Pending]:
        """Pop whole requests, oldest first, up to ``max_batch_queries`` queries (always at least one request)."""
        batch, n = [], 0
        while self._pending and (not batch or n + len(self._pending[0].queries) <= self.max_batch_queries):
            item = self._pending.pop(0)
            n += len(item.queries)
            if item.alive():
                batch.append(item)
            elif not item.future.done():
                item.future.set_exception(ClientGone())
        self._pending_queries -= n
        if not self._pending:
            self._arrived.clear()
        return batch

    async def _run(self) -> None:
        while True:
            await self._arrived.wait()
            if self._pending_queries < self.max_batch_queries:
                loop = asyncio.get_running_loop()
                self._window_closed = loop.create_future()
                timer = loop.call_later(self.window_s, _resolve, self._window_closed)
                await self._window_closed
                timer.cancel()
                self._window_closed = None
            batch = self._take_batch()
            if not batch:
                continue
            queries = [q for item in batch for q in item.queries]
            # One call at the largest topk; every request keeps its own best-first prefix.
            topk = max(item.topk for item in batch)
            try:
                hits = await self._call(queries, topk)
            except Exception as e:  # the backend failed: every request in the batch gets the error
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            offset = 0
            for item in batch:
                rows = hits[offset : offset + len(item.queries)]
                offset += len(item.queries)
                if not item.future.done():
                    item.future.set_result([row[: item.topk] for row in rows])


# ---------------------------------------------------------------------------------------------------- slow tools
class ToolGate:
    """The latency model and the tool limits of ``config``, in front of every search (module docstring).

    ``async with gate.call(n, alive): ...search...``: draws the ``n`` queries' latencies (arrival order), waits at
    the limits, sleeps the longest latency, runs the body, then frees the slots. Raises :class:`ClientGone` when
    ``alive()`` turns false while waiting or sleeping (checked every ``poll_s``).
    """

    def __init__(self, config: RetrieverConfig, metrics: ServerMetrics, poll_s: float = 0.1):
        self.sampler = LatencySampler(latency_model(config.latency), config.latency_seed)
        self.hang_s = config.latency_hang_s
        t = config.tool_limits
        self.limiter = ToolLimiter(t.max_concurrent, t.rate_per_s, t.burst, poll_s=max(poll_s, 0.01))
        self.metrics = metrics
        self.poll_s = poll_s

    async def _sleep(self, seconds: float, alive: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while (left := end - loop.time()) > 0:
            if not alive():
                raise ClientGone()
            await asyncio.sleep(min(left, self.poll_s))

    @asynccontextmanager
    async def call(self, n: int, alive: Callable[[], bool] = _always_alive) -> AsyncIterator[None]:
        delay = 0.0
        if not self.sampler.model.is_none:
            for d in self.sampler.sample_many(n):
                if d == float("inf"):
                    self.metrics.simulated_timeouts.inc()
                    d = self.hang_s
                else:
                    self.metrics.added_latency.observe(d)
                delay = max(delay, d)
        if self.limiter.enabled:  # a query that waits is counted when it starts waiting, whether it gets through
            start = time.perf_counter()
            try:
                await self.limiter.acquire(n, alive, on_wait=lambda: self.metrics.tool_limit_waits.inc(n))
            finally:
                self.metrics.tool_limit_wait.observe(time.perf_counter() - start)
        self.metrics.tool_inflight.inc(n)
        try:
            if delay > 0:
                await self._sleep(delay, alive)
            yield
        finally:
            self.metrics.tool_inflight.dec(n)
            if self.limiter.enabled:
                self.limiter.release(n)


# ------------------------------------------------------------------------------------------------------------ app
Answer = Callable[[web.Request, bytes, RetrieveRequest], Awaitable[web.Response]]


def _retrieve_handler(config: RetrieverConfig, metrics: ServerMetrics, gate: ToolGate, answer: Answer
                      ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``POST /retrieve``: body caps, parsing, the gate, then ``answer`` (search here, or forward upstream)."""
    limits = config.limits

    async def retrieve(request: web.Request) -> web.Response:
        start = time.perf_counter()
        try:
            if request.content_length is not None and request.content_length > limits.max_body_bytes:
                raise RequestError(
                    413, "body_too_large",
                    f"request body of {request.content_length} bytes exceeds the limit of {limits.max_body_bytes}",
                )
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(
                    413, "body_too_large", f"request body exceeds the limit of {limits.max_body_bytes} bytes"
                ) from None
            except (ConnectionError, aiohttp.ClientPayloadError):  # the client hung up before its body was in
                raise ClientGone() from None
            req = parse_retrieve_request(body, config.topk, limits)
            alive = lambda: not _disconnected(request)  # noqa: E731
            if req.queries:
                async with gate.call(len(req.queries), alive):
                    response = await answer(request, body, req)
            else:
                response = await answer(request, body, req)
            if response.status == 200:
                metrics.queries.inc(len(req.queries))
        except RequestError as e:
            metrics.errors.labels(e.kind).inc()
            response = _error(e.status, e.message)
        except ClientGone:
            metrics.errors.labels("client_gone").inc()
            response = _error(499, "client closed the request before it was searched")  # nginx's code; unseen
        except Exception as e:  # never let one request take the server down
            logger.exception("retrieve failed")
            metrics.errors.labels("backend").inc()
            response = _error(500, f"search backend failed: {type(e).__name__}: {e}")
        metrics.requests.labels(str(response.status)).inc()
        metrics.request_latency.observe(time.perf_counter() - start)
        return response

    return retrieve


def _app(config: RetrieverConfig, metrics: ServerMetrics, retrieve: Callable[[web.Request], Awaitable[web.Response]],
         health_body: dict[str, str]) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response(health_body, dumps=_dumps)

    async def prometheus(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @web.middleware
    async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp's own 404/405/... answers as JSON errors too."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            metrics.errors.labels("http").inc()
            return _error(e.status, f"{e.reason}: {request.method} {request.path}")

    # aiohttp enforces the body cap itself for bodies without a Content-Length (chunked uploads).
    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=[json_errors])
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    return app


def create_app(
    backend: SearchBackend,
    config: RetrieverConfig | None = None,
    metrics: ServerMetrics | None = None,
) -> web.Application:
    """The aiohttp application for ``backend`` with ``config``'s default topk, batching and limits.

    Backend calls run one at a time in a single worker thread: backends need not be thread-safe, and a CPU-bound
    search gains nothing from more threads under the GIL.
    """
    config = config if config is not None else RetrieverConfig()
    metrics = metrics if metrics is not None else ServerMetrics()
    backend_name = getattr(backend, "name", type(backend).__name__)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever-backend")
    batcher = QueryBatcher(backend, executor, metrics, config.batch_window_ms / 1000.0, config.max_batch_queries)

    async def answer(request: web.Request, body: bytes, req: RetrieveRequest) -> web.Response:
        hits = await batcher.search(req.queries, req.topk, alive=lambda: not _disconnected(request))
        return web.Response(text=_dumps(format_result(hits, req.return_scores)), content_type="application/json")

    async def on_startup(app: web.Application) -> None:
        batcher.start()

    async def on_cleanup(app: web.Application) -> None:
        await batcher.stop()
        executor.shutdown(wait=False, cancel_futures=True)

    retrieve = _retrieve_handler(config, metrics, ToolGate(config, metrics), answer)
    app = _app(config, metrics, retrieve, {"status": "ok", "backend": backend_name})
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def create_proxy_app(
    upstream: str,
    config: RetrieverConfig | None = None,
    metrics: ServerMetrics | None = None,
    timeout_s: float = 60.0,
) -> web.Application:
    """The same ``/retrieve`` (caps, latency model, tool limits) in front of another Search-R1-compatible server:
    each request's body goes to ``upstream``'s ``/retrieve`` unchanged and its reply comes back unchanged (status
    and body). An upstream that cannot be reached or does not answer within ``timeout_s`` gives 502/504 with a
    JSON error, which the rollout's client retries."""
    config = config if config is not None else RetrieverConfig()
    metrics = metrics if metrics is not None else ServerMetrics()
    url = upstream_retrieve_url(upstream)
    state: dict[str, aiohttp.ClientSession] = {}

    async def answer(request: web.Request, body: bytes, req: RetrieveRequest) -> web.Response:
        session = state["session"]
        try:
            async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                reply, status = await resp.read(), resp.status
                content_type = resp.content_type or "application/json"
        except asyncio.TimeoutError:
            metrics.errors.labels("upstream").inc()
            return _error(504, f"upstream {url} did not answer within {timeout_s:g} s")
        except aiohttp.ClientError as e:
            metrics.errors.labels("upstream").inc()
            return _error(502, f"upstream {url}: {type(e).__name__}: {e}")
        return web.Response(body=reply, status=status, content_type=content_type)

    async def on_startup(app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), raise_for_status=False, trust_env=False
        )

    async def on_cleanup(app: web.Application) -> None:
        await state["session"].close()

    retrieve = _retrieve_handler(config, metrics, ToolGate(config, metrics), answer)
    app = _app(config, metrics, retrieve, {"status": "ok", "backend": "proxy", "upstream": url})
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def upstream_retrieve_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/retrieve``; a URL with a path is used as given."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InputError(f"--upstream must be an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/") + "/retrieve" if parts.path in ("", "/") else url


def check_upstream(url: str, timeout_s: float = 5.0) -> None:
    """Raise :class:`InputError` when nothing listens at the upstream's host and port (a TCP connect)."""
    parts = urlsplit(upstream_retrieve_url(url))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise InputError(f"upstream {url} is not reachable: {e.strerror or e}") from None


# ------------------------------------------------------------------------------------------------------- running
def exposure_warning(host: str) -> str | None:
    """The warning for a server bound beyond loopback (``retriever.host``, ``retriever serve --host``): it has no
    authentication, so everyone who can reach the address can query the corpus and load the server. None on
    loopback."""
    if is_loopback(host):
        return None
    return (f"the retrieval server listens on {host}, beyond loopback, without authentication: anyone who can reach "
            "that address can query the corpus and load the server (use 127.0.0.1 unless other machines must reach "
            "it, and then a firewall)")


class MalformedRequestLog(logging.Filter):
    """aiohttp logs each malformed request (a bad header, a line too long, a broken body length) at ERROR with a
    traceback: a wrong client or a port scan floods the server's log. On the ``aiohttp.server`` logger this turns
    such a record into one WARNING line without the traceback, and of repeats of the same kind logs the 1st, 10th,
    100th and every 1000th, each with its count (``malformed_requests`` has them all)."""

    def __init__(self) -> None:
        super().__init__()
        self.malformed_requests: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        kind = type(exc).__name__
        n = self.malformed_requests[kind] = self.malformed_requests.get(kind, 0) + 1
        if n not in (1, 10, 100) and n % 1000:
            return False
        reason = str(getattr(exc, "message", "") or exc).strip().splitlines()
        what = record.getMessage()
        record.msg = "%s: refused (%s: %s); %d such request(s) so far"
        record.args = (what, kind, reason[0][:200] if reason else "", n)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True


MALFORMED = MalformedRequestLog()
logging.getLogger("aiohttp.server").addFilter(MALFORMED)


@asynccontextmanager
async def serve(
    backend: SearchBackend, config: RetrieverConfig | None = None, metrics: ServerMetrics | None = None
) -> AsyncIterator[str]:
    """Run the server on ``config.host:config.port`` (port 0 = a free port) in the current loop; yields its URL.

    ``async with serve(backend, cfg) as url: ...`` then POST to ``f"{url}/retrieve"``.
    """
    config = config if config is not None else RetrieverConfig()
    async with serve_app(create_app(backend, config, metrics), config) as url:
        yield url


@asynccontextmanager
async def serve_app(app: web.Application, config: RetrieverConfig) -> AsyncIterator[str]:
    """Run ``app`` (``create_app``, ``create_proxy_app``) on ``config.host:config.port``; yields its URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=2048)
        try:
            await site.start()
        except socket.gaierror as e:  # a host name that does not resolve
            raise InputError(f"cannot listen on {config.host}:{config.port}: {config.host!r} is not an address of "
                             f"this machine (the name does not resolve: {e.strerror})") from None
        except OSError as e:  # e.g. the port is in use: name the address (errno kept for the CLI's error line)
            raise OSError(e.errno, f"cannot listen on {config.host}:{config.port}: {e.strerror}") from None
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


class ServerThread:
    """A server running its own event loop in a daemon thread; ``url``, ``stop()``, and a context manager."""

    def __init__(
        self, backend: SearchBackend | None, config: RetrieverConfig | None = None,
        metrics: ServerMetrics | None = None, app: Callable[[], web.Application] | None = None,
    ):
        """``app``: serve what it makes (``create_proxy_app``) instead of ``backend``."""
        self.url = ""
        self._app = app
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(backend, config, metrics),), name="retriever-server", daemon=True
        )

    async def _main(
        self, backend: SearchBackend | None, config: RetrieverConfig | None, metrics: ServerMetrics | None
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            config = config if config is not None else RetrieverConfig()
            if self._app is None:
                assert backend is not None
                app = create_app(backend, config, metrics)
            else:
                app = self._app()
            async with serve_app(app, config) as url:
                self.url = url
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:
            self._error = e
            self._ready.set()

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"retrieval server did not start within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server_in_thread(
    backend: SearchBackend, config: RetrieverConfig | None = None, metrics: ServerMetrics | None = None
) -> ServerThread:
    """Start a server in a background thread and return it once it listens (``.url``; ``.stop()`` when done)."""
    return ServerThread(backend, config, metrics).start()


async def serve_until_signalled(backend: SearchBackend | None, config: RetrieverConfig, announce: str = "",
                                parent_pid: int | None = None, app: web.Application | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or, with ``parent_pid``, until that process is gone: a server a training started
    must not outlive it, even when the training is killed with SIGKILL and cleans nothing up); print
    ``retriever listening on URL`` (flushed) once listening. ``app`` instead of ``backend``: serve that app (the
    proxy)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def watch_parent() -> None:
        while os.getppid() == parent_pid:  # re-parented (to init or a subreaper) once the parent has died
            await asyncio.sleep(0.5)
        logger.warning("retriever: parent process %d is gone; shutting down", parent_pid)
        stop.set()

    if app is None:
        assert backend is not None
        app = create_app(backend, config)
    async with serve_app(app, config) as url:
        print(f"retriever listening on {url} {announce}".rstrip(), flush=True)
        watcher = asyncio.create_task(watch_parent()) if parent_pid is not None else None
        await stop.wait()
        if watcher is not None:
            watcher.cancel()


# --------------------------------------------------------------------------------------------------- subprocess
_LISTENING = re.compile(r"retriever listening on (http://\S+)")


class ServerProcess:
    """A ``retriever serve`` child process; ``url`` once it listens, ``stop()`` terminates it. A driver that owns it
    can ask whether it still answers (``healthy``) and start it again on the same port (``restart``), so the
    clients' URL stays valid."""

    def __init__(self, argv: list[str], timeout_s: float = 120.0, log_file: str | Path | None = None):
        """``log_file``: the child's stderr (its log lines) goes there instead of this process' stderr."""
        self.argv = argv
        self.timeout_s = timeout_s
        self.log_file = Path(log_file) if log_file is not None else None
        self.error: str | None = None  # the child's own `error:` line, raised here instead of printed
        self.restarts = 0
        self._start(argv)

    def _start(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: Queue[str | None] = Queue()
        proc = self.proc

        def pump() -> None:  # keep draining stdout so the child never blocks on a full pipe
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        def pump_stderr() -> None:  # the child's log goes on to ours, or to log_file
            assert proc.stderr is not None
            out = self.log_file.open("a") if self.log_file is not None else sys.stderr
            try:
                for line in proc.stderr:
                    if line.startswith("error: "):
                        self.error = line[len("error: "):].strip()
                    else:
                        out.write(line)
                        out.flush()
            finally:
                if out is not sys.stderr:
                    out.close()

        threading.Thread(target=pump, name="retriever-stdout", daemon=True).start()
        stderr_thread = threading.Thread(target=pump_stderr, name="retriever-stderr", daemon=True)
        stderr_thread.start()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except Empty:
                self.stop()
                raise TimeoutError(f"retrieval server did not start within {self.timeout_s} s: {' '.join(argv)}") \
                    from None
            if line is None:
                code = proc.wait()
                stderr_thread.join(5)
                if self.error is not None:
                    raise InputError(f"retrieval server: {self.error}")
                where = f"; its log: {self.log_file}" if self.log_file is not None else ""
                raise RuntimeError(f"retrieval server exited with code {code} before listening: {' '.join(argv)}{where}")
            match = _LISTENING.search(line)
            if match:
                self.url = match.group(1)
                return

    def healthy(self, timeout_s: float = 10.0) -> str | None:
        """None while the server runs and answers ``GET /health`` within ``timeout_s``; else why not (it exited,
        with its code or signal; or it did not answer: hung, stopped)."""
        code = self.proc.poll()
        if code is not None:
            return f"exited ({f'signal {-code}' if code < 0 else f'code {code}'})"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
        try:
            with opener.open(self.url + "/health", timeout=timeout_s) as r:
                return None if r.status == 200 else f"answered /health with HTTP {r.status}"
        except (OSError, ValueError) as e:
            return f"did not answer /health within {timeout_s:g} s ({type(e).__name__})"

    def restart(self) -> str:
        """Kill this server (it is dead or not answering: nothing to shut down gracefully) and start it again on the
        same port; its URL."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        port = urlsplit(self.url).port
        argv = list(self.argv)
        argv[argv.index("--port") + 1] = str(port)
        self.error = None
        self._start(argv)
        self.restarts += 1
        return self.url

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # also a stopped (SIGSTOP) one, which never handles the terminate
        return self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def slow_tool_args(c: RetrieverConfig) -> list[str]:
    """The ``retriever serve|proxy`` flags of ``c``'s latency model and tool limits."""
    t = c.tool_limits
    return ["--latency", c.latency, "--latency-seed", str(c.latency_seed), "--latency-hang-s", str(c.latency_hang_s),
            "--max-concurrent", str(t.max_concurrent), "--rate-per-s", str(t.rate_per_s), "--burst", str(t.burst)]


def spawn_server(corpus: str | Path, config: RetrieverConfig | None = None, timeout_s: float = 120.0,
                 log_file: str | Path | None = None) -> ServerProcess:
    """Run ``python -m retriever serve`` for ``corpus`` with every setting of ``config``."""
    c = config if config is not None else RetrieverConfig()
    argv = [
        sys.executable, "-m", "retriever", "serve", "--corpus", str(corpus),
        "--backend", c.backend, "--host", c.host, "--port", str(c.port), "--topk", str(c.topk),
        "--batch-window-ms", str(c.batch_window_ms), "--max-batch-queries", str(c.max_batch_queries),
        "--max-queries-per-request", str(c.limits.max_queries_per_request),
        "--max-query-chars", str(c.limits.max_query_chars), "--max-topk", str(c.limits.max_topk),
        "--max-body-bytes", str(c.limits.max_body_bytes), "--exit-with-parent", str(os.getpid()),
        *slow_tool_args(c),
    ]  # fmt: skip
    if c.index_dir is not None:
        argv += ["--index", c.index_dir]
    if c.dense_model is not None:
        argv += ["--dense-model", c.dense_model]
    if c.faiss_index is not None:
        argv += ["--faiss-index", c.faiss_index]
    argv += ["--query-prefix", c.query_prefix, "--passage-prefix", c.passage_prefix]
    return ServerProcess(argv, timeout_s, log_file)
