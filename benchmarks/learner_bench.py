"""Learner step time and tokens/s on the tiny model, and object-store publish latency into a real vLLM engine.

    python benchmarks/learner_bench.py                              # ~2-3 minutes on 2 cores
    python benchmarks/learner_bench.py --configs 0:float32 --publishes 0
    python benchmarks/learner_bench.py --out benchmarks/results/learner/    # also write the run's files there

One rank, real DeepSpeed on CPU (gloo, torch AdamW). The model is the tiny Qwen2 of ``TinyModelConfig``'s
defaults (hidden 128, 2 layers, 4 heads: the quickstart's model until 2026-12-01, which has 8 heads of 32 since; a
byte-level BPE of at most 4096 tokens trained on a generated search world: 3,540 on the shipped one), built into a
temporary folder unless ``--model`` names one.
A synthetic batch of ``--batch-size`` trajectories (prompt ``--prompt-len`` | model turn | observation | model turn,
``--response-len`` response tokens in all, two rollouts per prompt, rewards 0/1) is trained for ``--steps`` steps per
``zero_stage:dtype`` configuration (GRPO, decoupled PPO: one proximal pass, one forward/backward per micro-batch);
the first step is a warm-up and not counted. Reported: median wall time per step, non-padding tokens per second, and
the CPU seconds of this process per step (robust to other load on a shared machine, unlike wall time).
``--threads`` (default 1) sets torch's intra-op threads: 1 is what the learner gets in its Ray actor (Ray sets
OMP_NUM_THREADS=1 for fractional-CPU actors), and on a loaded 2-core machine two OpenMP threads made every step
2-4x slower (each parallel region waits for a descheduled thread; ~10 ms for a 400k-element ``mul``).

Publish: the learner's numpy state dict goes through ``ObjectStorePublisher`` to a Ray actor running
``VLLMEngine`` (in-process engine core, ``pause`` mode); ``--publishes`` publishes, median and max of the latency
(publish call to engine done), of ``ray.put`` and of the engine's own reload.

``--out DIR`` also writes DIR/result.json (the printed lines: ``learner_step``, one per configuration, and
``publish``), DIR/output.txt (what was printed) and DIR/run.json (command, commit, versions, cores, load average):
``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from async_agent_rl.batch import TrainBatch, pack_batch
from async_agent_rl.config import Config, TinyModelConfig, WorldConfig, build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan

if __package__:  # imported as benchmarks.learner_bench
    from benchmarks import record
else:  # run as python benchmarks/learner_bench.py: this folder is sys.path[0]
    import record

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def build_model(out: Path) -> Path:
    from async_agent_rl.data.world import generate_world, write_world
    from async_agent_rl.tiny_model import init_tiny_model

    write_world(generate_world(WorldConfig(seed=0)), out / "world", template="minimal")
    return init_tiny_model(out / "model", TinyModelConfig(max_position_embeddings=1024), out / "world" / "corpus.jsonl")


def synthetic_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(rows):
        n1 = response_len // 3
        k = response_len // 3
        n2 = response_len - n1 - k
        mask = [1] * n1 + [0] * k + [1] * n2
        trajs.append(Trajectory(
            prompt_ids=rng.integers(10, vocab, prompt_len).tolist(),
            response_ids=rng.integers(10, vocab, response_len).tolist(), loss_mask=mask,
            behavior_logprobs=[-8.0 if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask],
            turns=[TurnSpan("model", 0, n1), TurnSpan("observation", n1, n1 + k),
                   TurnSpan("model", n1 + k, response_len)],
            reward=float(i % 2), meta=EpisodeMeta(group_id=f"g{i // 2}")))
    return pack_batch(trajs, pad_id=0)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench_learner(cfg: Config, batch: TrainBatch, steps: int) -> dict:
    import time

    from learner.learner import Learner

    learner = Learner(cfg)
    learner.train_step(batch)  # warm-up
    walls, cpus, rates = [], [], []
    for _ in range(steps):
        c0, t0 = cpu_seconds(), time.perf_counter()
        m = learner.train_step(batch)
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_seconds() - c0)
        rates.append(m.tokens_per_s)
    return {"zero_stage": cfg.learner.zero_stage, "dtype": cfg.learner.dtype, "step_s": statistics.median(walls),
            "tokens_per_s": statistics.median(rates), "cpu_s_per_step": statistics.median(cpus),
            "tokens_per_step": int(batch.seq_lengths.sum()), "learner": learner}


def bench_publish(cfg: Config, learner, publishes: int) -> dict:
    import ray

    from actors.engine import VLLMEngine
    from driver.cluster import local_ray
    from driver.weight_sync import ObjectStorePublisher

    class EngineHost:
        async def start(self, model_dir: str, cfg: Config) -> None:
            self.engine = await VLLMEngine.create(model_dir, cfg)

        async def update_weights(self, version: int, weights):
            return await self.engine.update_weights(version, weights, mode="pause")

    local_ray(num_cpus=2)  # loopback only, token authentication: as a training's local cluster
    try:
        host = ray.remote(num_cpus=0)(EngineHost).options(runtime_env={"env_vars": VLLM_ENV}).remote()
        ray.get(host.start.remote(cfg.model.path, cfg))
        publisher = ObjectStorePublisher([host])
        stats = [publisher.publish(learner.bump_version(), learner.state_dict_for_publish())
                 for _ in range(publishes)]
    finally:
        ray.shutdown()
    latency = [s.seconds for s in stats]
    return {"publishes": publishes, "bytes": stats[0].bytes,
            "latency_s_median": statistics.median(latency), "latency_s_max": max(latency),
            "put_s_median": statistics.median(s.put_seconds for s in stats),
            "engine_reload_s_median": statistics.median(s.actor_seconds[0] for s in stats)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder (default: build the quickstart tiny model)")
    ap.add_argument("--configs", default="0:float32,0:bfloat16,2:float32,3:bfloat16", help="zero_stage:dtype,...")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--response-len", type=int, default=288)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--publishes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the learner actor's: 1)")
    record.add_out_argument(ap)
    args = ap.parse_args(argv)
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        rec.result = bench(args)


def bench(args: argparse.Namespace) -> dict:
    """Every configuration's learner steps, then the publishes; prints one JSON line each, returns them."""
    result: dict = {"learner_step": [], "publish": None}
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="learner_bench_") as tmp:
        model = Path(args.model) if args.model else build_model(Path(tmp))
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        batch = synthetic_batch(args.batch_size, args.prompt_len, args.response_len, vocab)
        learner = None
        for spec in args.configs.split(","):
            stage, dtype = spec.split(":")
            cfg = build_config({
                "model": {"path": str(model), "max_model_len": 1024},
                "rollout": {"group_size": 2},
                "learner": {"batch_size": args.batch_size, "mini_batch_size": args.batch_size,
                            "micro_batch_size": args.micro_batch_size, "zero_stage": int(stage), "dtype": dtype},
            })
            step = bench_learner(cfg, batch, args.steps)
            learner = step.pop("learner")
            print(json.dumps({"bench": "learner_step", **step}), flush=True)
            result["learner_step"].append(step)
        if args.publishes and learner is not None:
            result["publish"] = bench_publish(cfg, learner, args.publishes)
            print(json.dumps({"bench": "publish", **result["publish"]}), flush=True)
    return result


if __name__ == "__main__":
    main()
