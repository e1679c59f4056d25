"""Demonstration episodes for the supervised warm start (``async-agent-rl sft``): a scripted expert on the search world.

The expert knows each train question's ``subject`` (and ``bridge`` entity for two-hop questions) and acts as the RL
agent should::

    single-hop  <think> I need to search {subject}. </think>\\n<search> {subject} </search>
                [observation]
                <think> I found the answer. </think>\\n<answer> {answer} </answer>
    bridge      ... <search> {subject} </search> [observation]
                <think> Now I need to search {bridge}. </think>\\n<search> {bridge} </search> [observation]
                <think> I found the answer. </think>\\n<answer> {answer} </answer>

A demonstration IS a rollout episode: :meth:`DemoExpert.demonstrate` runs the rollouts' own episode loop
(``async_agent_rl.episode.EpisodeRunner``) with a scripted engine (:class:`ExpertEngine`, which emits the expert's
planned turns) and the configured search backend in process (``async_agent_rl.search.InProcessSearch``: what the
retriever REALLY returns for the query, cached per query). Prompt, observations (rendering, truncation to
``rollout.max_obs_length``), budgets, loss mask, turn spans, versions and rewards therefore come from the same code as
a rollout's, so SFT and RL train on the same sequences by construction:

- every model turn is tokenized ON ITS OWN, ends with its stop string (``</search>`` / ``</answer>``, no EOS), and
  has ``loss_mask`` 1, behaviour log-prob 0.0 and version ``DEMO_VERSION``; observations have ``loss_mask`` 0.
- a planned turn longer than the budget the runner offers (``req.max_tokens``) fails the demonstration
  (``turn_too_long``), as does an episode the runner ends before the expert's answer (``response_budget``: no room
  for a turn after an observation; ``too_many_turns``: ``rollout.max_turns`` reached).

The expert can be made imperfect, as demonstrations from a weaker model are (``sft.expert_search_prob``,
``sft.expert_second_hop_prob``): in a share of its episodes it answers at once without searching (a guess: the
relation's most common answer among the demonstrated questions; with ``sft.guess_value_loss: false`` the guessed
value's tokens are out of the loss, so only the decision to guess is imitated, not one constant value per relation
that a read answer has to outweigh) or, on a bridge question, stops after the first search and answers the bridge
entity it found. Each demonstration draws its behaviour independently of the
question, so imitation learns the format and reading from every demonstration but cannot learn which behaviour
pays; RL can, since only the searching ones are rewarded::

    guess       <think> I know the answer. </think>\n<answer> {guess} </answer>
    one hop     <search> {subject} </search> [observation] <think> I found the answer. </think>
                <answer> {bridge} </answer>

A question the expert cannot demonstrate honestly (the retriever does not surface the answer or the bridge entity
within the truncated observation, the episode does not fit the budgets, the question is not from the world) raises
:class:`DemoError` in :meth:`DemoExpert.demonstrate`; :func:`make_demonstrations` counts and logs those, never drops
them silently (:class:`DemoReport`). Only train questions may be demonstrated: a ``split == "test"`` example is refused.

:func:`shuffled_world_observations` makes the text of the optional pretraining stage of ``warm_start.sft``: observations
about every entity of the world with all facts shuffled (reading and copying, no true fact).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

from async_agent_rl.config import Config
from async_agent_rl.data.corpus import Passage
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode import EmptyEpisodeError, EpisodeRunner, PromptTooLongError, TurnOutput, TurnRequest
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.records import EpisodeMeta, Trajectory
from async_agent_rl.render import render_information
from async_agent_rl.rewards import exact_match
from async_agent_rl.search import Hit, InProcessSearch, SearchBackend

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


class ExpertEngine:
    """A scripted engine for one demonstration: the engine an ``EpisodeRunner`` drives (``TurnEngine``), emitting the
    expert's planned turns in order.

    Each turn is the tokenization of its text on its own, with behaviour log-probs 0.0 and versions
    ``DEMO_VERSION``. A turn longer than the budget the runner offers (``req.max_tokens``) raises ``turn_too_long``.
    Before the turn after a search, the observation the runner appended (the tokens it added to the prompt) must show
    what that turn needs (the bridge entity to search next, or the answer), else ``bridge_not_retrieved`` /
    ``answer_not_retrieved``.
    """

    version = DEMO_VERSION

    def __init__(self, tokenizer: Any, question_id: str, queries: Sequence[str], answer: str, turns: Sequence[str]):
        self.tokenizer = tokenizer
        self.question_id = question_id
        self.queries, self.answer, self.turns = list(queries), answer, list(turns)
        self.emitted = 0  # planned turns returned so far
        self._end = 0  # length of the token sequence after the last returned turn

    async def generate(self, req: TurnRequest) -> TurnOutput:
        if self.emitted >= len(self.turns):
            raise RuntimeError(f"question {self.question_id!r}: the episode asked for a turn after the expert's answer")
        if self.emitted:
            self.check_observation(self.emitted - 1, req.prompt_ids[self._end :])
        text = self.turns[self.emitted]
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if len(ids) > req.max_tokens:
            raise DemoError(self.question_id, "turn_too_long", f"{len(ids)} tokens, budget {req.max_tokens}: {text!r}")
        self.emitted += 1
        self._end = len(req.prompt_ids) + len(ids)
        decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
        return TurnOutput(ids, [0.0] * len(ids), [DEMO_VERSION] * len(ids), decoded, "stop")

    def check_observation(self, i: int, obs_ids: Sequence[int]) -> None:
        """The observation after search ``i`` must show what the next turn needs, as the model reads it."""
        needed = self.queries[i + 1] if i + 1 < len(self.queries) else self.answer
        if needed not in self.tokenizer.decode(list(obs_ids), skip_special_tokens=True):
            reason = "bridge_not_retrieved" if i + 1 < len(self.queries) else "answer_not_retrieved"
            raise DemoError(self.question_id, reason, f"{needed!r} not in the observation for {self.queries[i]!r}")


def _run_to_completion(coro: Any) -> Any:
    """Run a coroutine that never waits on anything (the scripted engine and the in-process search answer at once)
    without an event loop, so demonstrations can be made from inside a running one too."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a demonstration episode waited on something; its engine and search tool must not")


class DemoExpert:
    """The scripted expert for one config + tokenizer + search backend; :meth:`demonstrate` runs one episode.

    Retrieval results are cached per query (the backend is deterministic), and :meth:`prefetch` runs one batched
    search for many questions.
    """

    def __init__(self, cfg: Config, tokenizer: Any, backend: SearchBackend):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.backend = backend
        self.s = EpisodeSettings.from_config(cfg)
        self.search_tool = InProcessSearch(backend, cfg.retriever.topk)
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

    def prefetch(self, examples: Sequence[QAExample]) -> None:
        queries = [q for ex in examples for q in (ex.extra.get("subject"), ex.extra.get("bridge")) if q]
        self.search_tool.prefetch(queries)

    def search(self, query: str) -> list[Hit]:
        return self.search_tool.search_now(query)

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
        turns = [(SEARCH_TURN if i == 0 else BRIDGE_TURN).format(query=q) for i, q in enumerate(queries)]
        engine = ExpertEngine(self.tokenizer, ex.id, queries, answer, turns + [answer_turn.format(answer=answer)])
        runner = EpisodeRunner(engine, self.search_tool, self.tokenizer, self.s)
        tid = trajectory_id or f"demo/{ex.id}"
        try:
            traj: Trajectory = _run_to_completion(runner.run(ex, group_id=f"demo/{ex.id}", trajectory_id=tid))
        except PromptTooLongError as e:
            raise DemoError(ex.id, "prompt_too_long", str(e)) from None
        except EmptyEpisodeError as e:  # no context left for the first turn
            raise DemoError(ex.id, "turn_too_long", str(e)) from None
        if traj.meta.finish_reason != "answer":
            self._why_unfinished(ex, engine, runner, traj)
        last = traj.turns[-1]
        if exact_match(self.tokenizer.decode(traj.response_ids[last.start : last.end], skip_special_tokens=True),
                       [answer]) != 1.0:
            raise DemoError(ex.id, "answer_roundtrip", f"{answer!r} does not survive tokenization")
        if behaviour == GUESS and not self.cfg.sft.guess_value_loss:
            mask_value(self.tokenizer, traj, last, answer)
        traj.meta.extra = {"demo": True, "hops": ex.extra.get("hops"), "queries": list(queries),
                           "behaviour": behaviour, "relation": ex.extra.get("relation"), "answer": answer}
        return traj

    def _why_unfinished(self, ex: QAExample, engine: ExpertEngine, runner: EpisodeRunner, traj: Trajectory) -> None:
        """The runner stopped after the expert's search turn ``engine.emitted - 1`` without appending its observation
        (``max_turns`` reached, or no room for a turn after it): raise the reason, the observation's own problems
        first (what it must show, then its room), as for an observation that was appended."""
        finish = traj.meta.finish_reason
        if finish not in ("max_turns", "response_budget") or not 0 < engine.emitted <= len(engine.queries):
            raise DemoError(ex.id, str(finish), "the episode ended before the expert's answer")
        obs = runner.observation_ids(self.search(engine.queries[engine.emitted - 1]))
        engine.check_observation(engine.emitted - 1, obs)
        if not runner.observation_fits(len(traj.prompt_ids), len(traj.response_ids), len(obs)):
            raise DemoError(ex.id, "response_budget", f"no room for a turn after a {len(obs)}-token observation")
        raise DemoError(ex.id, "too_many_turns", f"rollout.max_turns={self.s.max_turns}")


def mask_value(tokenizer: Any, traj: Trajectory, turn: Any, value: str) -> None:
    """Set ``loss_mask`` 0 on the tokens of ``turn`` (a span of ``traj.response_ids``) that spell ``value`` (its last
    occurrence in the turn's text: the answer inside ``<answer> ... </answer>``): every token whose decoded
    characters overlap the value's. The rest of the turn (the decision to answer, the tags) stays a target."""
    for k in value_tokens(tokenizer, traj, turn, value):
        traj.loss_mask[k] = 0


def value_tokens(tokenizer: Any, traj: Trajectory, turn: Any, value: str) -> list[int]:
    """The indices into ``traj.response_ids`` of the tokens of ``turn`` that spell ``value`` (its last occurrence in
    the turn's text): every token whose decoded characters overlap the value's."""
    ids = traj.response_ids[turn.start : turn.end]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    at = text.rfind(value)
    if at < 0:
        raise DemoError(traj.meta.trajectory_id, "answer_roundtrip", f"{value!r} is not in the answer turn {text!r}")
    ends = [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=False)) for k in range(len(ids))]
    out, begin = [], 0
    for k, end in enumerate(ends):
        if begin < at + len(value) and end > at:  # token k spells characters [begin, end) of the turn
            out.append(turn.start + k)
        begin = end
    return out


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
                                questions: bool = False, questions_per_doc: int = 1) -> list[str]:
    """Observation-style texts about the world's entities with every fact SHUFFLED, for corpus pretraining.

    ``world_file`` is the ``world.json`` entity table that ``write_world`` writes. For each of ``copies`` copies,
    each attribute column is permuted among the entities of one kind (a person gets some person's birth city, some
    person's employer, ...), each entity is described with ``world.describe`` in its corpus format, and the passages
    are grouped 1..``max_docs`` at a time and rendered with ``render_information`` exactly like a search result.

    Every name of the world (test subjects included) appears in the same contexts as in real observations, so a
    model pretrained on these texts learns to read the format and to copy any name; no true fact about any entity
    is taught (a value matches the truth only by chance, differently in every copy), so held-out answers stay
    reachable only by searching. With ``questions`` (``sft.pretrain_questions``) each group of documents is followed
    by single-hop questions about them and their answers, ``questions_per_doc`` per document (drawn without repeats
    from all the questions about the group's documents).
    """
    from async_agent_rl.data.world import questions_about, read_entities, shuffle_facts

    entities = read_entities(world_file)
    rng = random.Random(seed)
    texts: list[str] = []
    for _ in range(copies):
        world = shuffle_facts(entities, rng)
        for group in observation_groups(world, rng, max_docs):
            text = render_information(group)
            if questions:  # reading exercises: single-hop questions about these documents, answered from them
                shown = [world[p.title.strip('"')] for p in group]
                qs = [q for e in shown for q in questions_about(e, world, rng, 0.0)]
                ask = min(len(qs), questions_per_doc * len(shown))
                text += "".join(f"\n{q.question} {q.answers[0]}" for q in rng.sample(qs, ask))
            texts.append(text)
    return texts


def observation_groups(world: dict[str, Any], rng: random.Random, max_docs: int = 3) -> Iterator[list[Passage]]:
    """The passages of every entity of ``world`` (an entity table, ``world.read_entities``), shuffled and cut into
    groups of 1..``max_docs``, each group one pretraining observation. Lazy: each group's size is drawn from
    ``rng`` when it is asked for, after whatever the caller drew for the previous one."""
    from async_agent_rl.data.world import describe

    passages = [Passage(str(i), f'"{e.name}"\n{describe(e)}') for i, e in enumerate(world.values())]
    rng.shuffle(passages)
    i = 0
    while i < len(passages):
        k = rng.randint(1, max_docs)
        yield passages[i : i + k]
        i += k


def shuffled_world_demonstrations(
    cfg: Config,
    tokenizer: Any,
    train_examples: Sequence[QAExample],
    n: int,
    copies: int,
    seed: int = 0,
    report: DemoReport | None = None,
    relations: Collection[str] | None = None,
) -> list[Trajectory]:
    """``n`` demonstrations spread over ``copies`` fact-shuffled copies of the embedded world.

    Each copy (``world.shuffle_facts`` of ``data.world_dir/world.json``) keeps every name and sentence shape but
    permutes each attribute among the entities of one kind, gets its own search index over its own passages (the
    configured backend), and asks the world's question templates about the SUBJECTS OF ``train_examples`` only
    (held-out subjects are never asked about); with ``relations``, only questions of those relations. A fact
    differs from copy to copy, so an answer can only be got right by reading the observation: the warm start learns
    to read instead of memorizing train answers, and nothing true about any entity is taught.
    """
    rng = random.Random(seed)
    per_copy = -(-n // copies) if copies >= 1 else 0
    out: list[Trajectory] = []
    for c, (examples, backend) in enumerate(shuffled_worlds(cfg, train_examples, copies, rng, relations)):
        take = min(per_copy, n - len(out))
        if take > 0:
            out += make_demonstrations(cfg, tokenizer, examples, backend, take, seed=seed + c, report=report)
    return out


def shuffled_worlds(
    cfg: Config,
    train_examples: Sequence[QAExample],
    copies: int,
    rng: random.Random,
    relations: Collection[str] | None = None,
) -> Iterator[tuple[list[QAExample], SearchBackend]]:
    """``copies`` fact-shuffled copies of the embedded world, one at a time: the questions about the subjects of
    ``train_examples`` (of ``relations`` only, when given) and a search index over the copy's passages."""
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
    for c in range(copies):
        world = shuffle_facts(entities, rng)
        passages = [Passage(id=p["id"], contents=p["contents"]) for p in passages_of(world)]
        r = cfg.retriever
        backend = open_backend(
            r.backend, passages, None, r.dense_model, query_prefix=r.query_prefix, passage_prefix=r.passage_prefix
        )
        examples = []
        for name in subjects:
            for q in questions_about(world[name], world, rng, cfg.data.world.two_hop_fraction):
                if relations is not None and q.relation not in relations:
                    continue
                examples.append(QAExample(
                    id=f"shuffled{c}/{len(examples)}", question=q.question, gold_answers=q.answers,
                    data_source=q.data_source, split="train", index=len(examples),
                    extra={"subject": q.subject, "hops": q.hops, "relation": q.relation, "bridge": q.bridge},
                ))
        if not examples:
            raise DemoError("*", "no_question", f"no question of the relations {sorted(relations or [])}")
        yield examples, backend
