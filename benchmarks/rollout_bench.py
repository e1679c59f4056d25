"""Rollout benchmark, one run, same engine, model, questions and retriever server for every arm.

(a) per-trajectory asynchronous rollout (``RolloutWorker``: every episode its own task, K in flight) against a
    batch-synchronous turn loop as in Search-R1 (every active episode generates, then every one searches, turn by
    turn). The synchronous arm runs the SAME ``EpisodeRunner`` code with two barriers per turn around generation
    (all active episodes start their turn together and wait for the slowest), processing batches of K episodes.
(b) orchestration overhead (latency ``none`` only): the asynchronous rollout's generated tokens/s divided by the
    raw engine's tokens/s when it generates the same episodes' turns right after, as chains at the same concurrency
    (same token counts, the recorded observations appended, no stop strings, no tools; ``run_raw``).
(c) search latency (``--latency none,web,local``): one block of both arms per model, all in one run. The harness
    wraps the search tool the ``EpisodeRunner`` calls (``LatencySearch``, the ``SearchTool`` protocol of
    ``async_agent_rl.episode``) so that every call sleeps a sampled latency (``asyncio.sleep``) and then returns the
    real retriever's answer. The retriever server itself is never slowed here. Models: the server's one table
    (``retriever.latency.LATENCY_MODELS``): ``none``; ``web``: log-normal, median 0.5 s, sigma 0.8, capped at 8 s,
    2% of calls hang (here: cost the client's timeout, then answer); results recorded before the shared table used
    median 0.3 s and no hangs; ``local``: log-normal, median 20 ms, sigma 0.5, capped at 0.5 s (unchanged).
    Every arm draws from its own RNG seeded with the same ``--latency-seed``, so both arms of a block see the same
    latency sequence in call order.

Each latency model runs ``--rounds`` rounds over consecutive chunks of the episodes; the arm order alternates
between rounds (sync first, then async first) and the engine's prefix cache is emptied before every phase, so
load drift on a shared machine and cached KV hit both arms alike. An arm's episodes/s is its total over rounds.

The policy is a short SFT warm start of the tiny model on an expert that always searches first (no pretraining):
every episode searches about once, and the number of turns varies (2 to max_turns: some later turns are invalid
actions), which is where a batch barrier hurts.

    python benchmarks/rollout_bench.py [--episodes 256] [--rounds 4] [--concurrency 32] [--latency none,web,local]
    python benchmarks/rollout_bench.py ... --out benchmarks/results/rollout/   # also write the run's files there

``--out DIR`` also writes DIR/result.json (the final JSON printed: every block, the raw engine's scaling),
DIR/output.txt (what was printed) and DIR/run.json (command, commit, versions, cores, load average):
``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from retriever.latency import LATENCY_MODELS, LatencyModel, LatencySampler

if __package__:  # imported as benchmarks.rollout_bench (tests)
    from benchmarks import record
else:  # run as python benchmarks/rollout_bench.py: this folder is sys.path[0]
    import record

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class LatencySearch:
    """A ``SearchTool`` (``async_agent_rl.episode``) that sleeps a sampled latency before each call of the real one.

    Benchmark harness: the latency models are the retrieval server's (``retriever.latency.LATENCY_MODELS``, one
    table), applied here to the tool the episode calls. A hung call costs ``hang_s`` (the client's timeout) and then
    gets the real answer, as a retry that succeeded at once would."""

    def __init__(self, inner, model: LatencyModel, seed: int, hang_s: float = 5.0):
        self.inner, self.model, self.hang_s = inner, model, hang_s
        self.sampler = LatencySampler(model, seed)
        self.delays: list[float] = []

    def sample(self) -> float:
        delay = self.sampler.sample()
        return self.hang_s if math.isinf(delay) else delay

    async def search(self, query: str):
        delay = self.sample()
        self.delays.append(delay)
        if delay > 0:
            await asyncio.sleep(delay)
        return await self.inner.search(query)

    def summary(self) -> dict:
        d = sorted(self.delays)
        if not d:
            return {"calls": 0}
        q = lambda f: round(d[min(len(d) - 1, int(f * len(d)))], 3)  # noqa: E731
        return {"calls": len(d), "mean_s": round(sum(d) / len(d), 3), "p50_s": q(0.5), "p90_s": q(0.9),
                "p99_s": q(0.99), "max_s": round(d[-1], 3)}


async def run_async(runner, examples, concurrency, group_size):
    from actors.rollout_worker import RolloutWorker

    out = []

    async def sink(batch):
        out.extend(batch)

    worker = RolloutWorker(runner, iter(examples), sink, group_size=group_size, max_concurrent=concurrency, seed=1)
    t = time.perf_counter()
    await worker.run(num_groups=len(examples) // group_size)
    return out, time.perf_counter() - t


async def run_sync(runner, examples, concurrency):
    from async_agent_rl.episode import EpisodeRunner
    from actors.lockstep import LockstepEngine, TurnBarrier

    out = []
    t = time.perf_counter()
    for i in range(0, len(examples), concurrency):
        batch = examples[i : i + concurrency]
        barrier = TurnBarrier(len(batch))
        sync_runner = EpisodeRunner(LockstepEngine(runner.engine, barrier), runner.search, runner.tokenizer, runner.s)

        async def one(ex, k):
            try:
                return await sync_runner.run(ex, group_id=f"s{i}-{k}")
            finally:
                await barrier.leave()

        out += await asyncio.gather(*(one(ex, k) for k, ex in enumerate(batch)))
    return out, time.perf_counter() - t


async def run_raw(engine, trajs, concurrency):
    """The same episodes without tools or orchestration: each trajectory's model turns generated in order as one
    chain (``concurrency`` chains in flight, as episodes in the asynchronous arm), every turn with max_tokens = the
    recorded turn's length and no stop strings, and the recorded observation tokens appended after it (no search,
    no tokenizing, no parsing). A turn's prompt is the prompt, the chain's OWN earlier turns and the observations, so
    the engine's prefix cache serves a chain exactly as it serves an episode (its own earlier turns are cached, the
    observation is prefilled)."""
    from actors.engine import TurnRequest

    sem = asyncio.Semaphore(concurrency)
    total = 0

    async def chain(t):
        nonlocal total
        async with sem:
            context = list(t.prompt_ids)
            for span in t.turns:
                if span.kind != "model":
                    context += t.response_ids[span.start : span.end]
                    continue
                out = await engine.generate(TurnRequest(prompt_ids=context, max_tokens=span.length, stop=(),
                                                        temperature=1.0))  # fmt: skip
                context += out.token_ids
                total += len(out.token_ids)

    t = time.perf_counter()
    await asyncio.gather(*(chain(t) for t in trajs))
    return total, time.perf_counter() - t


async def run_raw_turns(engine, trajs, concurrency):
    """Independent first turns (prompt, recorded length, no stop strings), ``concurrency`` in flight."""
    from actors.engine import TurnRequest

    reqs = [TurnRequest(prompt_ids=t.prompt_ids, max_tokens=t.turns[0].length, stop=(), temperature=1.0)
            for t in trajs]  # fmt: skip
    sem = asyncio.Semaphore(concurrency)
    total = 0

    async def one(r):
        nonlocal total
        async with sem:
            total += len((await engine.generate(r)).token_ids)

    t = time.perf_counter()
    await asyncio.gather(*(one(r) for r in reqs))
    return total, time.perf_counter() - t


class Clock:
    """Seconds and calls summed by name (awaited calls: the time each caller waited, summed over callers)."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1


class TimedEngine:
    """The engine as the episodes see it, each ``generate`` timed from the call to its answer (queueing in the
    engine included): summed over calls, the requests in the engine integrated over time."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.clock = inner, clock

    async def generate(self, req):
        t = time.perf_counter()
        try:
            return await self.inner.generate(req)
        finally:
            self.clock.add("engine.generate", time.perf_counter() - t)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class TimedSearch:
    """The search tool, each call timed; keeps every query's hits (``MemorySearch`` answers from them)."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.clock, self.memory = inner, clock, {}

    async def search(self, query: str):
        t = time.perf_counter()
        try:
            hits = await self.inner.search(query)
        finally:
            self.clock.add("search", time.perf_counter() - t)
        self.memory[query] = hits
        return hits


class MemorySearch:
    """Search with no retriever: the hits a ``TimedSearch`` recorded for the same query, else recorded hits in
    turn (observations of the same kind and length, no HTTP call, no server work)."""

    def __init__(self, memory: dict):
        self.memory, self.recorded, self.i = memory, list(memory.values()), 0

    async def search(self, query: str):
        if query in self.memory:
            return self.memory[query]
        self.i += 1
        return self.recorded[self.i % len(self.recorded)]


class TimedTokenizer:
    """The episodes' tokenizer, the seconds of each method call summed by name (the event loop is held meanwhile)."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.clock = inner, clock

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.clock.add(f"tokenizer.{name}", time.perf_counter() - t)

        return timed

    def __len__(self):
        return len(self.inner)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process (the episodes, vLLM's front end: tokenizing,
    detokenizing, stop strings, output processing), vLLM's engine core (this process's child that is not the
    retriever) and the retriever server."""
    import psutil

    me = psutil.Process()
    out = {"main process (episodes, vLLM front end)": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            name = "retriever server" if "retriever" in cmd else "engine core and other children"
            out[name] = out.get(name, 0.0) + sum(child.cpu_times()[:2])
        except Exception:  # a child that ended meanwhile
            continue
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 2) for k in after}


async def profile_block(engine, make_runner, examples, chunk: int, args) -> dict:
    """``--profile``: where the asynchronous arm's tokens/s go against the raw engine's at zero latency. Each round,
    on one chunk of episodes (prefix cache emptied before each arm): (1) the asynchronous arm instrumented (engine
    calls, searches, tokenizer calls timed; CPU seconds by process), then, in an order alternating by round, (2) the
    same arm with search answered from memory (no retriever) and (3) the raw engine on (1)'s episodes; each round's
    ratios to (3) are kept; then one asynchronous round under cProfile (this process only: the engine core is
    another process)."""
    import cProfile
    import io
    import pstats

    from async_agent_rl.episode import EpisodeRunner

    arms: dict[str, dict] = {}

    def account(name, trajs, secs, clock, cpu, generated=None):
        a = arms.setdefault(name, {"seconds": 0.0, "tokens": 0, "episodes": 0, "turns": 0, "clock": Clock(),
                                   "cpu": Counter()})
        a["seconds"] += secs
        a["tokens"] += generated if generated is not None else sum(t.num_generated_tokens for t in trajs)
        a["episodes"] += len(trajs)
        a["turns"] += sum(t.meta.num_turns for t in trajs)
        a["clock"].seconds.update(clock.seconds)
        a["clock"].calls.update(clock.calls)
        a["cpu"].update(cpu)

    memory: dict = {}
    by_round: dict[str, list[float]] = {}  # each round's tokens/s over the raw engine's in the same round
    for r in range(args.rounds):
        part = examples[r * chunk : (r + 1) * chunk]
        base = make_runner("none")
        clock = Clock()
        search = TimedSearch(base.search, clock)
        search.memory = memory
        runner = EpisodeRunner(TimedEngine(engine, clock), search, TimedTokenizer(base.tokenizer, clock), base.s)
        await fresh_cache(engine)
        c0 = cpu_seconds()
        trajs, secs = await run_async(runner, part, args.concurrency, 1)
        account("asynchronous", trajs, secs, clock, cpu_delta(c0, cpu_seconds()))
        rates = {"asynchronous": sum(t.num_generated_tokens for t in trajs) / secs}

        async def from_memory():
            clock = Clock()
            runner = EpisodeRunner(TimedEngine(engine, clock), TimedSearch(MemorySearch(memory), clock),
                                   TimedTokenizer(base.tokenizer, clock), base.s)
            await fresh_cache(engine)
            c0 = cpu_seconds()
            mtrajs, msecs = await run_async(runner, part, args.concurrency, 1)
            account("asynchronous, search from memory", mtrajs, msecs, clock, cpu_delta(c0, cpu_seconds()))
            rates["asynchronous, search from memory"] = sum(t.num_generated_tokens for t in mtrajs) / msecs

        async def raw():
            clock = Clock()
            await fresh_cache(engine)
            c0 = cpu_seconds()
            tokens, rsecs = await run_raw(TimedEngine(engine, clock), trajs, args.concurrency)
            account("raw engine", trajs, rsecs, clock, cpu_delta(c0, cpu_seconds()), generated=tokens)
            rates["raw engine"] = tokens / rsecs

        for arm in (from_memory, raw) if r % 2 == 0 else (raw, from_memory):  # the order alternates by round
            await arm()
        ratios = {k: round(v / rates["raw engine"], 3) for k, v in rates.items() if k != "raw engine"}
        for k, v in ratios.items():
            by_round.setdefault(k, []).append(v)
        print(json.dumps({"profile_round": r, "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
                          "over_raw": ratios}), flush=True)
    rows = {}
    raw_rate = arms["raw engine"]["tokens"] / arms["raw engine"]["seconds"]
    for name, a in arms.items():
        engine_s = a["clock"].seconds["engine.generate"]
        tok_s = sum(v for k, v in a["clock"].seconds.items() if k.startswith("tokenizer."))
        rows[name] = {
            "episodes": a["episodes"], "seconds": round(a["seconds"], 2), "generated_tokens": a["tokens"],
            "tokens_per_s": round(a["tokens"] / a["seconds"], 1),
            "over_raw": round(a["tokens"] / a["seconds"] / raw_rate, 3),
            "over_raw_by_round": by_round.get(name), "over_raw_median_of_rounds": round(
                statistics.median(by_round[name]), 3) if name in by_round else None,
            "engine_calls": a["clock"].calls["engine.generate"],
            "mean_requests_in_engine": round(engine_s / a["seconds"], 2),
            "tokens_per_request_second_in_engine": round(a["tokens"] / engine_s, 2) if engine_s else None,
            "search_calls": a["clock"].calls["search"], "search_s_per_call": round(
                a["clock"].seconds["search"] / a["clock"].calls["search"], 4) if a["clock"].calls["search"] else None,
            "tokenizer_s": round(tok_s, 3),
            "tokenizer_by_method": {k: [round(v, 3), a["clock"].calls[k]] for k, v in a["clock"].seconds.items()
                                    if k.startswith("tokenizer.")},
            "cpu_s": dict(a["cpu"]),
            "cpu_s_per_1k_tokens": {k: round(1000 * v / a["tokens"], 3) for k, v in a["cpu"].items()},
        }
    # one round under cProfile: this process's Python (episodes, vLLM's front end, the HTTP client)
    prof = cProfile.Profile()
    await fresh_cache(engine)
    runner = make_runner("none")
    prof.enable()
    ptrajs, psecs = await run_async(runner, examples[:chunk], args.concurrency, 1)
    prof.disable()
    tops = {}
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(25)
        tops[key] = trim_profile(text.getvalue())
    return {"profile": True, "arms": rows, "profiled_round": {
        "seconds": round(psecs, 2), "tokens_per_s": round(sum(t.num_generated_tokens for t in ptrajs) / psecs, 1),
        "top_tottime": tops["tottime"], "top_cumulative": tops["cumulative"]},
        "load_average_1min": round(os.getloadavg()[0], 1)}


def trim_profile(text: str) -> list[str]:
    """pstats' table lines, each path cut to its package's part (no machine path)."""
    import re

    cut = re.compile(r"[^\s(]*/(?:site-packages|lib/python3\.\d+)/|[^\s(]*/(?=(?:actors|async_agent_rl|retriever"
                     r"|benchmarks)/)")
    return [cut.sub("", line.rstrip()) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith(("Ordered by", "List reduced"))]


def print_profile(block: dict) -> None:
    """The account of ``profile_block`` as tables."""
    arms = block["arms"]
    print("\n| arm | tokens/s | / raw | mean requests in engine | tokens per request-second | engine calls | "
          "tokenizer s | search s/call | CPU s per 1k tokens (main / engine core / retriever) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, a in arms.items():
        c = a["cpu_s_per_1k_tokens"]
        cpu = " / ".join(f"{c.get(k, 0.0):.2f}" for k in ("main process (episodes, vLLM front end)",
                                                           "engine core and other children", "retriever server"))
        print(f"| {name} | {a['tokens_per_s']} | {a['over_raw']:.3f} | {a['mean_requests_in_engine']} | "
              f"{a['tokens_per_request_second_in_engine']} | {a['engine_calls']} | {a['tokenizer_s']} | "
              f"{a['search_s_per_call']} | {cpu} |")
    for name, a in arms.items():
        if a.get("over_raw_by_round"):
            r = a["over_raw_by_round"]
            print(f"{name}: over the raw engine by round, median {a['over_raw_median_of_rounds']:.3f} "
                  f"(min {min(r):.3f}, max {max(r):.3f}, {len(r)} rounds)")
    raw_cpu = sum(arms["raw engine"]["cpu_s_per_1k_tokens"].values())
    for name, a in arms.items():
        cpu = sum(a["cpu_s_per_1k_tokens"].values())
        print(f"{name}: CPU s per 1k tokens, all processes {cpu:.3f} (raw engine's / this: {raw_cpu / cpu:.3f})")
    print("\nprofiled asynchronous round (this process), top by tottime:")
    for line in block["profiled_round"]["top_tottime"][:30]:
        print("    " + line)


async def fresh_cache(engine) -> None:
    """Empty the engine's prefix cache (it is idle between phases), so no phase reuses the previous one's KV."""
    if not await engine.llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache (requests still running?)")


def summarize(name, trajs, seconds):
    gen = sum(t.num_generated_tokens for t in trajs)
    turns = Counter(t.meta.num_turns for t in trajs)
    return {
        "arm": name,
        "episodes": len(trajs),
        "seconds": round(seconds, 2),
        "episodes_per_s": round(len(trajs) / seconds, 2),
        "generated_tokens_per_s": round(gen / seconds, 1),
        "turns_histogram": dict(sorted(turns.items())),
        "searches": sum(t.meta.num_searches for t in trajs),
    }


async def main(args) -> dict:
    """The benchmark in ``args.work``, or in a temporary folder removed on every exit path (a world, a model and a
    warm start: tens of MB that a run without ``--work`` would otherwise leave behind)."""
    if args.work:
        return await run(args, Path(args.work))
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as work:
        return await run(args, Path(work))


async def run(args, work: Path) -> dict:
    from transformers import AutoTokenizer

    from actors.engine import VLLMEngine
    from async_agent_rl.episode import EpisodeRunner
    from async_agent_rl.prompts import STOP_STRINGS
    from actors.search_client import SearchClient
    from async_agent_rl.config import load_config
    from async_agent_rl.data.search_r1 import read_qa_parquet
    from async_agent_rl.episode_settings import EpisodeSettings
    from driver.prepare import prepare
    from warm_start.sft import run_sft
    from retriever.server import spawn_server

    cfg = load_config("configs/quickstart.yaml", [
        f"run.output_dir={work}", f"model.path={work}/model", f"data.world_dir={work}/world",
        f"data.train_files=[{work}/world/train.parquet]", f"data.test_files=[{work}/world/test.parquet]",
        f"data.corpus_file={work}/world/corpus.jsonl", "sft.num_demos=1024", "sft.epochs=1", "sft.warmup_steps=5",
        "sft.lr=3e-3", "sft.pretrain_steps=0", "sft.expert_search_prob=1.0", f"rollout.max_concurrent_episodes={args.concurrency}", f"rollout.max_turns={args.max_turns}", f"rollout.temperature={args.temperature}",
        f"rollout.max_response_length={96 * args.max_turns}", f"model.max_model_len={max(1024, 96 * args.max_turns + 256)}",
    ])  # fmt: skip
    for line in prepare(cfg):
        print(line)
    model = Path(args.model) if args.model else work / "sft"
    if not (model / "config.json").is_file():
        run_sft(cfg, cfg.model.path, model)
    examples = read_qa_parquet(cfg.data.train_files[0])[: args.episodes]
    tok = AutoTokenizer.from_pretrained(model)
    settings = EpisodeSettings.from_config(cfg)
    blocks, scaling = [], {}
    with spawn_server(cfg.data.corpus_file, cfg.retriever) as server:
        engine = await VLLMEngine.create(str(model), cfg)
        try:
            async with SearchClient(server.url, cfg.retriever.client) as sc:

                def runner(latency: str) -> EpisodeRunner:
                    search = LatencySearch(sc, LATENCY_MODELS[latency], args.latency_seed,
                                           hang_s=cfg.retriever.client.timeout_s)
                    return EpisodeRunner(engine, search, tok, settings)

                await run_sync(runner("none"), examples[: args.concurrency], args.concurrency)  # warm-up, not timed
                chunk = -(-len(examples) // args.rounds)
                for latency in args.latency:  # both arms of a latency model back to back, in interleaved rounds
                    sync_runner, async_runner = runner(latency), runner(latency)
                    sync_trajs, async_trajs, sync_s, async_s, raw_tokens, raw_s = [], [], 0.0, 0.0, 0, 0.0
                    for r in range(args.rounds):  # round r: sync then async when r is even, async then sync if odd
                        part = examples[r * chunk : (r + 1) * chunk]
                        for arm in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                            await fresh_cache(engine)
                            if arm == "sync":
                                trajs, secs = await run_sync(sync_runner, part, args.concurrency)
                                sync_trajs, sync_s = sync_trajs + trajs, sync_s + secs
                                continue
                            trajs, secs = await run_async(async_runner, part, args.concurrency, 1)
                            async_trajs, async_s = async_trajs + trajs, async_s + secs
                            if latency == "none":  # orchestration overhead: right after, on the same episodes
                                await fresh_cache(engine)
                                tokens, secs = await run_raw(engine, trajs, args.concurrency)
                                raw_tokens, raw_s = raw_tokens + tokens, raw_s + secs
                    a = summarize("asynchronous", async_trajs, async_s) | {"latency": async_runner.search.summary()}
                    s = summarize("batch-synchronous", sync_trajs, sync_s) | {"latency": sync_runner.search.summary()}
                    block = {
                        "latency_model": latency,
                        "latency_params": LATENCY_MODELS[latency].params(),
                        "arms": [a, s],
                        "async_over_sync_episodes_per_s": round(a["episodes_per_s"] / s["episodes_per_s"], 2),
                        "async_over_sync_tokens_per_s": round(
                            a["generated_tokens_per_s"] / s["generated_tokens_per_s"], 2),
                        "load_average_1min": round(os.getloadavg()[0], 1),
                    }
                    if latency == "none":
                        block["raw_engine_tokens_per_s"] = round(raw_tokens / raw_s, 1)
                        block["overhead_ratio"] = round(a["generated_tokens_per_s"] / (raw_tokens / raw_s), 2)
                    print(json.dumps(block), flush=True)
                    blocks.append(block)
                if args.stop_ab:  # one-token stop strings as stop token ids (actors/engine.py) against strings only
                    ab = {"ids": ([], 0.0), "strings": ([], 0.0)}
                    for r in range(args.rounds):
                        part = examples[r * chunk : (r + 1) * chunk]
                        for arm in ("ids", "strings") if r % 2 == 0 else ("strings", "ids"):
                            await fresh_cache(engine)
                            engine._stop_ids = {} if arm == "ids" else {tuple(STOP_STRINGS): []}
                            trajs, secs = await run_async(runner("none"), part, args.concurrency, 1)
                            ab[arm] = (ab[arm][0] + trajs, ab[arm][1] + secs)
                    engine._stop_ids = {}
                    i, s_ = (summarize(f"asynchronous, stops {k}", *ab[k]) for k in ("ids", "strings"))
                    block = {"stop_token_ids_ab": True, "arms": [i, s_],
                             "ids_over_strings_episodes_per_s": round(i["episodes_per_s"] / s_["episodes_per_s"], 2),
                             "load_average_1min": round(os.getloadavg()[0], 1)}
                    print(json.dumps(block), flush=True)
                    blocks.append(block)
                if args.profile:  # where the asynchronous arm's tokens/s go against the raw engine's
                    block = await profile_block(engine, runner, examples, chunk, args)
                    print_profile(block)
                    blocks.append(block)
                for c in args.scaling:  # the raw engine's tokens/s against how many sequences share a step
                    n = max(c * 4, 32)  # the same first turns for every concurrency
                    tokens, secs = await run_raw_turns(engine, async_trajs[:n], c)
                    scaling[c] = round(tokens / secs, 1)
        finally:
            await engine.close()
    result = {
        "episodes": args.episodes,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "multiprocess_engine_core": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
        "blocks": blocks,
        "raw_engine_tokens_per_s_by_concurrency": scaling,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=256, help="episodes per arm and latency model")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per latency model (arm order alternates)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--work", help="folder for the world, model and SFT (default: a temp dir)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout.temperature (higher: longer tail of turns)")
    p.add_argument("--model", help="policy folder (default: a short hot SFT warm start made in --work)")
    p.add_argument("--max-turns", type=int, default=4, help="rollout.max_turns (observations budgeted at 96 tokens)")
    p.add_argument("--scaling", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                   help="also measure the raw engine on first turns at these concurrencies (comma-separated; default: skip; gave implausibly low numbers in the last run, not yet checked)")
    p.add_argument("--latency", type=lambda s: [x for x in s.split(",") if x], default=list(LATENCY_MODELS),
                   help=f"search-latency models, one block of both arms each (comma-separated: {', '.join(LATENCY_MODELS)})")
    p.add_argument("--latency-seed", type=int, default=0, help="seed of every arm's latency RNG")
    p.add_argument("--stop-ab", action="store_true",
                   help="also compare, at zero latency, the asynchronous arm with one-token stop strings sent as stop "
                        "token ids (as training runs it) against the strings alone")
    p.add_argument("--profile", action="store_true",
                   help="also account for the asynchronous arm's tokens/s against the raw engine's at zero latency: "
                        "engine, search and tokenizer calls timed, CPU seconds by process, an arm with search "
                        "answered from memory, and one round under cProfile")
    record.add_out_argument(p)
    a = p.parse_args()
    if unknown := [x for x in a.latency if x not in LATENCY_MODELS]:
        p.error(f"unknown --latency model(s) {unknown}; known: {', '.join(LATENCY_MODELS)}")
    if a.scaling and not a.latency:  # the raw engine is measured on the episodes a latency block generated
        p.error("--scaling needs at least one --latency block (its episodes' first turns are what it measures)")
    if min(a.episodes, a.rounds, a.concurrency, a.max_turns) < 1 or (a.scaling and min(a.scaling) < 1):
        p.error("--episodes, --rounds, --concurrency, --max-turns and --scaling values must be at least 1")
    with record.Recording(a.out, __file__, None, vars(a)) as rec:
        rec.result = asyncio.run(main(a))
