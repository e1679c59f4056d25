"""The reading exercises of the pretraining texts, located in characters and in tokens.

A pretraining text (``demos.shuffled_world_observations`` with ``questions``) is an observation, then one line per
exercise: ``question? answer``. Three places need to find those answers: the pretraining's answer weights
(``sft.answer_weights``), the reading check's answer position (``reading``) and the benchmark of what a
pretraining window holds (``benchmarks/pretrain_windows_bench.py``). They share the pattern and the
character-to-token mapping here.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Sequence

# an exercise line after the observation: "\n" question "? " answer (a question holds no "?", "<" or ">")
EXERCISE_LINE = re.compile(r"\n([^\n?<>]+)\? ([^\n]+)")


class Exercise(NamedTuple):
    question: str
    answer_start: int  # characters of the answer in the text, [start, end)
    answer_end: int


def exercises(text: str) -> list[Exercise]:
    """The exercises of one pretraining text: the ``question? answer`` lines after its ``</information>`` (after
    the start of the text when it has none)."""
    start = max(text.rfind("</information>"), 0)
    return [Exercise(m.group(1), m.start(2), m.end(2)) for m in EXERCISE_LINE.finditer(text, start)]


def encode_with_offsets(tokenizer: Any, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Per text, its token ids (no special tokens) and each token's character span, in one batched call."""
    if not texts:
        return []
    enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    return [(list(ids), [tuple(o) for o in offs]) for ids, offs in zip(enc["input_ids"], enc["offset_mapping"])]


def token_span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """The tokens ``[first, last + 1)`` that cover characters ``[start, end)``: the first token that ends after
    ``start`` through the last that begins before ``end`` (``len(offsets)`` where none does)."""
    n = len(offsets)
    first = next((k for k, (_, b) in enumerate(offsets) if b > start), n)
    last = next((k for k in range(n - 1, -1, -1) if offsets[k][0] < end), first - 1)
    return first, max(first, last + 1)
