"""Publish latency by weight-sync method at three model sizes, against the raw cost of moving the same bytes.

    python benchmarks/weight_sync_bench.py                       # ~6 minutes on 2 cores
    python benchmarks/weight_sync_bench.py --sizes 1m --publishes 3
    python benchmarks/weight_sync_bench.py --out benchmarks/results/weight_sync/   # also write the run's files there
    python benchmarks/weight_sync_bench.py --phases --publishes 3 --out benchmarks/results/weight_sync_phases/

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

``--phases`` also times one publish by each path phase by phase (the learner's gather, copy and finite check, the
object store or the broadcast, the engine's RAM file, pause, vLLM reload and re-pack), ``--publishes`` times each,
beside patched arms measured the same way without changing the shipped code: ``head_only`` (the re-pack after the
reload limited to the tied head), ``sum_check`` (the learner's finite check by one sum per tensor: ``finite_by_sum``),
``direct_send`` (the broadcast from the live parameters, no float32 copy), ``no_pause_sleep`` (the engine's pause
without vLLM's fixed 20 ms sleep) and all of them together (``+``-joined); then one publish by each path
under cProfile (the reload's top list), and the learner's own split of ``state_dict_for_publish``.

``--out DIR`` also writes DIR/result.json (the results by size, as printed; the JSON file ``--out`` named before it
named a folder), DIR/output.txt (what was printed) and DIR/run.json (command, commit, versions, cores, load average):
``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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

    # --phases: each publish path's engine side step by step, the same calls as ``VLLMEngine.update_weights`` /
    # ``update_weights_collective`` (actors/engine.py), each timed; the workers' part runs ``worker_reload``
    async def update_weights_phased(self, version, weights, profile=False, variant="stock"):
        from safetensors.torch import save_file

        from actors.engine import WEIGHTS_PREFIX, _tensor_dict, check_weights, weights_tmp_root

        entered, engine, ph = time.time(), self.engine, {}
        async with engine._update_lock:
            t = time.perf_counter()
            tensors = _tensor_dict(weights)
            t = lap(ph, "engine: numpy to tensors", t)
            check_weights(tensors, engine._params, engine._aliases)
            t = lap(ph, "engine: check names, shapes", t)
            folder = tempfile.mkdtemp(prefix=f"{WEIGHTS_PREFIX}{os.getpid()}_", dir=weights_tmp_root())
            try:
                await asyncio.to_thread(save_file, tensors, os.path.join(folder, "model.safetensors"))
                t = lap(ph, "engine: write safetensors to /dev/shm", t)
                t = await self._paused(ph, version, t, dict(weights_path=folder, profile=profile, variant=variant))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            lap(ph, "engine: remove the file", t)
        return entered, ph

    async def update_weights_collective_phased(self, version, specs, profile=False, variant="stock"):
        entered, engine, ph = time.time(), self.engine, {}
        async with engine._update_lock:
            await self._paused(ph, version, time.perf_counter(), dict(specs=list(specs), profile=profile,
                                                                      variant=variant))
        return entered, ph

    async def _paused(self, ph, version, t, kwargs):
        engine = self.engine
        if "no_pause_sleep" in kwargs["variant"].split("+"):
            # the patched pause: AsyncLLM.pause_generation's two calls without its fixed 20 ms sleep (vLLM's own
            # comment: only to let outputs of requests it aborts come out first; "keep" aborts none)
            await engine.llm.renderer.clear_mm_cache_async()
            await engine.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=True)
        else:
            await engine.llm.pause_generation(mode="keep", clear_cache=True)
        t = lap(ph, "engine: pause + KV/prefix cache reset", t)
        try:
            (worker,) = await engine.llm.collective_rpc(worker_reload, kwargs=kwargs)
            t = lap(ph, "engine: worker call (total)", t)
            await engine.llm.update_weight_version(str(version))
            engine.version = version
            t = lap(ph, "engine: version stamp", t)
        finally:
            await engine.llm.resume_generation()
        t = lap(ph, "engine: resume", t)
        ph["worker"] = worker
        return t


def lap(phases: dict, name: str, t0: float) -> float:
    """Add the seconds since ``t0`` to ``phases[name]``; returns now."""
    now = time.perf_counter()
    phases[name] = phases.get(name, 0.0) + now - t0
    return now


PROFILED = {  # functions whose cumulative seconds the profiled reload reports, by the name shown
    "vLLM reload_weights (all)": ("inplace.py", "reload_weights"),
    "model.load_weights (per-parameter loaders)": ("qwen2.py", "load_weights"),
    "safetensors read (file iterator)": ("weight_utils.py", "safetensors_weights_iterator"),
    "layerwise: materialize layer (new storage)": ("meta.py", "materialize_layer"),
    "layerwise: weight loaders replayed": ("layerwise.py", "_layerwise_process"),
    "process_weights_after_loading (CPU GEMM pack)": ("utils.py", "dispatch_cpu_unquantized_gemm"),
    "oneDNN handler (pack)": ("_custom_ops.py", "create_onednn_mm"),
    "layerwise: copy back into kernel tensors": ("layerwise.py", "_copy_and_restore_kernel_tensors"),
    "layerwise: init (restore layers on meta)": ("layerwise.py", "initialize_layerwise_reload"),
    "layerwise: finalize (attention, unloaded layers)": ("layerwise.py", "finalize_layerwise_processing"),
    "refresh_derived_weights (re-tie, re-pack)": ("vllm_worker.py", "refresh_derived_weights"),
}


def worker_reload(worker, weights_path=None, specs=None, profile=False, variant="stock"):
    """Inside the vLLM worker (sent by ``collective_rpc``): what ``PolicyReloadExtension.reload_policy_weights`` /
    ``receive_policy_weights`` (actors/vllm_worker.py) do, each step timed; ``profile``: under cProfile, with the
    top list and the cumulative seconds of ``PROFILED``. ``variant``: ``stock`` (as shipped); with ``head_only``
    (of its ``+``-joined flags): the re-pack after the reload limited to the tied head, the one layer the reload
    did not re-pack."""
    import cProfile
    import io as io_
    import pstats
    import time as time_

    from actors.vllm_worker import refresh_derived_weights

    runner, ph = worker.model_runner, {}
    prof = cProfile.Profile() if profile else None
    t = time_.perf_counter()
    if specs is not None:
        received = list(worker._weight_group.receive(specs))
        t = lap(ph, "worker: receive the broadcast (incl. waiting for the sender)", t)
    if prof:
        prof.enable()
    if specs is not None:
        runner.reload_weights(weights_iterator=iter(received))
    else:
        runner.reload_weights(weights_path=weights_path)
    t = lap(ph, "worker: vLLM reload_weights", t)
    model = runner.get_model()
    if "head_only" in variant.split("+"):
        ph["repacked"] = repack_head(model)
    else:
        ph["repacked"] = refresh_derived_weights(model)
    t = lap(ph, "worker: re-tie and re-pack", t)
    if prof:
        prof.disable()
        stats = pstats.Stats(prof)
        found = {}
        for (file, _, func), (_, _, _, cum, _) in stats.stats.items():
            for label, (f, fn) in PROFILED.items():
                if file.endswith(f) and func == fn:
                    found[label] = max(found.get(label, 0.0), cum)
        ph["profiled_s"] = found
        for key in ("cumulative", "tottime"):
            text = io_.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(18)
            ph[f"profile_top_{key}"] = trim_profile(text.getvalue())
    return ph


def repack_head(model) -> int:
    """The patched re-pack: re-tie a tied head, then re-pack only the head (the reload re-packed every layer it
    loaded, the embedding included; the tied head is the one layer with no weights of its own in a publish, so its
    packed copy is the only stale one)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None:
        return 0
    if getattr(model.config, "tie_word_embeddings", False) and embed is not None and head.weight is not embed.weight:
        head.weight = embed.weight
    if hasattr(head, "cpu_linear") and head.weight.dim() == 2 and head.weight.numel() > 0:
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        return 1
    return 0


def trim_profile(text: str) -> list[str]:
    """pstats' table lines, each path cut to its package's part (``vllm/...``, ``actors/...``: no machine path)."""
    import re

    cut = re.compile(r"[^\s(]*/(?:site-packages|lib/python3\.\d+)/|[^\s(]*/(?=(?:actors|learner|driver|async_agent_rl)/)")
    return [cut.sub("", line.rstrip()) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith(("Ordered by", "List reduced"))]


def learner_phases(actor) -> dict[str, float]:
    """Inside the learner's rank 0 (``__ray_call__``): ``Learner.state_dict_for_publish`` (learner/learner.py) step
    by step: the parameters gathered (one rank: a walk over them), copied to float32 numpy, checked finite; then
    what each path does with the copy: the specs (collective), ``ray.put`` (object store: what returning the dict
    from the actor costs)."""
    import time as time_

    import ray as ray_
    import torch

    from async_agent_rl.weight_group import weight_specs
    from learner.learner import require_finite

    learner, ph = actor.learner, {}
    t = time_.perf_counter()
    params = list(learner.full_parameters())
    t = lap(ph, "learner: gather parameters", t)
    state = {name: p.detach().to("cpu", torch.float32, copy=True).numpy() for name, p in params}
    t = lap(ph, "learner: float32 numpy copy", t)
    require_finite(learner.step, "parameters", iter(state.items()))
    t = lap(ph, "learner: finite check", t)
    finite_by_sum(learner.step, "parameters", iter(state.items()))
    t = lap(ph, "learner: finite check by sum (finite_by_sum, patched)", t)
    weight_specs(state)
    t = lap(ph, "learner: specs", t)
    ref = ray_.put(state)
    lap(ph, "learner: ray.put of the copy", t)
    del ref
    return ph


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


def phased_object_store(host, learner, version: int, profile: bool, variant: str) -> dict:
    """One object-store publish as the trainer makes it (``state_dict_ref``, then the engine's update), by phase.
    ``variant``: ``+``-joined flags; ``sum_check``: the learner's copy checked by ``finite_by_sum``
    (``learner_state_sum_check``); the others go to the engine's side (``head_only``, ``no_pause_sleep``)."""
    t0 = time.perf_counter()
    if "sum_check" in variant.split("+"):
        ref = learner.actors[0].__ray_call__.remote(learner_state_sum_check)
    else:
        ref = learner.state_dict_ref()
    ray.wait([ref], fetch_local=False)
    t1 = time.perf_counter()
    called = time.time()
    entered, ph = ray.get(host.update_weights_phased.remote(version, ref, profile, variant))
    row = {"learner: state_dict_ref (gather, copy, into the object store)": t1 - t0,
           "engine actor: call, state fetched from the object store": max(0.0, entered - called)}
    return finish_row(row, ph, time.perf_counter() - t0)


def phased_collective(host, learner, version: int, profile: bool, variant: str) -> dict:
    """One collective publish as ``CollectivePublisher.publish`` makes it, by phase. ``variant``: ``+``-joined
    flags; ``direct_send``: the learner sends its live parameters (finite check kept, no float32 numpy copy:
    ``learner_direct_send``); ``sum_check``: its finite check by ``finite_by_sum``; the others go to the engine's
    side (``head_only``, ``no_pause_sleep``)."""
    flags = variant.split("+")
    rank0, direct, sum_check = learner.actors[0], "direct_send" in flags, "sum_check" in flags
    row: dict[str, float] = {}
    t0 = time.perf_counter()
    if direct:
        specs = ray.get(rank0.__ray_call__.remote(learner_specs))
        t = lap(row, "learner: specs of the live parameters", t0)
    elif sum_check:
        specs = ray.get(rank0.__ray_call__.remote(learner_prepare_sum_check))
        t = lap(row, "learner: prepare_publish (gather, copy, finite check, specs)", t0)
    else:
        specs = ray.get(rank0.prepare_publish.remote())
        t = lap(row, "learner: prepare_publish (gather, copy, finite check, specs)", t0)
    ray.get(host.check_weight_specs.remote(specs))
    t = lap(row, "engine: check the specs", t)
    called = time.time()
    pending = host.update_weights_collective_phased.remote(version, specs, profile, variant)
    if direct:
        sent = rank0.__ray_call__.remote(learner_direct_send, specs, sum_check)
        (check_s, send_s), (entered, ph) = ray.get([sent, pending])
        row["learner: finite check of the live parameters"] = check_s
    else:
        (_, send_s), (entered, ph) = ray.get([rank0.broadcast_weights.remote(specs), pending])
    row["engine actor: call"] = max(0.0, entered - called)
    row["learner: broadcast send (overlaps the worker's receive)"] = send_s
    return finish_row(row, ph, time.perf_counter() - t0)


def learner_specs(actor) -> list:
    """Inside the learner's rank 0: the specs of its live parameters (as ``prepare_publish`` returns them)."""
    from async_agent_rl.weight_group import weight_specs

    return weight_specs(dict(actor.learner.full_parameters()))


def learner_direct_send(actor, specs, sum_check: bool = False) -> tuple[float, float]:
    """Inside the learner's rank 0: the patched send: the finite check (``sum_check``: ``finite_by_sum``), then the
    broadcast straight from the live parameters (one rank: no gather; under ZeRO-3 each would be gathered in turn),
    no float32 numpy copy. Only valid while no step runs (the driver publishes between steps). Returns the check's
    and the send's seconds."""
    import time as time_

    from learner.learner import require_finite

    t = time_.perf_counter()
    state = dict(actor.learner.full_parameters())
    (finite_by_sum if sum_check else require_finite)(actor.learner.step, "parameters", iter(state.items()))
    t1 = time_.perf_counter()
    actor._group.send(state, specs)
    return t1 - t, time_.perf_counter() - t1


def finite_by_sum(step: int, what: str, values) -> None:
    """``require_finite`` (learner/learner.py) with a one-pass fast path: a tensor whose sum is finite holds no NaN
    or infinity (either makes the sum NaN or infinite), so only the tensors whose sum is not finite (a non-finite
    element, or finite elements whose float32 sum overflows) get its elementwise check (``torch.isfinite``: a bool
    tensor as large as the parameter, then a reduction). Same errors, same names."""
    import math

    import torch

    from learner.learner import require_finite

    suspects = [(name, v) for name, v in values if not math.isfinite(float(torch.as_tensor(v).sum()))]
    require_finite(step, what, iter(suspects))


def learner_state(actor, sum_check: bool) -> dict:
    """Inside the learner's rank 0 (one rank): ``Learner.state_dict_for_publish``, its finite check ``finite_by_sum``
    when ``sum_check``."""
    import torch

    from learner.learner import require_finite

    learner = actor.learner
    state = {name: p.detach().to("cpu", torch.float32, copy=True).numpy() for name, p in learner.full_parameters()}
    (finite_by_sum if sum_check else require_finite)(learner.step, "parameters", iter(state.items()))
    return state


def learner_state_sum_check(actor) -> dict:
    """The patched ``LearnerActor.state_dict_for_publish``: the copy checked by ``finite_by_sum``."""
    return learner_state(actor, True)


def learner_prepare_sum_check(actor) -> list:
    """The patched ``LearnerActor.prepare_publish``: the copy checked by ``finite_by_sum``, kept for
    ``broadcast_weights``; returns its specs."""
    from async_agent_rl.weight_group import weight_specs

    actor._prepared = learner_state(actor, True)
    return weight_specs(actor._prepared)


def finish_row(row: dict, ph: dict, total: float) -> dict:
    worker = ph.pop("worker")
    call = ph.get("engine: worker call (total)", 0.0)
    row.update(ph)
    row.update({k: v for k, v in worker.items() if k.startswith("worker: ")})
    row["worker: RPC into the engine core process"] = call - sum(v for k, v in worker.items()
                                                                  if k.startswith("worker: "))
    row["total"] = total
    extra = {k: v for k, v in worker.items() if not k.startswith("worker: ")}
    return {"phases": row, **extra}


ARMS = [("object_store", "stock"), ("collective", "stock"), ("object_store", "head_only"), ("collective", "head_only"),
        ("object_store", "sum_check"), ("collective", "sum_check"), ("collective", "direct_send"),
        ("object_store", "no_pause_sleep"), ("collective", "no_pause_sleep"),
        ("object_store", "sum_check+head_only+no_pause_sleep"),
        ("collective", "direct_send+sum_check+head_only+no_pause_sleep")]


def phase_runs(host, learner, version: int, reps: int) -> tuple[dict, int]:
    """``reps`` publishes by each path and variant, alternating (stock, then the patched re-pack), one profiled
    publish by each path after them; the median seconds of each phase, the learner's own split, the profiles."""
    arms: dict[tuple[str, str], list] = {(path, variant): [] for path, variant in ARMS}
    fns = {"object_store": phased_object_store, "collective": phased_collective}
    for _ in range(reps):
        for (path, variant), rows in arms.items():
            version += 1
            rows.append(fns[path](host, learner, version, False, variant)["phases"])
    out: dict = {}
    for (path, variant), rows in arms.items():
        out[f"{path}/{variant}"] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    for path, fn in fns.items():
        version += 1
        profiled = fn(host, learner, version, True, "stock")
        out[f"{path}/profile"] = {k: v for k, v in profiled.items() if k != "phases"}
        out[f"{path}/profile"]["phases_under_profiler"] = profiled["phases"]
    splits = [ray.get(learner.actors[0].__ray_call__.remote(learner_phases)) for _ in range(reps)]
    out["learner_split"] = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
    return out, version


def bench_size(model_dir: Path, publishes: int, phases: bool = False) -> dict:
    from async_agent_rl.weight_group import WeightGroup, listen_socket, weight_specs
    from learner.actor import create_learner_group
    from driver.weight_sync import CollectivePublisher, ObjectStorePublisher

    cfg = config(model_dir)
    learner = create_learner_group(cfg)
    env = VLLM_ENV | ({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if phases else {})  # --phases sends functions
    host = ray.remote(num_cpus=0)(EngineHost).options(runtime_env={"env_vars": env}).remote()
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
    phase_result = phase_runs(host, learner, 2 * publishes, publishes)[0] if phases else None
    ray.get(host.close.remote())
    for actor in [host, peer, *learner.actors]:
        ray.kill(actor)
    return {"parameters": nbytes // 4, "bytes": nbytes,
            "object_store": summary(times["object_store"]), "collective": summary(times["collective"]),
            "raw_put_get": summary(raw_put), "raw_broadcast": summary(raw_bcast)} | (
                {"phases": phase_result} if phases else {})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1m,20m,100m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--publishes", type=int, default=5)
    p.add_argument("--phases", action="store_true",
                   help="also time each phase of a publish by each path (learner, object store or broadcast, the "
                        "engine's pause, reload and re-pack) beside patched arms (head-only re-pack, finite check "
                        "by sum, direct send), and profile one publish by each path under cProfile (its top list)")
    record.add_out_argument(p)
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"error: --sizes {','.join(unknown)}: not one of {', '.join(SIZES)}", file=sys.stderr)
        return 2
    if args.publishes < 1:
        print(f"error: --publishes {args.publishes}: must be at least 1", file=sys.stderr)
        return 2
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        rec.result = bench(sizes, args.publishes, args.phases)
    return 0


def bench(sizes: list[str], publishes: int, phases: bool = False) -> dict:
    """Every size in turn; prints each size's JSON line and the table, returns the results by size."""
    local_ray(num_cpus=2)  # loopback only, token authentication: as a training's local cluster
    results = {}
    with tempfile.TemporaryDirectory(prefix="aar_wsync_") as tmp:
        models = build_models(Path(tmp), sizes)
        for size in sizes:
            results[size] = bench_size(models[size], publishes, phases)
            print(json.dumps({size: {k: v for k, v in results[size].items() if k != "phases"}}), flush=True)
    ray.shutdown()
    print("\n| size | parameters | MB | object_store (s) | collective (s) | raw put+get (s) | raw broadcast (s) |")
    print("|---|---|---|---|---|---|---|")
    for size, r in results.items():
        cells = [f"{r[k]['median_s']:.3f} (min {r[k]['min_s']:.3f})"
                 for k in ("object_store", "collective", "raw_put_get", "raw_broadcast")]
        print(f"| {size} | {r['parameters'] / 1e6:.1f}M | {r['bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    if phases:
        for size, r in results.items():
            print_phases(size, r)
    return results


def print_phases(size: str, r: dict) -> None:
    """The phase tables of one size: each path's phases (median seconds, share of its total) beside the patched
    re-pack, the ratios to the raw transfer of the same bytes, the learner's split, the profiled reload."""
    ph = r["phases"]
    for path, raw in (("object_store", "raw_put_get"), ("collective", "raw_broadcast")):
        variants = [v for p_, v in ARMS if p_ == path]
        cols = {v: ph[f"{path}/{v}"] for v in variants}
        stock, raw_s = cols["stock"], r[raw]["median_s"]
        print(f"\n#### {size} ({r['bytes'] / 1e6:.0f} MB), {path}: timed publishes {r[path]['median_s']:.3f} s = "
              f"{r[path]['median_s'] / raw_s:.1f}x {raw} ({raw_s:.3f} s); phased: "
              + ", ".join(f"{v} {c['total']:.3f} s = {c['total'] / raw_s:.1f}x" for v, c in cols.items()) + "\n")
        print("| phase | stock (s) | share | " + " | ".join(f"{v} (s)" for v in variants[1:]) + " |")
        print("|---|---|---|" + "---|" * (len(variants) - 1))
        names = list(dict.fromkeys(k for c in cols.values() for k in c if k != "total")) + ["total"]
        for k in names:
            v = stock.get(k)
            share = f"{v / stock['total']:.0%}" if v is not None and k != "total" else ""
            cells = [f"{c[k]:.4f}" if k in c else "-" for c in cols.values()]
            print(f"| {k} | {cells[0]} | {share} | " + " | ".join(cells[1:]) + " |")
        prof = ph[f"{path}/profile"]
        print(f"\nprofiled publish ({path}, stock; the profiler slows Python code): cumulative seconds")
        for k, v in sorted(prof.get("profiled_s", {}).items(), key=lambda kv: -kv[1]):
            print(f"    {v:8.4f}  {k}")
        print(f"top of the profiled reload by tottime ({path}):")
        for line in prof.get("profile_top_tottime", [])[:22]:
            print("    " + line)
    print(f"\nlearner's split of state_dict_for_publish ({size}), median seconds:")
    for k, v in ph["learner_split"].items():
        print(f"    {v:8.4f}  {k}")


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
