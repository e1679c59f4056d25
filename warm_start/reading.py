"""How well a model reads each relation off a passage, measured in the pretraining's own format.

A warm start has to learn to read every relation (a birth year, an occupation, a city's country, ...) from the
passage a search returns; whether it does is decided relation by relation
(benchmarks/history/2026-11-27_warm-start-recipes.md, "What the warm start reads"). ``reading_scores`` measures it
directly: on a fact-shuffled copy of the world that no training text
used (its own seed), the passages are grouped as the pretraining's observations are, each followed by one of the
world's single-hop questions about a shown document, and the model's greedy (teacher-forced) prediction of the
answer's tokens is checked. A shuffled copy has no true facts, so an answer is right only when it was read.

``run_sft`` reports the scores after pretraining (``sft_summary.json``: ``reading_after_pretraining``, and one log
line); with the probe's per-relation reading after the demonstrations stage (``async-agent-rl probe``), it tells
where a relation the warm start does not read was lost: never learned in pretraining, or learned there and not
carried into the episodes' format. After the demonstrations stage this check itself says little: a warm start
that reads every name in its episodes (probe: 1.00) answers one constant name in the pretraining's format, which it
no longer sees.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from async_agent_rl.render import render_information
from warm_start.exercises import encode_with_offsets, token_span

# the check's shuffled copy comes from a random stream of its own (the pretraining draws all its copies from one
# stream seeded with sft.seed), so it is a fresh permutation of the facts, not one the pretraining trained on
READING_SEED_OFFSET = 7_919


@dataclass(frozen=True)
class ReadingItem:
    context: str  # the observation and the question, up to the answer
    answer: str
    relation: str


def reading_items(world_file: str | Path, seed: int, per_relation: int = 40, max_docs: int = 3) -> list[ReadingItem]:
    """Up to ``per_relation`` single-hop questions of every relation, each after a group of 1..``max_docs``
    documents of a fact-shuffled copy of the world (``seed``) that shows its subject."""
    from async_agent_rl.data.world import questions_about, read_entities, shuffle_facts
    from warm_start.demos import observation_groups

    rng = random.Random(seed + READING_SEED_OFFSET)
    world = shuffle_facts(read_entities(world_file), rng)
    by_relation: dict[str, list[ReadingItem]] = {}
    for group in observation_groups(world, rng, max_docs):  # grouped as the pretraining's observations are
        shown = render_information(group)
        for p in group:
            e = world[p.title.strip('"')]
            for q in questions_about(e, world, rng, 0.0):
                by_relation.setdefault(q.relation, []).append(ReadingItem(f"{shown}\n{q.question}", q.answers[0],
                                                                          q.relation))
    items = []
    for relation in sorted(by_relation):
        pool = by_relation[relation]
        items += rng.sample(pool, min(per_relation, len(pool)))
    return items


def _encode(tokenizer: Any, item: ReadingItem) -> tuple[list[int], int]:
    """The item's tokens (context, a space, the answer) and the index of the answer's first token."""
    return _encode_all(tokenizer, [item])[0]


def _encode_all(tokenizer: Any, items: Sequence[ReadingItem]) -> list[tuple[list[int], int]]:
    """``_encode`` of every item, in one batched tokenizer call."""
    texts = [f"{it.context} {it.answer}" for it in items]
    out = []
    for it, text, (ids, offsets) in zip(items, texts, encode_with_offsets(tokenizer, texts)):
        start, _ = token_span(offsets, len(it.context), len(text))  # the token that reaches past the context
        out.append((ids, max(1, start)))
    return out


def reading_scores(model: Any, tokenizer: Any, items: Sequence[ReadingItem], batch_size: int = 32) -> dict[str, float]:
    """Per relation, the share of ``items`` whose every answer token is the model's most likely next token given
    what precedes it (teacher-forced greedy reading); keys sorted, plus ``all``."""
    rows = [(ids, list(range(start, len(ids))), it.relation)
            for it, (ids, start) in zip(items, _encode_all(tokenizer, items))]
    return greedy_reads(model, rows, batch_size)


def greedy_reads(model: Any, rows: Sequence[tuple[list[int], list[int], str]], batch_size: int) -> dict[str, float]:
    """``rows``: (token ids, the positions of the answer's tokens, relation). Per relation, the share of rows whose
    every answer token is the model's most likely next token given the ones before it; keys sorted, plus ``all``."""
    right: dict[str, list[bool]] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in range(0, len(rows), batch_size):
                chunk = rows[b : b + batch_size]
                width = max(len(ids) for ids, _, _ in chunk)
                x = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, (ids, _, _) in enumerate(chunk):
                    x[r, : len(ids)] = torch.tensor(ids)
                guess = model(input_ids=x).logits.argmax(-1)  # right padding: real tokens never see it
                for r, (_, at, rel) in enumerate(chunk):
                    pos = torch.tensor(at)
                    right.setdefault(rel, []).append(bool((guess[r, pos - 1] == x[r, pos]).all()))
    finally:
        model.train(was_training)
    scores = {rel: sum(v) / len(v) for rel, v in sorted(right.items())}
    scores["all"] = sum(sum(v) for v in right.values()) / max(1, sum(len(v) for v in right.values()))
    return scores


def scores_line(scores: dict[str, float]) -> str:
    """``birth_year 0.97, occupation 0.40, ...; all 0.81``."""
    return ", ".join(f"{k} {v:.2f}" for k, v in scores.items() if k != "all") + f"; all {scores['all']:.2f}"


# ---- reading in the episodes' own format -------------------------------------------------------------------------
# The check above reads in the pretraining's format. The one below reads where an answer is produced in RL: in the
# scripted expert's thorough episodes (prompt, searches, the retriever's real observations), on a fact-shuffled copy
# of the world that no training text used, about train subjects. A memorized answer is wrong there (every fact is
# permuted), so a relation scores high only when its value is read from the passage the episode shows.

EPISODE_READING_SEED_OFFSET = 104_729


def thorough(cfg: Any) -> Any:
    """``cfg`` with the expert searching as needed in every episode (no guesses, every second hop taken)."""
    return cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"expert_search_prob": 1.0,
                                                                    "expert_second_hop_prob": 1.0})})


def episode_reading_demos(cfg: Any, tokenizer: Any, train_examples: Sequence[Any], seed: int,
                          per_relation: int = 32) -> list[Any]:
    """Up to ``per_relation`` thorough expert episodes of every relation, on a fact-shuffled copy of the world of its
    own (``seed``), about the subjects of ``train_examples``. Questions the expert cannot demonstrate are left out."""
    from warm_start.demos import DemoError, DemoExpert, shuffled_worlds

    cfg = thorough(cfg)
    rng = random.Random(seed + EPISODE_READING_SEED_OFFSET)
    ((examples, backend),) = shuffled_worlds(cfg, train_examples, 1, rng)
    by_relation: dict[str, list[Any]] = {}
    for ex in examples:
        by_relation.setdefault(str(ex.extra["relation"]), []).append(ex)
    expert = DemoExpert(cfg, tokenizer, backend)
    chosen = [ex for rel in sorted(by_relation) for ex in rng.sample(by_relation[rel], min(per_relation,
                                                                                          len(by_relation[rel])))]
    expert.prefetch(chosen)
    demos = []
    for ex in chosen:
        try:
            demos.append(expert.demonstrate(ex))
        except DemoError:
            pass  # not demonstrable on this copy (the retriever does not surface the answer): no reading to check
    return demos


def episode_reading_scores(model: Any, tokenizer: Any, demos: Sequence[Any], batch_size: int = 16) -> dict[str, float]:
    """Per relation, the share of ``demos`` (thorough expert episodes) whose final answer's every token is the model's
    most likely next token given the episode before it (teacher-forced greedy reading); keys sorted, plus ``all``."""
    from warm_start.demos import value_tokens

    rows = []
    for d in demos:
        ids = list(d.prompt_ids) + list(d.response_ids)
        at = [len(d.prompt_ids) + k for k in value_tokens(tokenizer, d, d.turns[-1], d.meta.extra["answer"])]
        rows.append((ids, at, str(d.meta.extra.get("relation"))))
    return greedy_reads(model, rows, batch_size)
