"""``retriever`` commands: ``serve`` (a Search-R1-compatible server), ``proxy`` (the latency model and tool limits
in front of a server you already run) and ``index`` (build and save an index).

``register(subparsers)`` adds them to the project CLI; each parsed command carries ``func(args) -> int``.
``python -m retriever serve ...`` runs the same commands on their own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from pydantic import ValidationError

from async_agent_rl.config import ConfigError, RetrieverConfig, RetrieverLimits, ToolLimitsConfig
from async_agent_rl.data.corpus import CorpusError, PassageList, read_corpus
from async_agent_rl.errors import error_line
from retriever.backends import build_backend, check_encoder_dir, check_faiss_file, open_backend
from retriever.latency import LATENCY_MODELS
from retriever.server import check_upstream, create_proxy_app, exposure_warning, serve_until_signalled

logger = logging.getLogger(__name__)

_DEFAULTS = RetrieverConfig()


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``retriever`` command with ``serve`` and ``index`` subcommands."""
    parser = subparsers.add_parser("retriever", help="the search tool: serve a corpus, build an index")
    sub = parser.add_subparsers(dest="retriever_command", required=True)

    serve = sub.add_parser("serve", help="serve POST /retrieve (Search-R1 protocol), /health and /metrics")
    serve.add_argument("--corpus", required=True, help="JSONL corpus ({id, contents} per line)")
    serve.add_argument("--index", default=None, help="index dir: loaded if it holds one, else built and saved there")
    serve.add_argument("--backend", choices=["bm25", "dense"], default=_DEFAULTS.backend)
    _add_dense_args(serve)
    serve.add_argument(
        "--faiss-index", default=None, help="an existing FAISS index file over the corpus (dense backend, no --index)"
    )
    serve.add_argument("--host", default=_DEFAULTS.host, help="bind address (default loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="0 = a free port (printed on start)")
    serve.add_argument("--topk", type=int, default=_DEFAULTS.topk, help="default topk for requests without one")
    serve.add_argument(
        "--batch-window-ms", type=float, default=_DEFAULTS.batch_window_ms, help="coalescing window (0 = no batching)"
    )
    serve.add_argument("--max-batch-queries", type=int, default=_DEFAULTS.max_batch_queries)
    limits = _DEFAULTS.limits
    serve.add_argument("--max-queries-per-request", type=int, default=limits.max_queries_per_request)
    serve.add_argument("--max-query-chars", type=int, default=limits.max_query_chars)
    serve.add_argument("--max-topk", type=int, default=limits.max_topk)
    serve.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes)
    serve.add_argument("--exit-with-parent", type=int, metavar="PID", default=None,
                       help="stop when process PID (the parent that started this server) is gone")
    _add_slow_tool_args(serve)
    serve.set_defaults(func=cmd_serve)

    proxy = sub.add_parser(
        "proxy", help="forward POST /retrieve to a Search-R1-compatible server, with the latency model and limits"
    )
    proxy.add_argument("--upstream", required=True, help="the server to forward to (http://host:port)")
    proxy.add_argument("--upstream-timeout-s", type=float, default=60.0,
                       help="give up on the upstream after this long (502/504 to the client, which retries)")
    proxy.add_argument("--host", default=_DEFAULTS.host, help="bind address (default loopback only)")
    proxy.add_argument("--port", type=int, default=8001, help="0 = a free port (printed on start)")
    proxy.add_argument("--topk", type=int, default=_DEFAULTS.topk, help=argparse.SUPPRESS)
    proxy.add_argument("--max-queries-per-request", type=int, default=limits.max_queries_per_request)
    proxy.add_argument("--max-query-chars", type=int, default=limits.max_query_chars)
    proxy.add_argument("--max-topk", type=int, default=limits.max_topk)
    proxy.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes)
    _add_slow_tool_args(proxy)
    proxy.set_defaults(func=cmd_proxy)

    index = sub.add_parser("index", help="build an index for a corpus and save it")
    index.add_argument("--corpus", required=True)
    index.add_argument("--out", required=True, help="index directory to write")
    index.add_argument("--backend", choices=["bm25", "dense"], default="bm25")
    _add_dense_args(index)
    index.set_defaults(func=cmd_index)
    return parser


def _add_slow_tool_args(parser: argparse.ArgumentParser) -> None:
    tl = _DEFAULTS.tool_limits
    parser.add_argument("--latency", default=_DEFAULTS.latency, metavar="MODEL",
                        help=f"tool-latency model added to every query: {', '.join(LATENCY_MODELS)} (default none)")
    parser.add_argument("--latency-seed", type=int, default=_DEFAULTS.latency_seed)
    parser.add_argument("--latency-hang-s", type=float, default=_DEFAULTS.latency_hang_s,
                        help="how long a call the latency model hangs is held (until the client disconnects)")
    parser.add_argument("--max-concurrent", type=int, default=tl.max_concurrent,
                        help="queries in flight to the tool at once; more wait (0 = no cap)")
    parser.add_argument("--rate-per-s", type=float, default=tl.rate_per_s,
                        help="token bucket: queries a second; more wait (0 = no rate limit)")
    parser.add_argument("--burst", type=int, default=tl.burst, help="token bucket size (0 = one second's worth)")


def _add_dense_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dense-model", default=None, help="encoder folder: sentence-transformers, or plain Hugging Face (e5)"
    )
    parser.add_argument("--query-prefix", default="", help="dense: put before every query (e5: 'query: ')")
    parser.add_argument("--passage-prefix", default="", help="dense: put before every passage (e5: 'passage: ')")


def _config_from_args(args: argparse.Namespace) -> RetrieverConfig:
    try:
        backend = {} if args.retriever_command == "proxy" else dict(
            backend=args.backend,
            index_dir=args.index,
            dense_model=args.dense_model,
            faiss_index=args.faiss_index,
            query_prefix=args.query_prefix,
            passage_prefix=args.passage_prefix,
            batch_window_ms=args.batch_window_ms,
            max_batch_queries=args.max_batch_queries,
        )
        return RetrieverConfig(
            host=args.host,
            port=args.port,
            topk=args.topk,
            **backend,
            limits=RetrieverLimits(
                max_queries_per_request=args.max_queries_per_request,
                max_query_chars=args.max_query_chars,
                max_topk=args.max_topk,
                max_body_bytes=args.max_body_bytes,
            ),
            latency=args.latency,
            latency_seed=args.latency_seed,
            latency_hang_s=args.latency_hang_s,
            tool_limits=ToolLimitsConfig(
                max_concurrent=args.max_concurrent, rate_per_s=args.rate_per_s, burst=args.burst
            ),
        )
    except ValidationError as e:  # one line naming each bad argument, like every other bad input
        errors = (f"{_flag(err['loc'])}: {err['msg'].removeprefix('Value error, ')}" for err in e.errors())
        raise ConfigError("; ".join(errors)) from None


def _flag(loc: tuple) -> str:
    """The command-line flag of a ``RetrieverConfig`` field (``host`` -> ``--host``, ``index_dir`` -> ``--index``)."""
    if not loc:
        return "arguments"
    name = str(loc[-1])
    return "--index" if name == "index_dir" else "--" + name.replace("_", "-")


def _read_nonempty(path: str) -> PassageList:
    passages = read_corpus(path)
    if not passages:
        raise CorpusError(f"corpus {path} has no passages: nothing to serve")
    return passages


def cmd_serve(args: argparse.Namespace) -> int:
    """Load (or build) the index, then serve until SIGINT/SIGTERM. Exit 2 with a message on bad input."""
    start = time.perf_counter()
    try:
        config = _config_from_args(args)
        if config.faiss_index is not None:  # before reading the corpus, which can take minutes
            check_faiss_file(config.faiss_index)
            check_encoder_dir(config.dense_model)
        passages = _read_nonempty(args.corpus)
        backend = open_backend(
            config.backend,
            passages,
            config.index_dir,
            config.dense_model,
            config.faiss_index,
            config.query_prefix,
            config.passage_prefix,
        )
    except (CorpusError, ImportError, ValueError) as e:
        return _fail(e)
    elapsed = time.perf_counter() - start
    logger.info("loaded %d passages and a %s index in %.1f s", len(passages), config.backend, elapsed)
    exposed = exposure_warning(config.host)
    if exposed:
        print(f"warning: {exposed}", file=sys.stderr, flush=True)
    asyncio.run(serve_until_signalled(backend, config, f"({len(passages)} passages, {config.backend})",
                                      parent_pid=args.exit_with_parent))
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    """Forward ``/retrieve`` to ``--upstream`` with the latency model and limits until SIGINT/SIGTERM."""
    try:
        config = _config_from_args(args)
        if not args.upstream_timeout_s > 0:
            raise ConfigError(f"--upstream-timeout-s: must be > 0, got {args.upstream_timeout_s}")
        check_upstream(args.upstream)
        app = create_proxy_app(args.upstream, config, timeout_s=args.upstream_timeout_s)
    except ValueError as e:
        return _fail(e)
    exposed = exposure_warning(config.host)
    if exposed:
        print(f"warning: {exposed}", file=sys.stderr, flush=True)
    asyncio.run(serve_until_signalled(None, config, f"(proxy to {args.upstream}, latency {config.latency})", app=app))
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    """Build the index from scratch (replacing what ``--out`` held) and save it."""
    start = time.perf_counter()
    try:
        passages = _read_nonempty(args.corpus)
        build_backend(args.backend, passages, args.dense_model, args.query_prefix, args.passage_prefix).save(args.out)
    except (CorpusError, ImportError, ValueError) as e:
        return _fail(e)
    print(f"indexed {len(passages)} passages ({args.backend}) into {args.out} in {time.perf_counter() - start:.1f} s")
    return 0


def _fail(error: Exception) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m retriever serve|index ...`` (the project CLI's ``retriever``)."""
    parser = argparse.ArgumentParser(prog="async-agent-rl")
    register(parser.add_subparsers(dest="command", required=True))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser.parse_args(["retriever", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except Exception as e:  # the project CLI's mapping: one error: line for a known failure (a busy port, ...)
        line = error_line(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
