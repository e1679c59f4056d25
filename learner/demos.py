"""Demonstration episodes for the supervised warm start (``async-agent-rl sft``): a scripted expert on the search world.

The expert knows each train question's ``subject`` (and ``bridge`` entity for two-hop questions) and acts as the RL
agent should::

    single-hop  <think> I need to search {subject}. </think>\\n<search> {subject} </search>
                [observation]
                <think> I found the answer. </think>\\n<answer> {answer} </answer>
    bridge      ... <search> {subject} </search> [observation]
                <think> Now I need to search {bridge}. </think>\\n<search> {bridge} </search> [observation]
                <think> I found the answer. </think>\\n<answer> {answer} </answer>

Observations are what the retriever REALLY returns for the query (``backend.search([query], retriever.topk)``),
rendered and cut exactly as ``actors.episode.EpisodeRunner`` does (``render_information`` + ``truncate_observation``
to ``rollout.max_obs_length``, closing tag kept).

Token structure (identical to a rollout, so SFT and RL train on the same kind of sequence):

- ``prompt_ids`` = ``prompt_ids(tokenizer, [user message], data.apply_chat_template)`` with the message rendered by
  ``render_question_prompt(question, data.prompt_template)`` (or the dataset's prompt with ``data.prompt_from``).
- every model turn is tokenized ON ITS OWN, ends with its stop string (``</search>`` / ``</answer>``, no EOS), and
  has ``loss_mask`` 1; every observation is tokenized on its own and has ``loss_mask`` 0. The transcript is never
  re-tokenized.
- the same budgets as a rollout (``async_agent_rl.episode_settings.EpisodeSettings``): at most ``max_turns`` model
  turns, each within ``min(max_tokens_per_turn, response budget left, context left)``, and an observation only when
  at least ``min_turn_tokens`` remain after it for the next turn.

The expert can be made imperfect, as demonstrations from a weaker model are (``sft.expert_search_prob``,
``sft.expert_second_hop_prob``): in a share of its episodes it answers at once without searching (a guess: the
relation's most common answer among the demonstrated questions) or, on a bridge question, stops after the first
search and answers the bridge entity it found. Each demonstration draws its behaviour independently of the
question, so imitation learns the format and reading from every demonstration but cannot learn which behaviour
pays; RL can, since only the searching ones are rewarded::

    guess       <think> I know the answer. </think>\n<answer> {guess} </answer>
    one hop     <search> {subject} </search> [observation] <think> I found the answer. </think>
                <answer> {bridge} </answer>

A question the expert cannot demonstrate honestly (the retriever does not surface the answer or the bridge entity
within the truncated observation, the episode does not fit the budgets, the question is not from the world) raises
:class:`DemoError` in :meth:`DemoExpert.demonstrate`; :func:`make_demonstrations` counts and logs those, never drops
them silently (:class:`DemoReport`). Only train questions may be demonstrated: a ``split == "test"`` example is refused.

:func:`shuffled_world_observations` makes the text of the optional pretraining stage of ``learner.sft``: observations
about every entity of the world with all facts shuffled (reading and copying, no true fact).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from async_agent_rl.config import Config
from async_agent_rl.data.corpus import Passage
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.prompts import prompt_ids, render_question_prompt
from async_agent_rl.records import OBS_VERSION, EpisodeMeta, Trajectory, TurnSpan
from async_agent_rl.render import INFORMATION_CLOSE, render_information, truncate_observation
from async_agent_rl.rewards import compute_rewards, exact_match, scoring_text
from retriever.backends import Hit, SearchBackend

log = logging.getLogger(__name__)

# The expert's turns. Short on purpose: a tiny model learns short, regular strings fastest.
SEARCH_TURN = "<think> I need to search {query}. </think>\n<search> {query} </search>"
BRIDGE_TURN = "<think> Now I need to search {query}. </think>\n<search> {query} </search>"
ANSWER_TURN = "<think> I found the answer. </think>\n<answer> {answer} </answer>"
GUESS_TURN = "<think> I know the answer. </think>\n<answer> {answer} </answer>"

# The expert's behaviours: search as needed, answer without searching, stop a bridge question after one search.
THOROUGH, GUESS, ONE_HOP = "thorough", "guess", "one_hop"

DEMO_VERSION = 0  # policy version stamped on demonstration tokens (no policy sampled them)


class DemoError(ValueError):
    """The expert cannot demonstrate this question; ``reason`` is a short stable key (counted in reports)."""

    def __init__(self, question_id: str, reason: str, detail: str = ""):
        super().__init__(f"question {question_id!r}: cannot demonstrate ({reason}){': ' + detail if detail else ''}")
        self.question_id = question_id
        self.reason = reason


@dataclass
class DemoReport:
    """What :func:`make_demonstrations` did: demos made, distinct questions used, failures by reason."""

    requested: int = 0
    made: int = 0
    questions: int = 0
    failed: Counter = field(default_factory=Counter)
    single_hop: int = 0
    bridge: int = 0
    behaviours: Counter = field(default_factory=Counter)  # demonstrations made, by THOROUGH / GUESS / ONE_HOP

    @property
    def num_failed(self) -> int:
        return sum(self.failed.values())


class _Builder:
    """Builds one demonstration trajectory turn by turn, enforcing the rollout's budgets."""

    def __init__(self, ex: QAExample, prompt: list[int], s: EpisodeSettings):
        self.ex, self.prompt, self.s = ex, prompt, s
        self.resp: list[int] = []
        self.mask: list[int] = []
        self.turns: list[TurnSpan] = []
        self.texts: list[str] = []

    def _fail(self, reason: str, detail: str = "") -> DemoError:
        return DemoError(self.ex.id, reason, detail)

    def model_turn(self, ids: list[int], text: str) -> None:
        s = self.s
        if sum(t.kind == "model" for t in self.turns) >= s.max_turns:
            raise self._fail("too_many_turns", f"rollout.max_turns={s.max_turns}")
        budget = min(
            s.max_tokens_per_turn,
            s.max_response_length - len(self.resp),
            s.max_model_len - len(self.prompt) - len(self.resp),
        )
        if len(ids) > budget:
            raise self._fail("turn_too_long", f"{len(ids)} tokens, budget {budget}: {text!r}")
        self._append("model", ids, 1, text)

    def observation(self, ids: list[int], text: str) -> None:
        after = len(self.resp) + len(ids)
        room = min(self.s.max_response_length - after, self.s.max_model_len - len(self.prompt) - after)
        if room < self.s.min_turn_tokens:
            raise self._fail("response_budget", f"no room for a turn after a {len(ids)}-token observation")
        self._append("observation", ids, 0, text)

    def _append(self, kind: str, ids: list[int], m: int, text: str) -> None:
        self.turns.append(TurnSpan(kind, len(self.resp), len(self.resp) + len(ids)))  # type: ignore[arg-type]
        self.resp += ids
        self.mask += [m] * len(ids)
        self.texts.append(text)


class DemoExpert:
    """The scripted expert for one config + tokenizer + search backend; :meth:`demonstrate` builds one episode.

    Retrieval results are cached per query (the backend is deterministic), and :meth:`prefetch` runs one batched
    search for many questions.
    """

    def __init__(self, cfg: Config, tokenizer: Any, backend: SearchBackend):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.backend = backend
        self.s = EpisodeSettings.from_config(cfg)
        self.topk = cfg.retriever.topk
        self._closing_ids = self._encode(INFORMATION_CLOSE)
        self._hits: dict[str, list[Hit]] = {}
        self._obs: dict[str, tuple[list[int], str]] = {}
        self._reward_terms = [(t.name, t.weight) for t in cfg.reward.terms]
        self.search_prob = cfg.sft.expert_search_prob
        self.second_hop_prob = cfg.sft.expert_second_hop_prob
        self.guesses: dict[str, str] = {}  # relation -> the guess of a GUESS demonstration (see set_guesses)

    def set_guesses(self, examples: Sequence[QAExample]) -> None:
        """A GUESS demonstration answers the most common gold answer of its relation among ``examples`` (ties:
        the first in sorted order), or of all of them when the relation is unknown."""
        by_relation: dict[str, Counter] = {}
        for ex in examples:
            if ex.gold_answers:
                by_relation.setdefault(str(ex.extra.get("relation", "")), Counter())[ex.gold_answers[0]] += 1
                by_relation.setdefault("*", Counter())[ex.gold_answers[0]] += 1
        self.guesses = {rel: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for rel, c in by_relation.items()}

    def behaviour(self, ex: QAExample, rng: random.Random) -> str:
        """Draw the expert's behaviour for one demonstration of ``ex`` (independent of the question's text)."""
        if self.search_prob < 1.0 and rng.random() >= self.search_prob:
            return GUESS
        if ex.extra.get("hops") == 2 and self.second_hop_prob < 1.0 and rng.random() >= self.second_hop_prob:
            return ONE_HOP
        return THOROUGH

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids_for(self, ex: QAExample) -> list[int]:
        """``EpisodeRunner.prompt_ids_for`` semantics."""
        d = self.cfg.data
        if d.prompt_from == "dataset" and ex.prompt_messages:
            messages = ex.prompt_messages
        else:
            messages = [{"role": "user", "content": render_question_prompt(ex.question, d.prompt_template)}]
        return prompt_ids(self.tokenizer, messages, d.apply_chat_template)

    def prefetch(self, examples: Sequence[QAExample]) -> None:
        queries = sorted(
            {q for ex in examples for q in (ex.extra.get("subject"), ex.extra.get("bridge")) if q} - set(self._hits)
        )
        if queries:
            self._hits.update(zip(queries, self.backend.search(queries, self.topk)))

    def search(self, query: str) -> list[Hit]:
        if query not in self._hits:
            self._hits[query] = self.backend.search([query], self.topk)[0]
        return self._hits[query]

    def observation_ids(self, hits: Sequence[Hit]) -> list[int]:
        """The observation exactly as ``EpisodeRunner`` appends it after a search returning ``hits``."""
        return truncate_observation(self._encode(render_information(hits)), self.s.max_obs_length, self._closing_ids)

    def _observation(self, query: str, hits: Sequence[Hit]) -> tuple[list[int], str]:
        if query not in self._obs:
            ids = self.observation_ids(hits)
            self._obs[query] = (ids, self.tokenizer.decode(ids, skip_special_tokens=True))
        ids, text = self._obs[query]
        return list(ids), text

    def plan(self, ex: QAExample) -> list[str]:
        """The expert's search queries for ``ex``: [subject] or [subject, bridge]."""
        subject, bridge, hops = ex.extra.get("subject"), ex.extra.get("bridge"), ex.extra.get("hops")
        if not subject or hops not in (1, 2) or (hops == 2 and not bridge):
            raise DemoError(ex.id, "not_a_world_question", "needs extra.subject, extra.hops (and extra.bridge)")
        return [subject] if hops == 1 else [subject, bridge]

    def demonstrate(self, ex: QAExample, trajectory_id: str = "", behaviour: str = THOROUGH) -> Trajectory:
        """One demonstration episode for the train question ``ex`` (``behaviour``: THOROUGH, GUESS or ONE_HOP);
        raises :class:`DemoError`."""
        if ex.split == "test":
            raise DemoError(ex.id, "test_question", "demonstrations use train questions only")
        queries = self.plan(ex)
        answer = ex.gold_answers[0]
        answer_turn = ANSWER_TURN
        if behaviour == GUESS:
            queries = []
            answer = self.guesses.get(str(ex.extra.get("relation", "")), self.guesses.get("*", ""))
            answer_turn = GUESS_TURN
            if not answer:
                raise DemoError(ex.id, "no_guess", "set_guesses was not given any question")
        elif behaviour == ONE_HOP and len(queries) == 2:
            queries, answer = queries[:1], queries[1]
        b = _Builder(ex, self.prompt_ids_for(ex), self.s)
        retrieved: list[str] = []
        for i, query in enumerate(queries):
            text = (SEARCH_TURN if i == 0 else BRIDGE_TURN).format(query=query)
            b.model_turn(self._encode(text), text)
            hits = self.search(query)
            obs_ids, obs_text = self._observation(query, hits)
            retrieved.append(obs_text)  # what the model sees of the passages, as for rollouts
            # what the next turn needs must be readable in the observation the model actually sees
            needed = queries[i + 1] if i + 1 < len(queries) else answer
            if needed not in obs_text:
                reason = "bridge_not_retrieved" if i + 1 < len(queries) else "answer_not_retrieved"
                raise DemoError(ex.id, reason, f"{needed!r} not in the observation for {query!r}")
            b.observation(obs_ids, obs_text)
        text = answer_turn.format(answer=answer)
        ids = self._encode(text)
        b.model_turn(ids, text)
        response_text = scoring_text(zip((t.kind for t in b.turns), b.texts))
        if exact_match(self.tokenizer.decode(ids, skip_special_tokens=True), [answer]) != 1.0:
            raise DemoError(ex.id, "answer_roundtrip", f"{answer!r} does not survive tokenization")
        reward, parts = compute_rewards(self._reward_terms, response_text, ex.gold_answers, retrieved_texts=retrieved)
        meta = EpisodeMeta(
            data_source=ex.data_source,
            question_id=ex.id,
            group_id=f"demo/{ex.id}",
            gold_answers=list(ex.gold_answers),
            num_searches=len(queries),
            num_turns=len(queries) + 1,
            finish_reason="answer",
            trajectory_id=trajectory_id or f"demo/{ex.id}",
            extra={"demo": True, "hops": ex.extra.get("hops"), "queries": list(queries), "behaviour": behaviour},
        )
        versions = [DEMO_VERSION if m else OBS_VERSION for m in b.mask]
        traj = Trajectory(b.prompt, b.resp, b.mask, [0.0] * len(b.resp), versions, b.turns, reward, parts, meta)
        return traj.validate()


def make_demonstrations(
    cfg: Config,
    tokenizer: Any,
    examples: Sequence[QAExample],
    backend: SearchBackend,
    n: int,
    seed: int = 0,
    report: DemoReport | None = None,
) -> list[Trajectory]:
    """``n`` demonstration trajectories from the train questions ``examples`` (shuffled with ``seed``).

    Each question is demonstrated at most once per pass; when ``n`` exceeds the demonstrable questions, further
    passes (reshuffled) repeat them. Questions that raise :class:`DemoError` are counted in ``report.failed`` by
    reason and logged (once each). Raises ``ValueError`` for a test-split example, and :class:`DemoError` when no
    question can be demonstrated at all.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    test = [ex.id for ex in examples if ex.split == "test"]
    if test:
        raise ValueError(f"demonstrations use train questions only; got {len(test)} test questions, e.g. {test[0]!r}")
    report = report if report is not None else DemoReport()
    report.requested += n
    expert = DemoExpert(cfg, tokenizer, backend)
    expert.prefetch(examples)
    expert.set_guesses(examples)
    rng = random.Random(seed)
    cache: dict[tuple[str, str], Trajectory | None] = {}
    out: list[Trajectory] = []
    while len(out) < n:
        order = list(examples)
        rng.shuffle(order)
        before = len(out)
        for ex in order:
            if len(out) == n:
                break
            key = (ex.id, expert.behaviour(ex, rng))
            if key not in cache:
                try:
                    cache[key] = expert.demonstrate(ex, behaviour=key[1])
                except DemoError as e:
                    cache[key] = None
                    report.failed[e.reason] += 1
                    log.info("%s", e)
            demo = cache[key]
            if demo is not None:
                out.append(_copy_with_id(demo, f"demo/{len(out)}"))
                report.behaviours[key[1]] += 1
        if len(out) == before:
            raise DemoError("*", "no_demonstrable_question", f"none of {len(examples)} questions could be demonstrated")
    report.made += len(out)
    report.questions += len({qid for (qid, _), d in cache.items() if d is not None})
    report.single_hop += sum(d.meta.extra["hops"] == 1 for d in out)
    report.bridge += sum(d.meta.extra["hops"] == 2 for d in out)
    if report.num_failed:
        log.warning("demonstrations: %d questions not demonstrable: %s", report.num_failed, dict(report.failed))
    return out


def _copy_with_id(t: Trajectory, trajectory_id: str) -> Trajectory:
    meta = EpisodeMeta(**{**t.meta.__dict__, "trajectory_id": trajectory_id, "extra": dict(t.meta.extra)})
    return Trajectory(
        list(t.prompt_ids), list(t.response_ids), list(t.loss_mask), list(t.behavior_logprobs), list(t.versions),
        list(t.turns), t.reward, dict(t.reward_components), meta,
    )


def shuffled_world_observations(world_file: str | Path, copies: int, seed: int = 0, max_docs: int = 3,
                                questions: bool = False) -> list[str]:
    """Observation-style texts about the world's entities with every fact SHUFFLED, for corpus pretraining.

    ``world_file`` is the ``world.json`` entity table that ``write_world`` writes. For each of ``copies`` copies,
    each attribute column is permuted among the entities of one kind (a person gets some person's birth city, some
    person's employer, ...), each entity is described with ``world.describe`` in its corpus format, and the passages
    are grouped 1..``max_docs`` at a time and rendered with ``render_information`` exactly like a search result.

    Every name of the world (test subjects included) appears in the same contexts as in real observations, so a
    model pretrained on these texts learns to read the format and to copy any name; no true fact about any entity
    is taught (a value matches the truth only by chance, differently in every copy), so held-out answers stay
    reachable only by searching. With ``questions`` (``sft.pretrain_questions``) each group of documents is followed
    by single-hop questions about them and their answers, one per document.
    """
    from async_agent_rl.data.world import describe, questions_about, read_entities, shuffle_facts

    entities = read_entities(world_file)
    rng = random.Random(seed)
    texts: list[str] = []
    for _ in range(copies):
        world = shuffle_facts(entities, rng)
        passages = [Passage(str(i), f'"{e.name}"\n{describe(e)}') for i, e in enumerate(world.values())]
        rng.shuffle(passages)
        i = 0
        while i < len(passages):
            k = rng.randint(1, max_docs)
            text = render_information(passages[i : i + k])
            if questions:  # reading exercises: single-hop questions about these documents, answered from them
                shown = [world[p.title.strip('"')] for p in passages[i : i + k]]
                qs = [q for e in shown for q in questions_about(e, world, rng, 0.0)]
                text += "".join(f"\n{q.question} {q.answers[0]}" for q in rng.sample(qs, min(len(qs), len(shown))))
            texts.append(text)
            i += k
    return texts


def shuffled_world_demonstrations(
    cfg: Config,
    tokenizer: Any,
    train_examples: Sequence[QAExample],
    n: int,
    copies: int,
    seed: int = 0,
    report: DemoReport | None = None,
) -> list[Trajectory]:
    """``n`` demonstrations spread over ``copies`` fact-shuffled copies of the embedded world.

    Each copy (``world.shuffle_facts`` of ``data.world_dir/world.json``) keeps every name and sentence shape but
    permutes each attribute among the entities of one kind, gets its own search index over its own passages (the
    configured backend), and asks the world's question templates about the SUBJECTS OF ``train_examples`` only
    (held-out subjects are never asked about). A fact differs from copy to copy, so an answer can only be got right
    by reading the observation: the warm start learns to read instead of memorizing train answers, and nothing true
    about any entity is taught.
    """
    from async_agent_rl.data.world import passages_of, questions_about, read_entities, shuffle_facts
    from retriever.backends import open_backend

    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    world_file = Path(cfg.data.world_dir) / "world.json"
    if not world_file.is_file():
        raise FileNotFoundError(f"shuffled-world demonstrations need the world's entity table {world_file}")
    entities = read_entities(world_file)
    subjects = sorted({s for ex in train_examples if (s := ex.extra.get("subject")) in entities})
    if not subjects:
        raise DemoError("*", "no_world_subject", "no train question names an entity of the world")
    rng = random.Random(seed)
    per_copy = -(-n // copies)
    out: list[Trajectory] = []
    for c in range(copies):
        world = shuffle_facts(entities, rng)
        passages = [Passage(id=p["id"], contents=p["contents"]) for p in passages_of(world)]
        backend = open_backend(cfg.retriever.backend, passages, None, cfg.retriever.dense_model)
        examples = []
        for name in subjects:
            for q in questions_about(world[name], world, rng, cfg.data.world.two_hop_fraction):
                examples.append(QAExample(
                    id=f"shuffled{c}/{len(examples)}", question=q.question, gold_answers=q.answers,
                    data_source=q.data_source, split="train", index=len(examples),
                    extra={"subject": q.subject, "hops": q.hops, "relation": q.relation, "bridge": q.bridge},
                ))
        take = min(per_copy, n - len(out))
        if take > 0:
            out += make_demonstrations(cfg, tokenizer, examples, backend, take, seed=seed + c, report=report)
    return out
