"""A rollout stack in one process (no Ray): retriever server, engine, search client and episode runner.

Used by the ``rollout`` and ``eval`` commands, the benchmarks and the tests. The retriever is a real server: the
one at ``retriever.url`` when set, else a ``retriever serve`` child process on a free loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterable, Sequence

from actors.engine import Engine, create_engine
from actors.search_client import SearchClient
from async_agent_rl.config import Config
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode import EpisodeRunner
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.records import Trajectory
from async_agent_rl.rewards import exact_match, f1, scoring_text
from async_agent_rl.waits import all_within

# how long one wave of greedy episodes may take when the caller names no limit (a rollout actor's evaluation passes
# actors.rollout_worker.episodes_timeout_s of its config)
GREEDY_WAVE_S = 1800.0


@contextlib.contextmanager
def retriever_url(cfg: Config, log_file: str | Path | None = None):
    """Yield the URL of a Search-R1-compatible server: the configured one, or a child process we start (its log
    lines into ``log_file`` when given)."""
    if cfg.retriever.url:
        yield cfg.retriever.url
        return
    from retriever.server import spawn_server

    with spawn_server(cfg.data.corpus_file, cfg.retriever, log_file=log_file) as server:
        yield server.url


@dataclass
class Stack:
    cfg: Config
    engine: Engine
    runner: EpisodeRunner
    search: SearchClient
    url: str


@contextlib.asynccontextmanager
async def local_stack(cfg: Config, model_path: str | None = None, url: str | None = None) -> AsyncIterator[Stack]:
    from transformers import AutoTokenizer

    path = model_path or cfg.model.path
    with contextlib.ExitStack() as sync_stack:
        if url is None:
            url = sync_stack.enter_context(retriever_url(cfg))
        engine = await create_engine(cfg, path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            async with SearchClient(url, cfg.retriever.client, topk=cfg.retriever.topk) as search:
                runner = EpisodeRunner(engine, search, tokenizer, EpisodeSettings.from_config(cfg))
                yield Stack(cfg, engine, runner, search, url)
        finally:
            await engine.close()


async def run_greedy(runner: EpisodeRunner, examples: Sequence[QAExample], concurrency: int = 64,
                     wave_s: float = GREEDY_WAVE_S) -> list[Trajectory]:
    """One greedy episode per question (temperature 0), all concurrent up to ``concurrency``; within ``wave_s`` per
    wave of ``concurrency`` episodes (``WaitTimeout`` past it)."""
    greedy = dataclasses.replace(runner.s, temperature=0.0)
    r = EpisodeRunner(runner.engine, runner.search, runner.tokenizer, greedy)
    sem = asyncio.Semaphore(concurrency)

    async def one(ex: QAExample) -> Trajectory:
        async with sem:
            return await r.run(ex, group_id=f"eval-{ex.id}", trajectory_id=f"eval-{ex.id}")

    waves = max(1, -(-len(examples) // max(1, concurrency)))
    return await all_within([one(ex) for ex in examples], waves * wave_s, f"{len(examples)} greedy episodes")


def model_text(traj: Trajectory, tokenizer) -> str:
    """The response as the rewards read it (``rewards.scoring_text``): the model's turns, observations opaque."""
    return scoring_text((t.kind, tokenizer.decode(traj.response_ids[t.start : t.end], skip_special_tokens=True))
                        for t in traj.turns)


def score_episodes(trajs: Iterable[Trajectory], tokenizer, skipped_too_long: int = 0) -> dict:
    """Exact match, F1, searches per question, turns and finish reasons, overall and per data source; answers are
    read from the model's own turns only (``model_text``); ``all.skipped_too_long`` counts the questions not run
    because their prompt is over data.max_prompt_length, and ``all.correct`` lists the ids of the questions answered
    right (sorted), so two evaluations of the same questions can be compared question by question."""
    rows: dict[str, list[dict]] = {}
    correct: list[str] = []
    for t in trajs:
        text = model_text(t, tokenizer)
        em = exact_match(text, t.meta.gold_answers)
        if em == 1.0:
            correct.append(t.meta.question_id)
        row = {
            "em": em,
            "f1": f1(text, t.meta.gold_answers),
            "searches": t.meta.num_searches,
            "turns": t.meta.num_turns,
            "finish": t.meta.finish_reason,
        }
        rows.setdefault(t.meta.data_source, []).append(row)
        rows.setdefault("all", []).append(row)

    def summary(rs: list[dict]) -> dict:
        n = len(rs)
        finishes: dict[str, int] = {}
        for r in rs:
            finishes[r["finish"]] = finishes.get(r["finish"], 0) + 1
        return {
            "n": n,
            "exact_match": sum(r["em"] for r in rs) / n,
            "f1": sum(r["f1"] for r in rs) / n,
            "searches_per_question": sum(r["searches"] for r in rs) / n,
            "turns_per_question": sum(r["turns"] for r in rs) / n,
            "finish_reasons": finishes,
        }

    scores = {k: summary(v) for k, v in sorted(rows.items())}
    if "all" in scores:
        scores["all"]["skipped_too_long"] = skipped_too_long
        scores["all"]["correct"] = sorted(correct)
    return scores


def write_episodes(path: str | Path, trajs: Iterable[Trajectory], model_path: str) -> int:
    """JSON lines, one ``Trajectory.to_json()`` per line; ``meta.extra["model"]`` records the tokenizer folder."""
    n = 0
    with open(path, "w") as f:
        for t in trajs:
            t.meta.extra.setdefault("model", str(model_path))
            f.write(json.dumps(t.to_json()) + "\n")
            n += 1
    return n


def read_episodes(path: str | Path) -> list[Trajectory]:
    """The episodes of a ``write_episodes`` file; ``InputError`` naming the file and line of a bad one."""
    from async_agent_rl.errors import InputError

    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    out.append(Trajectory.from_json(json.loads(line)))
                except (ValueError, KeyError, TypeError) as e:
                    raise InputError(f"{path}:{lineno}: not an episode ({type(e).__name__}: {e})") from None
    return out
