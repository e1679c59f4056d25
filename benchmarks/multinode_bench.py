"""Weight publish across nodes by model size, against a raw transfer of the same bytes across nodes.

    python benchmarks/multinode_bench.py                                  # ~8 minutes on 2 cores
    python benchmarks/multinode_bench.py --sizes 1m --publishes 3
    python benchmarks/multinode_bench.py --out benchmarks/results/multinode_publish/

The cluster is a multi-node Ray cluster on this machine (``tests/multinode.py``: one raylet per node, each with its
own object store, all on 127.0.0.1, token authentication on): the head node runs this driver and one learner rank
(``cluster.learner_resources``), node ``r1`` one vLLM engine (CPU build, in-process engine core, ``pause`` mode;
``cluster.rollout_resources``) and a bare peer actor. For each size (the models of ``weight_sync_bench.py``: random
Qwen2 on the quickstart's tokenizer, ``1m`` the quickstart's four-head shape of before 2026-12-01), ``--publishes`` times each, alternately:

- ``object_store``: the trainer's path end to end: the learner's state dict into the head's object store
  (``LearnerGroup.state_dict_ref``), ``ObjectStorePublisher.publish``: the engine's node pulls the object into its
  own store, the engine writes a RAM file and reloads;
- ``collective``: ``CollectivePublisher.publish`` (gloo broadcast from the learner into the engine's worker, in-place
  reload); the group is made before the first one.

The raw costs of the same bytes, no engine, no learner: ``ray.put`` in this driver and ``ray.get`` in the peer on
``r1`` (across nodes: a transfer between object stores), the same with a peer on the head (one object store: shared
memory), and a bare gloo broadcast from this driver to the peer on ``r1``. Each publish and each raw put makes a
new object, so every ``ray.get`` on ``r1`` pulls the bytes again. Reported: the median and the minimum, seconds.

``--out DIR`` also writes DIR/result.json (the results by size, as printed), DIR/output.txt (what was printed) and
DIR/run.json (command, commit, versions, cores, load average): ``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # python benchmarks/multinode_bench.py: the repository's packages and tests/
    sys.path.insert(1, str(REPO))

if __package__:  # imported as benchmarks.multinode_bench
    from benchmarks import record
    from benchmarks import weight_sync_bench as wsb
else:  # run as python benchmarks/multinode_bench.py: this folder is sys.path[0]
    import record
    import weight_sync_bench as wsb

from async_agent_rl.config import Config, build_config  # noqa: E402
from tests.multinode import LocalNodes  # noqa: E402

OBJECT_STORE_BYTES = 1 << 30  # each node's store: the 100m model's state (400 MB) twice over, with room


def config(model_dir: Path, address: str) -> Config:
    return build_config({
        "model": {"path": str(model_dir), "max_model_len": 256}, "data": {"max_prompt_length": 128},
        "rollout": {"group_size": 1, "max_response_length": 128, "max_obs_length": 64},
        "learner": {"batch_size": 1, "mini_batch_size": 1, "micro_batch_size": 1},
        "weight_sync": {"method": "collective"},
        "cluster": {"ray_address": address, "learner_cpus": 0.5, "learner_resources": {"trainer": 1},
                    "rollout_resources": {"rollout": 1}},
    })


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda a: ray.get_runtime_context().get_node_id()))


def bench_size(model_dir: Path, address: str, publishes: int, node_ids: dict[str, str]) -> dict:
    from async_agent_rl.weight_group import WeightGroup, listen_socket, weight_specs
    from driver.weight_sync import CollectivePublisher, ObjectStorePublisher
    from learner.actor import create_learner_group

    cfg = config(model_dir, address)
    rollout = cfg.cluster.rollout_resources
    learner = create_learner_group(cfg)
    host = ray.remote(num_cpus=0)(wsb.EngineHost).options(resources=rollout,
                                                          runtime_env={"env_vars": wsb.VLLM_ENV}).remote()
    ray.get(host.start.remote(str(model_dir), cfg), timeout=900)
    far = ray.remote(num_cpus=0)(wsb.RawPeer).options(resources=rollout).remote()
    near = ray.remote(num_cpus=0)(wsb.RawPeer).options(resources={"trainer": 0.5}).remote()
    placed = {"learner": node_of(learner.actors[0]), "engine": node_of(host), "far_peer": node_of(far),
              "near_peer": node_of(near), "driver": ray.get_runtime_context().get_node_id()}
    assert placed["learner"] == placed["driver"] == placed["near_peer"] == node_ids["head"], placed
    assert placed["engine"] == placed["far_peer"] == node_ids["r1"], placed

    store = ObjectStorePublisher([host], 600)
    collective = CollectivePublisher([host], learner, backend="gloo", timeout_s=600)
    collective.connect()
    times = wsb.time_publishes(store, collective, learner, publishes)

    state = ray.get(learner.state_dict_ref())
    nbytes = sum(int(v.nbytes) for v in state.values())
    raw: dict[str, list[float]] = {"raw_put_get_across": [], "raw_put_get_same_node": []}
    for _ in range(publishes):
        for key, peer in (("raw_put_get_across", far), ("raw_put_get_same_node", near)):
            t0 = time.perf_counter()
            got = ray.get(peer.fetch.remote(ray.put(state)))
            raw[key].append(time.perf_counter() - t0)
            assert got == nbytes, (got, nbytes)
    sock = listen_socket()
    specs = weight_specs(state)
    joined = far.join.remote(sock.getsockname()[1], specs)
    sender = WeightGroup(sock.getsockname()[1], 0, 2, "gloo", timeout_s=300, listen=sock)
    ray.get(joined)
    bcast = []
    for _ in range(publishes):
        t0 = time.perf_counter()
        received = far.receive.remote()
        sender.send(state, specs)
        ray.get(received)
        bcast.append(time.perf_counter() - t0)
    sender.close()
    collective.close()
    ray.get(host.close.remote())
    for actor in [host, far, near, *learner.actors]:
        ray.kill(actor)
    return {"parameters": nbytes // 4, "bytes": nbytes,
            "object_store": wsb.summary(times["object_store"]), "collective": wsb.summary(times["collective"]),
            **{k: wsb.summary(v) for k, v in raw.items()}, "raw_broadcast_across": wsb.summary(bcast),
            "placement": {k: v[:8] for k, v in placed.items()}}


COLUMNS = ("object_store", "collective", "raw_put_get_across", "raw_put_get_same_node", "raw_broadcast_across")


def bench(sizes: list[str], publishes: int) -> dict:
    """Every size in turn on one cluster; prints each size's JSON line and the table, returns the results by size.
    The measuring driver is a process of its own, started with the cluster's token in its environment (Ray reads
    the authentication mode once per process)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="aar_mnode_") as tmp:
        models = wsb.build_models(Path(tmp), sizes)
        head = {"num_cpus": 2, "resources": {"trainer": 2}, "object_store_memory": OBJECT_STORE_BYTES}
        r1 = {"num_cpus": 1, "resources": {"rollout": 2}, "object_store_memory": OBJECT_STORE_BYTES}  # engine, peer
        with LocalNodes(head, {"r1": r1}) as nodes:
            spec = {"address": nodes.address, "node_ids": nodes.node_ids, "publishes": publishes,
                    "models": {size: str(models[size]) for size in sizes}}
            proc = subprocess.Popen([sys.executable, __file__, "--measure", json.dumps(spec)], cwd=REPO,
                                    env=nodes.env, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("SIZE "):
                    size, result = json.loads(line[5:])
                    results[size] = result
                    print(json.dumps({size: result}), flush=True)
            if proc.wait() != 0 or len(results) < len(sizes):
                raise SystemExit(f"error: the measuring driver exited {proc.returncode} after {list(results)}")
    print("\n| size | parameters | MB | " + " | ".join(f"{c} (s)" for c in COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for size, r in results.items():
        cells = [f"{r[k]['median_s']:.3f} (min {r[k]['min_s']:.3f})" for k in COLUMNS]
        print(f"| {size} | {r['parameters'] / 1e6:.1f}M | {r['bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    return results


def measure(spec: dict) -> None:
    """The measuring driver (``--measure SPEC``): connects to the cluster and prints one ``SIZE`` line per size."""
    from driver.cluster import ray_init

    for module in (sys.modules[__name__], wsb):  # the actor classes go to the workers by value
        ray.cloudpickle.register_pickle_by_value(module)
    models = {size: Path(path) for size, path in spec["models"].items()}
    ray_init(config(next(iter(models.values())), spec["address"]))
    for size, model_dir in models.items():
        result = bench_size(model_dir, spec["address"], spec["publishes"], spec["node_ids"])
        print("SIZE " + json.dumps([size, result]), flush=True)
    ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1m,20m,100m", help=f"comma-separated, of {', '.join(wsb.SIZES)}")
    p.add_argument("--publishes", type=int, default=5)
    p.add_argument("--measure", metavar="SPEC", help=argparse.SUPPRESS)  # the measuring driver (bench)
    record.add_out_argument(p)
    args = p.parse_args(argv)
    if args.measure:
        measure(json.loads(args.measure))
        return 0
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in wsb.SIZES]
    if unknown or not sizes:
        print(f"error: --sizes {','.join(unknown)}: not one of {', '.join(wsb.SIZES)}", file=sys.stderr)
        return 2
    if args.publishes < 1:
        print(f"error: --publishes must be at least 1, got {args.publishes}", file=sys.stderr)
        return 2
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        rec.result = bench(sizes, args.publishes)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
