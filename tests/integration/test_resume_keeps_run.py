"""A resume that loses nothing it promised, on a real short training (real Ray, vLLM CPU engine, DeepSpeed
learner, retrieval server).

A run is stopped right after its checkpoint of step 2 (the actors still generating: episodes in flight), then
resumed to step 4. The counts the checkpoint's buffer snapshot holds (admission, buffer counters, the staleness
histogram) are those of the resumed buffer before anything moves; the groups in flight at the checkpoint are taken up
by the rollout actor with the same prompts and trained on whole; the groups ready at the checkpoint are trained on;
the actor's prompt stream continues from the position of the last group it had admitted, not from its beginning.
Before, the episodes in flight counted as rejected at the restore (their groups released short or dropped, their
prompts never generated again) and the stream started over."""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from async_agent_rl.config import load_config
from buffer.actor import BufferActor
from buffer.replay_buffer import peek_group_id
from tests.helpers import world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


class RecordingBuffer(BufferActor):
    """The buffer actor, recording its stats right after a restore, the members of each group a batch takes and
    each prompt admitted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.consumed: Counter = Counter()
        self.admitted: list[tuple[str, str, str]] = []  # (actor, group id, prompt id)
        self.restored = None  # the stats right after a restore, before anything moves

    def restore(self, *args, **kwargs):
        self.restored = super().restore(*args, **kwargs)
        return self.restored

    def try_start(self, n, version, group_id, actor_id="", prompt=None):
        granted = super().try_start(n, version, group_id, actor_id, *([prompt] if prompt is not None else []))
        if granted and prompt:
            self.admitted.append((actor_id, group_id, prompt["id"]))
        return granted

    def sample(self, batch_size, learner_version):
        blobs = super().sample(batch_size, learner_version)
        for b in blobs or []:
            self.consumed[peek_group_id(b)] += 1
        return blobs

    def record(self) -> dict:
        return {"consumed": dict(self.consumed), "admitted": list(self.admitted), "restored": self.restored}


@pytest.mark.timeout(1200)
def test_a_resume_trains_what_was_ready_regenerates_what_was_in_flight_and_keeps_the_counts(
        tmp_path, world_dir, tiny_model_dir, monkeypatch):
    import ray

    import buffer.actor
    from actors.rollout_worker import PromptSource
    from async_agent_rl.data.search_r1 import read_qa_files
    from buffer.replay_buffer import _read_snapshot
    from driver.train import Trainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # RecordingBuffer goes to the actor by value
    monkeypatch.setattr(buffer.actor, "BufferActor", RecordingBuffer)
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8",
        "rollout.group_size=4", "rollout.max_concurrent_episodes=4", "eval.at_start=false", "eval.at_end=false",
        "eval.every_steps=0", "monitoring.enabled=false", "sft.enabled=false", "buffer.group_filter=none",
        "buffer.max_staleness=1", "learner.total_steps=4", "learner.checkpoint_every=2",
        f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir),
    ])  # fmt: skip

    # ---- the first run: stopped right after the checkpoint of step 2, episodes in flight
    first = Trainer(cfg, quiet=True)
    checkpoint = first.checkpoint

    def checkpoint_then_stop() -> str:
        # one group at a time (max_concurrent_episodes = group size): the actor is generating nearly always; the
        # checkpoint waits for a moment with a group ready and one in flight
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            b = ray.get(first.buffer.stats.remote(), timeout=60)
            if b.ready_groups and b.admission.running:
                break
            time.sleep(0.05)
        path = checkpoint()
        first.stops.signal = signal.SIGTERM  # as a SIGTERM would: the run stops at the next safe point, now
        return path

    first.checkpoint = checkpoint_then_stop
    assert first.run()["stopped_by"] == signal.SIGTERM
    ckpt = first.run_dir / "checkpoints" / "step_000002"
    snap = _read_snapshot(ckpt / "replay_buffer.snapshot")
    extra, admission = snap["extra"], snap["extra"]["admission"]
    running = {gid: g for gid, g in admission["open"].items() if g[1] > 0}  # [version, running, kept]
    assert running and admission["running"] > 0, "nothing was in flight at the checkpoint"
    assert snap["ready"], "nothing was ready at the checkpoint"
    ready = {g["gid"]: len(g["items"]) for g in snap["ready"]}

    # ---- the resumed run, to step 4
    second = Trainer.resume(first.run_dir, quiet=True)
    box: dict = {}
    stop_rollouts = second.stop_rollouts

    def record_then_stop():
        box["record"] = ray.get(second.buffer.record.remote(), timeout=60)
        return stop_rollouts()

    second.stop_rollouts = record_then_stop
    assert second.run()["steps"] == 4
    record = box["record"]

    # the counts after the restore are the checkpoint's
    after = record["restored"]
    keys = ("started", "accepted", "rejected", "evicted", "running", "groups_started", "groups_dropped",
            "groups_consumed", "groups_open", "oldest_open_version")
    assert {k: getattr(after.admission, k) for k in keys} == {k: admission[k] for k in keys}
    assert after.staleness_histogram == {int(k): v for k, v in snap["staleness_histogram"]}
    for name, value in snap["counters"].items():
        if hasattr(after, name):
            assert getattr(after, name) == value, name
    assert after.ready_groups == len(ready)

    # the groups in flight were taken up with their prompts, and trained on whole
    in_flight = {gid: g["prompt"] for gid, g in extra["in_flight"].items()}
    assert set(in_flight) == set(running) and None not in in_flight.values()
    taken = {gid: pid for t in second.taken_up for gid, pid, _ in t["groups"]}
    assert taken == in_flight
    for gid, (version, members, kept) in running.items():
        assert record["consumed"].get(gid) == members + kept, gid
    # the groups ready at the checkpoint were trained on
    assert all(record["consumed"].get(gid) == n for gid, n in ready.items()), (ready, record["consumed"])

    # the prompt stream continued where the checkpoint had it (before: from its first prompt)
    examples, _ = read_qa_files(cfg.data.train_files, cfg.data.on_bad_row)
    source = PromptSource(examples, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    cursor = extra["cursors"]["actor0"]
    source.restore(cursor)
    new = [pid for actor, gid, pid in record["admitted"] if actor == "actor0"]
    assert len(new) >= 3 and new[:3] == [next(source).id for _ in range(3)]
    assert second.taken_up[0]["cursor"] == cursor


@pytest.mark.timeout(1500)
def test_crash_fresh_fresh_keeps_every_earlier_checkpoint(tmp_path, world_dir, tiny_model_dir):
    """Until 60e3570 (2026-12-07) a fresh start moved the run before it to ``<run>.previous`` "(replacing what was
    there)": a run killed after its checkpoint of step 2, then two fresh starts of the same command, and the killed
    run's checkpoints were gone. Each earlier run now goes to a numbered folder of its own, said in one line."""
    import os

    from learner.checkpoint import verify_manifest
    from tests.helpers import Run

    def train(*extra: str) -> Run:
        return Run([sys.executable, "-m", "driver.cli", "train", "--config", str(REPO / "configs/quickstart.yaml"),
                    "learner.batch_size=8", "learner.mini_batch_size=8", "learner.micro_batch_size=8",
                    "rollout.group_size=4", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
                    "monitoring.enabled=false", "sft.enabled=false", "buffer.group_filter=none",
                    "learner.checkpoint_every=2", f"run.output_dir={tmp_path}", "run.name=run",
                    *world_overrides(world_dir, tiny_model_dir), *extra])  # fmt: skip

    run_dir = tmp_path / "run"
    crashed = train("learner.total_steps=6")
    try:
        deadline = time.monotonic() + 900
        while not (run_dir / "checkpoints" / "step_000002").is_dir():
            assert crashed.proc.poll() is None and time.monotonic() < deadline, crashed.text()
            time.sleep(0.5)
        os.kill(crashed.proc.pid, signal.SIGKILL)  # the driver, as the issue did; its reaper ends the rest
        crashed.proc.wait(60)
    finally:
        crashed.kill()
    for n in (1, 2):
        fresh = train("learner.total_steps=2")
        try:
            assert fresh.finish(900) == 0, fresh.text()
        finally:
            fresh.kill()
        said = [x for x in fresh.out if x.startswith(f"[run] {run_dir} held ")]
        assert len(said) == 1 and f"its results moved to {tmp_path / f'run.{n}'} (kept;" in said[0], fresh.text()
    for folder in (tmp_path / "run.1", tmp_path / "run.2", run_dir):
        verify_manifest(folder / "checkpoints" / "step_000002")  # every run's checkpoint, whole
    assert not (tmp_path / "run.1" / "summary.json").exists(), "run.1 is the killed run"
    assert (tmp_path / "run.2" / "summary.json").is_file() and (run_dir / "summary.json").is_file()
