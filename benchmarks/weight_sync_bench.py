"""Publish latency by weight-sync method at three model sizes, against the raw cost of moving the same bytes.

    python benchmarks/weight_sync_bench.py                       # ~6 minutes on 2 cores
    python benchmarks/weight_sync_bench.py --sizes 1m --publishes 3
    python benchmarks/weight_sync_bench.py --out benchmarks/results/weight_sync/   # also write the run's files there

For each size (random Qwen2 models on the quickstart's tokenizer: ``1m`` is the quickstart's four-head shape of before 2026-12-01, ``20m`` and
``100m`` are wider and deeper), one learner rank (a ``LearnerActor``, DeepSpeed on CPU) and one vLLM engine in a Ray
actor (CPU build, in-process engine core, ``pause`` mode) are started, then, alternately, ``--publishes`` times each:

- ``object_store``: what the trainer does on that path, end to end: the learner's state dict into the object store
  (``LearnerGroup.state_dict_ref``), then ``ObjectStorePublisher.publish`` (the engine writes a RAM file, reloads);
- ``collective``: ``CollectivePublisher.publish`` (the learner takes its weights, the engine checks their specs,
  pauses, its worker receives the gloo broadcast and reloads in place); the group is made before the first one.

The raw costs of the same bytes, no engine: ``ray.put`` in one process and ``ray.get`` in another (an actor), and a
bare gloo broadcast (``WeightGroup.send`` / ``receive``) from this process to an actor. Reported: the median and
the minimum of each, in seconds, and the bytes (float32: four per parameter).

``--out DIR`` also writes DIR/result.json (the results by size, as printed; the JSON file ``--out`` named before it
named a folder), DIR/output.txt (what was printed) and DIR/run.json (command, commit, versions, cores, load average):
``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

from async_agent_rl.config import Config, TinyModelConfig, WorldConfig, build_config
from driver.cluster import local_ray

if __package__:  # imported as benchmarks.weight_sync_bench
    from benchmarks import record
else:  # run as python benchmarks/weight_sync_bench.py: this folder is sys.path[0]
    import record

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SIZES = {  # hidden, intermediate, layers, heads, kv heads
    "1m": (128, 512, 2, 4, 2),
    "20m": (512, 1536, 6, 8, 2),
    "100m": (1024, 3072, 8, 16, 4),
}


class EngineHost:
    """A vLLM engine in a Ray actor with the methods both publishers call (as ``RolloutActor`` has them)."""

    async def start(self, model_dir: str, cfg: Config) -> None:
        from actors.engine import VLLMEngine

        self.engine = await VLLMEngine.create(model_dir, cfg)

    async def update_weights(self, version, weights):
        return await self.engine.update_weights(version, weights, mode="pause")

    async def join_weight_group(self, *args):
        return await self.engine.join_weight_group(*args)

    def check_weight_specs(self, specs):
        self.engine.check_weight_specs(specs)

    async def update_weights_collective(self, version, specs):
        return await self.engine.update_weights_collective(version, specs, mode="pause")

    async def close(self) -> None:
        await self.engine.close()


class RawPeer:
    """The far end of the raw transfers: takes an object-store dict, or receives a bare broadcast."""

    def fetch(self, state) -> int:  # Ray resolves the reference: this is the ``ray.get`` side
        return sum(int(v.nbytes) for v in state.values())

    def join(self, port: int, specs) -> None:
        from async_agent_rl.weight_group import WeightGroup

        self.group, self.specs = WeightGroup(port, 1, 2, "gloo", timeout_s=300), specs

    def receive(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.group.receive(self.specs))


def build_models(root: Path, sizes: list[str]) -> dict[str, Path]:
    from async_agent_rl.data.world import generate_world, write_world
    from async_agent_rl.tiny_model import init_tiny_model

    write_world(generate_world(WorldConfig(seed=0)), root / "world", template="minimal")
    base = init_tiny_model(root / "1m", TinyModelConfig(max_position_embeddings=1024), root / "world" / "corpus.jsonl")
    out = {}
    for size in sizes:
        hidden, inter, layers, heads, kv = SIZES[size]
        out[size] = base if size == "1m" else init_tiny_model(
            root / size, TinyModelConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=kv,
                                         max_position_embeddings=1024), tokenizer=base)
    return out


def config(model_dir: Path) -> Config:
    return build_config({
        "model": {"path": str(model_dir), "max_model_len": 256}, "data": {"max_prompt_length": 128},
        "rollout": {"group_size": 1, "max_response_length": 128, "max_obs_length": 64}, "learner": {"batch_size": 1, "mini_batch_size": 1, "micro_batch_size": 1},
        "weight_sync": {"method": "collective"}, "cluster": {"learner_cpus": 0.5},
    })


def summary(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "n": len(xs)}


def time_publishes(store, collective, learner, publishes: int) -> dict[str, list[float]]:
    """``publishes`` publishes by each path, alternating (object store: the learner's state dict into the object
    store and the publish, end to end, as the trainer does; collective: the publish's own seconds), each a new
    version; seconds per publish by path."""
    times: dict[str, list[float]] = {"object_store": [], "collective": []}
    version = 0
    for _ in range(publishes):
        version += 1
        t0 = time.perf_counter()
        store.publish(version, learner.state_dict_ref())
        times["object_store"].append(time.perf_counter() - t0)
        version += 1
        times["collective"].append(collective.publish(version).seconds)
    return times


def bench_size(model_dir: Path, publishes: int) -> dict:
    from async_agent_rl.weight_group import WeightGroup, listen_socket, weight_specs
    from learner.actor import create_learner_group
    from driver.weight_sync import CollectivePublisher, ObjectStorePublisher

    cfg = config(model_dir)
    learner = create_learner_group(cfg)
    host = ray.remote(num_cpus=0)(EngineHost).options(runtime_env={"env_vars": VLLM_ENV}).remote()
    ray.get(host.start.remote(str(model_dir), cfg), timeout=600)
    store, collective = ObjectStorePublisher([host]), CollectivePublisher([host], learner, backend="gloo",
                                                                          timeout_s=300)
    collective.connect()
    times = time_publishes(store, collective, learner, publishes)

    state = ray.get(learner.state_dict_ref())
    nbytes = sum(int(v.nbytes) for v in state.values())
    peer = ray.remote(num_cpus=0)(RawPeer).remote()
    raw_put = []
    for _ in range(publishes):
        t0 = time.perf_counter()
        ray.get(peer.fetch.remote(ray.put(state)))
        raw_put.append(time.perf_counter() - t0)
    sock = listen_socket()
    specs = weight_specs(state)
    joined = peer.join.remote(sock.getsockname()[1], specs)
    sender = WeightGroup(sock.getsockname()[1], 0, 2, "gloo", timeout_s=300, listen=sock)
    ray.get(joined)
    raw_bcast = []
    for _ in range(publishes):
        t0 = time.perf_counter()
        received = peer.receive.remote()
        sender.send(state, specs)
        ray.get(received)
        raw_bcast.append(time.perf_counter() - t0)
    sender.close()
    ray.get(host.close.remote())
    for actor in [host, peer, *learner.actors]:
        ray.kill(actor)
    return {"parameters": nbytes // 4, "bytes": nbytes,
            "object_store": summary(times["object_store"]), "collective": summary(times["collective"]),
            "raw_put_get": summary(raw_put), "raw_broadcast": summary(raw_bcast)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1m,20m,100m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--publishes", type=int, default=5)
    record.add_out_argument(p)
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"error: --sizes {','.join(unknown)}: not one of {', '.join(SIZES)}", file=sys.stderr)
        return 2
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        rec.result = bench(sizes, args.publishes)
    return 0


def bench(sizes: list[str], publishes: int) -> dict:
    """Every size in turn; prints each size's JSON line and the table, returns the results by size."""
    local_ray(num_cpus=2)  # loopback only, token authentication: as a training's local cluster
    results = {}
    with tempfile.TemporaryDirectory(prefix="aar_wsync_") as tmp:
        models = build_models(Path(tmp), sizes)
        for size in sizes:
            results[size] = bench_size(models[size], publishes)
            print(json.dumps({size: results[size]}), flush=True)
    ray.shutdown()
    print("\n| size | parameters | MB | object_store (s) | collective (s) | raw put+get (s) | raw broadcast (s) |")
    print("|---|---|---|---|---|---|---|")
    for size, r in results.items():
        cells = [f"{r[k]['median_s']:.3f} (min {r[k]['min_s']:.3f})"
                 for k in ("object_store", "collective", "raw_put_get", "raw_broadcast")]
        print(f"| {size} | {r['parameters'] / 1e6:.1f}M | {r['bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    return results


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
