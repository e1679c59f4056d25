"""Search-R1's observation text for a search turn, and its token-level truncation.

Rendering (Search-R1, ``_passages2string`` and the ``<information>`` wrapper), for hits ``h_1..h_n`` best first::

    passages = "".join(f"Doc {i}(Title: {title(h_i)}) {text(h_i)}\\n" for i = 1..n)
    block    = f"\\n\\n<information>{passages.strip()}</information>\\n\\n"

where ``title`` is the first line of ``contents`` with its double quotes and ``text`` the remaining lines joined by
``\\n``. There is no space before the parenthesis. Zero hits render as ``\\n\\n<information></information>\\n\\n``.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

from async_agent_rl.data.corpus import split_contents

INFORMATION_OPEN = "\n\n<information>"
INFORMATION_CLOSE = "</information>\n\n"


class HasContents(Protocol):
    contents: str


def render_passages(hits: Iterable[HasContents]) -> str:
    """``Doc {i}(Title: {title}) {text}\\n`` for each hit, ``i`` from 1."""
    parts = []
    for i, hit in enumerate(hits, start=1):
        title, text = split_contents(hit.contents)
        parts.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(parts)


def render_information(hits: Iterable[HasContents]) -> str:
    """The observation appended after a ``</search>`` turn: the rendered passages inside ``<information>`` tags."""
    return f"{INFORMATION_OPEN}{render_passages(hits).strip()}{INFORMATION_CLOSE}"


def truncate_observation(token_ids: Sequence[int], max_obs_length: int, closing_ids: Sequence[int]) -> list[int]:
    """Cut a tokenized observation to ``max_obs_length`` tokens, keeping its closing tag.

    Contract, with ``c = len(closing_ids)``:

    - ``max_obs_length >= c`` (else ``ValueError``).
    - If ``len(token_ids) <= max_obs_length`` the ids come back unchanged (as a new list).
    - Otherwise the result has exactly ``max_obs_length`` tokens and ends with ``closing_ids``: it is the first
      ``max_obs_length - c`` tokens of the body followed by ``closing_ids``, where the body is ``token_ids`` without
      its trailing ``closing_ids`` when it ends with them (tokenize the closing ``</information>\\n\\n`` on its own so
      that it does), else all of ``token_ids``.

    Search-R1 itself keeps the first ``max_obs_length`` tokens, which drops ``</information>`` from long observations
    and leaves the model reading an unterminated block; keeping the tag keeps the turn structure intact.
    """
    c = len(closing_ids)
    if max_obs_length < c:
        raise ValueError(f"max_obs_length {max_obs_length} cannot hold the {c} closing-tag tokens")
    ids = list(token_ids)
    if len(ids) <= max_obs_length:
        return ids
    closing = list(closing_ids)
    body = ids[: len(ids) - c] if c and ids[len(ids) - c :] == closing else ids
    return body[: max_obs_length - c] + closing
