"""Replay buffer throughput through the real Ray actor, with realistic ~2k-token trajectories, batched.

Phases (default buffer capacity: 4096 trajectories / 8M tokens, so about 3,900 of these fit):
  push     producers fill an empty buffer up to capacity, ``--push-batch`` trajectories per call
  sample   the learner drains it, ``--sample-batch`` trajectories per call (wire bytes)
  steady   producers push ``--steady`` trajectories into a nearly full buffer while the learner samples
  step     one learner step of ``--learner-batch`` trajectories: ``sample_batch`` (decoded and packed in the actor)

Producers call ``try_start`` before each push, as rollout actors do. Run from the repo root::

    python benchmarks/buffer_bench.py
    python benchmarks/buffer_bench.py --out benchmarks/results/buffer/   # also write the run's files there

``--out DIR`` also writes DIR/result.json (the printed numbers), DIR/output.txt (what was printed) and DIR/run.json
(command, commit, versions, cores, load average): ``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import msgpack
import numpy as np
import ray

from async_agent_rl.config import build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from buffer.actor import create_buffer_actor, push_all
from driver.cluster import local_ray

if __package__:  # imported as benchmarks.buffer_bench
    from benchmarks import record
else:  # run as python benchmarks/buffer_bench.py: this folder is sys.path[0]
    import record


def template(tokens: int, seed: int) -> dict:
    """Wire map of a Search-R1-like episode: prompt, then model/observation turns, ``tokens`` in all."""
    rng = np.random.default_rng(seed)
    prompt = tokens // 8
    turn, obs = (tokens - prompt) // 7, (tokens - prompt) // 7  # 4 model turns, 3 observations (last turn longer)
    spans, pos = [], 0
    for k in range(7):
        kind = "model" if k % 2 == 0 else "observation"
        end = tokens - prompt if k == 6 else pos + (turn if kind == "model" else obs)
        spans.append(TurnSpan(kind, pos, end))
        pos = end
    mask = np.zeros(pos, dtype=int)
    for s in spans:
        if s.kind == "model":
            mask[s.start : s.end] = 1
    return Trajectory(
        prompt_ids=rng.integers(0, 32000, prompt).tolist(),
        response_ids=rng.integers(0, 32000, pos).tolist(),
        loss_mask=mask.tolist(),
        behavior_logprobs=np.where(mask, rng.normal(-1, 0.5, pos), 0.0).tolist(),
        versions=np.where(mask, 0, -1).tolist(),
        turns=spans,
        reward=1.0,
        meta=EpisodeMeta(data_source="nq", question_id="q"),
    ).to_wire()


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, tokens: int, seed: int):
        self.wire = template(tokens, seed)
        self.seed = seed  # in the ids: admission refuses a group id twice, across producers too

    def make(self, name: str, n: int, group_size: int) -> int:
        """Encode ``n`` distinct trajectories (``n / group_size`` groups) ahead of the timed push."""
        self.blobs, self.group_size = [], group_size
        for i in range(n):
            self.wire["meta"]["group_id"] = f"{name}-p{self.seed}-{i // group_size}"
            self.wire["meta"]["trajectory_id"] = f"{name}-p{self.seed}-{i}"
            self.blobs.append(msgpack.packb(self.wire, use_bin_type=True))
        return sum(len(b) for b in self.blobs)

    def run(self, buffer, batch: int) -> int:
        """Push everything, ``batch`` per call, asking for admission first; returns the number of waits."""
        waits = 0
        for i in range(0, len(self.blobs), batch):
            chunk = self.blobs[i : i + batch]
            for gid in dict.fromkeys(msgpack.unpackb(b)["meta"]["group_id"] for b in chunk):
                while ray.get(buffer.try_start.remote(self.group_size, 0, gid, "bench")) == 0:
                    time.sleep(0.001)
            waits += push_all(buffer, chunk, poll_s=0.001)
        return waits


def drain(buffer, batch: int, total: int, patience_s: float = 30.0) -> int:
    """Sample ``total`` trajectories, ``batch`` per call."""
    got, last = 0, time.monotonic()
    while got < total:
        blobs = ray.get(buffer.sample.remote(batch, 0))
        if blobs is None:
            if time.monotonic() - last > patience_s:
                raise RuntimeError(f"no batch for {patience_s} s after {got}/{total}: {ray.get(buffer.stats.remote())}")
            time.sleep(0.0005)
            continue
        got, last = got + len(blobs), time.monotonic()
    return got


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1 (0 producers, repeats or tokens would divide by zero or time nothing)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=at_least_one, default=2048, help="prompt + response tokens per trajectory")
    ap.add_argument("--producers", type=at_least_one, default=2)
    ap.add_argument("--push-batch", type=at_least_one, default=64, help="rounded down to whole groups")
    ap.add_argument("--sample-batch", type=at_least_one, default=320)
    ap.add_argument("--learner-batch", type=at_least_one, default=40, help="a multiple of --group-size")
    ap.add_argument("--group-size", type=at_least_one, default=5)
    ap.add_argument("--steady", type=at_least_one, default=20000, help="trajectories through a full buffer")
    ap.add_argument("--repeats", type=at_least_one, default=20, help="learner steps timed in the step phase")
    record.add_out_argument(ap)
    args = ap.parse_args(argv)
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        rec.result = bench(args)


def bench(args: argparse.Namespace) -> dict:
    """The four phases; prints each, returns the printed numbers."""
    args.push_batch -= args.push_batch % args.group_size  # admission grants whole groups

    local_ray(num_cpus=2)  # loopback only, token authentication: as a training's local cluster
    prompt = args.tokens // 8  # as template() cuts it; the buffer refuses a trajectory longer than these allow
    cfg = build_config(
        {
            "model": {"max_model_len": max(args.tokens, 1024)},
            "data": {"max_prompt_length": prompt},
            "rollout": {"group_size": args.group_size, "num_actors": args.producers, "max_concurrent_episodes": 10**6,
                        "max_response_length": args.tokens - prompt},
            "learner": {"batch_size": args.learner_batch, "mini_batch_size": args.learner_batch,
                        "micro_batch_size": args.learner_batch},
            "buffer": {"max_staleness": 10**6},  # every version is 0 here; admission is exercised, not binding
            "cluster": {"buffer_cpus": 0},
        }
    )
    buffer = create_buffer_actor(cfg, pad_id=0)
    producers = [Producer.remote(args.tokens, i) for i in range(args.producers)]
    per_traj = len(msgpack.packb(template(args.tokens, 0), use_bin_type=True))
    unit = math.lcm(args.sample_batch, args.group_size * args.producers)  # whole samples, whole groups per producer
    fit = min(cfg.buffer.capacity_trajectories, cfg.buffer.capacity_tokens // args.tokens)
    fit -= fit % unit
    args.steady -= args.steady % unit
    print(f"trajectory: {args.tokens} tokens, {per_traj / 1024:.1f} KiB on the wire; buffer holds {fit}")
    result: dict = {"tokens": args.tokens, "wire_bytes": per_traj, "buffer_holds": fit}

    def timed_push(n_each: int, tag: str, consume: int = 0) -> tuple[float, int]:
        ray.get([p.make.remote(f"{tag}{i}", n_each, args.group_size) for i, p in enumerate(producers)])
        t0 = time.perf_counter()
        runs = [p.run.remote(buffer, args.push_batch) for p in producers]
        if consume:
            drain(buffer, args.sample_batch, consume)
        waits = sum(ray.get(runs))
        return time.perf_counter() - t0, waits

    n_each = fit // args.producers
    wall, _ = timed_push(n_each, "fill")
    pushed = n_each * args.producers
    print(f"push    {pushed} trajectories in {wall:.3f} s = {pushed / wall:,.0f} traj/s "
          f"({pushed * per_traj / wall / 2**20:,.0f} MiB/s), {args.push_batch} per call, {args.producers} producers")
    result["push"] = {"trajectories": pushed, "seconds": wall, "traj_per_s": pushed / wall,
                      "mib_per_s": pushed * per_traj / wall / 2**20, "per_call": args.push_batch,
                      "producers": args.producers}

    t0 = time.perf_counter()
    got = drain(buffer, args.sample_batch, pushed)
    wall = time.perf_counter() - t0
    print(f"sample  {got} trajectories in {wall:.3f} s = {got / wall:,.0f} traj/s, {args.sample_batch} per call")
    result["sample"] = {"trajectories": got, "seconds": wall, "traj_per_s": got / wall, "per_call": args.sample_batch}

    ray.get([p.make.remote("warm", fit // args.producers, args.group_size) for p in producers])
    ray.get([p.run.remote(buffer, args.push_batch) for p in producers])  # refill: the steady phase runs near capacity
    n_each = args.steady // args.producers
    wall, waits = timed_push(n_each, "steady", consume=n_each * args.producers)
    moved = n_each * args.producers
    print(f"steady  {moved} trajectories pushed and sampled through a nearly full buffer in {wall:.3f} s = "
          f"{moved / wall:,.0f} traj/s ({waits} backpressure waits)")
    result["steady"] = {"trajectories": moved, "seconds": wall, "traj_per_s": moved / wall, "backpressure_waits": waits}

    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        batch = ray.get(buffer.sample_batch.remote(0))
        times.append(time.perf_counter() - t0)
    print(f"step    sample_batch({args.learner_batch}) -> TrainBatch {tuple(batch.input_ids.shape)}: "
          f"median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms over {args.repeats}")
    result["step"] = {"learner_batch": args.learner_batch, "shape": list(batch.input_ids.shape),
                      "median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3, "repeats": args.repeats}
    stats = ray.get(buffer.stats.remote())
    print(f"stats   pushed={stats.pushed} sampled={stats.sampled} size={stats.size} "
          f"evicted={stats.evicted_total} push_refused={stats.push_refused}")
    result["stats"] = {"pushed": stats.pushed, "sampled": stats.sampled, "size": stats.size,
                       "evicted": stats.evicted_total, "push_refused": stats.push_refused}
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()
