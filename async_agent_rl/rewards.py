"""Reward functions for search-agent episodes (pure functions of text).

Semantics follow Search-R1's ``qa_em.py`` (docs/ALGORITHMS.md section 1):

- ``normalize_answer``: lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace.
- The prediction is the LAST ``<answer>...</answer>`` of the model's own output (the response, never the prompt;
  Search-R1 counts the prompt's example answer and therefore asks for "at least two matches": we do not inherit
  that quirk because we only ever look at the response). No answer tag -> no prediction -> score 0.
- Exact match: normalized prediction equals some normalized gold answer.
- Substring match: some normalized gold answer occurs inside the normalized prediction.
- Token F1: SQuAD-style bag-of-tokens F1 against the best gold answer.
- Format: partial credit for a well-formed think/search/information/answer sequence (see ``format_score``).

- ``search_r1_em``: Search-R1's own format-aware score, exactly (see the function; ``format_em`` differs).

What the rewards read: ``scoring_text(pieces)``, the response as the model wrote it, with every observation
replaced by one empty ``<information></information>`` block. Observations are the environment's words: an answer
tag inside one (the invalid-action observation itself names ``<answer> and </answer>``; a retrieved passage may
hold any tag) is never the model's answer, and a format check sees one opaque observation block in its place.
Training rewards (``async_agent_rl.episode``) and evaluation (``actors.stack.score_episodes``) both score this view.

Each function has the uniform signature ``fn(response_text, gold_answers, **context) -> float`` and is registered
by name in ``REWARD_FUNCTIONS`` so a config can list weighted terms.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Iterable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_TAGS = ("think", "search", "information", "answer")


OBSERVATION_BLOCK = "<information></information>"


def scoring_text(pieces: Iterable[tuple[str, str]]) -> str:
    """``(kind, text)`` pieces of a response, in order (kind ``"model"`` or ``"observation"``) -> the text the
    rewards read: model turns verbatim, each observation as ``OBSERVATION_BLOCK``."""
    return "".join(text if kind == "model" else OBSERVATION_BLOCK for kind, text in pieces)


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def extract_answer(response_text: str) -> str | None:
    """The last ``<answer>...</answer>`` in the response, stripped; None when there is none."""
    matches = _ANSWER.findall(response_text)
    return matches[-1].strip() if matches else None


def exact_match(response_text: str, gold_answers: Sequence[str], **_: object) -> float:
    pred = extract_answer(response_text)
    if pred is None:
        return 0.0
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in gold_answers))


def substring_match(response_text: str, gold_answers: Sequence[str], **_: object) -> float:
    pred = extract_answer(response_text)
    if pred is None:
        return 0.0
    p = normalize_answer(pred)
    return float(any(normalize_answer(g) in p for g in gold_answers if normalize_answer(g)))


def token_f1(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = Counter(p) & Counter(g)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(p), overlap / len(g)
    return 2 * precision * recall / (precision + recall)


def f1(response_text: str, gold_answers: Sequence[str], **_: object) -> float:
    pred = extract_answer(response_text)
    if pred is None:
        return 0.0
    return max((token_f1(pred, g) for g in gold_answers), default=0.0)


def is_valid_format(response_text: str) -> bool:
    """True when the model's turns form ``(<think>..</think>)? (<search>..</search> <information>..</information>)*
    (<think>..</think>)? <answer>..</answer>``: tags balanced, in that order, ending with one answer.

    The text is the full response (model turns and observations interleaved).
    """
    tokens = re.findall(r"</?(?:think|search|information|answer)>", response_text)
    # Collapse to a sequence of complete blocks; any unbalanced or nested tag fails.
    blocks: list[str] = []
    open_tag: str | None = None
    for t in tokens:
        name = t.strip("</>")
        if t.startswith("</"):
            if open_tag != name:
                return False
            blocks.append(name)
            open_tag = None
        else:
            if open_tag is not None:
                return False
            open_tag = name
    if open_tag is not None or not blocks or blocks[-1] != "answer" or blocks.count("answer") != 1:
        return False
    seq = "".join(b[0] for b in blocks)  # think, search, information, answer -> t, s, i, a
    return re.fullmatch(r"(t?si)*t?a", seq) is not None


def format_score(response_text: str, gold_answers: Sequence[str], **_: object) -> float:
    """1.0 for a well-formed sequence (``is_valid_format``), else 0.0."""
    return float(is_valid_format(response_text))


def format_em(
    response_text: str,
    gold_answers: Sequence[str],
    *,
    format_bonus: float = 0.2,
    **_: object,
) -> float:
    """A format-aware score after Search-R1 (its exact scoring is ``search_r1_em``): 1 for a correct answer in a
    well-formed episode (``is_valid_format``); ``1 - format_bonus`` for a correct answer with bad format;
    ``format_bonus`` for a wrong answer with good format; 0 otherwise."""
    em = exact_match(response_text, gold_answers)
    ok = is_valid_format(response_text)
    if em:
        return 1.0 if ok else 1.0 - format_bonus
    return format_bonus if ok else 0.0


def is_search_r1_sequence(response_text: str) -> bool:
    """Search-R1 v0.3's ``is_valid_sequence`` on the response: every tag balanced, and the tags in the order
    ``<think>..</think>`` then any number of ``<search>..</search><information>..</information><think>..</think>``
    then ``<answer>..</answer>``, with nothing but whitespace between tags (``<think>`` is required)."""
    if any(response_text.count(f"<{t}>") != response_text.count(f"</{t}>") for t in _TAGS):
        return False
    moves = {("start", "<think>"): "in_think", ("information", "<think>"): "in_think",
             ("in_think", "</think>"): "after_think", ("after_think", "<search>"): "in_search",
             ("in_search", "</search>"): "after_search", ("after_search", "<information>"): "in_information",
             ("in_information", "</information>"): "information", ("after_think", "<answer>"): "in_answer",
             ("in_answer", "</answer>"): "end"}  # fmt: skip
    state = "start"
    for part in re.split(r"(</?(?:think|search|information|answer)>)", response_text):
        if not part.strip():
            continue
        if re.fullmatch(r"</?(?:think|search|information|answer)>", part):
            state = moves.get((state, part), "")
            if not state:
                return False
        elif not state.startswith("in_"):  # text outside a block
            return False
    return state == "end"


def search_r1_em(
    response_text: str,
    gold_answers: Sequence[str],
    *,
    structure_format_score: float = 0.2,
    final_format_score: float = 0.1,
    **_: object,
) -> float:
    """Search-R1's format-aware exact match (``qa_em_format.compute_score_em`` with their scripts' settings, its
    retrieval score 0): valid sequence (``is_search_r1_sequence``) and correct -> 1; invalid and correct ->
    ``1 - structure_format_score``; valid and wrong -> ``structure_format_score``; invalid and wrong ->
    ``final_format_score``; no answer (never valid) -> 0.

    Differences from ``format_em``: wrong answer with bad format scores ``final_format_score`` (0.1) here, 0 there;
    ``<think>`` is required before every search and answer here, optional there; text between blocks is invalid
    here, allowed there."""
    valid = is_search_r1_sequence(response_text)  # a valid sequence ends with an answer
    if extract_answer(response_text) is None:
        return 0.0
    if exact_match(response_text, gold_answers):
        return 1.0 if valid else 1.0 - structure_format_score
    return structure_format_score if valid else final_format_score


def tag_count(response_text: str, gold_answers: Sequence[str], **_: object) -> float:
    """open-r1 style tag counting: 0.25 for each of think / answer present exactly once as a pair, plus 0.25 when
    every <search> is followed by an <information> block, plus 0.25 when nothing follows the final </answer>."""
    score = 0.0
    for tag in ("think", "answer"):
        if response_text.count(f"<{tag}>") >= 1 and response_text.count(f"<{tag}>") == response_text.count(f"</{tag}>"):
            score += 0.25
    if response_text.count("<search>") == response_text.count("<information>"):
        score += 0.25
    last = response_text.rfind("</answer>")
    if last >= 0 and not response_text[last + len("</answer>") :].strip():
        score += 0.25
    return score


def retrieval_hit(
    response_text: str,
    gold_answers: Sequence[str],
    *,
    retrieved_texts: Iterable[str] = (),
    **_: object,
) -> float:
    """1.0 when a normalized gold answer appears in any retrieved text the model saw (``retrieved_texts``: the
    search observations appended to the episode, as the model read them)."""
    golds = [normalize_answer(g) for g in gold_answers if normalize_answer(g)]
    for text in retrieved_texts:
        t = f" {normalize_answer(text)} "
        if any(f" {g} " in t for g in golds):
            return 1.0
    return 0.0


RewardFn = Callable[..., float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "substring_match": substring_match,
    "f1": f1,
    "format": format_score,
    "format_em": format_em,
    "search_r1_em": search_r1_em,
    "tag_count": tag_count,
    "retrieval_hit": retrieval_hit,
}


def get_reward_fn(name: str) -> RewardFn:
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise KeyError(f"unknown reward function {name!r}; allowed: {', '.join(sorted(REWARD_FUNCTIONS))}") from None


def compute_rewards(
    terms: Sequence[tuple[str, float]],
    response_text: str,
    gold_answers: Sequence[str],
    **context: object,
) -> tuple[float, dict[str, float]]:
    """Weighted sum of named reward terms. Returns (total, {name: unweighted score})."""
    parts = {name: float(get_reward_fn(name)(response_text, gold_answers, **context)) for name, _ in terms}
    total = sum(weight * parts[name] for name, weight in terms)
    return total, parts
