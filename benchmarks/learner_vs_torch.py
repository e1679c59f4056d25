"""The learner's step against a bare PyTorch loop doing the same work on the same batches, side by side in one run.

    python benchmarks/learner_vs_torch.py                        # both models, ~5 minutes on 2 cores
    python benchmarks/learner_vs_torch.py --models quickstart --steps 4
    python benchmarks/learner_vs_torch.py --patch --profile      # + a patched learner arm, where the time goes
    python benchmarks/learner_vs_torch.py --patch --profile --out benchmarks/results/learner_vs_torch/

Learner: ``learner.learner.Learner.train_step`` as the training runs it (one rank, DeepSpeed ZeRO 0 on CPU, gloo,
float32, torch AdamW). Bare loop (``BareLoop``): plain torch, no Ray, no DeepSpeed, the same work: the same model
class loaded from the same folder (the same weights), the same batch, the same proximal no-grad pass in
micro-batches, the same advantages (``compute_advantages``), the same mini-batch shuffle and micro-batches (rows
sorted by length), the same loss (the project's ``decoupled_ppo`` loss and entropy from ``async_agent_rl.algorithms``,
scaled exactly as the learner scales it for gradient accumulation), gradient clipping and ``torch.optim.AdamW`` with
the learner's hyperparameters.

Models (both qwen3, built in a temporary folder with ``async_agent_rl.tiny_model`` on one BPE tokenizer trained on
the generated search world of seed 0):

- ``quickstart``: ``configs/quickstart.yaml``'s ``model.init`` (hidden 128, 2 layers, 8 heads of 32, 4 KV heads);
- ``100m``: ``BIG_MODEL`` (hidden 768, 12 layers, 12 heads of 64, 6 KV heads, intermediate 2816), ~100M parameters
  (the exact count is printed).

Batches: ``learner_bench.synthetic_batch`` (prompt | model turn | observation | model turn, GRPO groups of 2,
rewards 0/1), one mini-batch per step cut into micro-batches (gradient accumulation); the shapes are flags.

``--patch``: a third arm, the learner with ``one_rank_without_allreduce`` applied to its class here, at run time
(``learner/`` is not edited): at one rank, DeepSpeed's gradient all-reduce of a ZeRO-0 float32 engine is turned off.

Correctness: every arm starts from the same weights and takes one step on the same batch (the warm-up); a line
``check`` per learner arm gives its and the bare loop's policy loss and gradient norm and the largest parameter
difference after that step. Timing: ``--steps`` rounds after ``--warmup`` warm-up steps of each arm, each arm once a
round, the order rotated every round, ``--threads`` torch intra-op threads (1: the learner's Ray actor's). Per step:
wall seconds, CPU seconds of this process (robust to other load on a shared machine), of them the system's, minor
page faults, and non-padding tokens; reported: medians, tokens per wall second and per CPU second of each arm, and
the ratios learner / bare (and the median of the per-round ratios of wall times: the steps of a round run back to
back).

``--profile``: after the timing, two more steps of each arm with phase timers in CPU seconds of the main thread
(targets: the proximal pass and the advantages; forward: the policy's forward with grad and the log-probs;
backward; optimizer: clipping, AdamW, zeroing the gradients; other: the rest, the loss arithmetic included), then
one step of each under ``torch.profiler``: the total self CPU time and the operators with the most.
``--out DIR`` writes DIR/result.json, output.txt and run.json (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import yaml

from async_agent_rl.algorithms import (
    agg_loss,
    compute_advantages,
    entropy_from_logits,
    get_policy_loss,
    place_outcome_rewards,
)
from async_agent_rl.batch import TrainBatch
from async_agent_rl.config import Config, TinyModelConfig, WorldConfig, build_config
from async_agent_rl.lr_schedule import lr_factor

if __package__:  # imported as benchmarks.learner_vs_torch
    from benchmarks import record
    from benchmarks.learner_bench import cpu_seconds, synthetic_batch
else:  # run as python benchmarks/learner_vs_torch.py: this folder is sys.path[0]
    import record
    from learner_bench import cpu_seconds, synthetic_batch

# ~100M parameters: 12 x 8.26M per layer + the tied embedding (vocabulary x 768)
BIG_MODEL = {"architecture": "qwen3", "head_dim": 64, "hidden_size": 768, "intermediate_size": 2816,
             "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 6,
             "max_position_embeddings": 1024}
PHASES = ("targets", "forward", "backward", "optimizer", "other")


# ------------------------------------------------------------------------------------------------ models
def quickstart_init() -> dict[str, Any]:
    """``model.init`` of configs/quickstart.yaml."""
    return yaml.safe_load((record.REPO / "configs" / "quickstart.yaml").read_text())["model"]["init"]


def build_models(out: Path, names: list[str]) -> dict[str, Path]:
    """{name: model folder}: the quickstart model (tokenizer trained on the generated world of seed 0) and the
    ~100M one on the same tokenizer."""
    from async_agent_rl.data.world import generate_world, write_world
    from async_agent_rl.tiny_model import init_tiny_model

    write_world(generate_world(WorldConfig(seed=0)), out / "world", template="minimal")
    quick = init_tiny_model(out / "quickstart", TinyModelConfig(**quickstart_init()), out / "world" / "corpus.jsonl")
    folders = {"quickstart": quick}
    if "100m" in names:
        folders["100m"] = init_tiny_model(out / "100m", TinyModelConfig(**BIG_MODEL), tokenizer=quick)
    return {name: folders[name] for name in names}


# ------------------------------------------------------------------------------------------- bare loop
class BareLoop:
    """The learner's ``train_step`` (one rank; GRPO, decoupled PPO, token-mean, masked observations, no critic, no
    KL) in plain torch. ``phases``: seconds per phase, accumulated while ``timed`` is set."""

    def __init__(self, cfg: Config):
        from transformers import AutoModelForCausalLM

        alg, lc = cfg.algorithm, cfg.learner
        if (alg.advantage_estimator == "gae" or alg.kl_coef > 0 or not alg.mask_observations
                or alg.loss_agg_mode != "token-mean" or lc.freeze_embeddings or lc.frozen_parameters):
            raise ValueError("BareLoop covers no critic, no KL, masked observations, token-mean, nothing frozen")
        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
        self.policy_loss = get_policy_loss(alg.policy_loss)
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.step = 0
        self.timed = False
        self.phases: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.timed:
            yield
            return
        t0 = time.thread_time()
        yield
        self.phases[name] += time.thread_time() - t0

    def forward(self, batch: TrainBatch, p0: int, rows: torch.Tensor, with_entropy: bool):
        """(log-probs, entropy or None) ``(n, T_rows)`` of tokens ``p0..`` of ``rows``: the learner's arithmetic."""
        length = int(batch.seq_lengths[rows].max())
        ids, attn = batch.input_ids[rows, :length], batch.attention_mask[rows, :length]
        logits = self.model(input_ids=ids, attention_mask=attn, logits_to_keep=length - p0 + 1, use_cache=False).logits
        logits = logits[:, :-1].float() / self.temperature
        logprobs = logits.gather(-1, ids[:, p0:].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.cfg.algorithm.entropy_coef > 0):
                entropy = entropy_from_logits(logits)
        return logprobs, entropy

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One step; returns ``policy_loss`` (mini-batch aggregates averaged over updates) and ``grad_norm``."""
        alg, lc = self.cfg.algorithm, self.cfg.learner
        B, mb = batch.batch_size, lc.micro_batch_size
        p0 = int(batch.prompt_lengths.min())
        generated = batch.loss_mask[:, p0:] > 0
        mask = generated.float()
        with self.phase("targets"):
            with torch.no_grad():
                proximal = torch.zeros(mask.shape)
                for start in range(0, B, mb):
                    rows = torch.arange(start, min(start + mb, B))
                    lp, _ = self.forward(batch, p0, rows, with_entropy=False)
                    proximal[start:start + len(rows), :lp.shape[1]] = lp
            behavior = torch.where(generated, batch.behavior_logprobs[:, p0:].float(), proximal)
            R = slice(0, batch.real_rows)
            advantages, _ = compute_advantages(
                place_outcome_rewards(batch.rewards[R].float(), mask[R]), mask[R], estimator=alg.advantage_estimator,
                stepwise=alg.stepwise_advantage, group_index=batch.group_index[R], values=None,
                turn_index=batch.turn_index[R, p0:], gamma=alg.gamma, lam=alg.lam, whiten=alg.whiten_advantages)
            if batch.real_rows < B:
                advantages = torch.cat([advantages, advantages.new_zeros(B - batch.real_rows, advantages.shape[1])])
        lr = lc.lr * lr_factor(self.step, warmup_steps=lc.warmup_steps, total_steps=lc.total_steps,
                               schedule=lc.lr_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        gas = lc.mini_batch_size // mb
        loss_sum = units_sum = 0.0
        norms = []
        for epoch in range(lc.ppo_epochs):
            perm = torch.as_tensor(np.random.default_rng([lc.seed, self.step, epoch]).permutation(B))
            for start in range(0, B, lc.mini_batch_size):
                mini = perm[start:start + lc.mini_batch_size]
                mini_units = float(mask[mini].sum())
                mini = mini[torch.argsort(batch.seq_lengths[mini], descending=True, stable=True)]
                micro_batches = list(mini.split(mb))
                scale = len(micro_batches) / max(mini_units, 1.0)
                for rows in micro_batches:
                    units = float(mask[rows].sum())
                    with self.phase("forward"):
                        logprobs, entropy = self.forward(batch, p0, rows, with_entropy=True)
                    width = logprobs.shape[1]
                    m = mask[rows, :width]
                    policy_loss, _ = self.policy_loss(
                        logprobs, proximal[rows, :width], behavior[rows, :width], advantages[rows, :width], m,
                        clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high,
                        dual_clip_c=alg.dual_clip_c, behavior_weight_mode=alg.behavior_weight_mode,
                        behavior_weight_cap=alg.behavior_weight_cap, loss_agg_mode=alg.loss_agg_mode,
                        horizon=self.cfg.rollout.max_response_length)
                    entropy_term = agg_loss(entropy, m, alg.loss_agg_mode, horizon=self.cfg.rollout.max_response_length)
                    loss = policy_loss - alg.entropy_coef * entropy_term
                    with self.phase("backward"):
                        # the learner's engine.backward(loss * weight), which DeepSpeed divides by the accumulation
                        (loss * (units * scale) / gas).backward()
                    loss_sum += units * float(policy_loss.detach())
                    units_sum += units
                with self.phase("optimizer"):
                    norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, lc.grad_clip)))
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"policy_loss": loss_sum / max(units_sum, 1.0), "grad_norm": sum(norms) / len(norms)}


# ------------------------------------------------------------------------------------------ measurement
def median_summary(walls: list[float], cpus: list[float], tokens: int) -> dict[str, float]:
    """Medians of per-step wall and CPU seconds, and tokens per wall / CPU second of the median step."""
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return {"step_s": wall, "cpu_s_per_step": cpu, "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}


def ratios(learner: dict[str, float], bare: dict[str, float], pair_walls: list[tuple[float, float]]
           ) -> dict[str, float]:
    """Learner / bare: tokens per wall second, tokens per CPU second, and the median of the per-pair wall ratios
    (bare wall / learner wall of the two steps of one pair, run back to back)."""
    return {"tokens_per_s": learner["tokens_per_s"] / bare["tokens_per_s"],
            "tokens_per_cpu_s": learner["tokens_per_cpu_s"] / bare["tokens_per_cpu_s"],
            "pairwise_median": statistics.median(b / lw for lw, b in pair_walls)}


def timed_call(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def kernel_share() -> tuple[float, int]:
    """(system CPU seconds, minor page faults) of this process so far: a fresh buffer of N bytes costs about
    N / 4096 minor faults and their system time when it is first written."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_stime, usage.ru_minflt


def thread_cpu_call(fn: Callable[[], Any]) -> float:
    """CPU seconds of this thread (where torch computes with one intra-op thread) in one call."""
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def parameter_difference(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, float]:
    """Largest absolute difference of any parameter, and the largest relative to that parameter's largest value."""
    pb = dict(b.named_parameters())
    worst = rel = 0.0
    for name, p in a.named_parameters():
        d = float((p.detach() - pb[name].detach()).abs().max())
        worst = max(worst, d)
        rel = max(rel, d / max(float(p.detach().abs().max()), 1e-30))
    return {"max_abs": worst, "max_rel": rel}


def learner_config(model: Path, rows: int, micro: int, lr: float) -> Config:
    """One mini-batch of ``rows`` in micro-batches of ``micro``; the proximal pass pinned on where the config can
    skip it (``algorithm.proximal``: the synthetic batch's tokens are all fresh), as the bare loop always runs it."""
    from async_agent_rl.config import AlgorithmConfig

    algorithm = {"proximal": "recompute"} if "proximal" in AlgorithmConfig.model_fields else {}
    return build_config({
        "model": {"path": str(model), "max_model_len": 1024},
        "rollout": {"group_size": 2},
        "algorithm": algorithm,
        "learner": {"batch_size": rows, "mini_batch_size": rows, "micro_batch_size": micro, "lr": lr,
                    "zero_stage": 0, "dtype": "float32"},
    })


@contextmanager
def learner_phases(learner, phases: dict[str, float]) -> Iterator[None]:
    """Time a ``Learner``'s phases by wrapping its methods on the instance (the class is not touched): the no-grad
    pass, the policy forward with grad (and the loss), DeepSpeed's backward, the engine's step."""
    engine = learner.policy.engine
    saved: list[tuple[Any, str, bool, Any]] = []

    def wrap(owner: Any, attr: str, name: Callable[[], str | None]) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            key = name()
            t0 = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                if key:
                    phases[key] += time.thread_time() - t0
        saved.append((owner, attr, attr in vars(owner), original))
        setattr(owner, attr, timed)

    wrap(learner, "_targets", lambda: "targets")
    wrap(learner, "_policy_forward", lambda: "forward" if torch.is_grad_enabled() else None)
    wrap(engine, "backward", lambda: "backward")
    wrap(learner.policy, "step", lambda: "optimizer")
    try:
        yield
    finally:
        for owner, attr, own, original in reversed(saved):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)


def phase_table(phases: dict[str, float], total: float, steps: int) -> dict[str, float]:
    """CPU seconds (of the main thread) per step of each of ``PHASES`` (``other``: the step's not in a timed
    phase)."""
    out = {k: phases.get(k, 0.0) / steps for k in PHASES if k != "other"}
    out["other"] = total / steps - sum(out.values())
    return out


def top_operators(fn: Callable[[], Any], rows: int) -> dict[str, Any]:
    """One call of ``fn`` under torch.profiler: the total self CPU time and the ``rows`` operators with the most."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"total_self_ms": round(total / 1e3, 1),
            "ops": [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1),
                     "share": round(e.self_cpu_time_total / total, 3), "calls": e.count} for e in events[:rows]]}


@contextmanager
def one_rank_without_allreduce() -> Iterator[None]:
    """While open, ``Learner._engine`` (patched on the class, restored at exit) turns off DeepSpeed's gradient
    all-reduce of a plain engine (ZeRO 0, float32: DeepSpeed keeps the torch optimizer) when there is one rank. At
    every accumulation boundary that all-reduce flattens every gradient into a new buffer (``aten::cat`` of all the
    parameters), all-reduces it over a group of one and copies it back: nothing to average at one rank. The engine
    then steps on the gradients as they are (the same values; the check line compares)."""
    from learner.learner import Learner

    original = Learner._engine

    def _engine(self, model, lr):
        engine = original(self, model, lr)
        if self.world_size == 1 and engine.plain:
            engine.engine.enable_backward_allreduce = False
        return engine

    Learner._engine = _engine
    try:
        yield
    finally:
        Learner._engine = original


def bench_model(name: str, model: Path, shape: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    """Build the arms (``learner``, ``learner_patched`` with ``--patch``, ``bare``), check them after one step from
    the same weights, time ``--steps`` rounds (each arm once a round, the order rotated every round), summarize, and
    with ``--profile`` time the phases and list the top operators."""
    from learner.learner import Learner

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batch = synthetic_batch(shape["rows"], shape["prompt_len"], shape["response_len"], vocab)
    tokens = int(batch.seq_lengths.sum())
    cfg = learner_config(model, shape["rows"], shape["micro"], args.lr)
    learners = {"learner": Learner(cfg)}
    if args.patch:
        with one_rank_without_allreduce():
            learners["learner_patched"] = Learner(cfg)
    bare = BareLoop(cfg)
    arms = [*learners, "bare"]
    n_params = sum(p.numel() for p in bare.model.parameters())
    print(json.dumps({"bench": "model", "model": name, "parameters": n_params, "vocab": vocab, **shape,
                      "tokens_per_step": tokens, "micro_batches_per_step": shape["rows"] // shape["micro"],
                      "arms": arms}), flush=True)

    # the first step of each, from the same weights on the same batch: the correctness check (and a warm-up)
    ref = bare.train_step(batch)
    checks = {}
    for arm, learner in learners.items():
        stats = learner.train_step(batch)
        checks[arm] = {"bench": "check", "model": name, "arm": arm, "policy_loss": stats.policy_loss,
                       "bare_policy_loss": ref["policy_loss"], "grad_norm": stats.grad_norm,
                       "bare_grad_norm": ref["grad_norm"],
                       **{f"param_{k}": v
                          for k, v in parameter_difference(learner.policy.engine.module, bare.model).items()}}
        print(json.dumps(checks[arm]), flush=True)
    runs: dict[str, Callable[[], Any]] = {arm: (lambda lr=lr: lr.train_step(batch)) for arm, lr in learners.items()}
    runs["bare"] = lambda: bare.train_step(batch)
    for _ in range(args.warmup - 1):
        for arm in arms:
            runs[arm]()

    walls: dict[str, list[float]] = {arm: [] for arm in arms}
    cpus: dict[str, list[float]] = {arm: [] for arm in arms}
    kernel: dict[str, list[tuple[float, int]]] = {arm: [] for arm in arms}
    for i in range(args.steps):
        for arm in rotated(arms, i):
            sys0, faults0 = kernel_share()
            wall, cpu = timed_call(runs[arm])
            sys1, faults1 = kernel_share()
            walls[arm].append(wall)
            cpus[arm].append(cpu)
            kernel[arm].append((sys1 - sys0, faults1 - faults0))
        print(json.dumps({"bench": "round", "model": name, "round": i, "order": rotated(arms, i),
                          **{f"{arm}_s": walls[arm][-1] for arm in arms},
                          **{f"{arm}_cpu_s": cpus[arm][-1] for arm in arms},
                          **{f"{arm}_sys_s": kernel[arm][-1][0] for arm in arms},
                          **{f"{arm}_minor_faults": kernel[arm][-1][1] for arm in arms}}), flush=True)
    summary = {arm: median_summary(walls[arm], cpus[arm], tokens) for arm in arms}
    for arm in arms:
        summary[arm]["sys_s_per_step"] = statistics.median(k[0] for k in kernel[arm])
        summary[arm]["minor_faults_per_step"] = statistics.median(k[1] for k in kernel[arm])
    result: dict[str, Any] = {"model": name, "parameters": n_params, "vocab": vocab, "shape": shape,
                              "tokens_per_step": tokens, "steps": args.steps, "summary": summary, "ratio": {},
                              "checks": checks, "walls": walls, "cpus": cpus, "kernel": kernel}
    for arm in learners:
        result["ratio"][arm] = ratios(summary[arm], summary["bare"], list(zip(walls[arm], walls["bare"])))
        print(json.dumps({"bench": "learner_vs_torch", "model": name, "arm": arm, "parameters": n_params,
                          "tokens_per_step": tokens, **{f"learner_{m}": v for m, v in summary[arm].items()},
                          **{f"bare_{m}": v for m, v in summary["bare"].items()},
                          **{f"ratio_{k}": v for k, v in result["ratio"][arm].items()}}), flush=True)

    if args.profile:
        result["phases"], result["top_operators"] = {}, {}
        for arm in arms:
            times: dict[str, float] = defaultdict(float)
            total = 0.0
            for _ in range(2):
                if arm == "bare":
                    bare.phases, bare.timed = times, True
                    total += thread_cpu_call(runs[arm])
                    bare.timed = False
                else:
                    with learner_phases(learners[arm], times):
                        total += thread_cpu_call(runs[arm])
            result["phases"][arm] = phase_table(times, total, 2)
            print(json.dumps({"bench": "phases", "model": name, "arm": arm, "cpu_s_per_step": result["phases"][arm]}),
                  flush=True)
        for arm in arms:
            result["top_operators"][arm] = top = top_operators(runs[arm], args.profile_rows)
            print(json.dumps({"bench": "top_operators", "model": name, "arm": arm, **top}), flush=True)
    return result


def rotated(arms: list[str], i: int) -> list[str]:
    """Round ``i``'s order: ``arms`` rotated left by ``i`` (each arm goes first, second, ... in turn)."""
    k = i % len(arms)
    return arms[k:] + arms[:k]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="quickstart,100m", help="comma-separated: quickstart, 100m")
    ap.add_argument("--shape-quickstart", default="16:8:96:288", help="rows:micro:prompt_len:response_len")
    ap.add_argument("--shape-100m", default="4:2:64:192", help="rows:micro:prompt_len:response_len")
    ap.add_argument("--steps", type=int, default=6, help="timed pairs (one learner and one bare step each)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps of each first (the first is the check)")
    ap.add_argument("--lr", type=float, default=3e-4, help="learner.lr (the quickstart's)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the learner actor's: 1)")
    ap.add_argument("--patch", action="store_true",
                    help="a third arm: the learner with one_rank_without_allreduce (patched here, not in learner/)")
    ap.add_argument("--profile", action="store_true", help="also phase timers and torch.profiler's top operators")
    ap.add_argument("--profile-rows", type=int, default=12)
    record.add_out_argument(ap)
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in ("quickstart", "100m")]
    shapes = {}
    for name in ("quickstart", "100m"):
        spec = getattr(args, f"shape_{name}")
        try:
            rows, micro, prompt_len, response_len = (int(x) for x in spec.split(":"))
        except ValueError:
            rows = micro = 0
        if not (rows > 0 and micro > 0 and rows % micro == 0 and prompt_len > 0 and response_len >= 3):
            sys.exit(f"error: --shape-{name} {spec!r}: want rows:micro:prompt_len:response_len, positive, rows a "
                     "multiple of micro, response_len >= 3")
        shapes[name] = {"rows": rows, "micro": micro, "prompt_len": prompt_len, "response_len": response_len}
    if bad or not models:
        sys.exit(f"error: --models {args.models!r}: allowed names are quickstart, 100m")
    if args.steps < 1 or args.warmup < 1 or args.threads < 1:
        sys.exit("error: --steps, --warmup and --threads must be at least 1")
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        torch.set_num_threads(args.threads)
        print(json.dumps({"bench": "setup", "threads": torch.get_num_threads(), "models": models}), flush=True)
        result: dict[str, Any] = {"threads": args.threads, "models": {}}
        with tempfile.TemporaryDirectory(prefix="learner_vs_torch_") as tmp:
            folders = build_models(Path(tmp), models)
            for name in models:
                result["models"][name] = bench_model(name, folders[name], shapes[name], args)
        rec.result = result


if __name__ == "__main__":
    main()
