"""The engine health probe: a rollout actor whose engine stopped answering without failing episodes (a hung
engine core: ``generate`` requests in flight, none ever finishing, while the actor still answers ``stats()``) was
never noticed; its episodes waited for ever and the run ended through the progress watchdog as a stall. Now the
worker's probe (``RolloutWorker._probe_engine``, reading ``MeteredEngine.silence()``) stops the worker with the cause
once requests have been in flight with none finishing for ``rollout.engine_silence_s``, so ``stats.done`` is set and
supervision restarts the actor. A weight update's pause, an idle worker and a slow engine that keeps finishing are
no silence. The derived limit (``engine_silence_s``) stays well below the watchdog's."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

import actors.rollout_actor as rollout_actor
from actors.rollout_actor import RolloutActor
from actors.rollout_worker import (ENGINE_SILENCE_FLOOR_S, EngineSilent, MeteredEngine, RolloutFailure, RolloutWorker,
                                   engine_silence_s)
from async_agent_rl.config import ConfigError, load_config
from async_agent_rl.data.search_r1 import QAExample
from async_agent_rl.records import Trajectory
from driver.limits import SLOWEST_EPISODE_TOKENS_PER_S, ProgressWatchdog, first_step_s
from tests.helpers import Clock, run_actor_shell_until_done, traj

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = [QAExample(id=f"q{i}", question="q", gold_answers=["x"]) for i in range(4)]
LIMIT = 0.5  # the probe's limit in these tests, seconds


def forever():
    while True:
        yield from EXAMPLES


class OneTurnRunner:
    """Each episode is one ``generate`` call on its engine (the worker's ``MeteredEngine`` around the stand-in)."""

    def __init__(self, engine):
        self.engine = engine
        self.episodes = 0

    async def run(self, ex, group_id="", trajectory_id="", seed=None):
        self.episodes += 1
        n = self.episodes
        await self.engine.generate(SimpleNamespace(prompt_ids=[1, 2]))
        return Trajectory.decode(traj(group_id, n))


class HungEngine:
    """A hung engine core: every request stays in flight for ever. ``abort_hangs``: a cancelled request does not
    end either, the first time (vLLM's abort of a request talks to the hung core)."""

    def __init__(self, abort_hangs: bool = False):
        self.version = 0
        self.abort_hangs = abort_hangs

    async def generate(self, req):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if self.abort_hangs:
                await asyncio.sleep(3600)
            raise


class SlowEngine:
    """Every request takes ``seconds``; a weight update pauses generation for ``update_s`` (requests in flight
    wait for it, as vLLM's ``pause_generation`` makes them)."""

    def __init__(self, seconds: float, update_s: float = 0.0, spread: bool = False):
        self.version = 0
        self.seconds = seconds
        self.spread = spread  # requests take 1/2, 2/3, 5/6, 1 x seconds in turn: they overlap, never all end at once
        self.update_s = update_s
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.started = self.finished = 0

    async def generate(self, req):
        self.started += 1
        await asyncio.sleep(self.seconds * ((3 + self.started % 4) / 6 if self.spread else 1))
        await self.resumed.wait()  # a paused engine finishes nothing
        self.finished += 1
        return req

    async def update_weights(self, version, weights, mode="pause"):
        self.resumed.clear()
        try:
            await asyncio.sleep(self.update_s)
            self.version = version
        finally:
            self.resumed.set()
        return SimpleNamespace(version=version, mode=mode, pause_seconds=self.update_s, bytes=0)


async def keep(batch):
    return None


def worker(engine, limit: float = LIMIT, **kw) -> RolloutWorker:
    return RolloutWorker(OneTurnRunner(engine), forever(), keep, group_size=2, max_concurrent=4, push_batch_size=2,
                         actor_id="actor3", engine_silence_s=limit, **kw)


async def run_for(w: RolloutWorker, seconds: float):
    """Run ``w`` for ``seconds`` (it must not stop by itself meanwhile), then stop it; its stats."""
    task = asyncio.create_task(w.run())
    await asyncio.sleep(seconds)
    assert not task.done(), task.exception() if task.done() and not task.cancelled() else "cancelled"
    w.stop()
    return await asyncio.wait_for(task, timeout=10)


# ------------------------------------------------------------------------------------------------ the worker
def test_a_hung_engine_stops_the_worker_with_the_cause_within_the_limit():
    w = worker(HungEngine())

    async def go():
        t0 = time.monotonic()
        with pytest.raises(RolloutFailure) as info:
            await asyncio.wait_for(w.run(), timeout=10)  # before: waits for ever (a TimeoutError here)
        return info.value, time.monotonic() - t0

    error, took = asyncio.run(go())
    msg = str(error)
    assert "rollout worker actor3: the engine failed: EngineSilent: engine stopped answering: 4 request(s) in " \
           "flight, none finished for " in msg and f"(limit {LIMIT:g} s, rollout.engine_silence_s)" in msg, msg
    assert isinstance(error.__cause__, EngineSilent)
    assert LIMIT < took < LIMIT + 2.0, took
    assert w.stats.finished == 0 and w.stats.failed == 0, "no episode failed: the failures-in-a-row rule saw nothing"


def test_a_hung_engine_that_does_not_let_its_requests_be_aborted_still_stops_the_worker():
    w = worker(HungEngine(abort_hangs=True), cancel_grace_s=0.3)

    async def go():
        t0 = time.monotonic()
        with pytest.raises(RolloutFailure, match="EngineSilent: engine stopped answering"):
            await asyncio.wait_for(w.run(), timeout=10)
        return time.monotonic() - t0

    assert asyncio.run(go()) < LIMIT + 0.3 + 2.0


def test_the_actor_reports_done_and_the_engines_silence_for_supervision():
    """What ``Fleet.supervise`` reads: ``stats().done`` and ``error()`` (it then kills and restarts the actor)."""

    stats, error = asyncio.run(run_actor_shell_until_done(worker(HungEngine()), index=3))
    assert stats.done and stats.ready and stats.running == 4
    assert error.startswith("RolloutFailure: rollout worker actor3: the engine failed: EngineSilent: engine stopped "
                            "answering: 4 request(s) in flight"), error


def test_a_weight_update_that_pauses_generation_almost_the_limit_is_no_silence():
    engine = SlowEngine(seconds=0.05, update_s=0.8 * LIMIT)
    w = worker(engine)

    async def go():
        task = asyncio.create_task(w.run())
        await asyncio.sleep(0.3)
        before = engine.finished
        await w.engine.update_weights(1, {})  # as the actor does it: through the worker's metered engine
        assert engine.version == 1 and w.engine.silence()[0] > 0, "requests were in flight during the pause"
        await asyncio.sleep(0.3)
        assert not task.done(), task.exception()
        assert engine.finished > before
        w.stop()
        return await asyncio.wait_for(task, timeout=10)

    stats = asyncio.run(go())
    assert w.failure is None and stats.finished > 0


def test_an_idle_worker_is_no_silence():
    """No request in flight for many limits: admission grants nothing (a full staleness window)."""

    async def nothing(n, version, group_id, prompt=None):
        return 0

    w = worker(HungEngine(), admit=nothing)
    stats = asyncio.run(run_for(w, 4 * LIMIT))
    assert w.failure is None and stats.started == 0


def test_a_slow_engine_that_finishes_requests_just_under_the_limit_is_no_silence():
    """Requests of up to 0.7 x the limit, overlapping: some are always in flight, one finishes at least every 0.7 x
    the limit."""
    engine = SlowEngine(seconds=0.7 * LIMIT, spread=True)
    w = worker(engine, limit=LIMIT)
    stats = asyncio.run(run_for(w, 6 * LIMIT))
    assert w.failure is None and stats.finished >= 12


def test_no_limit_no_probe():
    w = worker(HungEngine(), limit=0)

    async def go():
        task = asyncio.create_task(w.run())
        await asyncio.sleep(4 * LIMIT)
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ the reading
def test_silence_counts_from_the_last_answer_while_requests_are_in_flight():
    clock = Clock(100.0)
    gates: list[asyncio.Future] = []

    class Gated:
        version = 0

        async def generate(self, req):
            fut = asyncio.get_running_loop().create_future()
            gates.append(fut)
            return await fut

        async def update_weights(self, version, weights, mode="pause"):
            clock.now += 1000  # a long pause
            return version

    async def go():
        m = MeteredEngine(Gated(), clock=clock)
        assert m.silence() == (0, 0.0)
        clock.now = 200.0  # idle for 100 s: no silence
        assert m.silence() == (0, 0.0)
        a = asyncio.create_task(m.generate(1))
        await asyncio.sleep(0)
        clock.now = 210.0
        assert m.silence() == (1, 10.0)  # from the start of the oldest request in flight
        b = asyncio.create_task(m.generate(2))
        await asyncio.sleep(0)
        clock.now = 215.0
        assert m.silence() == (2, 15.0)
        gates[0].set_result("a")
        assert await a == "a"
        clock.now = 217.0
        assert m.silence() == (1, 2.0)  # from the last request that finished
        await m.update_weights(1, {})
        assert m.silence() == (1, 0.0)  # the update's pause is no silence, counted from the resume
        clock.now += 3
        assert m.silence() == (1, 3.0)
        gates[1].set_exception(RuntimeError("bad request"))
        with pytest.raises(RuntimeError):
            await b  # an error is an answer
        assert m.silence() == (0, 0.0)
        c = asyncio.create_task(m.generate(3))
        await asyncio.sleep(0)
        clock.now += 50
        d = asyncio.create_task(m.generate(4))
        await asyncio.sleep(0)
        d.cancel()  # a request its caller gave up on is no answer
        await asyncio.gather(d, return_exceptions=True)
        assert m.silence() == (1, 50.0)
        gates[2].set_result("c")
        await c

    asyncio.run(go())


def test_a_pause_counts_from_its_own_start_and_an_endless_one_is_silence():
    """A weight update's pause is not added to the requests' silence before it (it counts from the update's start),
    but an update that never ends is: a hung engine core holds the update as well as the requests."""
    clock = Clock(0.0)
    m = MeteredEngine(SimpleNamespace(version=0), clock=clock)
    m.requests.enter()
    clock.now = 5.0
    assert m.silence() == (1, 5.0)
    with m.paused():
        clock.now = 6.0
        assert m.silence() == (1, 1.0)  # not 6: the pause started at 5
        with m.paused():  # a second update inside the first: still counted from the first's start
            clock.now = 500.0
            assert m.silence() == (1, 495.0)
    clock.now = 501.0
    assert m.silence() == (1, 1.0)  # the update ended at 500: an answer


def test_a_weight_update_that_never_ends_stops_the_worker_within_the_limit():
    """The engine core hung during a weight update (SIGSTOP of a real one, tests/integration/test_fault_injection.py):
    the update call never returns, requests wait behind it; before, the probe ignored the whole pause and the run
    ended by the watchdog blaming the rollout actors instead of the actor being restarted."""
    engine = SlowEngine(seconds=0.05, update_s=3600)
    w = worker(engine)

    async def go():
        task = asyncio.create_task(w.run())
        await asyncio.sleep(0.3)
        update = asyncio.create_task(w.engine.update_weights(1, {}))
        t0 = time.monotonic()
        with pytest.raises(RolloutFailure, match="engine stopped answering"):
            await asyncio.wait_for(task, timeout=10)
        update.cancel()
        return time.monotonic() - t0

    assert asyncio.run(go()) < LIMIT + 2.0


# ------------------------------------------------------------------------------------------------ the actor
def test_the_actor_gives_its_worker_the_limit_and_updates_weights_through_the_probes_pause(monkeypatch, tmp_path):
    """``setup`` with stand-ins for the engine, the data and the tokenizer: the worker gets ``engine_silence_s`` of
    the config, and a weight update (the driver's publish) goes through the metered engine, pausing the probe."""
    class CharTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 200 for c in text]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    engine = SlowEngine(seconds=0.01)

    async def create_engine(cfg, model_path, version):
        return engine

    monkeypatch.setattr(rollout_actor, "create_engine", create_engine)
    monkeypatch.setattr(rollout_actor, "read_qa_files", lambda files, on_bad_row: (EXAMPLES, SimpleNamespace(skipped=0)))
    tokenizers = SimpleNamespace(from_pretrained=lambda path, **kw: CharTokenizer())
    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(AutoTokenizer=tokenizers))  # no model files
    cfg = load_config(None, ["rollout.engine_silence_s=42", "data.max_prompt_length=1000",
                                "data.apply_chat_template=false"])

    async def go():
        actor = RolloutActor(cfg.to_dict(), 0, "http://127.0.0.1:9", "model-dir")
        started = await actor.setup(buffer=None)
        # outside Ray the actor names no node, and starts no Ray cluster to ask (a unit test once did, unasked,
        # and every later test in the process found Ray already running)
        assert started["node"] is None and not ray.is_initialized()
        assert actor.worker.engine_silence_s == 42
        assert isinstance(actor.engine, MeteredEngine) and actor.engine is actor.worker.runner.engine
        seen = []
        real = engine.update_weights

        async def update_weights(*args, **kw):
            seen.append(actor.engine._updating)
            return await real(*args, **kw)

        engine.update_weights = update_weights
        await actor.update_weights(5, {})
        assert seen == [1] and engine.version == 5 and actor.stats().version == 5

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ the limit
@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_the_derived_limit_is_generous_and_below_the_watchdogs_for_the_shipped_configs(path):
    cfg = load_config(path)
    assert cfg.rollout.engine_silence_s == 0, "the shipped configs derive it"
    limit = engine_silence_s(cfg)
    one_turn_s = cfg.rollout.max_tokens_per_turn / SLOWEST_EPISODE_TOKENS_PER_S
    assert limit >= max(ENGINE_SILENCE_FLOOR_S, 10 * one_turn_s), "many turns at the slowest pace assumed"
    watchdog = ProgressWatchdog(cfg.cluster.progress_timeout_s, floor=first_step_s(cfg)).limit()
    assert watchdog is not None and limit <= watchdog / 2, (limit, watchdog)


def test_the_derived_limit_for_the_quickstart_and_the_gpu_config():
    assert engine_silence_s(load_config(REPO / "configs/quickstart.yaml")) == 180.0  # 48 tokens a turn
    assert engine_silence_s(load_config(REPO / "configs/search_r1_nq_gpu.yaml")) == 500.0  # 500 tokens a turn


def test_the_limit_follows_the_watchdogs_setting_and_an_explicit_value():
    assert engine_silence_s(load_config(None, ["cluster.progress_timeout_s=60"])) == 30.0
    assert engine_silence_s(load_config(None, ["cluster.progress_timeout_s=0"])) == ENGINE_SILENCE_FLOOR_S
    assert engine_silence_s(load_config(None, ["rollout.engine_silence_s=7.5"])) == 7.5
    # an explicit limit the unset watchdog would not wait for raises the watchdog's floor instead
    big = load_config(None, ["rollout.engine_silence_s=5000"])
    assert first_step_s(big) >= 10_000
    for cfg in (load_config(None, ["rollout.max_tokens_per_turn=2000"]),
                load_config(None, ["rollout.max_tokens_per_turn=2000", "cluster.progress_timeout_s=300"])):
        watchdog = ProgressWatchdog(cfg.cluster.progress_timeout_s, floor=first_step_s(cfg)).limit()
        assert engine_silence_s(cfg) <= watchdog / 2


def test_the_key_is_validated():
    with pytest.raises(ConfigError, match="engine_silence_s"):
        load_config(None, ["rollout.engine_silence_s=-1"])
    with pytest.raises(ConfigError, match=r"rollout.engine_silence_s \(90\) must be below cluster.progress_timeout_s"):
        load_config(None, ["rollout.engine_silence_s=90", "cluster.progress_timeout_s=90"])
    assert load_config(None, ["rollout.engine_silence_s=90", "cluster.progress_timeout_s=0"]).rollout.engine_silence_s == 90
