"""Supervised warm start: teach a (tiny, random-init) model the search format from demonstration episodes.

``run_sft`` is a plain torch loop on CPU (no DeepSpeed, no Ray), in two stages::

    pretrain   (optional, sft.pretrain_steps) next-token LM on observation-formatted passages of the world with
               every fact shuffled (demos.shuffled_world_observations): reading and copying, no true facts
    demos      make_demonstrations(train questions, real retrieval)                     (learner.demos)
    SFT        per epoch: seeded shuffle -> length-grouped batches of sft.batch_size -> pack_batch (the RL
               learner's TrainBatch); loss = token-mean NLL over model-generated tokens (loss_mask == 1); AdamW;
               grad clip 1.0; linear warmup over sft.warmup_steps, then cosine decay to 0; the embedding rows of
               entity-name tokens frozen
    end        save_pretrained(model + tokenizer) into out_dir, sft_metrics.jsonl (one line per step), sft_summary.json

Masking follows RL exactly: prompt and observation tokens are context, never targets. Alignment: the hidden state at
position ``t - 1`` predicts token ``t``, so the loss positions are ``loss_mask[:, 1:]`` applied to ``hidden[:, :-1]``.
Only those positions go through the output projection (the vocabulary matmul dominates a tiny model's cost, and
most tokens of an episode are prompt and observation).

Why the pretraining stage and the frozen name embeddings (quickstart world, hidden-128 2-layer model, greedy EM on
200 held-out test questions): masked SFT alone teaches the format but not to copy an unseen name into ``<search>``;
the model memorizes which tokens were train subjects (train query accuracy 0.4 after 600 steps, held-out 0.0, EM
0.0). Pretraining on the real passages of train subjects: held-out queries 8% right, EM 0.02 (50 questions).
Shuffled-fact pretraining (300 steps) plus frozen name embeddings: held-out queries ~97% right, EM 0.10 / 0.18 / 0.34
after 1 / 2 / 3 epochs of 2000 demonstrations (fewer, more repeated demonstrations make the model guess answers from
memory: 800 x 3 epochs gives EM 0.005).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from async_agent_rl.batch import TrainBatch, pack_batch
from async_agent_rl.config import Config
from async_agent_rl.records import Trajectory
from learner.learner import lr_factor

log = logging.getLogger(__name__)

METRICS_FILE = "sft_metrics.jsonl"
SUMMARY_FILE = "sft_summary.json"
INPUTS_FILE = "warm_start_inputs.json"
# the retriever settings that shape the demonstrations' observations (unset ones are left out, so a warm start
# written before a key existed still matches)
RETRIEVER_KEYS = ("backend", "topk", "index_dir", "dense_model", "faiss_index", "query_prefix", "passage_prefix")


def warm_start_inputs(cfg: Config, model_dir: str | Path) -> dict[str, Any]:
    """The resolved settings a warm start depends on (JSON-able): the starting model, the data and prompt format,
    the retriever that makes the demonstrations' observations, the episode budgets and the ``sft`` section.
    ``run_sft`` writes them beside the model; a run reusing the folder must have the same ones."""
    d = cfg.to_dict()
    rollout = ("max_turns", "max_tokens_per_turn", "max_response_length", "max_obs_length")
    return {
        "model_dir": str(model_dir),
        "model": {k: v for k, v in d["model"].items() if k in ("init", "max_model_len")},
        "data": {k: v for k, v in d["data"].items() if k not in ("test_files",)},
        "retriever": {k: v for k, v in d["retriever"].items() if k in RETRIEVER_KEYS and v not in (None, "")},
        "rollout": {k: d["rollout"][k] for k in rollout},
        "reward": d["reward"],
        "sft": {k: v for k, v in d["sft"].items() if k not in ("enabled", "output_dir")},
    }


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Dotted paths where two nested dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{path}{k}.")]
    return [] if a == b else [path.rstrip(".")]


def check_warm_start(folder: str | Path, expected: dict[str, Any]) -> bool:
    """True if ``folder`` holds a finished warm start made from ``expected`` inputs; False if there is none.
    Raises ``ValueError`` naming the differing settings when it was made from other ones."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / SUMMARY_FILE).is_file():
        return False
    saved_file = folder / INPUTS_FILE
    if not saved_file.is_file():
        raise ValueError(f"{folder} holds a model but no {INPUTS_FILE}: not a warm start this version wrote; "
                         f"delete it or point sft.output_dir elsewhere")
    diff = _differences(json.loads(saved_file.read_text()), expected)
    if diff:
        raise ValueError(f"the warm start in {folder} was made with other settings ({', '.join(diff)}); delete it, "
                         f"or set sft.output_dir to a new folder")
    return True
PRETRAIN_SEQ_LEN = 128


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


def pretrain_on_texts(
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
    per-step losses. Used on ``demos.shuffled_world_observations`` (see ``run_sft`` for why)."""
    stream: list[int] = []
    for t in texts:
        stream += tokenizer.encode(t, add_special_tokens=False)
    if len(stream) <= seq_len + 1:
        raise ValueError(f"pretraining needs more than {seq_len + 1} tokens, got {len(stream)}")
    data = torch.tensor(stream)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    head = model.get_output_embeddings()
    losses: list[float] = []
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(step, warmup_steps=warmup_steps, total_steps=steps, schedule="constant")
        starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen).tolist()
        x = torch.stack([data[i : i + seq_len] for i in starts])
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


def entity_token_ids(tokenizer: Any, titles: Iterable[str]) -> list[int]:
    """Token ids that spell entity names (each title with and without a leading space, quotes stripped)."""
    ids: set[int] = set()
    for title in titles:
        name = title.strip().strip('"')
        for text in (name, " " + name):
            ids.update(tokenizer.encode(text, add_special_tokens=False))
    return sorted(ids)


def freeze_embedding_rows(model: Any, token_ids: Sequence[int]) -> None:
    """Zero the gradient of these rows of the input and output embeddings (one tensor when tied). With AdamW and
    no weight decay a row whose gradient is always zero never moves."""
    params = {id(p): p for p in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    for p in params.values():
        keep = torch.ones(p.shape[0], 1, dtype=p.dtype)
        keep[torch.as_tensor(list(token_ids), dtype=torch.long)] = 0
        p.register_hook(lambda g, keep=keep: g * keep)


def build_demonstrations(cfg: Config, tokenizer: Any, report: Any = None) -> tuple[list[Trajectory], list[str]]:
    """``cfg.sft.num_demos`` demonstrations from ``cfg.data.train_files`` with the configured retriever over
    ``cfg.data.corpus_file``, and the corpus titles (entity names)."""
    from async_agent_rl.data.corpus import read_corpus
    from async_agent_rl.data.search_r1 import read_qa_files
    from learner.demos import make_demonstrations, shuffled_world_demonstrations
    from retriever.backends import open_backend

    examples, _ = read_qa_files(cfg.data.train_files, cfg.data.on_bad_row)
    passages = read_corpus(cfg.data.corpus_file)
    r = cfg.retriever
    backend = open_backend(
        r.backend, passages, r.index_dir, r.dense_model, r.faiss_index, r.query_prefix, r.passage_prefix
    )
    if cfg.sft.shuffled_copies:
        demos = shuffled_world_demonstrations(
            cfg, tokenizer, examples, cfg.sft.num_demos, cfg.sft.shuffled_copies, seed=cfg.sft.seed, report=report
        )
    else:
        demos = make_demonstrations(cfg, tokenizer, examples, backend, cfg.sft.num_demos, seed=cfg.sft.seed, report=report)
    return demos, [p.title for p in passages]


def _pretrain_texts(cfg: Config, steps: int, batch_size: int, seq_len: int, tokenizer: Any) -> list[str]:
    """Enough shuffled-world copies that ``steps`` batches see each window about once (no memorizing)."""
    from learner.demos import shuffled_world_observations

    world_file = Path(cfg.data.world_dir) / "world.json"
    if not world_file.is_file():
        raise FileNotFoundError(
            f"pretraining needs the embedded world's entity table {world_file} (written by `data make-world`); "
            "use --pretrain-steps 0 for other data"
        )
    questions = cfg.sft.pretrain_questions
    one = shuffled_world_observations(world_file, 1, cfg.sft.seed, questions=questions)
    per_copy = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in one)
    copies = max(1, math.ceil(steps * batch_size * seq_len / per_copy))
    return shuffled_world_observations(world_file, copies, cfg.sft.seed, questions=questions)


def train_on_demos(
    model: Any,
    demos: Sequence[Trajectory],
    plan: Sequence[Sequence[int]],
    lr: float,
    warmup_steps: int,
    pad_id: int,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[float], int, int]:
    """Masked SFT: one AdamW step per entry of ``plan`` (row indices into ``demos``), token-mean NLL over model
    tokens, grad clip 1.0, warmup + cosine LR. Returns (per-step losses, non-padding tokens, loss tokens)."""
    batches = ([demos[i] for i in rows] for rows in plan)
    return train_on_batches(model, batches, lr, warmup_steps, pad_id, on_step, total_steps=len(plan))


def train_on_batches(
    model: Any,
    batches: Iterable[Sequence[Trajectory]],
    lr: float,
    warmup_steps: int,
    pad_id: int,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    *,
    total_steps: int | None = None,
    time_budget_s: float | None = None,
) -> tuple[list[float], int, int]:
    """``train_on_demos``' loop over batches of demonstrations. The cosine decays over ``total_steps``; with
    ``time_budget_s`` instead, ``batches`` may be endless: training stops once the steps themselves (packing,
    forward, backward, update; not the time ``batches`` takes to yield) have taken that many seconds, and the
    cosine's length is the number of steps the budget holds at the pace so far, so the LR still ends near 0."""
    if (total_steps is None) == (time_budget_s is None):
        raise ValueError("give exactly one of total_steps and time_budget_s")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses: list[float] = []
    tokens = loss_tokens = 0
    t0 = time.perf_counter()
    trained_s = 0.0
    for step, trajs in enumerate(batches):
        t_step = time.perf_counter()
        total = total_steps
        if time_budget_s is not None:
            if trained_s >= time_budget_s:
                break
            total = max(step + 1, int(step * time_budget_s / trained_s) if trained_s > 0 else 0)
        step_lr = lr * lr_factor(step, warmup_steps=warmup_steps, total_steps=total, schedule="cosine")
        for g in opt.param_groups:
            g["lr"] = step_lr
        batch = pack_batch(list(trajs), pad_id)
        loss, n = batch_nll(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        losses.append(float(loss.detach()))
        tokens += int(batch.attention_mask.sum())
        loss_tokens += n
        trained_s += time.perf_counter() - t_step
        if on_step:
            m = {"stage": "sft", "step": step + 1, "loss": losses[-1], "lr": step_lr, "grad_norm": grad_norm,
                 "loss_tokens": n, "elapsed_s": time.perf_counter() - t0}
            on_step(m if time_budget_s is None else {**m, "train_s": trained_s})
    return losses, tokens, loss_tokens


def _start(model_dir: str | Path, out_dir: str | Path, seed: int) -> tuple[Path, Any, Any, int]:
    """Seed Python and torch, make ``out_dir``, load the tokenizer and a float32 model from ``model_dir``; returns
    them with the padding id (the EOS id where the tokenizer has no padding token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    random.seed(seed)
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return out, tokenizer, model, pad_id


def run_sft(
    cfg: Config,
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    demos: Sequence[Trajectory] | None = None,
    pretrain_steps: int | None = None,
    freeze_entity_embeddings: bool | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    log_every: int = 25,
) -> dict[str, Any]:
    """Warm-start the model in ``model_dir`` and save it (and its tokenizer) into ``out_dir``.

    1. Pretraining (``pretrain_steps``, default ``cfg.sft.pretrain_steps``):
       ``pretrain_on_texts`` over ``demos.shuffled_world_observations`` of ``data.world_dir/world.json``.
    2. Masked SFT on ``demos`` (default ``build_demonstrations``: ``cfg.sft.num_demos``) for ``cfg.sft.epochs``,
       with the embedding rows of entity-name tokens (``entity_token_ids`` of the corpus titles) frozen when
       ``freeze_entity_embeddings`` (default: when there was pretraining, ``pretrain_steps > 0``: frozen names only
       make sense once pretraining made them generic).

    Why both (measured on the quickstart world, see the module docstring): a random-init model trained on the
    demonstrations alone learns the format but not to copy a name it has not seen as a target, so held-out queries
    are wrong; it memorizes which tokens were train subjects (train query accuracy rises, held-out stays at 0).
    Pretraining on shuffled-fact observations builds the copying and reading circuits over every name without
    teaching any true fact; freezing the name embeddings in SFT removes the memorization shortcut.

    Every step's metrics go to ``out_dir/sft_metrics.jsonl`` (``stage`` = pretrain | sft) and to ``on_step``.
    Returns the summary (also in ``out_dir/sft_summary.json``): ``first_loss``, ``final_loss`` (SFT, mean of the
    last 10 steps), ``steps``, ``epochs``, ``pretrain_steps``, ``pretrain_final_loss``, ``frozen_rows``, ``demos``,
    ``single_hop_demos``, ``bridge_demos``, ``demo_failures``, ``loss_tokens``, ``tokens`` (non-padding SFT tokens),
    ``tokens_per_s`` (SFT), ``seconds`` (both stages), ``pretrain_seconds``, ``demo_seconds``, ``out_dir``.
    """
    from async_agent_rl.data.corpus import read_corpus
    from learner.demos import DemoReport

    s = cfg.sft
    pretrain_steps = s.pretrain_steps if pretrain_steps is None else pretrain_steps
    if freeze_entity_embeddings is None:
        freeze_entity_embeddings = pretrain_steps > 0
    out, tokenizer, model, pad_id = _start(model_dir, out_dir, s.seed)

    t0 = time.perf_counter()
    report = DemoReport()
    if demos is None:
        demos, titles = build_demonstrations(cfg, tokenizer, report=report)
    else:
        titles = [p.title for p in read_corpus(cfg.data.corpus_file)] if freeze_entity_embeddings else []
    demos = list(demos)
    demo_seconds = time.perf_counter() - t0

    with (out / METRICS_FILE).open("w") as mf:

        def record(m: dict[str, Any]) -> None:
            mf.write(json.dumps(m) + "\n")
            if on_step:
                on_step(m)
            if log_every and m["step"] % log_every == 0:
                log.info("%s step %d: loss %.4f", m["stage"], m["step"], m["loss"])

        t_pre = time.perf_counter()
        pre_losses: list[float] = []
        if pretrain_steps:
            texts = _pretrain_texts(cfg, pretrain_steps, s.batch_size, PRETRAIN_SEQ_LEN, tokenizer)
            log.info("pretraining: %d steps on %d shuffled-world observations", pretrain_steps, len(texts))
            pre_losses = pretrain_on_texts(
                model, tokenizer, texts, pretrain_steps, s.batch_size, s.lr, s.warmup_steps, s.seed,
                PRETRAIN_SEQ_LEN, on_step=record,
            )
        pretrain_seconds = time.perf_counter() - t_pre

        frozen = entity_token_ids(tokenizer, titles) if freeze_entity_embeddings else []
        if frozen:
            freeze_embedding_rows(model, frozen)
        plan = epoch_batches([d.total_length for d in demos], s.batch_size, s.epochs, s.seed)
        log.info("sft: %d demonstrations, %d steps of %d, lr %g, %d frozen embedding rows",
                 len(demos), len(plan), s.batch_size, s.lr, len(frozen))
        t_sft = time.perf_counter()
        losses, tokens, loss_tokens = train_on_demos(model, demos, plan, s.lr, s.warmup_steps, pad_id, record)
        sft_seconds = time.perf_counter() - t_sft

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / INPUTS_FILE).write_text(json.dumps(warm_start_inputs(cfg, model_dir), indent=1, sort_keys=True) + "\n")
    summary = {
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "steps": len(plan),
        "epochs": s.epochs,
        "pretrain_steps": pretrain_steps,
        "pretrain_final_loss": sum(pre_losses[-10:]) / len(pre_losses[-10:]) if pre_losses else None,
        "frozen_rows": len(frozen),
        "demos": len(demos),
        "single_hop_demos": sum(d.meta.extra.get("hops") == 1 for d in demos),
        "bridge_demos": sum(d.meta.extra.get("hops") == 2 for d in demos),
        "demo_failures": dict(report.failed),
        "demo_behaviours": dict(report.behaviours),
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


CONTINUE_SUMMARY_FILE = "continue_sft_summary.json"


def continue_sft(
    cfg: Config,
    warm_start_dir: str | Path,
    out_dir: str | Path,
    seconds: float,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    log_every: int = 25,
) -> dict[str, Any]:
    """More of the warm start's SFT for a wall-time budget: the model in ``warm_start_dir`` (made by ``run_sft``
    with ``cfg``) trained ``seconds`` more on fresh demonstrations, saved with its tokenizer into ``out_dir``. The
    learning bench's SFT-only arm, matched in time to RL from the same warm start.

    Made as the warm start was: rounds of ``build_demonstrations`` (same source: ``sft.num_demos``,
    ``sft.shuffled_copies``, the configured retriever), round ``r`` drawn with seed ``sft.seed + 1 + r`` (the warm
    start's own draw was ``sft.seed``), each trained for ``sft.epochs`` epochs of ``epoch_batches``; ``sft.lr``,
    ``sft.batch_size``, warmup over ``sft.warmup_steps`` then cosine to 0 over the budget (``train_on_batches``);
    the entity-name embedding rows frozen under the same rule as ``run_sft``. The pretraining stage is part of the
    warm start and not repeated.

    The budget is training time: the optimizer steps. Drawing demonstrations (scripted episodes with real retrieval,
    which a pipeline could prepare ahead, and whose first round pays fixed start costs such as building the search
    index) is timed apart (``demo_s``), as RL's clock starts once its components are up; loading and saving the
    model are outside both.

    Writes ``sft_metrics.jsonl`` and ``continue_sft_summary.json`` (``warm_start``, ``budget_s``, ``seconds`` (of
    training), ``demo_s``, ``wall_s``, ``steps``, ``rounds``, ``demos``, ``frozen_rows``, ``first_loss``,
    ``final_loss``, ``tokens``) into ``out_dir`` and returns the summary.
    """
    from async_agent_rl.data.corpus import read_corpus

    if seconds <= 0:
        raise ValueError(f"the time budget must be > 0 seconds, got {seconds}")
    s = cfg.sft
    out, tokenizer, model, pad_id = _start(warm_start_dir, out_dir, s.seed)
    frozen: list[int] = []
    if s.pretrain_steps > 0:  # frozen as in run_sft: names are frozen only after pretraining
        frozen = entity_token_ids(tokenizer, [p.title for p in read_corpus(cfg.data.corpus_file)])
        freeze_embedding_rows(model, frozen)

    drawn = {"rounds": 0, "demos": 0, "seconds": 0.0}

    def rounds() -> Iterable[list[Trajectory]]:
        while True:
            t = time.perf_counter()
            seed = s.seed + 1 + drawn["rounds"]
            round_cfg = cfg.model_copy(update={"sft": s.model_copy(update={"seed": seed})})
            demos, _ = build_demonstrations(round_cfg, tokenizer)
            drawn["rounds"] += 1
            drawn["demos"] += len(demos)
            drawn["seconds"] += time.perf_counter() - t
            log.info("continue sft: round %d, %d demonstrations (seed %d)", drawn["rounds"], len(demos), seed)
            for rows in epoch_batches([d.total_length for d in demos], s.batch_size, s.epochs, seed):
                yield [demos[i] for i in rows]

    trained = {"train_s": 0.0}
    with (out / METRICS_FILE).open("w") as mf:

        def record(m: dict[str, Any]) -> None:
            trained["train_s"] = m["train_s"]
            mf.write(json.dumps(m) + "\n")
            if on_step:
                on_step(m)
            if log_every and m["step"] % log_every == 0:
                log.info("continue sft step %d: loss %.4f", m["step"], m["loss"])

        t0 = time.perf_counter()
        losses, tokens, _ = train_on_batches(model, rounds(), s.lr, s.warmup_steps, pad_id, record,
                                             time_budget_s=seconds)
        wall = time.perf_counter() - t0

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary = {
        "warm_start": str(warm_start_dir),
        "budget_s": seconds,
        "seconds": trained["train_s"],
        "demo_s": drawn["seconds"],
        "wall_s": wall,
        "steps": len(losses),
        "rounds": drawn["rounds"],
        "demos": drawn["demos"],
        "frozen_rows": len(frozen),
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan"),
        "tokens": tokens,
        "out_dir": str(out),
    }
    (out / CONTINUE_SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary
