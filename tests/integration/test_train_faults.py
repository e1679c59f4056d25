"""Fault tolerance of the whole system on Ray: a killed rollout actor (in the run that also checks evaluations
beside training), a crashed driver, a retriever outage.

Each test runs a short real training (real Ray, vLLM CPU engine, DeepSpeed learner, retrieval server)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from async_agent_rl.config import load_config
from driver.plots import read_jsonl
from tests.helpers import leaked_weight_dirs, shm_weight_dirs, world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

SMALL = [
    "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8",
    "rollout.group_size=4", "rollout.max_concurrent_episodes=16", "eval.num_questions=8",
    "eval.every_steps=0",  # no mid-run evaluation
    "monitoring.enabled=false", "sft.enabled=false",
    "buffer.group_filter=none",  # the random-init policy never scores: every group would be filtered
]  # fmt: skip


def small_config(tmp_path: Path, world_dir: Path, model_dir: Path, *extra: str):
    return load_config(REPO / "configs/quickstart.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, model_dir), *extra,
    ])  # fmt: skip


THAW_AFTER_STEP = 3


@pytest.mark.timeout(900)
def test_killed_rollout_actor_is_restarted_and_training_finishes_with_evaluations_beside(tmp_path, world_dir,
                                                                                          tiny_model_dir, capsys):
    """One training (eta 0, 9 steps) carries two properties, to keep CI's time: each is asserted on its own below.

    A rollout actor killed mid-run with episodes in flight: they are counted lost (their groups go short or are
    dropped) and the run finishes. At eta 0 this used to hang: short groups could never fill an exact batch and
    admission had no room left (tests/unit/test_staleness.py has the model of it). (The quickstart's eta with an
    actor killed is the fault-injection suite's first fault.)

    Evaluations beside training (``eval.beside``): the evaluator's process is frozen (SIGSTOP) as the
    evaluation of step 1 is handed to it and thawed after step 3: the learner goes on stepping meanwhile (the loop
    never waits for the evaluation), the evaluations due while it runs are skipped (one line, counted), and the
    step-1 evaluation is written once it is done, tagged with the step and the policy version it measured; the end
    evaluation runs on rollout actor 0 as without ``eval.beside``."""
    import ray

    from driver.train import Trainer

    cfg = small_config(tmp_path, world_dir, tiny_model_dir, "learner.total_steps=9", "buffer.max_staleness=0",
                       "eval.at_start=false", "eval.at_end=true", "eval.every_steps=1", "eval.beside=true")
    trainer = Trainer(cfg)
    killed = threading.Event()

    def killer():
        metrics = trainer.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not killed.is_set():
            steps = len(read_jsonl(metrics)) if metrics.is_file() else 0
            if steps >= 4 or (steps >= 2 and ray.get(trainer.buffer.stats.remote()).admission.running > 0):
                ray.kill(ray.get_actor("rollout-0"), no_restart=False)  # the process dies; Ray restarts it
                killed.set()
            time.sleep(0.2)

    frozen: dict = {}
    evaluate_beside, train_step = trainer.evaluations.evaluate_beside, trainer.train_step

    def freeze_then_evaluate(*args) -> None:
        if not frozen:  # the first evaluation beside training: its engine frozen before it gets the work
            frozen["pid"] = ray.get(trainer.evaluations.beside.evaluator.stats.remote(), timeout=60).pid
            os.kill(frozen["pid"], signal.SIGSTOP)
            frozen["step"] = trainer.step
        evaluate_beside(*args)

    def step_then_thaw(t0: float) -> None:
        train_step(t0)
        if frozen and trainer.step == THAW_AFTER_STEP:
            os.kill(frozen["pid"], signal.SIGCONT)

    trainer.evaluations.evaluate_beside, trainer.train_step = freeze_then_evaluate, step_then_thaw
    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        summary = trainer.run()
    finally:  # never leave a frozen process behind
        if frozen and _alive(frozen["pid"]):
            os.kill(frozen["pid"], signal.SIGCONT)
    t.join(5)
    rows = read_jsonl(trainer.run_dir / "metrics.jsonl")
    assert summary["steps"] == 9 and [r["step"] for r in rows] == list(range(1, 10))

    # the killed actor: restarted once, its lost episodes counted, and it produced later batches
    assert killed.is_set(), "the actor was never killed (training too short?)"
    assert summary["actor_restarts"] == {"actor0": 1}
    assert summary["lost_episodes"] == rows[-1]["lost_episodes"] >= 1
    assert rows[-1]["per_actor"]["actor0"]["finished"] > 0

    # evaluations beside training: the step-1 one done while the learner went on, with the step and version it
    # measured; those due while it ran skipped (steps 2 and 3 at least), those after it run
    assert frozen["step"] == 1
    evals = read_jsonl(trainer.run_dir / "eval.jsonl")
    beside = [e for e in evals if e.get("beside")]
    versions = {r["step"]: r["version"] for r in rows}
    first = beside[0]
    assert first["step"] == 1 and first["version"] == versions[1] and first["done_at_step"] >= THAW_AFTER_STEP, first
    assert first["all"]["n"] == 8 and first["seconds"] > 0
    assert summary["evals_skipped"] >= THAW_AFTER_STEP - 1, summary
    assert summary["evals_beside"] == len(beside) >= 2 and summary["evaluator_failed"] is None, summary
    assert [e["step"] for e in beside] == sorted(e["step"] for e in beside)
    assert all(e["version"] == versions[e["step"]] for e in beside), (beside, versions)
    assert evals[-1]["when"] == "end" and not evals[-1].get("beside") and evals[-1]["step"] == 9
    assert json.loads((trainer.run_dir / "summary.json").read_text())["evals_beside"] == len(beside)
    console = capsys.readouterr().out
    assert console.count("is skipped: the one of step 1 is still running") == 1, console  # once, however many
    assert "[eval step 1] held-out exact match" in console and "beside training: version" in console


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "driver.cli", "train", *args]


def test_resume_after_driver_crash_continues_from_checkpoint(tmp_path, world_dir, tiny_model_dir):
    """The driver is killed with SIGKILL after the step-2 checkpoint (the OOM killer, a lost machine session: no
    chance to shut down). Its reaper ends every process of the run (Ray's GCS, raylet, agents, workers, the
    retriever) and removes their /dev/shm files; before it, Ray's agents and joblib's semaphores were left for good.
    The newest checkpoint's policy is then damaged (truncated), so the resume says it skipped it and continues from
    step 1, redoing steps 2-4. (One run for both: each is a training start, a minute of CI.)"""
    import psutil

    cfg = small_config(tmp_path, world_dir, tiny_model_dir, "learner.total_steps=4", "learner.checkpoint_every=1")
    cfg_file = cfg.save(tmp_path / "cfg.yaml")
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(_train_cmd("--config", str(cfg_file)), cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    pids: set[int] = set()  # every process of the crashed run (the owners of its /dev/shm weight copies)
    shm_before = shm_weight_dirs()
    try:
        marker = run_dir / "checkpoints" / "step_000002" / "driver_state.json"
        deadline = time.monotonic() + 420
        while not marker.is_file():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within the deadline"
            pids |= _tree(proc.pid)
            time.sleep(0.5)
        procs = {p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "driver.reaper" not in " ".join(p.cmdline())}  # fmt: skip
        assert any("raylet" in p.name() for p in procs.values()), [p.name() for p in procs.values()]
        proc.send_signal(signal.SIGKILL)  # the driver alone: its reaper ends the rest
        proc.wait(10)

        def alive(p: psutil.Process) -> bool:
            try:
                return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False

        def files() -> list[Path]:
            return [f for pid in procs for f in Path("/dev/shm").glob(f"sem.loky-{pid}-*")] + \
                leaked_weight_dirs(shm_before, set(procs))

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (any(alive(p) for p in procs.values()) or files()):
            time.sleep(0.5)
        left = [f"{p.pid} {p.name()}" for p in procs.values() if alive(p)]
        left_files = files()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the reaper left (the assertions below name it)
        except ProcessLookupError:
            pass
        proc.wait(30)
    assert not left, f"left 20 s after the driver was killed: {left}"
    assert not left_files, f"/dev/shm files of the run left 20 s after the driver was killed: {left_files}"
    before = read_jsonl(run_dir / "metrics.jsonl")
    assert 2 <= len(before) < 4
    ckpts = run_dir / "checkpoints"
    assert [p.name for p in sorted(ckpts.iterdir()) if not p.name.startswith(".")][:2] == ["step_000001", "step_000002"]
    for later in sorted(ckpts.glob("step_00000[3-9]")):  # a step-3 checkpoint sealed before the kill
        shutil.rmtree(later)
    damaged = ckpts / "step_000002" / "policy" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # truncated

    r = subprocess.run(_train_cmd("--resume", str(run_dir)), cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=480)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"skipped a damaged checkpoint: {damaged}" in r.stdout, r.stdout[-3000:]
    assert "[resume]" in r.stdout and "step 1, version 1" in r.stdout, r.stdout[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3, 4]  # each step once: steps after the checkpoint were redone
    assert rows[2]["version"] == 3  # the resumed learner continued from the checkpoint's version
    from learner.checkpoint import verify_manifest

    verify_manifest(ckpts / "step_000002")  # redone and intact again
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and Path(summary["final_policy"], "config.json").is_file()
    # the crashed run's copies of the policy in /dev/shm are gone (removed after each reload, or swept since)
    left = leaked_weight_dirs(shm_before, pids)
    assert len(pids) > 5 and not left, left


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return set()


def test_retriever_outage_degrades_to_error_observations_and_training_recovers(
    tmp_path, world_dir, searching_model_dir
):
    """The retrieval server (our own process, passed as ``retriever.url``) is frozen with SIGSTOP for 8 s in the
    middle of a run, then resumed. Searches during the outage time out and become masked error observations that
    are trained on like any other (nothing is dropped, the actor never crashes); once the server answers again the
    batches have no search errors, and the run finishes every step."""
    from driver.train import Trainer
    from retriever.server import spawn_server

    probe = small_config(tmp_path, world_dir, searching_model_dir)
    with spawn_server(world_dir / "corpus.jsonl", probe.retriever) as server:
        cfg = small_config(
            tmp_path, world_dir, searching_model_dir, "learner.total_steps=12", f"retriever.url={server.url}",
            "retriever.client.timeout_s=1", "retriever.client.retries=1", "retriever.client.deadline_s=2",
            "buffer.max_staleness=1",
        )  # fmt: skip
        trainer = Trainer(cfg, quiet=True)
        outage: dict[str, float] = {}

        def freeze_then_thaw():
            metrics = trainer.run_dir / "metrics.jsonl"
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                if metrics.is_file() and len(read_jsonl(metrics)) >= 2:
                    os.kill(server.proc.pid, signal.SIGSTOP)
                    outage["at_step"] = len(read_jsonl(metrics))
                    time.sleep(8.0)
                    os.kill(server.proc.pid, signal.SIGCONT)
                    outage["resumed_at_step"] = len(read_jsonl(metrics))
                    return
                time.sleep(0.2)

        t = threading.Thread(target=freeze_then_thaw, daemon=True)
        t.start()
        try:
            summary = trainer.run()
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)  # never leave a stopped process behind
        t.join(10)

    assert "resumed_at_step" in outage, "the outage never happened (training too short?)"
    assert summary["steps"] == 12 and summary["episodes_failed"] == 0
    rows = read_jsonl(trainer.run_dir / "metrics.jsonl")
    errors = [r["batch"]["search_errors"] for r in rows]
    # the outage's failed searches reached the learner as (masked) error observations ...
    assert max(errors) > 0, errors
    # ... and the batches generated after the server came back search without errors: every batch from two steps
    # after the thaw on (eta = 1: an episode begun before the thaw is too stale by then), at least the last two.
    # They search between them; a single batch of 16 sampled episodes may not search at all (seen once: 0.0).
    after = rows[int(outage["resumed_at_step"]) + 2 :]
    assert len(after) >= 2 and errors[-2:] == [0.0, 0.0], (outage, errors)
    assert all(r["batch"]["search_errors"] == 0 for r in after), (outage, errors)
    assert sum(r["batch"]["searches"] for r in after) > 0, (outage, [r["batch"]["searches"] for r in rows])
