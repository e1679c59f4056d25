"""Prompt templates for the search task and the tags the agent speaks.

``search_r1`` is Search-R1's instruction template (docs/ALGORITHMS.md section 1), the default. ``minimal`` is a short
instruction for tiny models and ablations. Either is wrapped in the tokenizer's chat template (instruct style) or
used as plain text (base style), per ``data.apply_chat_template``.
"""

from __future__ import annotations

from typing import Any, Sequence

TAGS = ("<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>")
STOP_STRINGS = ("</search>", "</answer>")

SEARCH_R1_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> "
    "and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)

MINIMAL_TEMPLATE = (
    "Search with <search> query </search>, read the <information>, then answer with <answer> answer </answer>. "
    "Question: {question}\n"
)

TEMPLATES = {"search_r1": SEARCH_R1_TEMPLATE, "minimal": MINIMAL_TEMPLATE}


def render_question_prompt(question: str, template: str = "search_r1") -> str:
    """The user message for a question. Like Search-R1, a missing final '?' is added."""
    try:
        fmt = TEMPLATES[template]
    except KeyError:
        raise KeyError(f"unknown prompt template {template!r}; allowed: {', '.join(TEMPLATES)}") from None
    q = question.strip()
    if q and not q.endswith("?"):
        q += "?"
    return fmt.format(question=q)


def prompt_text(tokenizer: Any, messages: Sequence[dict[str, str]], apply_chat_template: bool) -> str:
    """The exact text the model is conditioned on before its first turn."""
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.apply_chat_template=true but the tokenizer has no chat template")
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "".join(m["content"] for m in messages)


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]], apply_chat_template: bool) -> list[int]:
    return list(tokenizer.encode(prompt_text(tokenizer, messages, apply_chat_template), add_special_tokens=False))
