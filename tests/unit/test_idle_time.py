"""Where time idles. The time-weighted accounting (``stats.Occupancy``) on a fake clock; the engine
wrapper's idle time for scripted in-flight intervals; the episode loop's tool wait with a slow search stand-in; the
worker reporting them in ``RolloutStats``; the driver's per-step ``IdleStats`` and their metrics."""

from __future__ import annotations

import asyncio

import pytest

from actors.rollout_worker import MeteredEngine, RolloutWorker
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.episode import EpisodeRunner, EpisodeTimers, SearchError, TurnOutput, TurnRequest
from async_agent_rl.episode_settings import EpisodeSettings
from async_agent_rl.search import Hit
from async_agent_rl.stats import IdleStats, Occupancy, RolloutStats, idle_stats
from monitoring import metrics as M
from tests.helpers import Clock

pytestmark = pytest.mark.unit


class CharTokenizer:
    """One token per character: enough for the episode loop, no model files."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


SETTINGS = EpisodeSettings(max_turns=4, max_tokens_per_turn=64, max_response_length=2048, max_obs_length=512,
                           max_model_len=8192, prompt_template="minimal", apply_chat_template=False)
EXAMPLE = QAExample(id="q0", question="who?", gold_answers=["x"])


# ------------------------------------------------------------------------------------------------- occupancy
def test_occupancy_integrates_the_count_in_flight_and_the_time_with_none():
    clock = Clock(0.0)
    occ = Occupancy(clock)
    clock.now = 1.0
    occ.enter()
    clock.now = 2.0
    occ.enter()
    clock.now = 4.0
    occ.leave()
    assert occ.totals() == (1.0 + 2 * 2.0, 1.0)  # read mid-flight: the interval in progress counts
    clock.now = 5.0
    occ.leave()
    clock.now = 8.0
    assert occ.totals() == (6.0, 1.0 + 3.0)
    assert occ.in_flight == 0
    with pytest.raises(RuntimeError, match="without a matching enter"):
        occ.leave()
    with pytest.raises(ValueError):
        with occ.held():
            clock.now = 9.5
            raise ValueError("the block failed")
    assert occ.in_flight == 0 and occ.totals() == (7.5, 4.0)  # left however the block ended


# ------------------------------------------------------------------------------------------------ the engine
class GatedEngine:
    """Each request stays in flight until the test releases it."""

    version = 3

    def __init__(self):
        self.gates: dict[str, asyncio.Event] = {}

    async def generate(self, req: TurnRequest) -> TurnOutput:
        name = req.stop[0]
        self.gates[name] = asyncio.Event()
        await self.gates[name].wait()
        return TurnOutput([1], [-0.1], [self.version], name, "stop")

    async def update_weights(self, version, weights, mode="pause"):
        return ("updated", version)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_metered_engine_idles_exactly_while_no_request_is_in_flight():
    """Scripted requests: A in flight 2..5, B 3..6, C 10..12, read at 16: idle 2 + 4 + 4 = 10 of 16 s."""
    clock = Clock(0.0)
    inner = GatedEngine()
    engine = MeteredEngine(inner, Occupancy(clock))

    async def go() -> None:
        tasks = {}

        async def start(name: str, t: float) -> None:
            clock.now = t
            tasks[name] = asyncio.create_task(engine.generate(TurnRequest([1], 4, stop=(name,))))
            await _settle()

        async def finish(name: str, t: float) -> None:
            clock.now = t
            inner.gates[name].set()
            await tasks[name]

        await start("A", 2.0)
        await start("B", 3.0)
        assert engine.requests.in_flight == 2
        await finish("A", 5.0)
        await finish("B", 6.0)
        await start("C", 10.0)
        await finish("C", 12.0)
        assert await engine.update_weights(4, {}) == ("updated", 4)  # the engine's own methods pass through

    asyncio.run(go())
    clock.now = 16.0
    busy, idle = engine.requests.totals()
    assert idle == 10.0 and idle / clock.now == 0.625
    assert busy == 3.0 + 3.0 + 2.0  # request-seconds
    assert engine.version == 3


# ----------------------------------------------------------------------------------------- the episode loop
class TurnEngine:
    """Searches ``searches`` times, then answers; every turn takes ``turn_s`` on the clock."""

    version = 0
    SEARCH = "<search> zq </search>"

    def __init__(self, clock: Clock, searches: int = 2, turn_s: float = 1.0):
        self.clock, self.searches, self.turn_s = clock, searches, turn_s

    async def generate(self, req: TurnRequest) -> TurnOutput:
        self.clock.now += self.turn_s
        done = "".join(map(chr, req.prompt_ids)).count(self.SEARCH)  # searches this episode made so far
        text = "<answer> x </answer>" if done >= self.searches else self.SEARCH
        ids = [ord(c) for c in text]
        return TurnOutput(ids, [-0.1] * len(ids), [0] * len(ids), text, "stop")


class SlowSearch:
    """A search stand-in that takes ``seconds[i]`` of the clock for its i-th call; a negative one fails."""

    def __init__(self, clock: Clock, seconds: list[float]):
        self.clock, self.seconds, self.calls = clock, list(seconds), 0

    async def search(self, query: str):
        s = self.seconds[self.calls]
        self.calls += 1
        self.clock.now += abs(s)
        if s < 0:
            raise SearchError("timeout", "too slow")
        return [Hit(id="d0", contents="\"x\"\nx is the answer", score=1.0)]


def test_an_episode_counts_its_time_awaiting_the_search_tool():
    """Two searches of 2.5 s and (failing) 1.5 s between three 1 s turns: 4 s of tool wait in a 7 s episode."""
    clock = Clock(0.0)
    timers = EpisodeTimers(clock)
    search = SlowSearch(clock, [2.5, -1.5])
    runner = EpisodeRunner(TurnEngine(clock), search, CharTokenizer(), SETTINGS, timers)
    traj = asyncio.run(runner.run(EXAMPLE))
    assert traj.meta.num_searches == 2 and traj.meta.num_search_errors == 1 and traj.meta.finish_reason == "answer"
    assert clock.now == 7.0
    assert timers.totals() == (7.0, 4.0)  # (episode-seconds, tool-wait seconds)
    # a runner made from it (the lockstep baseline's) shares its timers
    again = EpisodeRunner(TurnEngine(clock, searches=1), SlowSearch(clock, [3.0]), CharTokenizer(), SETTINGS,
                          runner.timers)
    asyncio.run(again.run(EXAMPLE))
    assert timers.totals() == (7.0 + 5.0, 4.0 + 3.0)


def test_the_worker_reports_engine_idle_episode_and_tool_wait_seconds():
    """A real worker, one episode at a time (2 turns of 1 s around a 2 s search each): its RolloutStats carry the
    engine's idle seconds (the searches and the time after), the episode-seconds and the tool wait."""
    clock = Clock(0.0)
    runner = EpisodeRunner(TurnEngine(clock, searches=1), SlowSearch(clock, [2.0] * 3), CharTokenizer(), SETTINGS,
                           EpisodeTimers(clock))
    runner.engine = MeteredEngine(runner.engine, Occupancy(clock))  # the worker keeps an engine metered already

    async def sink(batch):
        return None

    worker = RolloutWorker(runner, iter([EXAMPLE] * 3), sink, group_size=1, max_concurrent=1, flush_after_s=0.01)
    asyncio.run(worker.run(num_groups=3))
    clock.now += 5.0  # idle after the last episode
    stats = worker.stats.message(index=0)
    assert stats.finished == 3
    assert stats.episode_s == 3 * 4.0
    assert stats.tool_wait_s == 3 * 2.0
    assert stats.engine_idle_s == 3 * 2.0 + 5.0


def test_a_worker_meters_a_plain_engine_itself():
    clock = Clock(0.0)
    runner = EpisodeRunner(TurnEngine(clock, searches=0), SlowSearch(clock, []), CharTokenizer(), SETTINGS)

    async def sink(batch):
        return None

    worker = RolloutWorker(runner, iter([EXAMPLE]), sink, group_size=1, max_concurrent=1)
    assert isinstance(runner.engine, MeteredEngine) and worker.runner.engine.version == 0
    asyncio.run(worker.run(num_groups=1))
    stats = worker.stats.message(index=0)
    assert 0.0 < stats.engine_idle_s <= stats.elapsed_s  # real clock: idle but for the one fake-clock turn
    assert stats.episode_s > 0 and stats.tool_wait_s == 0.0


# ----------------------------------------------------------------------------------------- the driver's step
def _actor(index: int, incarnation: str, elapsed: float, idle: float, episodes: float, tool: float) -> RolloutStats:
    return RolloutStats(index=index, incarnation=incarnation, elapsed_s=elapsed, engine_idle_s=idle,
                        episode_s=episodes, tool_wait_s=tool)


def test_idle_stats_cover_the_time_since_the_previous_record_over_every_actor():
    first = [_actor(0, "a", 10.0, 4.0, 30.0, 6.0), _actor(1, "b", 10.0, 1.0, 35.0, 5.0)]
    idle = idle_stats(3.0, 12.0, first, {})  # the first record: since each actor's start
    assert idle == IdleStats(sample_wait_s=3.0, learner_batch_wait_share=0.25, rollout_engine_idle_share=5.0 / 20.0,
                             rollout_tool_wait_s=11.0, rollout_tool_wait_share=11.0 / 65.0)
    # actor 0 goes on; actor 1 was restarted (a new incarnation: counted from its new start)
    now = [_actor(0, "a", 16.0, 7.0, 42.0, 12.0), _actor(1, "c", 2.0, 2.0, 0.0, 0.0)]
    idle = idle_stats(1.0, 8.0, now, {r.index: r for r in first})
    assert idle.learner_batch_wait_share == 1.0 / 8.0
    assert idle.rollout_engine_idle_share == pytest.approx((3.0 + 2.0) / (6.0 + 2.0))
    assert idle.rollout_tool_wait_s == 6.0 and idle.rollout_tool_wait_share == 6.0 / 12.0
    # nothing passed: no share rather than a made-up one
    none = idle_stats(0.0, 0.0, now, {r.index: r for r in now})
    assert (none.learner_batch_wait_share, none.rollout_engine_idle_share, none.rollout_tool_wait_share) == \
        (None, None, None)
    assert none.rollout_tool_wait_s == 0.0


def test_idle_metrics_and_the_rollout_time_counters():
    reg = M.new_registry()
    u = M.register_all(reg)
    u["idle"].update(IdleStats(sample_wait_s=2.0, learner_batch_wait_share=0.4, rollout_engine_idle_share=0.1,
                               rollout_tool_wait_s=3.0, rollout_tool_wait_share=None))
    assert reg.get_sample_value(M.IDLE_LEARNER_BATCH_WAIT_SECONDS) == 2.0
    assert reg.get_sample_value(M.IDLE_LEARNER_BATCH_WAIT_SHARE) == 0.4
    assert reg.get_sample_value(M.IDLE_ROLLOUT_ENGINE_IDLE_SHARE) == 0.1
    assert reg.get_sample_value(M.IDLE_ROLLOUT_TOOL_WAIT_SHARE) is None  # not computed: absent, not 0

    u["rollout"].update(_actor(0, "a", 10.0, 4.0, 30.0, 6.0))
    u["rollout"].update(_actor(0, "a", 20.0, 5.5, 50.0, 9.0))
    u["rollout"].update(_actor(0, "b", 1.0, 1.0, 0.0, 0.0))  # restarted: its new totals add on
    assert reg.get_sample_value(M.ROLLOUT_ENGINE_IDLE_SECONDS, {"actor": "0"}) == 6.5
    assert reg.get_sample_value(M.ROLLOUT_EPISODE_SECONDS, {"actor": "0"}) == 50.0
    assert reg.get_sample_value(M.ROLLOUT_TOOL_WAIT_SECONDS, {"actor": "0"}) == 9.0
