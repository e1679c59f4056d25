"""Faults during a weight publish, on a real short training run as a user runs it (the command line in a process
session of its own; real Ray, vLLM CPU engine, DeepSpeed learner, retrieval server), with
``cluster.progress_timeout_s=60``, which bounds every phase between steps (``driver.limits.phase_limit``):

- the learner (its ``ray::LearnerActor`` process) stopped (SIGSTOP) as the publish of step 2 begins, on both weight
  paths: the run ends in one ``error:`` line naming the learner and the publish within the publish's limit. Before
  the fix the learner's part of a publish (``LearnerGroup.state_dict_ref``, ``prepare_publish``) waited
  ``cluster.actor_setup_timeout_s`` (900 s by default) whatever the user's limit;
- the rollout actor (its ``ray::RolloutActor`` process) stopped as a collective publish begins: the publish fails
  within the publish's limit naming the actor, and the fleet restarts the silent actor as it does any (a
  ``[fault]`` line, then ``restarted``); the run finishes every step. Before the fix the collective publish waited
  ``weight_sync.timeout_s`` (300 s by default), not the publish's limit;
- a SIGTERM a few seconds after the learner stopped as an object-store publish begins: the run ends within the
  stop limit (``driver.limits.stop_s``), its checkpoint of the step naming the stopped learner. Before the fix the
  learner's part of a publish did not look at the stop requests: the run waited on for
  ``cluster.actor_setup_timeout_s``.

Each ends with no process of the run left. The fault is injected by the driver itself (``PUBLISH_CLI``) at the
moment the publish begins: a stop sent from outside would hit a sub-second publish only by chance."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from async_agent_rl.config import load_config
from driver.limits import model_bytes, phase_limit, stop_s
from tests.helpers import Run, plain_env, world_overrides
from tests.integration.test_fault_injection import REPO, SMALL, WATCHDOG_S, describe, left_behind, tree

pytestmark = pytest.mark.slow

AT = 2  # the publish (the learner step whose weights) during which the fault comes

# the command line, whose driver stops the process AAR_TEST_STOP names as the learner's part of publish AAR_TEST_AT
# begins (the AT-th call of LearnerGroup.state_dict_ref or prepare_publish: one per publish, no evaluation runs)
PUBLISH_CLI = textwrap.dedent('''
    import os, signal, sys, threading
    import psutil
    from learner.actor import LearnerGroup
    from driver.cli import main

    target, at, calls = os.environ["AAR_TEST_STOP"], int(os.environ["AAR_TEST_AT"]), [0]
    term_after = float(os.environ.get("AAR_TEST_TERM_AFTER") or 0)  # then a SIGTERM to this driver this much later

    def stopping_first(real):
        def method(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == at:
                hits = [p for p in psutil.Process().children(recursive=True)
                        if target in " ".join(p.cmdline() or [p.name()])]
                hits[0].send_signal(signal.SIGSTOP)
                print(f"[test] stopped {target} (pid {hits[0].pid}) as publish {at} begins", flush=True)
                if term_after:
                    threading.Timer(term_after, os.kill, (os.getpid(), signal.SIGTERM)).start()
            return real(self, *args, **kwargs)
        return method

    LearnerGroup.state_dict_ref = stopping_first(LearnerGroup.state_dict_ref)
    LearnerGroup.prepare_publish = stopping_first(LearnerGroup.prepare_publish)
    sys.exit(main(sys.argv[1:]))
''')


def start(tmp_path: Path, world_dir: Path, model_dir: Path, target: str, *extra: str,
          term_after: float = 0) -> tuple[Run, float]:
    """The run, and its publish's limit (``phase_limit``: with ``cluster.actor_timeout_s=20`` the object-store
    path's is 20 s, the collective path's ``weight_sync.timeout_s`` bounded by ``cluster.progress_timeout_s=60``).
    ``term_after``: the driver gets a SIGTERM this many seconds after it stopped ``target``."""
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, model_dir), *extra])
    cfg_file = cfg.save(tmp_path / "cfg.yaml")
    env = {**plain_env(), "AAR_TEST_STOP": target, "AAR_TEST_AT": str(AT), "AAR_TEST_TERM_AFTER": str(term_after)}
    limit = phase_limit(cfg, "publish", model_bytes(model_dir))[0]
    assert limit <= WATCHDOG_S
    return Run([sys.executable, "-c", PUBLISH_CLI, "train", "--config", str(cfg_file)], env=env), limit


def stopped_pid(run: Run, timeout_s: float) -> tuple[int, float]:
    """The pid the driver stopped, and when its line came."""
    when = run.wait_for("[test] stopped ", timeout_s)
    line = next(x for x in run.out if x.startswith("[test] stopped "))
    return int(line.split("(pid ", 1)[1].split(")", 1)[0]), when


def thaw_and_kill(pid: int | None) -> None:
    """The test's own clean-up (after the checks): a process the run left stopped."""
    if pid is None:
        return
    try:
        p = psutil.Process(pid)
        p.send_signal(signal.SIGCONT)
        p.kill()
    except psutil.Error:
        pass


@pytest.mark.timeout(900)
@pytest.mark.parametrize("method, part", [("object_store", "state_dict_for_publish"),
                                          ("collective", "prepare_publish")])
def test_a_learner_stopped_during_a_publish_ends_the_run_in_one_error_line_within_the_publish_limit(
        method, part, tmp_path, world_dir, tiny_model_dir):
    run, limit = start(tmp_path, world_dir, tiny_model_dir, "ray::LearnerActor", f"weight_sync.method={method}",
                       "learner.total_steps=4")
    pid, seen = None, {}
    try:
        pid, stopped_at = stopped_pid(run, timeout_s=420)
        seen = {p.pid: describe(p) for p in tree(run.proc.pid)}
        # the publish's limit, then the run's end; before the fix: 900 s (cluster.actor_setup_timeout_s)
        rc = run.finish(timeout_s=WATCHDOG_S + 150)
        ended = time.monotonic() - stopped_at
        left = left_behind(seen)
    finally:
        run.kill()
        thaw_and_kill(pid)
    console = run.text()
    assert "Traceback" not in "\n".join(run.out + run.err), console
    errors = [x for x in run.err + run.out if x.startswith("error:")]
    assert rc not in (0, None) and len(errors) == 1, console
    assert errors[0] == (f"error: the learner ({part}, a weight publish) did not answer within {limit:g} s, the "
                         "publish's limit (hung or stopped)"), console
    assert ended < limit + 120, f"ended {ended:.0f} s after the learner stopped (publish limit {limit:g} s)"
    assert not left, "processes of the run left 15 s after it ended:\n" + "\n".join(left)


@pytest.mark.timeout(900)
def test_a_rollout_actor_stopped_during_a_collective_publish_is_restarted_and_the_run_finishes(
        tmp_path, world_dir, tiny_model_dir):
    run_dir = tmp_path / "run"
    run, limit = start(tmp_path, world_dir, tiny_model_dir, "ray::RolloutActor", "weight_sync.method=collective",
                       "learner.total_steps=4")
    pid, seen = None, {}
    try:
        pid, stopped_at = stopped_pid(run, timeout_s=420)
        seen = {p.pid: describe(p) for p in tree(run.proc.pid)}
        # the publish fails within its limit (60 s; before the fix weight_sync.timeout_s, 300 s), naming the actor
        failed_at = run.wait_for("[fault] weight publish of version 2 failed", timeout_s=limit + 30)
        restarted_at = run.wait_for("[fault] rollout actor 0 restarted", timeout_s=WATCHDOG_S + 240)
        seen |= {p.pid: describe(p) for p in tree(run.proc.pid)}
        rc = run.finish(timeout_s=WATCHDOG_S + 240)
        left = left_behind(seen)
    finally:
        run.kill()
        thaw_and_kill(pid)
    console = run.text()
    assert "Traceback" not in "\n".join(run.out + run.err), console
    assert rc == 0 and not [x for x in run.err + run.out if x.startswith("error:")], console
    failed = next(x for x in run.out if x.startswith("[fault] weight publish of version 2 failed"))
    assert "rollout actor 0 did not answer" in failed and f"within {limit:g} s" in failed, failed
    assert failed_at - stopped_at < limit + 20, f"the publish failed {failed_at - stopped_at:.0f} s after the stop"
    assert any(x.startswith("[fault] rollout actor 0: ") and "restarting it" in x for x in run.out), console
    assert restarted_at > failed_at
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["actor_restarts"] == {"actor0": 1}, summary
    assert not left, "processes of the run left 15 s after it ended:\n" + "\n".join(left)


TERM_AFTER_S = 3.0  # the SIGTERM comes this long after the learner stopped: while the publish waits on it


@pytest.mark.timeout(900)
def test_a_sigterm_during_a_publish_the_stopped_learner_holds_ends_the_run_within_the_stop_limit(
        tmp_path, world_dir, tiny_model_dir):
    run, _ = start(tmp_path, world_dir, tiny_model_dir, "ray::LearnerActor", "weight_sync.method=object_store",
                   "learner.total_steps=4", term_after=TERM_AFTER_S)
    stop = stop_s(load_config(tmp_path / "cfg.yaml", []))
    pid, seen = None, {}
    try:
        pid, _ = stopped_pid(run, timeout_s=420)
        termed_at = run.wait_for("[stop] SIGTERM", timeout_s=TERM_AFTER_S + 30)
        seen = {p.pid: describe(p) for p in tree(run.proc.pid)}
        # the publish's wait ends at the stop request; the checkpoint of the step then gets the stop limit. Before the
        # fix the learner's part of the publish waited on (cluster.actor_setup_timeout_s, 900 s)
        rc = run.finish(timeout_s=stop + 120)
        ended = time.monotonic() - termed_at
        left = left_behind(seen)
    finally:
        run.kill()
        thaw_and_kill(pid)
    console = run.text()
    assert "Traceback" not in "\n".join(run.out + run.err), console
    errors = [x for x in run.err + run.out if x.startswith("error:")]
    assert rc not in (0, None) and len(errors) == 1 and errors[0].startswith("error: the learner ("), console
    assert ended < stop + 60, f"ended {ended:.0f} s after the SIGTERM (stop limit {stop:g} s)"
    assert not left, "processes of the run left 15 s after it ended:\n" + "\n".join(left)
