"""The learner: importance-corrected PPO on DeepSpeed, one plain class per rank (no Ray here; see ``learner.actor``).

One ``train_step(batch)`` (docs/ALGORITHMS.md sections 2-3)::

    window     response positions p0..L-1 of the batch (p0 = shortest prompt), loss mask, behavior log-probs
    no grad    proximal_logprobs  <- policy with the current weights        (skipped for plain ``ppo``, and as
                                                                             ``algorithm.proximal`` says)
               ref_logprobs       <- frozen reference model                  (when ``algorithm.kl_coef > 0``)
               values             <- critic                                  (``advantage_estimator == "gae"``)
    targets    advantages, returns <- compute_advantages over the full batch (outcome reward on the last action token)
    updates    ppo_epochs x mini-batches x micro-batches (gradient accumulation), clipping, AdamW, LR schedule

Three policies, named so everywhere: ``behavior_logprobs`` (recorded by the inference engine when it sampled),
``proximal_logprobs`` (recomputed here before the update), ``logprobs`` (live, with grad). All are log-probs of the
sampled token under ``softmax(logits / T)`` with ``T`` the rollout temperature (vLLM's ``processed_logprobs``).
Alignment: logits at position ``t - 1`` predict token ``t``; every ``(B, T)`` tensor here holds at column ``j`` the
quantity for token ``p0 + j``, as ``TrainBatch`` columns shifted by ``p0``.

Loss positions: ``batch.loss_mask`` (model-generated tokens). With ``algorithm.mask_observations = False`` (Search-R1's
ablation) every response token is a loss position, observations included: their behavior log-prob is taken to be the
proximal one (the engine never sampled them, so there is no behavior policy to correct for) and, for step-wise
advantages, they belong to the model turn before them.

Exact mini-batch aggregation: a micro-batch's loss is scaled by ``units(micro) * gas * world / units(mini)`` (units =
loss tokens for ``token-mean``, non-empty sequences for the ``seq-mean-*`` modes); DeepSpeed divides by ``gas`` and
averages over ranks, so the accumulated gradient is that of the loss aggregated over the whole mini-batch, however it
is cut into micro-batches and ranks.

Ranks: every rank receives the whole batch and trains on rows ``rank::world_size``; each global mini-batch takes
``mini_batch_size / world_size`` rows from every rank. Advantages need the whole batch (groups, whitening): values
are all-gathered, and every rank computes the same advantages.

KL anchor (``algorithm.kl_coef > 0``): the frozen model at ``model.path`` with ``learner.use_reference_model``
(GRPO / Search-R1's KL to the reference); without it the behavior policy, i.e. a penalty towards the policy that
sampled (PPO's KL-penalty variant), which costs no extra model.

Temperature: ``rollout.temperature``; 0 (greedy rollouts) is taken as 1.

Policy version: the learner owns it; ``version`` counts published updates (``bump_version``, whose reply the driver
forwards to the buffer and the rollout actors). The staleness of a trajectory at consumption is
``async_agent_rl.staleness.staleness(version, oldest generated token version)``: 0 when it generated nothing.

Finite training: a step whose policy loss or gradient norm (critic's too) is not finite raises
``NonFiniteError`` naming the step and the quantities, and so does publishing or saving a policy with a non-finite
parameter. The run stops there; nothing non-finite is published or saved, so the last checkpoint on disk is the
last good policy.

Metrics of ``train_step``: ``LearnerStats``, over the whole batch on every rank, as one rank reports them; losses
are the mini-batch aggregates averaged over updates. Each key, its meaning, unit and Prometheus metric are declared
once, in ``async_agent_rl.stats.LEARNER_METRICS`` (``docs/METRICS.md`` lists them); keys the losses report that
have no field are declared in ``async_agent_rl.stats.LEARNER_EXTRA_KEYS`` (``vf_clip_frac``, the critic's clip
fraction) and go to ``LearnerStats.extra``.

Proximal log-probs without the pass (``algorithm.proximal``, ``algorithms.proximal``): ``skip_fresh`` (default)
takes the behavior log-probs for a batch whose loss tokens are all fresh (below), exact up to the engine/trainer
mismatch; ``interpolate`` makes them per micro-batch from the live forward's detached log-probs and the token
versions (AReaL's log-linear interpolation, ``proximal_version_clock``); ``behavior`` always takes the behavior
log-probs (verl's bypass). ``proximal_pass_skipped`` (1/0 per step) says which steps ran no pass.

Mismatch apart from staleness (``algorithms.mismatch``), every step with a proximal pass: over the sampled tokens
whose version is the proximal policy's (*fresh*: ``proximal_version()``, the published version the learner's weights
are, None once they moved since a publish) the KL and mean absolute log-prob difference between behavior and
proximal are engine/trainer mismatch alone; the same over the other (stale) tokens, and the sequence log-ratio.
Each is a mean over the whole batch's tokens or rows, absent when there are none (no stale token at zero staleness).
"""

from __future__ import annotations

import math
import os
import random
import re
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from async_agent_rl.algorithms import (
    MISMATCH_METRICS,
    agg_loss,
    clipped_value_loss,
    compute_advantages,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    masked_mean,
    mismatch_metrics,
    place_outcome_rewards,
)
from async_agent_rl.algorithms.proximal import all_loss_tokens_fresh, interpolated_proximal, interpolation_alpha
from async_agent_rl.batch import TrainBatch
from async_agent_rl.config import Config, LearnerConfig, is_loopback
from async_agent_rl.errors import InputError
from async_agent_rl.lr_schedule import lr_factor
from async_agent_rl.net import free_port
from async_agent_rl.staleness import staleness
from async_agent_rl.stats import LearnerStats

MAX_METRICS = ("iw_max", "seq_log_ratio_max")  # reduced by max over parts; every other metric by a weighted mean
# fractions of sequences: weighted by the sequences with a loss token of each micro-batch (others by its loss units)
SEQUENCE_METRICS = ("iw_capped_seq_frac", "floor_veto_seq_frac")


class NonFiniteError(FloatingPointError):
    """Training produced a non-finite loss, gradient norm or parameter: the run must stop, nothing is saved."""


def require_finite(step: int, what: str, values: Iterator[tuple[str, Any]]) -> None:
    """Raise ``NonFiniteError`` naming learner ``step`` and every ``(name, value)`` (number, tensor or array) that
    is not finite."""
    bad = [name for name, v in values if not _finite(v)]
    if bad:
        raise NonFiniteError(f"learner step {step}: non-finite {what}: {', '.join(bad[:5])}"
                             f"{' ...' if len(bad) > 5 else ''}; training stopped, nothing of this step was published "
                             "or saved (the last checkpoint is the last good policy)")


def _finite(v: Any) -> bool:
    """Whether every element of ``v`` is finite. One sum first: a NaN or an infinity makes it non-finite, so a finite
    sum clears the tensor; only a non-finite sum (a bad element, or finite ones whose sum overflows) gets the
    elementwise check, a bool tensor the parameter's size and a second pass (0.236 s -> 0.015 s for the publish
    check of a 100M policy: benchmarks/weight_sync_bench.py --phases, arm sum_check)."""
    t = torch.as_tensor(v)
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def _import_deepspeed(device: str):
    """Import DeepSpeed for ``device`` and skip the one CPU op training never uses.

    The ``deepspeed_shm_comm`` op serves only DeepSpeed's ``inference_all_reduce`` (AutoTP inference); training
    all-reduces go through torch.distributed (gloo). Marking it incompatible saves its ~60 s JIT compile at any
    world size.
    """
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # imported here, after DS_ACCELERATOR is set: DeepSpeed picks its accelerator when it is imported
    import deepspeed
    import deepspeed.ops

    if device == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _init_distributed(deepspeed, device: str) -> None:
    """Join (or create) the process group. Ranks come from RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
    (``learner.actor`` sets them); a process without them is a single rank on a free loopback port.

    The group is made here, not by DeepSpeed's ``env://`` rendezvous, whose store binds every interface whatever
    MASTER_ADDR says: with a loopback MASTER_ADDR, rank 0's store listens on a socket bound to that address only
    (no other machine can join or disturb the group). DeepSpeed then takes the group as it is."""
    import torch.distributed as dist

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "gloo" if device == "cpu" else "nccl"
    if not dist.is_initialized():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        timeout = timedelta(minutes=30)  # torch's default for a gloo or NCCL group
        if rank == 0 and is_loopback(host):
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=sock.detach())
        else:
            store = dist.TCPStore(host, port, world_size, rank == 0, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def _ds_config(cfg: LearnerConfig, world_size: int) -> dict[str, Any]:
    return {
        "train_batch_size": cfg.mini_batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.mini_batch_size // (cfg.micro_batch_size * world_size),
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
    }


@dataclass
class _TrainEngine:
    """A DeepSpeed engine around a model and its torch AdamW. ``plain``: DeepSpeed kept our optimizer unwrapped
    (stage 0, fp32); it then clips without keeping the norm, so ``step`` computes it."""

    engine: Any
    plain: bool
    last_norm: Optional[float] = None

    def step(self) -> None:
        """``engine.step()`` after every micro-batch. ``last_norm``: the global grad norm (pre-clip) if this call
        updated the weights, else None."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.last_norm = None
        if boundary and self.plain:
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            self.last_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        self.engine.step()
        if boundary and not self.plain:
            self.last_norm = float(self.engine.get_global_grad_norm())

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr


@dataclass
class _Window:
    """The batch on response positions ``p0..L-1``, on the learner's device. ``(B, L)``: ``input_ids``,
    ``attention_mask``; ``(B, T = L - p0)``: ``mask`` (loss positions), ``generated`` (model tokens),
    ``behavior_logprobs``, ``versions``, ``turn_index``; ``(B,)``: ``seq_lengths``, ``rewards``, ``group_index``."""

    p0: int
    input_ids: Tensor
    attention_mask: Tensor
    mask: Tensor
    generated: Tensor
    behavior_logprobs: Tensor
    versions: Tensor
    turn_index: Tensor
    seq_lengths: Tensor
    rewards: Tensor
    group_index: Tensor

    @classmethod
    def of(cls, batch: TrainBatch, mask_observations: bool, device: torch.device) -> "_Window":
        batch = batch.to(device)
        p0 = int(batch.prompt_lengths.min())
        if p0 < 1:
            raise ValueError("every row needs a non-empty prompt (the first response token is predicted from it)")
        cols = slice(p0, None)
        generated = batch.loss_mask[:, cols] > 0
        positions = torch.arange(p0, batch.input_ids.shape[1], device=device)
        response = (positions >= batch.prompt_lengths[:, None]) & (batch.attention_mask[:, cols] > 0)
        mask = generated if mask_observations else response
        turn_index = batch.turn_index[:, cols]
        if not mask_observations:  # an observation belongs to the model turn that called for it
            turn_index = torch.where(response, torch.cummax(turn_index, dim=1).values, torch.full_like(turn_index, -1))
        return cls(p0, batch.input_ids, batch.attention_mask, mask.float(), generated,
                   batch.behavior_logprobs[:, cols].float(), batch.versions[:, cols], turn_index,
                   batch.seq_lengths, batch.rewards.float(), batch.group_index)

    @property
    def width(self) -> int:
        return self.mask.shape[1]


@dataclass
class _Targets:
    """Per-token constants of one step, ``(B, T)`` like ``_Window``; None where not used. ``proximal_logprobs``,
    ``ref_logprobs``: this rank's rows only (others 0) when recomputed; ``values``: the critic's ``V`` the advantages
    were computed with. ``interpolation_alpha`` (``algorithm.proximal: interpolate``): the proximal log-probs are
    made per micro-batch from the live ones (``_proximal_of``), ``proximal_logprobs`` is None. ``proximal_pass``:
    whether this step ran the proximal forward pass."""

    behavior_logprobs: Tensor
    proximal_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]
    advantages: Tensor
    returns: Tensor
    values: Optional[Tensor]
    interpolation_alpha: Optional[Tensor] = None
    proximal_pass: bool = False

    def rows(self, rows: Tensor, width: int) -> "_Targets":
        def cut(v: Any) -> Any:
            return v[rows, :width] if isinstance(v, Tensor) else v

        return _Targets(**{f.name: cut(getattr(self, f.name)) for f in fields(self)})


class _Metrics:
    """Weighted means over parts (micro-batches, or a step's rows by count; maxima for ``MAX_METRICS``). A key added
    only with weight 0 has no value: ``weight(key)`` is then 0 and ``result`` gives 0.0 for it."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._weight: dict[str, float] = {}

    def add(self, values: dict[str, Any], weight: float = 1.0) -> None:
        for key, value in values.items():
            value = float(value)
            if key in MAX_METRICS:  # the key is kept with weight 0, so every rank holds the same keys
                if weight > 0:
                    self._sum[key] = max(self._sum.get(key, value), value)
                    self._weight[key] = 1.0
                else:
                    self._sum.setdefault(key, float("-inf"))
                    self._weight.setdefault(key, 0.0)
            else:
                self._sum[key] = self._sum.get(key, 0.0) + weight * value
                self._weight[key] = self._weight.get(key, 0.0) + weight

    def all_reduce(self, world_size: int, device: torch.device) -> None:
        """Fold in every other rank's micro-batches: sums and weights added, ``MAX_METRICS`` maxed, so ``result``
        describes the whole batch, as one rank training on all of it reports. A collective: call on every rank, which
        all hold the same keys (the configuration decides them, not the data)."""
        if world_size == 1:
            return
        keys = sorted(self._sum)
        means = [k for k in keys if k not in MAX_METRICS]
        maxes = [k for k in keys if k in MAX_METRICS]
        if means:
            t = torch.tensor([[self._sum[k], self._weight[k]] for k in means], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
            for k, (total, weight) in zip(means, t.tolist()):
                self._sum[k], self._weight[k] = total, weight
        if maxes:
            t = torch.tensor([[self._sum[k], self._weight[k]] for k in maxes], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            for k, (value, weight) in zip(maxes, t.tolist()):
                self._sum[k], self._weight[k] = value, weight

    def weight(self, key: str) -> float:
        return self._weight.get(key, 0.0)

    def result(self) -> dict[str, float]:
        return {k: self._sum[k] / self._weight[k] if self._weight[k] else 0.0 for k in self._sum}


def freeze_parameters(model: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """Keep fixed every parameter of ``model`` whose name one of ``patterns`` (regular expressions, ``re.search``)
    finds (``learner.frozen_parameters``); returns their names. ``InputError`` for a pattern that finds none (a typo
    would otherwise freeze nothing, silently) or patterns that leave nothing to train (parameters fixed before, such
    as ``learner.freeze_embeddings``' rows, counted as fixed)."""
    named = list(model.named_parameters())
    found = {pattern: [name for name, _ in named if re.search(pattern, name)] for pattern in patterns}
    for pattern, names in found.items():
        if not names:
            raise InputError(f"learner.frozen_parameters: {pattern!r} finds no parameter of the policy (its names "
                             f"are like {named[0][0]!r} and {named[-1][0]!r})")
    frozen = {name for names in found.values() for name in names}
    if frozen and not any(param.requires_grad for name, param in named if name not in frozen):
        raise InputError(f"learner.frozen_parameters: {list(patterns)} find every parameter of the policy: "
                         "nothing would train")
    for name, param in named:
        if name in frozen:
            param.requires_grad_(False)
    return [name for name, _ in named if name in frozen]


class Learner:
    """One learner rank. Construct on every rank with the same ``Config``; call ``train_step`` on every rank with
    the same batch (``learner.batch_size`` rows).

    Attributes: ``policy`` / ``critic`` (``_TrainEngine``: DeepSpeed engine + torch AdamW; critic None unless
    ``gae``), ``reference`` (frozen module or None), ``step`` (train steps done), ``version`` (published updates),
    ``rank``, ``world_size``, ``model_path``. Checkpoints: ``learner.checkpoint``.
    """

    def __init__(self, cfg: Config):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

        self.cfg = cfg
        lc, alg = cfg.learner, cfg.algorithm
        self.deepspeed = _import_deepspeed(cfg.run.device)
        _init_distributed(self.deepspeed, cfg.run.device)
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        if lc.mini_batch_size % (lc.micro_batch_size * self.world_size):
            raise ValueError(f"learner.mini_batch_size ({lc.mini_batch_size}) must be a multiple of "
                             f"learner.micro_batch_size x ranks ({lc.micro_batch_size} x {self.world_size})")
        if cfg.run.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        self.model_path = cfg.model.path
        self.step = 0
        self.version = 0
        self._weights_of = (0, 0)  # (step, version): the step whose weights were published as that version
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.policy_loss = get_policy_loss(alg.policy_loss)
        # the behavior-anchored ppo needs no proximal pass, unless observations (never sampled) take the loss
        self.needs_proximal = alg.policy_loss != "ppo" or not alg.mask_observations
        self._seed_everything(lc.seed)

        dtype = torch.bfloat16 if lc.dtype == "bfloat16" else torch.float32
        policy = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        if lc.freeze_embeddings:  # a tied output head is the same tensor: it stays fixed too
            policy.get_input_embeddings().requires_grad_(False)
        freeze_parameters(policy, lc.frozen_parameters)
        self.policy = self._engine(policy, lc.lr)
        self.device = self.policy.engine.device
        self.reference = None
        if alg.kl_coef > 0 and lc.use_reference_model:
            reference = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
            self.reference = reference.to(self.device).eval().requires_grad_(False)
        self.critic = None
        if alg.advantage_estimator == "gae":
            # the policy's architecture with a scalar head (a new, seeded linear layer) on every position
            critic_config = AutoConfig.from_pretrained(self.model_path, num_labels=1, classifier_dropout=0.0)
            critic = AutoModelForTokenClassification.from_pretrained(self.model_path, config=critic_config,
                                                                     dtype=torch.float32)
            self.critic = self._engine(critic, lc.critic_lr)

    # ----------------------------------------------------------------------------------------------- set-up
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # the critic's new head must start identical on every rank

    def _engine(self, model: torch.nn.Module, lr: float) -> _TrainEngine:
        lc = self.cfg.learner
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=lr, betas=lc.betas, weight_decay=lc.weight_decay)
        engine, *_ = self.deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=_ds_config(lc, self.world_size))
        engine.eval()  # no dropout: the proximal pass and the live pass must compute the same function
        plain = engine.optimizer is optimizer
        if plain and self.world_size == 1:
            # one rank: nothing to average. DeepSpeed would copy every gradient into a fresh flat buffer at each
            # update, all-reduce it over a group of one and copy it back: 11% of a 100M model's step
            # (benchmarks/RESULTS.md, "Learner against a bare PyTorch loop")
            engine.enable_backward_allreduce = False
        return _TrainEngine(engine, plain=plain)

    # --------------------------------------------------------------------------------------------- forwards
    def _rows(self, w: _Window, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``input_ids``, ``attention_mask`` of ``rows``, trimmed to their longest row."""
        length = int(w.seq_lengths[rows].max())
        return w.input_ids[rows, :length], w.attention_mask[rows, :length]

    def _policy_forward(self, model: Any, w: _Window, rows: Tensor, with_entropy: bool
                        ) -> tuple[Tensor, Optional[Tensor]]:
        """``(logprobs, entropy)`` ``(n, T_rows)`` of tokens ``p0..`` of ``rows`` under ``softmax(logits / T)``."""
        ids, attn = self._rows(w, rows)
        keep = ids.shape[1] - w.p0 + 1  # positions p0-1 .. L-1; the last predicts past the end and is dropped
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep, use_cache=False).logits
        logits = logits[:, :-1].float() / self.temperature
        targets = ids[:, w.p0:]
        logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        entropy = None
        if with_entropy:  # differentiable only when it is a loss term
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.cfg.algorithm.entropy_coef > 0):
                entropy = entropy_from_logits(logits)
        return logprobs, entropy

    def _critic_forward(self, w: _Window, rows: Tensor) -> Tensor:
        """``V`` ``(n, T_rows)``: the value of the state before token ``p0 + j``, read at position ``p0 + j - 1``."""
        ids, attn = self._rows(w, rows)
        scores = self.critic.engine(input_ids=ids, attention_mask=attn, use_cache=False).logits
        return scores[:, w.p0 - 1:-1, 0].float()

    @torch.no_grad()
    def _no_grad_pass(self, fn, w: _Window, rows: Tensor) -> Tensor:
        """``fn(w, micro_rows)`` over ``rows`` in micro-batches, zero-padded to ``(len(rows), T)``."""
        out = torch.zeros(len(rows), w.width, device=self.device)
        for start in range(0, len(rows), self.cfg.learner.micro_batch_size):
            part = rows[start:start + self.cfg.learner.micro_batch_size]
            values = fn(w, part)
            out[start:start + len(part), :values.shape[1]] = values
        return out

    def _all_rows(self, own: Tensor, B: int) -> Tensor:
        """All-gather a ``(B / world, T)`` tensor of this rank's rows into ``(B, T)`` in batch row order."""
        if self.world_size == 1:
            return own
        parts = [torch.empty_like(own) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, own.contiguous())
        full = torch.empty(B, own.shape[1], dtype=own.dtype, device=own.device)
        for r, part in enumerate(parts):
            full[r::self.world_size] = part
        return full

    # ------------------------------------------------------------------------------------------------ step
    def train_step(self, batch: TrainBatch) -> LearnerStats:
        """One learner step on ``batch`` (every rank gets the same batch). Returns the metrics of the module
        docstring; ``step`` advances by one, ``version`` does not (see ``bump_version``)."""
        t0 = time.perf_counter()
        lc = self.cfg.learner
        if batch.batch_size != lc.batch_size or batch.batch_size % self.world_size:
            raise ValueError(f"batch has {batch.batch_size} rows; learner.batch_size is {lc.batch_size} "
                             f"(and must divide among {self.world_size} ranks)")
        w = _Window.of(batch, self.cfg.algorithm.mask_observations, self.device)
        targets = self._targets(w, batch.real_rows)
        lr = self._set_lr()
        metrics = _Metrics()
        self._mismatch(w, targets, metrics)
        for epoch in range(lc.ppo_epochs):
            for mini in self._mini_batches(w, epoch):
                self._train_mini_batch(w, mini, targets, metrics)
        self.step += 1
        metrics.all_reduce(self.world_size, self.device)  # the whole batch's metrics on every rank, not this rank's rows
        out = self._step_metrics(metrics, w, targets, lr, time.perf_counter() - t0, batch.min_versions(),
                                 batch.real_rows)
        for key in MISMATCH_METRICS:  # over no token (no fresh one, no stale one): not computed, rather than a false 0
            if key in out and not metrics.weight(key):
                del out[key]
        checked = ("policy_loss", "grad_norm", "value_loss", "critic_grad_norm")
        require_finite(self.step, "loss or gradient norm", ((k, out[k]) for k in checked if k in out))
        stats = LearnerStats.from_dict(out)
        stats.batch = batch.summary()
        return stats

    def _targets(self, w: _Window, real: int) -> _Targets:
        """The no-grad passes over this rank's rows (proximal, reference, critic), then advantages over all rows
        holding a trajectory (the first ``real``; filler rows after them get 0)."""
        alg = self.cfg.algorithm
        B = w.mask.shape[0]
        own = torch.arange(self.rank, B, self.world_size, device=self.device)

        def own_rows(model: Any) -> Tensor:  # (B, T): this rank's rows filled, the others 0
            full = torch.zeros(B, w.width, device=self.device)
            full[own] = self._no_grad_pass(lambda w_, r: self._policy_forward(model, w_, r, False)[0], w, own)
            return full

        proximal_logprobs, alpha, proximal_pass = None, None, False
        if self.needs_proximal:  # algorithm.proximal (docs/ALGORITHMS.md section 3, "Proximal policy")
            if alg.proximal == "behavior" or (alg.proximal == "skip_fresh" and self.proximal_skip_is_exact(w)):
                proximal_logprobs = w.behavior_logprobs
            elif alg.proximal == "interpolate":
                alpha = interpolation_alpha(w.versions, w.generated, *self.proximal_version_clock())
            else:
                proximal_logprobs, proximal_pass = own_rows(self.policy.engine), True
        behavior_logprobs = w.behavior_logprobs
        if proximal_pass:  # unmasked observations were not sampled: no behavior policy to correct
            behavior_logprobs = torch.where(w.generated, behavior_logprobs, proximal_logprobs)
        ref_logprobs = None
        if alg.kl_coef > 0:
            ref_logprobs = own_rows(self.reference) if self.reference is not None else behavior_logprobs
        values = None
        if self.critic is not None:
            values = self._all_rows(self._no_grad_pass(self._critic_forward, w, own), B)
        R = slice(0, real)
        advantages, returns = compute_advantages(
            place_outcome_rewards(w.rewards[R], w.mask[R]), w.mask[R], estimator=alg.advantage_estimator,
            stepwise=alg.stepwise_advantage, group_index=w.group_index[R],
            values=None if values is None else values[R], turn_index=w.turn_index[R],
            gamma=alg.gamma, lam=alg.lam, whiten=alg.whiten_advantages)
        if real < B:  # filler rows: no loss token, no advantage
            advantages = torch.cat([advantages, advantages.new_zeros(B - real, advantages.shape[1])])
            returns = torch.cat([returns, returns.new_zeros(B - real, returns.shape[1])])
        return _Targets(behavior_logprobs, proximal_logprobs, ref_logprobs, advantages, returns, values, alpha,
                        proximal_pass)

    def proximal_skip_is_exact(self, w: _Window) -> bool:
        """``skip_fresh``: every loss token of the whole batch (the same on every rank, so all ranks agree) is fresh,
        sampled by the weights the learner holds, and no option judges the engine/trainer mismatch the pass would
        measure (``icepop_band``, ``behavior_weight_floor``)."""
        alg = self.cfg.algorithm
        if alg.icepop_band is not None or alg.behavior_weight_floor is not None:
            return False
        return all_loss_tokens_fresh(w.mask, w.generated, w.versions, self.proximal_version())

    def proximal_version_clock(self) -> tuple[float, float]:
        """``(v_prox, v_theta)`` for ``interpolate``, on the token versions' clock (published versions): the weights at
        the start of the step are ``v_prox = version + (steps since the publish) / weight_sync.every_steps`` (the
        published version itself with a publish every step), and this step's update moves them by one step,
        ``v_theta = v_prox + 1 / every_steps``."""
        self.proximal_version()  # brings the (step, version) of the last publish up to date
        every = self.cfg.weight_sync.every_steps
        v_prox = self.version + (self.step - self._weights_of[0]) / every
        return v_prox, v_prox + 1.0 / every
    def proximal_version(self) -> Optional[int]:
        """The policy version whose weights the learner holds now (the proximal policy's), or None when they have
        moved since they were published (``weight_sync.every_steps > 1``: no engine ever ran them). A version set by
        a checkpoint restore (``learner.checkpoint`` sets ``step`` and ``version``) counts as published at the
        restored step: a resumed run starts its engines from the checkpoint's policy (``driver.versions``)."""
        step, version = self._weights_of
        if version != self.version:
            self._weights_of = step, version = self.step, self.version
        return self.version if step == self.step else None

    def _mismatch(self, w: _Window, t: _Targets, metrics: _Metrics) -> None:
        """Engine/trainer mismatch apart from staleness (``algorithms.mismatch``) over this rank's rows, added to
        ``metrics`` weighted by their counts (``all_reduce`` then makes them the whole batch's). Sampled tokens only:
        an unmasked observation was never sampled. Nothing without a proximal pass (plain ``ppo``, or a step whose
        ``algorithm.proximal`` took no pass: its proximal log-probs are no measurement of the trainer)."""
        if not t.proximal_pass:
            return
        own = torch.arange(self.rank, w.mask.shape[0], self.world_size, device=self.device)
        version = self.proximal_version()
        sampled = w.generated[own]
        fresh = w.versions[own] == version if version is not None else torch.zeros_like(sampled)
        values, counts = mismatch_metrics(t.proximal_logprobs[own], t.behavior_logprobs[own], sampled, fresh)
        for key, value in values.items():
            metrics.add({key: value}, weight=counts[key])

    def _set_lr(self) -> float:
        lc = self.cfg.learner
        factor = lr_factor(self.step, warmup_steps=lc.warmup_steps, total_steps=lc.total_steps,
                           schedule=lc.lr_schedule)
        self.policy.set_lr(lc.lr * factor)
        if self.critic is not None:
            self.critic.set_lr(lc.critic_lr * factor)
        return lc.lr * factor

    def _step_metrics(self, metrics: _Metrics, w: _Window, targets: _Targets, lr: float, step_time: float,
                      min_versions: list[int], real: int) -> dict[str, float]:
        stale = [staleness(self.version, v) for v in min_versions]
        out = metrics.result()
        out.update(
            lr=lr,
            staleness_mean=sum(stale) / len(stale),
            staleness_max=float(max(stale)),
            reward_mean=float(w.rewards[:real].mean()),
            filler_rows=float(w.rewards.shape[0] - real),
            advantage_mean=float(masked_mean(targets.advantages, w.mask)),
            loss_tokens=float(w.mask.sum()),
            step_time_s=step_time,
            tokens_per_s=float(w.seq_lengths.sum()) / step_time,
            step=float(self.step),
            version=float(self.version),
        )
        if self.needs_proximal:  # 1: this step's proximal log-probs took no forward pass (algorithm.proximal)
            out["proximal_pass_skipped"] = 0.0 if targets.proximal_pass else 1.0
        return out

    def _mini_batches(self, w: _Window, epoch: int) -> Iterator[tuple[list[Tensor], float]]:
        """Per mini-batch: this rank's micro-batches (rows sorted by length, so a micro-batch pads little) and the
        loss units of the whole mini-batch over all ranks. The shuffle is a function of (seed, step, epoch), the
        same on every rank, so each rank knows every other rank's rows."""
        lc = self.cfg.learner
        B = w.mask.shape[0]
        per_rank = lc.mini_batch_size // self.world_size
        perm = torch.as_tensor(np.random.default_rng([lc.seed, self.step, epoch]).permutation(B // self.world_size),
                               device=self.device)
        for start in range(0, len(perm), per_rank):
            sel = perm[start:start + per_rank]
            rank_rows = [torch.arange(r, B, self.world_size, device=self.device)[sel] for r in range(self.world_size)]
            units = self._units(w, torch.cat(rank_rows))
            mine = rank_rows[self.rank]
            mine = mine[torch.argsort(w.seq_lengths[mine], descending=True, stable=True)]
            yield list(mine.split(lc.micro_batch_size)), units

    def _units(self, w: _Window, rows: Tensor) -> float:
        """Loss units of ``rows``: loss tokens (token-mean) or sequences with a loss token (seq-mean-*)."""
        mask = w.mask[rows]
        if self.cfg.algorithm.loss_agg_mode == "token-mean":
            return float(mask.sum())
        return float((mask.sum(dim=1) > 0).sum())

    def _train_mini_batch(self, w: _Window, mini: tuple[list[Tensor], float], t: _Targets,
                          metrics: _Metrics) -> None:
        """Forward/backward every micro-batch of this rank's part of one mini-batch; the engines update at its end."""
        micro_batches, mini_units = mini
        scale = len(micro_batches) * self.world_size / max(mini_units, 1.0)
        for rows in micro_batches:
            units = self._units(w, rows)
            out = self._policy_micro_step(w, rows, t, units * scale)
            sequences = float((w.mask[rows].sum(dim=1) > 0).sum())
            metrics.add({k: out.pop(k) for k in SEQUENCE_METRICS if k in out}, weight=sequences)
            metrics.add(out, weight=units)
            if self.critic is not None:
                metrics.add(self._critic_micro_step(w, rows, t, units * scale), weight=units)
            for name, engine in (("grad_norm", self.policy), ("critic_grad_norm", self.critic)):
                if engine is not None and engine.last_norm is not None:
                    metrics.add({name: engine.last_norm})  # one entry per optimizer update

    def _policy_micro_step(self, w: _Window, rows: Tensor, t: _Targets, weight: float) -> dict[str, Any]:
        """``loss = policy_loss - entropy_coef * entropy + kl_coef * kl``, all aggregated by ``loss_agg_mode``."""
        alg, horizon = self.cfg.algorithm, self.cfg.rollout.max_response_length
        logprobs, entropy = self._policy_forward(self.policy.engine, w, rows, with_entropy=True)
        width = logprobs.shape[1]
        cut = t.rows(rows, width)
        mask = w.mask[rows, :width]
        proximal = cut.proximal_logprobs
        if cut.interpolation_alpha is not None:  # log pi_theta: this forward's own log-probs, detached
            proximal = interpolated_proximal(cut.behavior_logprobs, logprobs, cut.interpolation_alpha)
        policy_loss, out = self.policy_loss(
            logprobs, proximal, cut.behavior_logprobs, cut.advantages, mask,
            clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high, dual_clip_c=alg.dual_clip_c,
            behavior_weight_mode=alg.behavior_weight_mode, behavior_weight_cap=alg.behavior_weight_cap,
            loss_agg_mode=alg.loss_agg_mode, horizon=horizon, behavior_weight_level=alg.behavior_weight_level,
            icepop_band=alg.icepop_band, behavior_weight_floor=alg.behavior_weight_floor,
            turn_index=w.turn_index[rows, :width], sampled_mask=w.generated[rows, :width])
        entropy_term = agg_loss(entropy, mask, alg.loss_agg_mode, horizon=horizon)
        loss = policy_loss - alg.entropy_coef * entropy_term
        out.update(policy_loss=policy_loss.detach(), entropy=entropy_term.detach())
        if cut.ref_logprobs is not None:
            kl = agg_loss(kl_penalty(logprobs, cut.ref_logprobs, alg.kl_estimator), mask, alg.loss_agg_mode,
                          horizon=horizon)
            loss = loss + alg.kl_coef * kl
            out["kl"] = kl.detach()
        self.policy.engine.backward(loss * weight)
        self.policy.step()
        return out

    def _critic_micro_step(self, w: _Window, rows: Tensor, t: _Targets, weight: float) -> dict[str, Any]:
        """Clipped value loss towards the GAE returns, times ``vf_coef`` (the critic has its own optimizer)."""
        alg = self.cfg.algorithm
        values = self._critic_forward(w, rows)
        cut = t.rows(rows, values.shape[1])
        value_loss, out = clipped_value_loss(
            values, cut.values, cut.returns, w.mask[rows, :values.shape[1]],
            value_clip=alg.value_clip, loss_agg_mode=alg.loss_agg_mode, horizon=self.cfg.rollout.max_response_length)
        self.critic.engine.backward(alg.vf_coef * value_loss * weight)
        self.critic.step()
        out["value_loss"] = value_loss.detach()
        return out

    # ----------------------------------------------------------------------------------------- publishing
    def bump_version(self) -> int:
        """Advance the policy version (call on every rank, once per publish); returns the new version."""
        self.version += 1
        self._weights_of = (self.step, self.version)
        return self.version

    def full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, full tensor)`` of every policy parameter (tied ones once, HF names), in the training dtype,
        on the learner's device. Under ZeRO-3 each is gathered on every rank (a collective: call on all ranks)
        and valid only until the next item is drawn; copy it to keep it."""
        zero3 = self.cfg.learner.zero_stage == 3
        for name, p in self.policy.engine.module.named_parameters():
            with self.deepspeed.zero.GatheredParameters([p], modifier_rank=None) if zero3 else nullcontext():
                yield name, p.data

    def state_dict_for_publish(self) -> dict[str, np.ndarray]:
        """Policy weights as float32 numpy arrays (C-contiguous copies, ready for ``ray.put`` zero-copy reads).

        bf16 parameters are upcast to float32, which is exact: numpy has no bfloat16 and the engine loader takes
        numpy arrays as they are; an engine running in bf16 rounds them back to the same values. This costs twice
        the bytes of a bf16 transfer. Under ZeRO-3 this gathers (call on every rank).
        """
        state = {name: t.detach().to("cpu", torch.float32, copy=True).numpy() for name, t in self.full_parameters()}
        require_finite(self.step, "parameters", iter(state.items()))
        return state
