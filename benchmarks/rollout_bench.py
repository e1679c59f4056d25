"""Rollout benchmark, one run, same engine, model, questions and retriever server for every arm.

(a) per-trajectory asynchronous rollout (``RolloutWorker``: every episode its own task, K in flight) against a
    batch-synchronous turn loop as in Search-R1 (every active episode generates, then every one searches, turn by
    turn). The synchronous arm runs the SAME ``EpisodeRunner`` code with two barriers per turn around generation
    (all active episodes start their turn together and wait for the slowest), processing batches of K episodes.
(b) orchestration overhead: the asynchronous rollout's generated tokens/s divided by the raw engine's tokens/s when
    it generates exactly the same turns (same prompts, same token counts, no stop strings, no tools) at the same
    concurrency.

The policy is a short, hot SFT warm start of the tiny model (about half its first turns search), so the number of
turns per episode varies widely (1 to max_turns), which is where a batch barrier hurts.

    python benchmarks/rollout_bench.py [--episodes 128] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


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
    """The same model turns, generated without tools: prompt = what preceded the turn, max_tokens = its length."""
    from actors.engine import TurnRequest

    reqs = []
    for t in trajs:
        for span in t.turns:
            if span.kind == "model":
                reqs.append(TurnRequest(prompt_ids=t.prompt_ids + t.response_ids[: span.start], max_tokens=span.length,
                                        stop=(), temperature=1.0))  # fmt: skip
    sem = asyncio.Semaphore(concurrency)
    total = 0

    async def one(r):
        nonlocal total
        async with sem:
            out = await engine.generate(r)
            total += len(out.token_ids)

    t = time.perf_counter()
    await asyncio.gather(*(one(r) for r in reqs))
    return total, time.perf_counter() - t


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
    from transformers import AutoTokenizer

    from actors.engine import VLLMEngine
    from async_agent_rl.episode import EpisodeRunner
    from actors.search_client import SearchClient
    from async_agent_rl.config import load_config
    from async_agent_rl.data.search_r1 import read_qa_parquet
    from async_agent_rl.episode_settings import EpisodeSettings
    from driver.prepare import prepare
    from learner.sft import run_sft
    from retriever.server import spawn_server

    work = Path(args.work or tempfile.mkdtemp(prefix="rollout_bench_"))
    cfg = load_config("configs/quickstart.yaml", [
        f"run.output_dir={work}", f"model.path={work}/model", f"data.world_dir={work}/world",
        f"data.train_files=[{work}/world/train.parquet]", f"data.test_files=[{work}/world/test.parquet]",
        f"data.corpus_file={work}/world/corpus.jsonl", "sft.num_demos=64", "sft.epochs=2", "sft.warmup_steps=1",
        "sft.lr=1e-2", f"rollout.max_concurrent_episodes={args.concurrency}", f"rollout.max_turns={args.max_turns}", f"rollout.temperature={args.temperature}",
        f"rollout.max_response_length={96 * args.max_turns}", f"model.max_model_len={max(1024, 96 * args.max_turns + 256)}",
    ])  # fmt: skip
    for line in prepare(cfg):
        print(line)
    model = Path(args.model) if args.model else work / "sft"
    if not (model / "config.json").is_file():
        run_sft(cfg, cfg.model.path, model)
    examples = read_qa_parquet(cfg.data.train_files[0])[: args.episodes]
    tok = AutoTokenizer.from_pretrained(model)
    with spawn_server(cfg.data.corpus_file, cfg.retriever) as server:
        engine = await VLLMEngine.create(str(model), cfg)
        try:
            async with SearchClient(server.url, cfg.retriever.client) as sc:
                runner = EpisodeRunner(engine, sc, tok, EpisodeSettings.from_config(cfg))
                await run_sync(runner, examples[: args.concurrency], args.concurrency)  # warm-up, not timed
                sync_trajs, sync_s = await run_sync(runner, examples, args.concurrency)
                async_trajs, async_s = await run_async(runner, examples, args.concurrency, 1)
                raw_tokens, raw_s = await run_raw(engine, async_trajs, args.concurrency)
                scaling = {}
                for c in args.scaling:  # the raw engine's tokens/s against how many sequences share a step
                    n = max(c * 4, 32)  # the same first turns for every concurrency
                    tokens, secs = await run_raw(engine, async_trajs[: n // 2], c)
                    scaling[c] = round(tokens / secs, 1)
        finally:
            await engine.close()
    a, s = summarize("asynchronous", async_trajs, async_s), summarize("batch-synchronous", sync_trajs, sync_s)
    result = {
        "episodes": args.episodes,
        "concurrency": args.concurrency,
        "arms": [a, s],
        "async_over_sync_episodes_per_s": round(a["episodes_per_s"] / s["episodes_per_s"], 2),
        "async_over_sync_tokens_per_s": round(a["generated_tokens_per_s"] / s["generated_tokens_per_s"], 2),
        "raw_engine_tokens_per_s": round(raw_tokens / raw_s, 1),
        "overhead_ratio": round(a["generated_tokens_per_s"] / (raw_tokens / raw_s), 2),
        "raw_engine_tokens_per_s_by_concurrency": scaling,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--work", help="folder for the world, model and SFT (default: a temp dir)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout.temperature (higher: longer tail of turns)")
    p.add_argument("--model", help="policy folder (default: a short hot SFT warm start made in --work)")
    p.add_argument("--max-turns", type=int, default=4, help="rollout.max_turns (observations budgeted at 96 tokens)")
    p.add_argument("--scaling", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 8, 32],
                   help="also measure the raw engine at these concurrencies (comma-separated; empty: skip)")
    asyncio.run(main(p.parse_args()))
