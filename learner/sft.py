"""Supervised warm start: teach a (tiny, random-init) model the search format from demonstration episodes.

``run_sft`` is a plain torch loop on CPU (no DeepSpeed, no Ray)::

    demos      make_demonstrations(train questions, real retrieval)       (async_agent_rl.demos)
    per epoch  seeded shuffle -> length-grouped batches of sft.batch_size -> pack_batch (the RL learner's TrainBatch)
    per step   loss = token-mean NLL over model-generated tokens (loss_mask == 1); AdamW; grad clip 1.0;
               LR: linear warmup over sft.warmup_steps, then cosine decay to 0 at the last step
    end        save_pretrained(model + tokenizer) into out_dir, sft_metrics.jsonl (one line per step), sft_summary.json

Masking follows RL exactly: prompt and observation tokens are context, never targets. Alignment: the hidden state at
position ``t - 1`` predicts token ``t``, so the loss positions are ``loss_mask[:, 1:]`` applied to ``hidden[:, :-1]``.
Only those positions go through the output projection (the vocabulary matmul dominates a tiny model's cost, and
most tokens of an episode are prompt and observation), which keeps a quickstart warm start near a minute on 2 cores.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from async_agent_rl.batch import TrainBatch, pack_batch
from async_agent_rl.config import Config
from async_agent_rl.records import Trajectory

log = logging.getLogger(__name__)

METRICS_FILE = "sft_metrics.jsonl"
SUMMARY_FILE = "sft_summary.json"


def masked_nll(
    model: Any, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor, targets: Tensor | None = None
) -> tuple[Tensor, int]:
    """Token-mean negative log-likelihood of ``targets`` over the loss positions, and their number.

    Shapes: ``input_ids``, ``attention_mask``, ``loss_mask``, ``targets`` are ``(B, L)``; ``targets`` defaults to
    ``input_ids`` (teacher forcing). Token ``t`` is a target iff ``loss_mask[:, t] == 1``; it is predicted from the
    hidden state at ``t - 1``. Targets where ``loss_mask == 0`` never enter the loss (the property tests pin this).
    """
    targets = input_ids if targets is None else targets
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    sel = loss_mask[:, 1:] > 0  # (B, L-1): token t+1 is a target
    n = int(sel.sum())
    if n == 0:
        return hidden.sum() * 0.0, 0
    logits = model.get_output_embeddings()(hidden[:, :-1][sel]).float()  # (n, V)
    return F.cross_entropy(logits, targets[:, 1:][sel]), n


def batch_nll(model: Any, batch: TrainBatch) -> tuple[Tensor, int]:
    """``masked_nll`` of a packed ``TrainBatch``."""
    return masked_nll(model, batch.input_ids, batch.attention_mask, batch.loss_mask)


@torch.no_grad()
def evaluate_nll(model: Any, trajs: Sequence[Trajectory], pad_id: int, batch_size: int = 32) -> float:
    """Token-mean NLL over all model-generated tokens of ``trajs`` (no grad, eval mode restored after)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(trajs), batch_size):
        loss, n = batch_nll(model, pack_batch(trajs[i : i + batch_size], pad_id))
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / max(1, count)


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier for 0-based ``step``: ``(step+1)/warmup`` during warmup, then cosine from 1 to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def epoch_batches(lengths: Sequence[int], batch_size: int, epochs: int, seed: int, pool: int = 8) -> list[list[int]]:
    """Row indices of every step. Each epoch: a fresh seeded shuffle, cut into pools of ``pool * batch_size`` rows,
    each pool sorted by length and cut into batches (similar lengths pad little), then the epoch's batches shuffled.
    Every row appears exactly once per epoch."""
    rng = random.Random(seed)
    steps: list[list[int]] = []
    for _ in range(epochs):
        order = list(range(len(lengths)))
        rng.shuffle(order)
        batches = []
        for p in range(0, len(order), pool * batch_size):
            chunk = sorted(order[p : p + pool * batch_size], key=lambda i: lengths[i])
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        steps += batches
    return steps


def corpus_pretrain_texts(passages: Sequence[Any], train_examples: Sequence[Any]) -> list[str]:
    """The corpus passages of train-question subjects, each rendered as an observation shows it
    (``Doc 1(Title: "X") ...``). Train and test subjects are disjoint, so no passage about a held-out subject is
    ever a training target; facts about test subjects stay reachable only by searching."""
    from async_agent_rl.retriever.render import render_passages

    subjects = {ex.extra.get("subject") for ex in train_examples} - {None, ""}
    return [render_passages([p]) for p in passages if p.title.strip('"') in subjects]


def pretrain_on_corpus(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    seed: int,
    seq_len: int = 128,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[float]:
    """Plain next-token LM on ``texts`` (every token a target): ``steps`` AdamW steps on ``batch_size`` random
    ``seq_len``-token windows of the concatenated token stream (seeded); warmup then constant LR. Returns the
    per-step losses.

    Why: a random-init model cannot copy an unseen name from the question into ``<search>`` or an answer out of
    an ``<information>`` block; with masked SFT alone it memorizes the train names instead (held-out query accuracy
    stays at 0). A short LM stage on passages, where every name recurs (title, then body), builds the copying
    circuits a pretrained LLM already has, and the masked SFT that follows then generalizes to held-out subjects.
    """
    stream: list[int] = []
    for t in texts:
        stream += tokenizer.encode(t, add_special_tokens=False)
    if len(stream) <= seq_len + 1:
        raise ValueError(f"corpus pretraining needs more than {seq_len + 1} tokens, got {len(stream)}")
    data = torch.tensor(stream)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    head = model.get_output_embeddings()
    losses = []
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / max(1, warmup_steps))
        starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen)
        x = torch.stack([data[i : i + seq_len] for i in starts.tolist()])
        hidden = model.base_model(input_ids=x, use_cache=False).last_hidden_state[:, :-1]
        loss = F.cross_entropy(head(hidden).float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if on_step:
            on_step({"stage": "pretrain", "step": step + 1, "loss": losses[-1]})
    return losses


def build_inputs(cfg: Config, tokenizer: Any, report: Any = None) -> tuple[list[Trajectory], list[str]]:
    """Demonstrations (``cfg.sft.num_demos``, from ``cfg.data.train_files`` with the configured retriever over
    ``cfg.data.corpus_file``) and the corpus pretraining texts for the same train questions."""
    from async_agent_rl.data.corpus import read_corpus
    from async_agent_rl.data.search_r1 import read_qa_files
    from async_agent_rl.demos import make_demonstrations
    from async_agent_rl.retriever.backends import open_backend

    examples, _ = read_qa_files(cfg.data.train_files, cfg.data.on_bad_row)
    passages = read_corpus(cfg.data.corpus_file)
    r = cfg.retriever
    backend = open_backend(r.backend, passages, r.index_dir, r.dense_model)
    demos = make_demonstrations(cfg, tokenizer, examples, backend, cfg.sft.num_demos, seed=cfg.sft.seed, report=report)
    return demos, corpus_pretrain_texts(passages, examples)


def run_sft(
    cfg: Config,
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    demos: Sequence[Trajectory] | None = None,
    pretrain_texts: Sequence[str] | None = None,
    pretrain_steps: int | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    log_every: int = 10,
) -> dict[str, Any]:
    """Warm-start the model in ``model_dir`` and save it into ``out_dir``.

    Stage 1 (when ``pretrain_steps`` > 0; default ``cfg.sft.pretrain_steps`` if the config has it, else 0):
    ``pretrain_on_corpus`` on ``pretrain_texts`` (default: ``corpus_pretrain_texts`` of the train questions).
    Stage 2: masked SFT on ``demos`` (default: ``cfg.sft.num_demos`` from ``build_inputs``) for ``cfg.sft.epochs``.
    Every step's metrics go to ``out_dir/sft_metrics.jsonl`` (``stage`` = pretrain | sft) and to ``on_step``.
    Returns the summary (also ``out_dir/sft_summary.json``): ``first_loss``, ``final_loss`` (SFT, mean of the last
    10 steps), ``steps``, ``pretrain_steps``, ``pretrain_final_loss``, ``demos``, ``loss_tokens``, ``tokens``
    (non-padding SFT tokens), ``tokens_per_s`` (SFT), ``seconds`` (both stages), ``pretrain_seconds``,
    ``demo_seconds``, ``demo_failures``, ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_agent_rl.demos import DemoReport

    s = cfg.sft
    if pretrain_steps is None:
        pretrain_steps = int(getattr(s, "pretrain_steps", 0) or 0)
    random.seed(s.seed)
    torch.manual_seed(s.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    t0 = time.perf_counter()
    report = DemoReport()
    if demos is None or (pretrain_steps and pretrain_texts is None):
        built_demos, built_texts = build_inputs(cfg, tokenizer, report=report)
        demos = built_demos if demos is None else demos
        pretrain_texts = built_texts if pretrain_texts is None else pretrain_texts
    demos = list(demos)
    demo_seconds = time.perf_counter() - t0
    plan = epoch_batches([d.total_length for d in demos], s.batch_size, s.epochs, s.seed)

    with (out / METRICS_FILE).open("w") as mf:

        def record(m: dict[str, Any]) -> None:
            mf.write(json.dumps(m) + "\n")
            if on_step:
                on_step(m)
            if log_every and (m["step"] % log_every == 0):
                log.info("%s step %d loss %.4f", m["stage"], m["step"], m["loss"])

        t_pre = time.perf_counter()
        pre_losses: list[float] = []
        if pretrain_steps:
            log.info("corpus pretraining: %d texts, %d steps", len(pretrain_texts or []), pretrain_steps)
            pre_losses = pretrain_on_corpus(
                model, tokenizer, pretrain_texts or [], pretrain_steps, s.batch_size, s.lr, s.warmup_steps, s.seed,
                on_step=record,
            )
        pretrain_seconds = time.perf_counter() - t_pre

        log.info("sft: %d demonstrations (%.1fs), %d steps of %d, lr %g", len(demos), demo_seconds, len(plan), s.batch_size, s.lr)
        opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
        losses: list[float] = []
        tokens = loss_tokens = 0
        t_train = time.perf_counter()
        for step, rows in enumerate(plan):
            lr = s.lr * lr_factor(step, s.warmup_steps, len(plan))
            for g in opt.param_groups:
                g["lr"] = lr
            batch = pack_batch([demos[i] for i in rows], pad_id)
            loss, n = batch_nll(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            losses.append(float(loss.detach()))
            tokens += int(batch.attention_mask.sum())
            loss_tokens += n
            record({"stage": "sft", "step": step + 1, "loss": losses[-1], "lr": lr, "grad_norm": grad_norm,
                    "loss_tokens": n, "elapsed_s": time.perf_counter() - t_train})
        sft_seconds = time.perf_counter() - t_train

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary = {
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "steps": len(plan),
        "epochs": s.epochs,
        "pretrain_steps": pretrain_steps,
        "pretrain_final_loss": sum(pre_losses[-10:]) / len(pre_losses[-10:]) if pre_losses else None,
        "demos": len(demos),
        "single_hop_demos": sum(d.meta.extra.get("hops") == 1 for d in demos),
        "bridge_demos": sum(d.meta.extra.get("hops") == 2 for d in demos),
        "demo_failures": dict(report.failed),
        "loss_tokens": loss_tokens,
        "tokens": tokens,
        "tokens_per_s": tokens / sft_seconds if sft_seconds > 0 else 0.0,
        "seconds": pretrain_seconds + sft_seconds,
        "pretrain_seconds": pretrain_seconds,
        "demo_seconds": demo_seconds,
        "out_dir": str(out),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary
