"""Supervised warm start: teach a (tiny, random-init) model the search format from demonstration episodes.

``run_sft`` is a plain torch loop on CPU (no DeepSpeed, no Ray), in two stages::

    pretrain   (optional, sft.pretrain_steps) next-token LM on observation-formatted passages of the world with
               every fact shuffled (demos.shuffled_world_observations): reading and copying, no true facts; rows
               are 128-token windows of the concatenated texts or whole texts (sft.pretrain_packing); then the
               per-relation reading check (warm_start.reading) when the texts carry reading exercises
    demos      make_demonstrations(train questions, real retrieval)                     (warm_start.demos)
    SFT        per epoch: seeded shuffle -> length-grouped batches of sft.batch_size -> pack_batch (the RL
               learner's TrainBatch); loss = token-mean NLL over model-generated tokens (loss_mask == 1); AdamW;
               grad clip 1.0; linear warmup over sft.warmup_steps, then cosine decay to 0; sft.weight_decay on the
               layers' matrices (0 by default, every stage); the embedding rows of entity-name tokens frozen
    end        save_pretrained(model + tokenizer) into out_dir, sft_metrics.jsonl (one line per step), sft_summary.json

Masking follows RL exactly: prompt and observation tokens are context, never targets. Alignment: the hidden state at
position ``t - 1`` predicts token ``t``, so the loss positions are ``loss_mask[:, 1:]`` applied to ``hidden[:, :-1]``.
Only those positions go through the output projection (the vocabulary matmul dominates a tiny model's cost, and
most tokens of an episode are prompt and observation). The tokens every row of a batch starts with (the prompt
template) go through the model once per batch, not once per row (``shared_prefix_nll``): same loss and gradients,
about a fifth fewer tokens computed on the quickstart's demonstrations.

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
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from async_agent_rl.batch import TrainBatch, pack_batch
from async_agent_rl.config import Config
from async_agent_rl.errors import InputError
from async_agent_rl.lr_schedule import lr_factor
from async_agent_rl.progress import Progress
from async_agent_rl.records import Trajectory
from warm_start.exercises import encode_with_offsets, exercises, token_span
from warm_start.prebuilt import fingerprint, write_fingerprint

log = logging.getLogger(__name__)

METRICS_FILE = "sft_metrics.jsonl"
SUMMARY_FILE = "sft_summary.json"
INPUTS_FILE = "warm_start_inputs.json"
# the retriever settings that shape the demonstrations' observations (unset ones are left out, so a warm start
# written before a key existed still matches)
RETRIEVER_KEYS = ("backend", "topk", "index_dir", "dense_model", "faiss_index", "query_prefix", "passage_prefix")


SFT_DEFAULTS = {("threads", 0), ("pretrain_questions_per_doc", 1), ("guess_value_loss", True),
                ("frozen_embeddings", "names"), ("pretrain_packing", "windows"),
                ("pretrain_answer_weight", 1.0), ("reading_target", 0.0), ("reading_round_steps", 250),
                ("reading_max_rounds", 4), ("weight_decay", 0.0)}  # left out of warm_start_inputs at these values


def warm_start_inputs(cfg: Config, model_dir: str | Path) -> dict[str, Any]:
    """The resolved settings a warm start depends on (JSON-able): the starting model, the data and prompt format,
    the retriever that makes the demonstrations' observations, the episode budgets and the ``sft`` section.
    ``run_sft`` writes them beside the model; a run reusing the folder must have the same ones."""
    from retriever.backends import BM25Backend

    d = cfg.to_dict()
    rollout = ("max_turns", "max_tokens_per_turn", "max_response_length", "max_obs_length")
    retriever = {k: v for k, v in d["retriever"].items() if k in RETRIEVER_KEYS and v not in (None, "")}
    if retriever["backend"] == "bm25":  # which of equally scored passages a search returns (since ad0d94b)
        retriever["ties"] = BM25Backend.TIES
    return {
        "model_dir": str(model_dir),
        "model": {k: v for k, v in d["model"].items() if k in ("init", "max_model_len")},
        "data": {k: v for k, v in d["data"].items() if k not in ("test_files",)},
        "retriever": retriever,
        "rollout": {k: d["rollout"][k] for k in rollout},
        "reward": d["reward"],
        # a pinned thread count names its own warm start (the learning study compares them); the default does not
        # settings added later name no warm start of their own at their default, which keeps the old behaviour
        "sft": {k: v for k, v in d["sft"].items() if k not in ("enabled", "output_dir", "prebuilt") and (k, v) not in SFT_DEFAULTS},
    }


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Dotted paths where two nested dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{path}{k}.")]
    return [] if a == b else [path.rstrip(".")]


def check_warm_start(folder: str | Path, expected: dict[str, Any]) -> bool:
    """True if ``folder`` holds a finished warm start made from ``expected`` inputs; False if there is none.
    Raises ``InputError`` naming the differing settings when it was made from other ones."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / SUMMARY_FILE).is_file():
        return False
    saved_file = folder / INPUTS_FILE
    if not saved_file.is_file():
        raise InputError(f"{folder} holds a model but no {INPUTS_FILE}: not a warm start this version wrote; "
                         f"delete it or point sft.output_dir elsewhere")
    diff = _differences(json.loads(saved_file.read_text()), expected)
    if diff:
        raise InputError(f"the warm start in {folder} was made with other settings ({', '.join(diff)}); delete it, "
                         f"or set sft.output_dir to a new folder")
    return True
PRETRAIN_SEQ_LEN = 128


THREADS_ENV = "AAR_SFT_THREADS"  # pins the warm start's torch thread count (else ThreadTuner picks it)


class ThreadTuner:
    """Picks torch's intra-op thread count for a training loop from the loop's own step times.

    Why: on the shared 2-core machine, torch's default (one thread per core) made warm-start steps 4-6x slower than
    one thread whenever another job was running (each OpenMP region waits for a descheduled thread; AdamW's step went
    from 15 ms to 370 ms), while on an idle machine two threads can be faster. The right count depends on the load,
    which changes during a run. So: step 0 is a warm-up (at the fewest threads); then a round of probes,
    ``probe_steps`` steps at each candidate count (a candidate whose first probe step costs over ``drop`` times the
    best so far is not probed further that round), and the cheapest (median seconds per token) is kept for
    ``every`` steps, a period that doubles (up to ``max_every``) each round the choice stays the same. A later round
    moves off the kept count only when another is at least ``margin`` times cheaper: probe steps are different
    batches (lengths vary), and on the idle 2-core machine a 2-step probe once measured one thread 12% cheaper than
    two, which then ran 200 steps at about half the speed.

    The thread count does not change what is computed (the same ops on the same tensors; on the quickstart model
    the weights after training at 1 and at 2 threads are bitwise equal), only how fast.
    """

    def __init__(self, candidates: Sequence[int], probe_steps: int = 2, every: int = 200, max_every: int = 1600,
                 drop: float = 1.5, margin: float = 1.25):
        self.candidates = sorted({max(1, int(c)) for c in candidates}) or [1]
        self.probe_steps, self.every, self.max_every, self.drop = max(1, probe_steps), max(1, every), max_every, drop
        self.margin = margin
        self.chosen = self.candidates[0]  # until measured (the warm-up step)
        self.choices: list[tuple[int, int]] = []  # (step, count) after each round of probes
        self._costs: dict[int, list[float]] = {}
        self._queue: list[int] = []  # the probe steps of this round still to run, as candidate counts
        self._next_round = 1  # the step at which the next round of probes starts
        self._period = self.every
        self._current: int | None = None
        self._probe: int | None = None

    @classmethod
    def for_machine(cls, **kw: Any) -> "ThreadTuner":
        """Candidates 1, 2, 4, ... up to the cores this process may run on (and that number); ``AAR_SFT_THREADS``
        pins one count."""
        pinned = os.environ.get(THREADS_ENV, "").strip()
        if pinned:
            return cls([int(pinned)], **kw)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        counts, c = {cores}, 1
        while c < cores:
            counts.add(c)
            c *= 2
        return cls(sorted(counts), **kw)

    @classmethod
    def for_config(cls, threads: int, **kw: Any) -> "ThreadTuner":
        """``sft.threads``: that count pinned when > 0, else :meth:`for_machine`."""
        return cls([threads], **kw) if threads > 0 else cls.for_machine(**kw)

    def kept(self) -> list[int]:
        """The counts kept after each round of probes (the one count when there was nothing to choose)."""
        return [c for _, c in self.choices] or [self.chosen]

    def before_step(self, step: int) -> None:
        if len(self.candidates) > 1 and step == self._next_round:
            self._queue = [c for c in self.candidates for _ in range(self.probe_steps)]
            self._costs = {}
        if self._probe is not None and not self._queue:
            self._choose(step)
        self._probe = self._queue.pop(0) if self._queue else None
        want = self._probe if self._probe is not None else self.chosen
        if want != self._current:
            torch.set_num_threads(want)
            self._current = want

    def after_step(self, seconds: float, tokens: int) -> None:
        c = self._probe
        if c is None or tokens <= 0:
            return
        cost = seconds / tokens
        self._costs.setdefault(c, []).append(cost)
        best = min((min(v) for k, v in self._costs.items() if k != c), default=None)
        if best is not None and cost > self.drop * best:
            self._queue = [q for q in self._queue if q != c]  # clearly slower now: no more probes of it this round

    def _choose(self, step: int) -> None:
        medians = {c: sorted(v)[len(v) // 2] for c, v in self._costs.items() if v}
        previous = self.choices[-1][1] if self.choices else None
        if medians:
            best = min(medians, key=medians.get)
            keep = previous in medians and medians[previous] <= self.margin * medians[best]
            self.chosen = previous if keep else best
        self._period = min(self.max_every, self._period * 2) if self.chosen == previous else self.every
        self.choices.append((step, self.chosen))
        self._next_round = step + self._period
        self._probe = None
        log.info("threads: %d for the next %d steps (ms per 1k tokens: %s)", self.chosen, self._period,
                 ", ".join(f"{c}: {1e6 * m:.1f}" for c, m in sorted(medians.items())))


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
    return _nll_from_hidden(model, hidden, loss_mask, targets)


def _nll_from_hidden(model: Any, hidden: Tensor, loss_mask: Tensor, targets: Tensor) -> tuple[Tensor, int]:
    """``masked_nll``'s loss from the hidden states ``(B, L, H)`` of the positions ``loss_mask`` and ``targets``
    ``(B, L)`` cover: the output projection only where the next token is a target."""
    sel = loss_mask[:, 1:] > 0  # (B, L-1): token t+1 is a target
    n = int(sel.sum())
    if n == 0:
        return hidden.sum() * 0.0, 0
    logits = model.get_output_embeddings()(hidden[:, :-1][sel]).float()  # (n, V)
    return F.cross_entropy(logits, targets[:, 1:][sel]), n


def batch_nll(model: Any, batch: TrainBatch) -> tuple[Tensor, int]:
    """``masked_nll`` of a packed ``TrainBatch``."""
    return masked_nll(model, batch.input_ids, batch.attention_mask, batch.loss_mask)


def right_padded_nll(model: Any, batch: TrainBatch) -> tuple[Tensor, int]:
    """``batch_nll`` of a right-padded batch (``pack_batch``'s) without passing the attention mask: under causal
    attention a real token only attends to positions before it, all real, and the position ids do not depend on the
    mask, so every hidden state the loss reads is the same (bitwise, measured); without a mask SDPA runs its
    causal kernel instead of materializing a (B, 1, L, L) mask (the warm start's training step)."""
    return masked_nll(model, batch.input_ids, None, batch.loss_mask)


MIN_SHARED_PREFIX = 8  # below this the batch-1 prefix pass costs more than the rows it saves


def shared_prefix_length(input_ids: Tensor, loss_mask: Tensor) -> int:
    """How many leading tokens every row of a ``(B, L)`` batch can share in ``shared_prefix_nll``: the longest
    prefix equal in all rows, cut to end before the hidden state that predicts the first loss target (the loss
    reads no hidden state inside it) and to leave every row at least one token of its own. 0 below
    ``MIN_SHARED_PREFIX`` or with one row."""
    if input_ids.shape[0] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(0).to(torch.int64)  # (L,)
    common = int(same.cumprod(0).sum())
    targets = (loss_mask > 0).any(0).nonzero()
    first_target = int(targets[0]) if len(targets) else input_ids.shape[1]
    n = min(common, first_target - 1, input_ids.shape[1] - 1)
    return n if n >= MIN_SHARED_PREFIX else 0


def shared_prefix_nll(model: Any, batch: TrainBatch) -> tuple[Tensor, int]:
    """``right_padded_nll`` computing the rows' common leading tokens once. Every demonstration starts with the
    same prompt template (28 of a mean 114 tokens on the quickstart); under causal attention their hidden states,
    keys and values are the same in every row, so they are computed for one row, their keys and values expanded
    (not copied) to the batch, and only each row's own tokens run through the model against them. The loss reads the
    same hidden states and its gradient reaches the shared tokens summed over the rows, as when each row computes
    them; results differ only by float reassociation (test_sft pins both). Falls back to ``right_padded_nll``
    when the rows share fewer than ``MIN_SHARED_PREFIX`` tokens (``shared_prefix_length``)."""
    p = shared_prefix_length(batch.input_ids, batch.loss_mask)
    if p == 0:
        return right_padded_nll(model, batch)
    ids, rows = batch.input_ids, batch.input_ids.shape[0]
    cache = model.base_model(input_ids=ids[:1, :p], use_cache=True).past_key_values
    for layer in cache.layers:
        layer.keys = layer.keys.expand(rows, -1, -1, -1)
        layer.values = layer.values.expand(rows, -1, -1, -1)
    hidden = model.base_model(input_ids=ids[:, p:], past_key_values=cache, use_cache=True).last_hidden_state
    return _nll_from_hidden(model, hidden, batch.loss_mask[:, p:], ids[:, p:])  # positions p.. of every row


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


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """``tokenizer.encode(t, add_special_tokens=False)`` of every text, in one batched call when the tokenizer is a
    fast (Rust) one: the same ids, about twice as fast (the quickstart's pretraining stream: 17 s -> 10 s)."""
    if getattr(tokenizer, "is_fast", False) and texts:
        return list(tokenizer(list(texts), add_special_tokens=False)["input_ids"])
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def token_stream(tokenizer: Any, texts: Sequence[str]) -> Tensor:
    """The concatenated token ids of ``texts`` (int64), what ``pretrain_on_texts`` draws its windows from."""
    return torch.tensor([i for ids in encode_texts(tokenizer, texts) for i in ids], dtype=torch.long)


def pretrain_windows(data: Tensor, steps: int, batch_size: int, seq_len: int, seed: int) -> Iterator[Tensor]:
    """The ``(batch_size, seq_len)`` windows of every pretraining step: random starts from a generator seeded with
    ``seed`` (one ``randint`` per step), so the batches are fixed by (stream, seed) alone."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"pretraining needs more than {seq_len + 1} tokens, got {len(data)}")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=gen)
        yield data[starts[:, None] + offsets]


def pretrain_rows(texts: Sequence[list[int]], steps: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """The text indices of every pretraining step when whole texts are the rows (``sft.pretrain_packing: texts``):
    seeded shuffles of all texts, one after another, cut into ``batch_size`` rows; fixed by (texts, seed) alone."""
    if not texts:
        raise ValueError("pretraining needs at least one text")
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            more = list(range(len(texts)))
            rng.shuffle(more)
            order += more
        yield order[:batch_size]
        order = order[batch_size:]


def padded_rows(rows: Sequence[list[int]], pad_id: int,
                weights: Sequence[list[float]] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, targets, target_weights)``: the rows right-padded with ``pad_id``; the targets are the next
    tokens, -100 (no loss) where the next token is padding; a target's weight is its token's in ``weights`` (one per
    token of each row; default 1), 0 on padding. Right padding needs no attention mask: a causal model never lets a
    real token see the padding after it."""
    width = max(len(r) for r in rows)
    x = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width - 1), -100, dtype=torch.long)
    w = torch.zeros((len(rows), width - 1))
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        targets[i, : len(r) - 1] = x[i, 1 : len(r)]
        w[i, : len(r) - 1] = torch.tensor(weights[i][1:], dtype=torch.float) if weights is not None else 1.0
    return x, targets, w


def answer_weights(texts: Sequence[str], offsets: Sequence[Sequence[tuple[int, int]]],
                   weight: float) -> list[list[float]]:
    """Per text, one weight per token (``offsets``: each token's character span, ``exercises.encode_with_offsets``):
    ``weight`` for the tokens of a reading exercise's answer (``exercises.exercises``), 1 for every other token."""
    out = []
    for t, offs in zip(texts, offsets):
        w = [1.0] * len(offs)
        for ex in exercises(t):
            first, end = token_span(offs, ex.answer_start, ex.answer_end)
            w[first:end] = [weight] * (end - first)
        out.append(w)
    return out


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
    *,
    threads: ThreadTuner | None = None,
    progress: Progress | None = None,
    packing: str = "windows",
    answer_weight: float = 1.0,
    weight_decay: float = 0.0,
) -> list[float]:
    """Plain next-token LM on ``texts`` (every token a target): ``steps`` AdamW steps on ``batch_size`` rows, each
    a random ``seq_len``-token window of the concatenated token stream (``packing="windows"``,
    ``pretrain_windows``) or one whole text, right-padded (``packing="texts"``, ``pretrain_rows``); both seeded;
    warmup then constant LR. Returns the per-step losses. Used on ``demos.shuffled_world_observations`` (see
    ``run_sft`` for why). ``answer_weight`` (whole texts only): the loss weight of the reading exercises' answer
    tokens (``answer_weights``), the loss then the weighted mean. ``weight_decay``: ``warm_start_optimizer``'s.
    ``threads`` picks torch's thread count step by step (``ThreadTuner``; None: leave it); ``progress`` is updated
    after every step."""
    if packing == "texts":
        if answer_weight != 1.0:  # one tokenization gives the ids and where each exercise's answer is
            kept = [(t, ids, offs) for t, (ids, offs) in zip(texts, encode_with_offsets(tokenizer, texts))
                    if len(ids) > 1]
            weights = answer_weights([t for t, _, _ in kept], [offs for _, _, offs in kept], answer_weight)
        else:
            kept = [(t, ids, None) for t, ids in zip(texts, encode_texts(tokenizer, texts)) if len(ids) > 1]
            weights = None
        encoded = [ids for _, ids, _ in kept]
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        batches: Iterator[tuple[Tensor, Tensor, Tensor | None]] = (
            padded_rows([encoded[i] for i in rows], pad_id, [weights[i] for i in rows] if weights else None)
            for rows in pretrain_rows(encoded, steps, batch_size, seed))
    elif packing == "windows":
        if answer_weight != 1.0:
            raise ValueError("an answer weight needs whole texts as rows (packing='texts')")
        data = token_stream(tokenizer, texts)
        batches = ((x, x[:, 1:], None) for x in pretrain_windows(data, steps, batch_size, seq_len, seed))
    else:
        raise ValueError(f"unknown pretraining packing {packing!r} (windows or texts)")
    opt = warm_start_optimizer(model, lr, weight_decay)
    head = model.get_output_embeddings()
    losses: list[float] = []
    seen = 0
    model.train()
    for step, (x, targets, w) in enumerate(batches):
        t_step = time.perf_counter()
        if threads:
            threads.before_step(step)
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(step, warmup_steps=warmup_steps, total_steps=steps, schedule="constant")
        hidden = model.base_model(input_ids=x, use_cache=False).last_hidden_state[:, :-1]
        if w is None or answer_weight == 1.0:
            loss = F.cross_entropy(head(hidden).float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        else:  # the weighted mean over the real targets
            ce = F.cross_entropy(head(hidden).float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                 reduction="none")
            loss = (ce * w.flatten()).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if threads:  # cost per position computed, padding included
            threads.after_step(time.perf_counter() - t_step, x.numel())
        if progress:  # the texts' tokens, not the padding: each row's targets and its first token
            seen += int((targets != -100).sum()) + x.shape[0]
            progress.update(step + 1, tokens=seen, loss=losses[-1])
        if on_step:
            on_step({"stage": "pretrain", "step": step + 1, "loss": losses[-1]})
    return losses


def warm_start_optimizer(model: Any, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The warm start's AdamW (betas 0.9, 0.95) over the model's trainable parameters, ``weight_decay`` on the
    matrices of the layers only: the input and output embeddings (a frozen row must stay where it is, and AdamW's
    decay moves a row whose gradient is zero) and every vector (norms, biases) are not decayed."""
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    params = [p for p in model.parameters() if p.requires_grad]
    decayed = {id(p) for p in params if weight_decay and p.dim() >= 2 and id(p) not in embeddings}
    groups = [{"params": [p for p in params if id(p) in decayed], "weight_decay": weight_decay},
              {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


def entity_token_ids(tokenizer: Any, titles: Iterable[str]) -> list[int]:
    """Token ids that spell entity names (each title with and without a leading space, quotes stripped)."""
    ids: set[int] = set()
    for title in titles:
        name = title.strip().strip('"')
        for text in (name, " " + name):
            ids.update(tokenizer.encode(text, add_special_tokens=False))
    return sorted(ids)


def frozen_token_ids(cfg: Config, tokenizer: Any, model: Any, titles: Iterable[str]) -> list[int]:
    """The embedding rows the demonstrations stage keeps fixed (``sft.frozen_embeddings``): the tokens of entity
    names (``entity_token_ids`` of ``titles``), every token of the corpus passages, or every row of the model's
    input embeddings."""
    if cfg.sft.frozen_embeddings == "all":
        return list(range(model.get_input_embeddings().weight.shape[0]))
    names = entity_token_ids(tokenizer, titles)
    if cfg.sft.frozen_embeddings == "corpus":
        from async_agent_rl.data.corpus import read_corpus

        texts = [p.contents for p in read_corpus(cfg.data.corpus_file)]
        return sorted(set(names) | {i for ids in encode_texts(tokenizer, texts) for i in ids})
    return names


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
    from retriever.backends import open_backend
    from warm_start.demos import make_demonstrations, shuffled_world_demonstrations

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
    """Enough shuffled-world copies that ``steps`` batches see each text (``sft.pretrain_packing: texts``) or each
    window's worth of tokens (``windows``) about once (no memorizing)."""
    from warm_start.demos import shuffled_world_observations

    world_file = Path(cfg.data.world_dir) / "world.json"
    if not world_file.is_file():
        raise FileNotFoundError(
            f"pretraining needs the embedded world's entity table {world_file} (written by `data make-world`); "
            "use --pretrain-steps 0 for other data"
        )
    questions = dict(questions=cfg.sft.pretrain_questions, questions_per_doc=cfg.sft.pretrain_questions_per_doc)
    one = shuffled_world_observations(world_file, 1, cfg.sft.seed, **questions)
    if cfg.sft.pretrain_packing == "texts":  # one text per row
        copies = max(1, math.ceil(steps * batch_size / len(one)))
    else:
        per_copy = sum(len(ids) for ids in encode_texts(tokenizer, one))
        copies = max(1, math.ceil(steps * batch_size * seq_len / per_copy))
    return shuffled_world_observations(world_file, copies, cfg.sft.seed, **questions)


def _reading_after_pretraining(cfg: Config, model: Any, tokenizer: Any) -> dict[str, float] | None:
    """``warm_start.reading`` scores of the pretrained model (None without reading exercises), logged in one line."""
    from warm_start.reading import reading_items, reading_scores, scores_line

    if not cfg.sft.pretrain_questions:
        return None
    t = time.perf_counter()
    scores = reading_scores(model, tokenizer, reading_items(Path(cfg.data.world_dir) / "world.json", cfg.sft.seed))
    log.info("pretraining reads (a shuffled copy of its own, %.0f s): %s", time.perf_counter() - t,
             scores_line(scores))
    return scores


def train_on_demos(
    model: Any,
    demos: Sequence[Trajectory],
    plan: Sequence[Sequence[int]],
    lr: float,
    warmup_steps: int,
    pad_id: int,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    **kw: Any,
) -> tuple[list[float], int, int]:
    """Masked SFT: one AdamW step per entry of ``plan`` (row indices into ``demos``), token-mean NLL over model
    tokens, grad clip 1.0, warmup + cosine LR. Returns (per-step losses, non-padding tokens, loss tokens). ``kw``:
    ``threads``, ``progress`` of ``train_on_batches``."""
    batches = ([demos[i] for i in rows] for rows in plan)
    return train_on_batches(model, batches, lr, warmup_steps, pad_id, on_step, total_steps=len(plan), **kw)


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
    threads: ThreadTuner | None = None,
    progress: Progress | None = None,
    weight_decay: float = 0.0,
) -> tuple[list[float], int, int]:
    """``train_on_demos``' loop over batches of demonstrations. The cosine decays over ``total_steps``; with
    ``time_budget_s`` instead, ``batches`` may be endless: training stops once the steps themselves (packing,
    forward, backward, update; not the time ``batches`` takes to yield) have taken that many seconds, and the
    cosine's length is the number of steps the budget holds at the pace so far, so the LR still ends near 0.
    ``weight_decay``: ``warm_start_optimizer``'s.
    ``threads`` picks torch's thread count step by step (``ThreadTuner``; None: leave it); ``progress`` is updated
    after every step (non-padding tokens)."""
    if (total_steps is None) == (time_budget_s is None):
        raise ValueError("give exactly one of total_steps and time_budget_s")
    opt = warm_start_optimizer(model, lr, weight_decay)
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
        if threads:
            threads.before_step(step)
        step_lr = lr * lr_factor(step, warmup_steps=warmup_steps, total_steps=total, schedule="cosine")
        for g in opt.param_groups:
            g["lr"] = step_lr
        batch = pack_batch(list(trajs), pad_id)
        loss, n = shared_prefix_nll(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        losses.append(float(loss.detach()))
        tokens += int(batch.attention_mask.sum())
        loss_tokens += n
        step_s = time.perf_counter() - t_step
        trained_s += step_s
        if threads:
            threads.after_step(step_s, batch.input_ids.numel())
        if progress:
            progress.update(step + 1, tokens=tokens, loss=losses[-1])
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
    progress: bool = True,
    threads: ThreadTuner | None = None,
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
    ``tokens_per_s`` (SFT), ``seconds`` (both stages), ``pretrain_seconds``, ``demo_seconds``, ``threads`` (the
    thread counts kept, by stage), ``out_dir``.

    With ``progress`` each stage prints progress lines on stdout (``async_agent_rl.progress``: every few seconds on
    a terminal, every 10% otherwise) and a closing line, and the end ``summary_line``, one readable line. Torch's
    thread count is picked per stage by ``threads`` (default ``ThreadTuner.for_machine()``, which
    ``AAR_SFT_THREADS=N`` pins) and restored at the end.
    """
    from async_agent_rl.data.corpus import read_corpus
    from warm_start.demos import DemoReport

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
        texts: list[str] | None = None
        reading: dict[str, float] | None = None
        threads_before = torch.get_num_threads()
        kept: dict[str, list[int]] = {}
        try:
            if pretrain_steps:
                texts = _pretrain_texts(cfg, pretrain_steps, s.batch_size, PRETRAIN_SEQ_LEN, tokenizer)
                log.info("pretraining: %d steps on %d shuffled-world observations", pretrain_steps, len(texts))
                bar = Progress("[sft] pretraining", pretrain_steps) if progress else None
                tuner = threads or ThreadTuner.for_config(cfg.sft.threads)
                pre_losses = pretrain_on_texts(
                    model, tokenizer, texts, pretrain_steps, s.batch_size, s.lr, s.warmup_steps, s.seed,
                    PRETRAIN_SEQ_LEN, on_step=record, threads=tuner, progress=bar, packing=s.pretrain_packing,
                    answer_weight=s.pretrain_answer_weight, weight_decay=s.weight_decay,
                )
                kept["pretrain"] = tuner.kept()
                if bar:
                    bar.close(_mean_last(pre_losses), f"threads {_counts_text(kept['pretrain'])}")
                reading = _reading_after_pretraining(cfg, model, tokenizer)
            pretrain_seconds = time.perf_counter() - t_pre

            frozen = frozen_token_ids(cfg, tokenizer, model, titles) if freeze_entity_embeddings else []
            if frozen:
                freeze_embedding_rows(model, frozen)
            plan = epoch_batches([d.total_length for d in demos], s.batch_size, s.epochs, s.seed)
            log.info("sft: %d demonstrations, %d steps of %d, lr %g, %d frozen embedding rows",
                     len(demos), len(plan), s.batch_size, s.lr, len(frozen))
            bar = Progress("[sft] demonstrations", len(plan)) if progress else None
            tuner = threads or ThreadTuner.for_config(cfg.sft.threads)
            t_sft = time.perf_counter()
            losses, tokens, loss_tokens = train_on_demos(model, demos, plan, s.lr, s.warmup_steps, pad_id, record,
                                                         threads=tuner, progress=bar, weight_decay=s.weight_decay)
            sft_seconds = time.perf_counter() - t_sft
            kept["sft"] = tuner.kept()
            if bar:
                bar.close(_mean_last(losses), f"threads {_counts_text(kept['sft'])}")
            t_read = time.perf_counter()
            rounds = read_every_relation(cfg, model, tokenizer, pad_id, record, threads, progress) \
                if s.reading_target > 0 else []
            reading_seconds = time.perf_counter() - t_read
        finally:
            torch.set_num_threads(threads_before)

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / INPUTS_FILE).write_text(json.dumps(warm_start_inputs(cfg, model_dir), indent=1, sort_keys=True) + "\n")
    write_fingerprint(out, fingerprint(cfg, model_dir, demos, texts))  # what sft.prebuilt compares (prebuilt.py)
    summary = {
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "steps": len(plan),
        "epochs": s.epochs,
        "pretrain_steps": pretrain_steps,
        "pretrain_final_loss": sum(pre_losses[-10:]) / len(pre_losses[-10:]) if pre_losses else None,
        "reading_after_pretraining": reading,
        "reading_rounds": rounds,
        "reading_seconds": reading_seconds,
        "frozen_rows": len(frozen),
        "demos": len(demos),
        "single_hop_demos": sum(d.meta.extra.get("hops") == 1 for d in demos),
        "bridge_demos": sum(d.meta.extra.get("hops") == 2 for d in demos),
        "demo_failures": dict(report.failed),
        "demo_behaviours": dict(report.behaviours),
        "loss_tokens": loss_tokens,
        "tokens": tokens,
        "tokens_per_s": tokens / sft_seconds if sft_seconds > 0 else 0.0,
        "seconds": pretrain_seconds + sft_seconds + reading_seconds,
        "pretrain_seconds": pretrain_seconds,
        "demo_seconds": demo_seconds,
        "threads": kept,
        "out_dir": str(out),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    if progress:
        print(summary_line(summary), flush=True)
    return summary


READING_ROUND_SEED = 1_000  # the rounds' shuffled copies: seeds sft.seed + READING_ROUND_SEED + 2r (and + 1)


def read_every_relation(
    cfg: Config,
    model: Any,
    tokenizer: Any,
    pad_id: int,
    record: Callable[[dict[str, Any]], None],
    threads: ThreadTuner | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """``sft.reading_target``: train until the model reads every relation, relation by relation.

    Which relations a warm start learns to read in its demonstrations stage is chance
    (benchmarks/history/2026-11-27_reading-rounds.md): most read, about one (birth years, occupations, a city's
    country...) does not,
    and RL does not teach it. So: check reading per relation (``warm_start.reading.episode_reading_scores``: thorough
    expert episodes on a fact-shuffled copy of the world of its own, about train subjects, teacher-forced; a
    memorized answer is wrong there); while some relation reads below the target, train ``sft.reading_round_steps``
    steps on thorough expert episodes of a new fact-shuffled copy, half of them questions of the relations below the
    target and half of every relation (so what is read is kept), at ``sft.lr`` with warmup and a cosine to 0 per
    round; then check again, at most ``sft.reading_max_rounds`` rounds. Returns one record per check (``round``,
    ``scores``, ``below``, and ``steps`` trained after it); each check is a log line (and a printed one with
    ``progress``), each step a metrics line (``stage`` = reading)."""
    from async_agent_rl.data.search_r1 import read_qa_files
    from warm_start.demos import shuffled_world_demonstrations
    from warm_start.reading import episode_reading_demos, episode_reading_scores, scores_line, thorough

    s = cfg.sft
    examples, _ = read_qa_files(cfg.data.train_files, cfg.data.on_bad_row)
    check = episode_reading_demos(cfg, tokenizer, examples, s.seed)
    expert = thorough(cfg)
    rounds: list[dict[str, Any]] = []
    done = 0
    for r in range(s.reading_max_rounds + 1):
        scores = episode_reading_scores(model, tokenizer, check)
        below = [k for k, v in scores.items() if k != "all" and v < s.reading_target]
        rounds.append({"round": r, "scores": scores, "below": below, "steps": 0})
        last = not below or r == s.reading_max_rounds
        then = ("done" if not below else "the check alone (sft.reading_max_rounds=0)" if s.reading_max_rounds == 0
                else "rounds used up" if last else f"{s.reading_round_steps} more steps, half on {', '.join(below)}")
        line = f"[sft] reads (episodes on a shuffled copy, {len(check)}): {scores_line(scores)} -> {then}"
        log.info("%s", line)
        if progress:
            print(line, flush=True)
        if last:
            break
        seed = s.seed + READING_ROUND_SEED + 2 * r
        n = s.reading_round_steps * s.batch_size
        demos = shuffled_world_demonstrations(expert, tokenizer, examples, n // 2, 1, seed=seed, relations=below)
        demos += shuffled_world_demonstrations(expert, tokenizer, examples, n - n // 2, 1, seed=seed + 1)
        plan = epoch_batches([d.total_length for d in demos], s.batch_size, 1, seed)

        def record_round(m: dict[str, Any], r: int = r) -> None:
            record({**m, "stage": "reading", "round": r + 1, "step": done + m["step"]})

        bar = Progress(f"[sft] reading round {r + 1}", len(plan)) if progress else None
        losses, _, _ = train_on_demos(model, demos, plan, s.lr, s.warmup_steps, pad_id, record_round,
                                      threads=threads or ThreadTuner.for_config(s.threads), progress=bar,
                                      weight_decay=s.weight_decay)
        if bar:
            bar.close(_mean_last(losses), "")
        rounds[-1]["steps"] = len(plan)
        done += len(plan)
    return rounds


def _mean_last(xs: Sequence[float], k: int = 10) -> float:
    return sum(xs[-k:]) / len(xs[-k:]) if xs else float("nan")


def _counts_text(counts: Sequence[int]) -> str:
    return str(counts[0]) if len(set(counts)) == 1 else ", ".join(map(str, counts))


def summary_line(s: dict[str, Any]) -> str:
    """One readable line for a ``run_sft`` summary (the full JSON is in ``sft_summary.json``)."""
    from async_agent_rl.progress import duration

    parts = []
    if s.get("pretrain_steps"):
        parts.append(f"pretraining {s['pretrain_steps']} steps in {duration(s['pretrain_seconds'])}, "
                     f"loss {s['pretrain_final_loss']:.3f}")
    parts.append(f"demonstrations {s['steps']} steps in "
                 f"{duration(s['seconds'] - s['pretrain_seconds'] - s.get('reading_seconds', 0.0))}, "
                 f"{s['tokens_per_s']:,.0f} tokens/s, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}")
    if s.get("reading_rounds"):
        last = s["reading_rounds"][-1]
        parts.append(f"reading checked {len(s['reading_rounds'])} times in {duration(s['reading_seconds'])}, "
                     f"all {last['scores']['all']:.2f}" + (f", below target: {', '.join(last['below'])}"
                                                          if last["below"] else ""))
    return (f"[sft] done in {duration(s['seconds'])} (+{duration(s['demo_seconds'])} making {s['demos']} "
            f"demonstrations): " + "; ".join(parts) + f" -> {s['out_dir']}")


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
        frozen = frozen_token_ids(cfg, tokenizer, model, [p.title for p in read_corpus(cfg.data.corpus_file)])
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
                                             time_budget_s=seconds, weight_decay=s.weight_decay)
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
