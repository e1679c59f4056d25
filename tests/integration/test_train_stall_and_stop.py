"""Nothing stalls in silence, on a real short training (real Ray, vLLM CPU engine, buffer actor,
DeepSpeed learner) run the way a user does, through the command line in a subprocess of its own:

- a run whose learner never gets another batch after step 1 (the driver's sampler, patched in the driver process to
  answer "no batch" as a buffer that never fills one does) ends within the watchdog's limit
  (``cluster.progress_timeout_s``) with one ``error:`` line naming the blocked component and every component's
  state, a checkpoint of step 1, and exit status 2; before, it waited for ever with a ``[wait]`` line a minute;
- SIGTERM in the middle of a run stops it with a checkpoint and one closing ``[stopped]`` line, exit status 143,
  no traceback; before, Ray's handler ended it in SIGABRT with a C++ stack dump. Before the signal, every listening
  socket of the run's processes (Ray, engines, learner, retriever) is on loopback, the learner's process-group store
  included;
- SIGTERM during the SFT warm start stops it at its next step, unsaved (before: it went on to the end).

SIGKILL of the driver (its reaper leaves no process of the run and no /dev/shm file behind) is checked in the run
that then resumes from it (tests/integration/test_train_faults.py). About 5 minutes on 2 cores."""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from async_agent_rl.config import load_config
from driver.fleet import BUFFER
from tests.helpers import Run, listening_sockets, world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Ray's line for a restartable actor created with an argument it keeps by reference (the buffer's handle once)
RAY_ARGUMENT_LINE = "has constructor arguments in the object store and max_restarts > 0"
SMALL = [
    "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8",
    "rollout.group_size=4", "rollout.max_concurrent_episodes=16", "eval.num_questions=8", "eval.at_start=false",
    "eval.at_end=false", "monitoring.enabled=false", "sft.enabled=false", "buffer.group_filter=none",
    "learner.checkpoint_every=0",
]  # fmt: skip

# the command line, with the driver's sampler answering "no batch" (after a buffer-like wait) from step 2 on
STALLING_CLI = textwrap.dedent('''
    import sys, time
    import ray
    import driver.train as train
    from driver.cli import main

    @ray.remote(num_cpus=0)
    def no_batch(timeout_s):
        time.sleep(timeout_s)
        return None

    class NoBatch:
        def remote(self, version, timeout_s):
            return no_batch.remote(timeout_s)

    class StalledBuffer:
        """The run's buffer actor, but sample_batch never finds a batch."""
        sample_batch = NoBatch()

        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            return getattr(self._real, name)

    real_train_step = train.Trainer.train_step

    def train_step(self, t0):
        if self.step >= 1 and not isinstance(self.buffer, StalledBuffer):
            self.buffer = StalledBuffer(self.buffer)
            print("[test] the sampler stalls from now on", flush=True)
        return real_train_step(self, t0)

    train.Trainer.train_step = train_step
    sys.exit(main(sys.argv[1:]))
''')


def config_file(tmp_path: Path, world_dir: Path, model_dir: Path, *extra: str) -> Path:
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, model_dir), *extra])
    return cfg.save(tmp_path / "cfg.yaml")


def test_a_run_whose_learner_gets_no_batch_ends_in_one_error_line_with_a_checkpoint(tmp_path, world_dir, tiny_model_dir):
    limit = 30
    cfg = config_file(tmp_path, world_dir, tiny_model_dir, "learner.total_steps=20",
                      f"cluster.progress_timeout_s={limit}")
    run = Run([sys.executable, "-c", STALLING_CLI, "train", "--config", str(cfg)])
    try:
        stalled = run.wait_for("[test] the sampler stalls", timeout_s=480)
        rc = run.finish(timeout_s=limit + 120)
    finally:
        run.kill()
    ended = time.monotonic() - stalled
    assert rc == 2, run.text()
    errors = [x for x in run.err if x.startswith("error:")]
    assert len(errors) == 1, run.text()
    line = errors[0]
    assert line.startswith("error: no learner step completed for ") and f"(step 2; limit {limit} s, " \
        "cluster.progress_timeout_s)" in line, line
    for part in ("blocked: ", "learner: waiting for a batch (idle)", "buffer: ", " ready groups, ", "admission: ",
                 " groups open, oldest open version ", "actor0: running, ", " pushed, last push ",
                 "last publish: version 1, ", "checkpoint "):
        assert part in line, (part, line)
    # the part at fault is the buffer's sample_batch: the actors filled the buffer with a batch's worth of ready
    # groups (admission then had nothing left to grant), yet it handed the learner none; not admission, not the actors
    blocked = line.split("; blocked: ", 1)[1].split("; learner: ", 1)[0]
    assert blocked.startswith(f"{BUFFER} (") and blocked.endswith("a batch needs 4, yet sample_batch handed none)"), \
        blocked
    assert int(blocked.removeprefix(f"{BUFFER} (").split()[0]) >= 4, blocked
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert f"checkpoint {ckpt}" in line and (ckpt / "MANIFEST.json").is_file(), line
    assert "Traceback" not in "\n".join(run.err), run.text()
    assert RAY_ARGUMENT_LINE not in run.text(), "Ray's constructor-argument error line is back at start-up"
    assert ended < limit + 60, f"ended {ended:.0f} s after the stall began (limit {limit} s)"


def test_sigterm_mid_run_stops_with_a_checkpoint_and_one_closing_line(tmp_path, world_dir, tiny_model_dir):
    cfg = config_file(tmp_path, world_dir, tiny_model_dir, "learner.total_steps=50")
    run = Run([str(Path(sys.executable).parent / "async-agent-rl"), "train", "--config", str(cfg)])
    try:
        run.wait_for("step  1/50", timeout_s=480)
        listening = listening_sockets(run.proc.pid)  # the whole run: Ray, engines, learner, retriever
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish(timeout_s=180)
    finally:
        run.kill()
    assert rc == 128 + signal.SIGTERM, run.text()
    stopped = [x for x in run.out if x.startswith("[stopped] ")]
    assert len(stopped) == 1 and stopped[0] is run.out[-1], run.text()
    assert stopped[0].startswith("[stopped] SIGTERM at step ") and "--resume" in stopped[0], stopped
    step = int(stopped[0].split("at step ")[1].split()[0])
    assert step >= 1
    assert (tmp_path / "run" / "checkpoints" / f"step_{step:06d}" / "MANIFEST.json").is_file(), run.text()
    err = "\n".join(run.err)
    assert "Traceback" not in err and "SIGABRT" not in err and "error:" not in err, run.text()
    assert not (tmp_path / "run" / "summary.json").exists()
    names = {name for _, _, name in listening}
    assert {"gcs_server", "raylet"} <= names, listening
    public = [s for s in listening if not (s[0].startswith(("127.", "::ffff:127.")) or s[0] == "::1")]
    # learner rank 0's process-group store included (it listened on every interface before it bound MASTER_ADDR)
    assert not public, f"a training listens beyond loopback: {public}"


def test_sigterm_during_the_warm_start_stops_it_at_the_next_step_unsaved(tmp_path, world_dir, tiny_model_dir):
    """Before: the warm start never looked at the stop flag, so a SIGTERM printed "stopping after the current step"
    and the warm start went on for its minutes (the RL loop was the only place that stopped)."""
    cfg = config_file(tmp_path, world_dir, tiny_model_dir, "sft.enabled=true", "sft.num_demos=64",
                      "sft.pretrain_steps=3000", f"sft.output_dir={tmp_path / 'sft'}")
    run = Run([str(Path(sys.executable).parent / "async-agent-rl"), "train", "--config", str(cfg)])
    try:
        run.wait_for("[sft] warm start on", timeout_s=240)
        time.sleep(3)
        run.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        rc = run.finish(timeout_s=150)
    finally:
        run.kill()
    took = time.monotonic() - sent
    assert rc == 128 + signal.SIGTERM, run.text()
    assert any(x.startswith("[stop] SIGTERM: stopping at the next step of the warm start") for x in run.out), run.text()
    assert run.out[-1].startswith("[stopped] SIGTERM at step 0 of "), run.text()
    assert not (tmp_path / "sft" / "config.json").exists(), "a stopped warm start must not be saved as one"
    assert "Traceback" not in "\n".join(run.err), run.text()
    assert took < 120, f"the warm start went on for {took:.0f} s after SIGTERM"


def test_sigterm_during_the_start_stops_the_run_at_once_with_one_closing_line(tmp_path, world_dir, tiny_model_dir):
    """Until 2026-12-07, the run's SIGTERM handler was put back only once every component had started (``ray.init``
    puts its own in place of it, whose ``sys.exit`` inside Ray's C++ code ends in SIGABRT), and the start's waits (the
    rollout actors' setup, the learner's start) never looked at a stop request. Now the handler is back right after
    ``ray.init`` and those waits look at the stop requests every second."""
    cfg = config_file(tmp_path, world_dir, tiny_model_dir, "learner.total_steps=50")
    run = Run([str(Path(sys.executable).parent / "async-agent-rl"), "train", "--config", str(cfg)])
    try:
        run.wait_for("[start] retriever", timeout_s=240)  # Ray is up; the learner and the rollout actors start
        run.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        rc = run.finish(timeout_s=150)
    finally:
        run.kill()
    took = time.monotonic() - sent
    assert rc == 128 + signal.SIGTERM, run.text()
    assert run.out[-1].startswith("[stopped] SIGTERM at step 0 of 50: no step yet"), run.text()
    err = "\n".join(run.err)
    assert "Traceback" not in err and "SIGABRT" not in err and "error:" not in err, run.text()
    assert not any(x.startswith("[start] rollout actor") or "step  1/50" in x for x in run.out), run.text()
    assert took < 90, f"the start went on for {took:.0f} s after SIGTERM"
