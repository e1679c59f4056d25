"""One multi-turn search episode, as one async function over an engine and a search tool (no Ray, vLLM or HTTP inside).

Used by the rollout actors (``actors``: vLLM engine, HTTP ``SearchClient``) and by the SFT warm start's
demonstrations (``warm_start.demos``: a scripted expert engine, the search backend in process), so both produce
episodes by the same code. It lives in the core so that neither of those packages imports the other.

The loop, per turn (Search-R1 semantics, docs/ALGORITHMS.md sections 1-2)::

    generate one model turn from prompt_ids + response_ids        (stop after </search> or </answer>, stop kept;
                                                                   the turn's text is the decoding of its tokens)
        budget = min(max_tokens_per_turn, response budget left, context left)
    parse the FIRST <search>q</search> | <answer>a</answer> of the turn
        answer            -> stop
        search            -> call the search engine, render Search-R1's <information> block
        none (invalid)    -> Search-R1's invalid-action observation
    tokenize the observation ON ITS OWN (the transcript is never re-tokenized), cut it to max_obs_length keeping
    </information>, append it with loss_mask 0

The episode always ends on a model-generated token: an observation is appended only when another model turn
follows it and at least ``min_turn_tokens`` of budget and context remain for that turn. A failed search becomes
an error observation (masked, counted in ``meta.num_search_errors``), never an exception. An episode with no
model token at all raises ``EmptyEpisodeError`` (the learner cannot train on it).

Where episode time goes: the runner's ``timers`` (``EpisodeTimers``) count the episodes running and the episodes
awaiting the search tool over time (``stats.Occupancy``); the rollout worker reports their totals (episode-seconds,
tool-wait seconds) in ``RolloutStats``.

Rewards score the model's own turns (``rewards.scoring_text``: observations are opaque blocks) and
``retrieval_hit`` credits only the search results that were appended, as the model read them (truncated).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence

from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.prompts import STOP_STRINGS, prompt_ids, render_question_prompt
from async_agent_rl.records import OBS_VERSION, EpisodeMeta, Trajectory, TurnSpan
from async_agent_rl.render import INFORMATION_CLOSE, INFORMATION_OPEN, render_information, truncate_observation
from async_agent_rl.rewards import compute_rewards, scoring_text
from async_agent_rl.stats import Occupancy

log = logging.getLogger(__name__)

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

INVALID_ACTION_OBSERVATION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"
)


@dataclass
class TurnRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: Sequence[str] = STOP_STRINGS
    seed: int | None = None


@dataclass
class TurnOutput:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str  # the engine's text; the episode reads the decoding of token_ids (vLLM cuts text at a stop string)
    finish_reason: str  # "stop" (stop string or EOS), "length", "abort"
    stop_reason: Any = None


class TurnEngine(Protocol):
    """What an episode needs from an engine: one model turn per ``generate`` (``actors.engine.Engine`` adds weight
    updates)."""

    version: int

    async def generate(self, req: TurnRequest) -> TurnOutput: ...


ErrorKind = Literal["timeout", "connection", "http_status", "bad_reply"]


class SearchError(Exception):
    """A search that failed. ``kind``: timeout | connection | http_status | bad_reply; ``status``: the HTTP status."""

    def __init__(
        self, kind: ErrorKind, message: str, attempts: int = 1, status: int | None = None, retryable: bool = False
    ):
        super().__init__(f"search failed ({kind}): {message}")
        self.kind = kind
        self.message = message
        self.attempts = attempts
        self.status = status
        self.retryable = retryable


class PromptTooLongError(ValueError):
    """The chat-templated prompt exceeds ``data.max_prompt_length``; the worker counts the episode as failed."""


class EmptyEpisodeError(ValueError):
    """The episode has no model-generated token (no context left for a first turn, or the engine aborted before
    its first token): there is nothing to train on; the worker counts the episode as failed, never pushes it."""


def parse_action(text: str) -> tuple[str | None, str]:
    """Search-R1's action: the FIRST ``<search>..</search>`` or ``<answer>..</answer>``; (None, "") if neither."""
    m = _ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


def search_error_observation(err: SearchError) -> str:
    return f"{INFORMATION_OPEN}Search failed ({err.kind}). No results.{INFORMATION_CLOSE}"


class SearchTool(Protocol):
    """What an episode needs from search: ``await search(query) -> hits`` raising ``SearchError`` on failure."""

    async def search(self, query: str) -> Sequence[Any]: ...


@dataclass
class EpisodeTimers:
    """Episode time, counted over time by every episode a runner runs: ``episodes`` running (integral:
    episode-seconds), ``searches``: episodes awaiting the search tool (integral: tool-wait seconds)."""

    clock: Callable[[], float] = time.monotonic
    episodes: Occupancy = field(init=False)
    searches: Occupancy = field(init=False)

    def __post_init__(self) -> None:
        self.episodes, self.searches = Occupancy(self.clock), Occupancy(self.clock)

    def totals(self) -> tuple[float, float]:
        """``(episode_s, tool_wait_s)`` up to now."""
        return self.episodes.totals()[0], self.searches.totals()[0]


class EpisodeRunner:
    """Runs episodes for one engine + search tool + tokenizer. Stateless between episodes but for ``timers`` (shared
    with a runner made from this one, e.g. the lockstep baseline's); safe to share across many concurrent asyncio
    tasks."""

    def __init__(self, engine: TurnEngine, search: SearchTool, tokenizer: Any, settings: EpisodeSettings,
                 timers: EpisodeTimers | None = None):
        self.engine = engine
        self.search = search
        self.tokenizer = tokenizer
        self.s = settings
        self.timers = timers or EpisodeTimers()
        self._closing_ids = self._encode(INFORMATION_CLOSE)
        self._invalid_ids = self._encode(INVALID_ACTION_OBSERVATION)[: settings.max_obs_length]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def split_by_prompt_length(self, examples: Sequence[QAExample]) -> tuple[list[QAExample], list[QAExample]]:
        """``(fitting, too_long)``: the examples whose prompt fits ``max_prompt_length`` and the others, which are
        logged in one line (a count and the longest) instead of failing one episode each."""
        fitting, too_long, longest = [], [], 0
        for ex in examples:
            n = len(self.prompt_ids_for(ex))
            (fitting if n <= self.s.max_prompt_length else too_long).append(ex)
            if n > self.s.max_prompt_length:
                longest = max(longest, n)
        if too_long:
            log.warning("skipping %d of %d prompts longer than data.max_prompt_length=%d tokens (longest %d)",
                        len(too_long), len(examples), self.s.max_prompt_length, longest)
        return fitting, too_long

    def observation_ids(self, hits: Sequence[Any]) -> list[int]:
        """The observation appended after a search returning ``hits``: rendered, tokenized on its own, cut to
        ``max_obs_length`` keeping ``</information>``."""
        return truncate_observation(self._encode(render_information(hits)), self.s.max_obs_length, self._closing_ids)

    def observation_fits(self, prompt_len: int, response_len: int, obs_len: int) -> bool:
        """Whether an observation of ``obs_len`` tokens may follow: at least ``min_turn_tokens`` of response budget
        and of context must remain after it for the model turn that has to follow it."""
        after = response_len + obs_len
        s = self.s
        return (
            s.max_response_length - after >= s.min_turn_tokens
            and s.max_model_len - prompt_len - after >= s.min_turn_tokens
        )

    def prompt_ids_for(self, ex: QAExample) -> list[int]:
        if self.s.prompt_from == "dataset" and ex.prompt_messages:
            messages = ex.prompt_messages
        else:
            messages = [{"role": "user", "content": render_question_prompt(ex.question, self.s.prompt_template)}]
        return prompt_ids(self.tokenizer, messages, self.s.apply_chat_template)

    async def run(
        self, ex: QAExample, group_id: str = "", trajectory_id: str = "", seed: int | None = None
    ) -> Trajectory:
        with self.timers.episodes.held():
            return await self._run(ex, group_id, trajectory_id, seed)

    async def _run(self, ex: QAExample, group_id: str, trajectory_id: str, seed: int | None) -> Trajectory:
        s = self.s
        prompt = self.prompt_ids_for(ex)
        if len(prompt) > s.max_prompt_length:
            raise PromptTooLongError(
                f"question {ex.id}: prompt has {len(prompt)} tokens, data.max_prompt_length is {s.max_prompt_length}"
            )
        resp: list[int] = []
        mask: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        turns: list[TurnSpan] = []
        pieces: list[tuple[str, str]] = []  # the response as text: ("model" | "search_results" | "observation", text)
        searches = errors = 0
        finish = "max_turns"

        for turn in range(s.max_turns):
            response_left = s.max_response_length - len(resp)
            context_left = s.max_model_len - len(prompt) - len(resp)
            budget = min(s.max_tokens_per_turn, response_left, context_left)
            if budget <= 0:
                finish = "context_limit" if context_left <= 0 else "response_budget"
                break
            out = await self.engine.generate(
                TurnRequest(
                    prompt_ids=prompt + resp,
                    max_tokens=budget,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=s.top_k,
                    seed=None if seed is None else seed * 1000 + turn,
                )
            )
            # The model said what its tokens say: vLLM cuts its text right after a stop string, which with a real
            # BPE often ends inside the last token (Qwen: '>\n\n', '>.'), while those tokens are trained on and read.
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            if out.token_ids:
                turns.append(TurnSpan("model", len(resp), len(resp) + len(out.token_ids)))
                resp += out.token_ids
                mask += [1] * len(out.token_ids)
                logps += out.logprobs
                versions += out.versions
                pieces.append(("model", text))
            if out.finish_reason == "abort":
                finish = "aborted"
                break
            action, arg = parse_action(text)
            if action == "answer":
                finish = "answer"
                break
            if turn == s.max_turns - 1:
                finish = "max_turns"
                break
            obs_kind = "observation"
            if action == "search":
                searches += 1
                try:
                    with self.timers.searches.held():  # the episode's time waiting for the tool
                        hits = await self.search.search(arg)
                    obs_ids = self.observation_ids(hits)
                    obs_kind = "search_results"
                except SearchError as e:
                    errors += 1
                    obs_ids = self._encode(search_error_observation(e))
            else:
                obs_ids = self._invalid_ids
            # An observation must be followed by a model turn: keep room for one.
            if not self.observation_fits(len(prompt), len(resp), len(obs_ids)):
                finish = "response_budget"
                break
            after = len(resp) + len(obs_ids)
            turns.append(TurnSpan("observation", len(resp), after))
            resp += obs_ids
            mask += [0] * len(obs_ids)
            logps += [0.0] * len(obs_ids)
            versions += [OBS_VERSION] * len(obs_ids)
            pieces.append((obs_kind, self.tokenizer.decode(obs_ids, skip_special_tokens=True)))

        if turns and turns[-1].kind == "observation":  # only after an aborted turn: end on a model token
            cut = turns.pop().start
            del resp[cut:], mask[cut:], logps[cut:], versions[cut:]
            pieces.pop()
        if not turns:
            raise EmptyEpisodeError(f"question {ex.id}: no model token was generated (finish: {finish}; prompt "
                                    f"{len(prompt)} tokens, model.max_model_len {s.max_model_len})")
        # rewards read the model's own words; retrieval credit only for passages the model saw (as it saw them)
        seen = [text for kind, text in pieces if kind == "search_results"]
        reward, parts = compute_rewards(s.reward_terms, scoring_text(pieces), ex.gold_answers, retrieved_texts=seen)
        meta = EpisodeMeta(
            data_source=ex.data_source,
            question_id=ex.id,
            group_id=group_id or uuid.uuid4().hex,
            gold_answers=list(ex.gold_answers),
            num_searches=searches,
            num_search_errors=errors,
            num_turns=sum(t.kind == "model" for t in turns),
            finish_reason=finish,
            trajectory_id=trajectory_id or uuid.uuid4().hex,
        )
        traj = Trajectory(prompt, resp, mask, logps, versions, turns, reward, parts, meta)
        return traj.validate()
