"""The driver's supervision on real Ray: a rollout actor that stops answering (slow, not dead) is killed and
restarted by Ray before it is set up again, never set up a second time while it still runs; its in-flight episodes
are counted lost and a push it sends late is dropped, not charged to another actor. On the collective weight path a
restarted actor never gets weights stamped with a version they are not (``weight_sync.every_steps > 1``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from async_agent_rl.config import load_config
from async_agent_rl.stats import RolloutStats
from buffer.actor import create_buffer_actor
from async_agent_rl.errors import error_line
from driver.fleet import Fleet
from driver.limits import RunFailed
from driver.train import Trainer
from driver.versions import PolicyVersions
from driver.weight_sync import create_publisher
from tests.helpers import traj

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray")]


@dataclass
class StandInStats(RolloutStats):
    pid: int = 0
    setups: int = 0
    began: bool = False  # start() was called


class SlowFirstIncarnation:
    """Rollout actor stand-in with the driver-facing methods. Its first incarnation stops answering ``stats()``
    (busy for a minute); Ray's restart runs ``__init__`` again in a new process, which answers."""

    def __init__(self, index: int, marker: str):
        self.index, self.setups, self.started, self.marker = index, 0, False, Path(marker)
        self.first = not self.marker.exists()
        self.marker.touch()

    def setup(self, buffer=None) -> dict:
        self.setups += 1
        return {"index": self.index, "pid": os.getpid()}

    def start(self) -> None:
        self.started = True

    def update_weights(self, version, weights) -> dict:
        return {"version": version}

    def close_engine(self, timeout_s: float) -> dict:
        """What ``RolloutActor.close_engine`` answers (no engine here); the call is recorded beside the marker, as
        the process is killed after it."""
        (self.marker.parent / f"closed-by-{os.getpid()}").touch()
        return {"pids": [], "killed": []}

    def stats(self) -> StandInStats:
        if self.first and self.setups:
            time.sleep(60)
        return StandInStats(index=self.index, incarnation=str(os.getpid()), ready=self.setups > 0, pid=os.getpid(),
                            setups=self.setups, began=self.started)


def say(quiet: bool):
    return (lambda line: None) if quiet else (lambda line: print(line, flush=True))


def supervised(cfg, tmp_path: Path, actor_cls: type, max_restarts: int = 1, quiet: bool = True) -> Fleet:
    """A fleet with a real buffer actor, one stand-in rollout actor (restartable ``max_restarts`` times by Ray,
    ``actor_cls(0, marker)``) and an object-store publisher that is told of restarts."""
    buffer = create_buffer_actor(cfg, pad_id=0)
    # started before the test's short limits apply: on a loaded machine a new actor's process takes seconds to start
    ray.get(buffer.stats.remote(), timeout=120)
    remote_cls = ray.remote(num_cpus=0, max_restarts=max_restarts)(actor_cls)
    actors = [remote_cls.remote(0, str(tmp_path / "incarnated"))]
    publisher = create_publisher("object_store", actors,  # a restarted actor is reported to it
                                 actor_timeout_s=cfg.cluster.actor_timeout_s)
    return Fleet(cfg, say(quiet), buffer, actors, PolicyVersions(cfg, None, publisher, say(quiet)))


def test_a_slow_actor_is_killed_before_it_is_set_up_again(tmp_path):
    cfg = load_config(None, ["cluster.actor_timeout_s=3", "rollout.group_size=2", "learner.batch_size=4",
                             "learner.mini_batch_size=4", "learner.micro_batch_size=4", "buffer.max_staleness=0"])
    fleet = supervised(cfg, tmp_path, SlowFirstIncarnation)
    slow = fleet.actors[0]
    first_pid = ray.get(slow.setup.remote())["pid"]
    assert ray.get(fleet.buffer.try_start.remote(2, 0, "actor0-g", "actor0")) == 2
    assert ray.get(fleet.buffer.try_start.remote(2, 0, "actor1-g", "actor1")) == 2

    stats = fleet.supervise()[0]
    assert stats.setups == 1 and stats.began, "the new incarnation is set up once and running"
    assert fleet.restarts == {"actor0": 1} and fleet.lost_episodes == 2
    assert stats.pid != first_pid, "a new process, not the slow one"
    # a push the dead incarnation sent late is dropped; the other actor's pushes are unaffected
    ray.get(fleet.buffer.push_many.remote([traj("actor0-g", 0)]))
    ray.get(fleet.buffer.push_many.remote([traj("actor1-g", 0), traj("actor1-g", 1)]))
    b = ray.get(fleet.buffer.stats.remote())
    assert b.late_pushes == 1 and b.admission.running == 0 and b.lost_episodes == {"actor0": 2}


class Restartable:
    """Rollout actor stand-in that records the weights it is given (``update_weights``) and when it starts."""

    def __init__(self):
        self.updates, self.started = [], False

    def setup(self, buffer=None) -> dict:
        return {}

    def update_weights(self, version, weights) -> None:
        self.updates.append((version, weights))

    def start(self) -> None:
        self.started = True

    def close_engine(self, timeout_s: float) -> dict:
        return {"pids": [], "killed": []}

    def seen(self) -> tuple[list, bool]:
        return self.updates, self.started


class StandInLearner:
    """The learner group's calls a restart makes on the collective path: its step's weights, and the version bump.
    A stand-in because what is tested is the driver's choice between them; the real collective publish (DeepSpeed
    rank 0 into a vLLM engine) is tested in test_weight_publish_collective.py and test_train_two_actors_two_ranks.py,
    and making a real learner reach step 5 with weights no version was published for would add minutes, not a check."""

    def __init__(self, version: int):
        self.version = version

    def state_dict_ref(self):
        return {"weights_of_version": self.version}

    def bump_version(self) -> int:
        self.version += 1
        return self.version


class RecordingPublisher:
    def __init__(self):
        self.published, self.restarted = [], 0

    def member_restarted(self) -> None:
        self.restarted += 1

    def publish(self, version, state=None):
        self.published.append(version)


@pytest.mark.parametrize("step, republished", [(4, False), (5, True)])
def test_a_restart_on_the_collective_path_never_stamps_unpublished_weights(tmp_path, step, republished):
    """The collective path keeps no copy of the published weights: a restarted actor takes the learner's. With
    ``weight_sync.every_steps=2`` the learner at step 5 holds weights no version was published for (version 2 is
    step 4's), so they are published as version 3 to every actor instead of reaching one stamped 2."""
    cfg = load_config(None, ["weight_sync.method=collective", "weight_sync.every_steps=2", "buffer.max_staleness=2"])
    versions = PolicyVersions(cfg, StandInLearner(version=2), RecordingPublisher(), say(True))
    versions.version, versions.published_step, versions.learner_step = 2, 4, step
    fleet = Fleet(cfg, say(True), create_buffer_actor(cfg, pad_id=0), [ray.remote(num_cpus=0)(Restartable).remote()],
                  versions)

    fleet.restart(0)
    updates, started = ray.get(fleet.actors[0].seen.remote())
    assert started and versions.publisher.restarted == 1
    if republished:
        assert updates == [] and versions.publisher.published == [3] and versions.version == 3
        assert versions.published_step == 5
    else:  # the learner's weights are version 2's
        assert updates == [(2, {"weights_of_version": 2})] and versions.publisher.published == []
        assert versions.version == 2


PUSH_FAILED = "RolloutFailure: rollout worker actor0: pushing finished episodes failed: ConnectionError: buffer gone"


class StoppedGenerating(SlowFirstIncarnation):
    """Rollout actor stand-in whose first incarnation is alive and answers, but its rollouts ended (a failed push:
    ``stats().done``, ``error()`` the cause), as ``RolloutActor`` reports it (tests/unit/test_rollout_failures.py)."""

    def error(self) -> str | None:
        return PUSH_FAILED if self.first else None

    def stats(self) -> StandInStats:
        return StandInStats(index=self.index, incarnation=str(os.getpid()), ready=self.setups > 0,
                            done=self.first and self.setups > 0, pid=os.getpid(), setups=self.setups, began=self.started)


def stopped_actor_fleet(tmp_path, max_restarts: int) -> Fleet:
    cfg = load_config(None, [f"cluster.max_actor_restarts={max_restarts}", "cluster.actor_timeout_s=10",
                             "rollout.group_size=2", "learner.batch_size=4", "learner.mini_batch_size=4",
                             "learner.micro_batch_size=4"])
    fleet = supervised(cfg, tmp_path, StoppedGenerating, max_restarts=max_restarts, quiet=False)
    ray.get(fleet.actors[0].setup.remote())
    return fleet


def test_an_actor_that_stopped_generating_is_restarted_with_its_cause_on_the_console(tmp_path, capsys):
    """Until 9554d5e (2026-11-25), supervision read only ``ready``; an actor alive but done (its push failed) was left
    alone and the run waited for batches forever."""
    fleet = stopped_actor_fleet(tmp_path, max_restarts=1)
    first_pid = ray.get(fleet.actors[0].stats.remote()).pid
    t0 = time.monotonic()
    stats = fleet.supervise()[0]
    assert time.monotonic() - t0 < 30
    assert stats.pid != first_pid and stats.setups == 1 and stats.began and not stats.done
    assert fleet.restarts == {"actor0": 1}
    assert (tmp_path / f"closed-by-{first_pid}").exists(), "the answering actor closed its engine before the restart"
    out = capsys.readouterr().out
    assert f"[fault] rollout actor 0: stopped generating: {PUSH_FAILED}; restarting it" in out


def test_an_actor_that_stopped_generating_with_no_restart_left_ends_the_run_in_one_error_line(tmp_path):
    fleet = stopped_actor_fleet(tmp_path, max_restarts=0)
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as info:
        fleet.supervise()
    assert time.monotonic() - t0 < 10, "within seconds"
    assert error_line(info.value) == (f"error: rollout actor 0: stopped generating: {PUSH_FAILED} (restarted 0 "
                                      "time(s) already, cluster.max_actor_restarts=0)")


class SlowSecondSetup(SlowFirstIncarnation):
    """Its restarted incarnation takes far longer to set up than the run allows (a large model loading)."""

    def setup(self, buffer=None) -> dict:
        if not self.first:
            time.sleep(60)
        return super().setup()


def test_a_restarted_actor_that_is_not_set_up_in_time_ends_the_run_in_one_error_line(tmp_path):
    """Before: a fixed ``actor_timeout_s`` for the restarted actor's setup, and its GetTimeoutError escaped as a
    traceback. Now ``cluster.actor_setup_timeout_s`` bounds it and the run ends in one error line naming the key."""
    cfg = load_config(None, ["cluster.actor_timeout_s=3", "cluster.actor_setup_timeout_s=5", "rollout.group_size=2",
                             "learner.batch_size=4", "learner.mini_batch_size=4", "learner.micro_batch_size=4"])
    fleet = supervised(cfg, tmp_path, SlowSecondSetup)
    ray.get(fleet.actors[0].setup.remote())
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as err:
        fleet.supervise()
    assert time.monotonic() - t0 < 40
    line = error_line(err.value)
    assert "cluster.actor_setup_timeout_s=5" in line and "\n" not in line


class HangsOnWeights(SlowFirstIncarnation):
    """Its first incarnation never finishes applying a publish (a process stopped by SIGSTOP, or hung, after it was
    set up); what it is asked after that waits behind it. The restarted one answers."""

    def update_weights(self, version, weights) -> dict:
        if self.first:
            time.sleep(120)
        return super().update_weights(version, weights)


def test_a_publish_to_a_hung_actor_fails_in_time_and_supervision_restarts_it(tmp_path, capsys):
    """Seen in CI before f0c1791 (2026-11-26): a rollout actor stopped while the buffer still held a batch; the learner
    stepped and the publish waited forever for the stopped actor (no limit, and the watchdog does not count
    publishes)."""
    cfg = load_config(None, ["cluster.actor_timeout_s=4", "rollout.group_size=2", "learner.batch_size=4",
                             "learner.mini_batch_size=4", "learner.micro_batch_size=4"])
    fleet = supervised(cfg, tmp_path, HangsOnWeights, quiet=False)
    first_pid = ray.get(fleet.actors[0].setup.remote())["pid"]
    versions = fleet.versions
    versions.version, versions.weights_ref = 1, ray.put({"w": 1})
    t0 = time.monotonic()
    assert versions.publish() is None and versions.publish_failures == 1
    assert time.monotonic() - t0 < 15
    assert "did not apply version 1 within 4 s" in capsys.readouterr().out
    stats = fleet.supervise()[0]
    assert time.monotonic() - t0 < 60
    assert stats.pid != first_pid and stats.setups == 1 and stats.began and fleet.restarts == {"actor0": 1}


def test_a_stop_request_during_a_publish_to_a_hung_actor_ends_it_at_once(tmp_path):
    """Until 2026-12-07, a SIGTERM during a publish printed ``[stop]`` and the driver went on waiting for the hung
    actor for the publish's whole limit. Now the publish's wait looks at the stop requests every second and ends."""
    import threading

    from driver.stops import StopRequested, StopRequests
    from driver.weight_sync import ObjectStorePublisher

    cfg = load_config(None, ["cluster.actor_timeout_s=60"])
    fleet = supervised(cfg, tmp_path, HangsOnWeights)
    ray.get(fleet.actors[0].setup.remote(), timeout=120)
    stops = StopRequests(say(True), lambda: 1)
    publisher = ObjectStorePublisher(fleet.actors, 60, stops)
    threading.Timer(1.0, stops._handle, (15, None)).start()  # SIGTERM, as its handler takes it
    t0 = time.monotonic()
    with pytest.raises(StopRequested):
        publisher.publish(1, ray.put({"w": 1}))
    assert time.monotonic() - t0 < 10, "the publish waited on after the stop request"


@ray.remote(num_cpus=0)
class StoppedBuffer:
    """A buffer actor stand-in that stopped (SIGSTOP, a hang): it never answers."""

    def stats(self):
        time.sleep(120)

    def snapshot(self, path):
        time.sleep(120)


@ray.remote(num_cpus=0)
class SavesCheckpoint:
    """A learner rank whose save is quick."""

    def save_checkpoint(self, folder) -> str:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "policy.bin").write_bytes(b"w")
        return folder


def test_a_buffer_that_stopped_answering_ends_a_checkpoint_in_one_error_line_and_no_partial_copy(tmp_path):
    """Until f0c1791 (2026-11-26), the driver asked the buffer with no limit between steps (stats, snapshot, lost
    episodes), so a stopped buffer could hold the run past its watchdog."""
    cfg = load_config(None, ["cluster.actor_timeout_s=3"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run", quiet=True)
    from learner.actor import LearnerGroup

    trainer.mon, trainer.buffer = None, StoppedBuffer.remote()
    trainer.learner = LearnerGroup([SavesCheckpoint.remote()], 3, 4)
    trainer.versions = PolicyVersions(cfg, trainer.learner, None, say(True))
    trainer.versions.learner_step = 2
    trainer.fleet = Fleet(cfg, say(True), trainer.buffer, [], trainer.versions)
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as err:
        trainer.checkpoint()
    assert time.monotonic() - t0 < 15
    assert error_line(err.value) == ("error: the buffer actor (snapshot) did not answer within "
                                     "cluster.actor_timeout_s=3 s (hung or stopped)")
    assert not list((tmp_path / "run" / "checkpoints").iterdir()), "no partial checkpoint is left"


class AnswersLate:
    """The learner group's ``train_step`` on a loaded machine: it takes its batch, then needs a few seconds more to
    answer (``None``: the buffer had no batch)."""

    def __init__(self, answer_after_s: float):
        self.answer_after_s = answer_after_s

    def train_step(self, batch, timeout_s=None):
        got = ray.get(batch)
        time.sleep(self.answer_after_s)
        return None if got is None else "stats"


@ray.remote(num_cpus=0)
class IdleBuffer:
    def stats(self):
        from async_agent_rl.stats import BufferStats
        return BufferStats()


def stalled_trainer(tmp_path, learner) -> Trainer:
    cfg = load_config(None, ["cluster.progress_timeout_s=1"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run", quiet=True)
    trainer.mon, trainer.buffer, trainer.learner = None, IdleBuffer.remote(), learner
    trainer.versions = PolicyVersions(cfg, learner, None, say(True))
    trainer.versions.learner_step = 1
    trainer.fleet = Fleet(cfg, say(True), trainer.buffer, [], trainer.versions)
    trainer.watchdog.waiting()
    time.sleep(1.5)
    assert trainer.watchdog.expired()
    return trainer


def test_a_no_batch_answer_still_on_its_way_when_the_watchdog_fires_is_not_reported_as_computing(tmp_path):
    """Seen in CI: the buffer answered sample_batch with no batch, the watchdog's limit passed while the learner's
    "no batch" was on its way back, and the run ended blaming "the learner (computing step 2 ...)" instead of an
    idle learner waiting for a batch (whose line carries a checkpoint)."""
    trainer = stalled_trainer(tmp_path, AnswersLate(answer_after_s=3))
    assert trainer._learner_step(ray.put(None)) is None  # the idle answer: the caller reports "waiting for a batch"
    # a batch that arrived and is being computed on is still the learner's, and a "no batch" that never comes back
    # is reported once the buffer's own timeout and the report's have passed
    trainer = stalled_trainer(tmp_path, AnswersLate(answer_after_s=30))
    with pytest.raises(RunFailed, match=r"blocked: the learner \(computing step 2 for up to \d+ s \(its batch has"):
        trainer._learner_step(ray.put("a batch"))
    trainer = stalled_trainer(tmp_path, AnswersLate(answer_after_s=60))
    t0 = time.monotonic()
    with pytest.raises(RunFailed, match=r"blocked: the learner \(not answering for \d+ s after the buffer answered "
                                        "sample_batch with no batch\\)"):
        trainer._learner_step(ray.put(None))
    assert time.monotonic() - t0 < 30


def test_learner_ranks_ray_cannot_place_end_the_start_in_one_error_line_in_time(tmp_path):
    """The learner group's start waited for its ranks with no limit: ranks asking for more CPUs than the cluster has
    left the run waiting forever, saying nothing."""
    from driver.start import started
    from learner.actor import create_learner_group

    cfg = load_config(None, ["cluster.learner_cpus=64", "cluster.actor_setup_timeout_s=3"])
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as err:
        started(cfg, lambda: create_learner_group(cfg))
    assert time.monotonic() - t0 < 15
    assert error_line(err.value) == (
        "error: the 1 learner actor(s) were not started within cluster.actor_setup_timeout_s=3 s (each asks Ray for "
        "cluster.learner_cpus=64, learner_gpus=0; the cluster has 2 CPUs, 0 GPUs)")


@ray.remote(num_cpus=0)
class StoppedLearnerRank:
    """A learner rank stopped (SIGSTOP) while it saves a checkpoint: the call is taken and never answered."""

    def save_checkpoint(self, folder):
        time.sleep(120)


def test_a_learner_that_stopped_during_a_checkpoint_ends_the_run_in_one_error_line_in_time(tmp_path):
    """Until e4918d9 (2026-11-26), the learner's save had no limit (``LearnerGroup`` waited with a bare ``ray.get``): a
    learner stopped while it saved held the driver for good. Then the group's long limit
    (``cluster.actor_setup_timeout_s``, 900 s by default) ended it, whatever ``cluster.progress_timeout_s`` the user set:
    a learner stopped after step 2 with ``cluster.progress_timeout_s=120`` gave no line for 430 s. Now the checkpoint
    is a phase with its own limit (``driver.limits.phase_limit``), which the progress timeout bounds: one error line
    naming the learner and the checkpoint within it, and the partial copy is removed."""
    from learner.actor import LearnerGroup

    cfg = load_config(None, ["cluster.actor_timeout_s=30", "cluster.actor_setup_timeout_s=60",
                             "cluster.progress_timeout_s=4"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run", quiet=True)
    trainer.mon, trainer.buffer = None, IdleBuffer.remote()
    trainer.learner = LearnerGroup([StoppedLearnerRank.remote()], 30, 60)
    ray.get(trainer.buffer.stats.remote(), timeout=120)  # placed before the short limit applies
    trainer.versions = PolicyVersions(cfg, trainer.learner, None, say(True))
    trainer.versions.learner_step = 2
    trainer.fleet = Fleet(cfg, say(True), trainer.buffer, [], trainer.versions)
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as err:
        trainer.checkpoint()
    took = time.monotonic() - t0
    assert error_line(err.value) == ("error: the learner (checkpoint of step 2) did not answer within "
                                     "cluster.progress_timeout_s=4 s (hung or stopped)")
    assert took < 15, f"named after {took:.0f} s: the progress timeout is 4 s, the others 30 s and 60 s"
    assert not list((tmp_path / "run").glob("checkpoints/*")), "no partial checkpoint is left"


@ray.remote(num_cpus=0)
class StoppedRank:
    """A learner rank stopped (SIGSTOP) once it was placed: no call is answered, not even its rank."""

    def placed(self) -> bool:
        return True

    def rank(self):
        time.sleep(120)


def test_a_stopped_learner_on_the_drivers_own_node_is_not_waited_for_as_a_lost_node(tmp_path):
    """Until 2026-11-28, any Ray error of the RL loop (a learner that stopped answering one) first asked whether the
    learner's or the buffer's node was lost: a probe (``REPORT_TIMEOUT_S``), then up to ``SETTLE_S`` for Ray to
    declare the node dead. On one machine that node is the driver's own, which cannot be lost while the driver runs:
    the error line of a stopped learner came ~70 s late (and CI paid it in every such test). Now the driver's node is
    not asked about, and the error goes on at once."""
    from learner.actor import LearnerGroup, LearnerTimeout

    cfg = load_config(None, ["cluster.actor_timeout_s=3", "cluster.actor_setup_timeout_s=4"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run", quiet=True)
    trainer.buffer = IdleBuffer.remote()
    trainer.learner = LearnerGroup([StoppedRank.remote()], 3, 4)
    ray.get([trainer.buffer.stats.remote(), trainer.learner.actors[0].placed.remote()])  # both placed on their node
    trainer.nodes.note(trainer.buffer, trainer.learner)
    assert set(trainer.nodes.held) == {ray.get_runtime_context().get_node_id()}, trainer.nodes.held
    t0 = time.monotonic()
    with pytest.raises(LearnerTimeout):
        with trainer.nodes.watch(lambda: trainer.step):
            raise LearnerTimeout("the learner (bump_version) did not answer")
    assert time.monotonic() - t0 < 5


class SlowToStop(SlowFirstIncarnation):
    """Its in-flight episodes take far longer to finish than stopping allows."""

    def stop(self, timeout_s):
        time.sleep(60)


def test_a_finished_run_whose_actor_is_slow_to_stop_goes_on_with_its_last_stats(tmp_path, capsys):
    """Until e4918d9 (2026-11-26), stopping the rollouts was bounded by ``cluster.actor_timeout_s`` while an actor's
    ``stop`` itself may wait as long for its in-flight episodes, so a run whose steps were all done could end in error
    without ``final/``. Now an actor that does not stop in time is left to Ray's shutdown, said in one line, and its
    last stats stand for it."""
    cfg = load_config(None, ["cluster.actor_timeout_s=2", "rollout.max_response_length=16", "rollout.max_obs_length=16",
                             "rollout.max_tokens_per_turn=16", "rollout.group_size=2",
                             "learner.batch_size=4", "learner.mini_batch_size=4", "learner.micro_batch_size=4"])
    fleet = supervised(cfg, tmp_path, SlowToStop, quiet=False)  # the fleet says the stop's lines
    ray.get(fleet.actors[0].setup.remote())
    last = fleet.supervise()
    trainer = Trainer(cfg, run_dir=tmp_path / "run", quiet=False)
    trainer.fleet = fleet
    t0 = time.monotonic()
    assert trainer.stop_rollouts() == last
    assert time.monotonic() - t0 < 30
    assert "[warn] rollout actor 0 did not stop within 2 s; its in-flight episodes are dropped" in capsys.readouterr().out


RAY_ARGUMENT_LINE = "has constructor arguments in the object store and max_restarts > 0"


def test_rollout_actors_start_without_rays_constructor_argument_line(capfd):
    """Until 45c3a3e (2026-11-26), every training start showed Ray's ``core_worker.cc ... E ... has constructor
    arguments in the object store and max_restarts > 0``, logged by this (the driver's) process when it creates an actor
    that Ray may restart with an argument it keeps by reference: the buffer actor's handle was one. Created as the
    driver creates them (the buffer now comes with ``setup``), restartable rollout actors give no such line. Ray logs it
    once per process: a test before this one that logged it would hide it here."""
    from actors.rollout_actor import create_rollout_actors

    cfg = load_config(None, ["rollout.num_actors=2"])
    capfd.readouterr()
    actors = create_rollout_actors(cfg, "http://127.0.0.1:9", "no-model", 0, max_restarts=1)
    time.sleep(1.0)
    err = capfd.readouterr().err
    for actor in actors:
        ray.kill(actor)
    assert RAY_ARGUMENT_LINE not in err, err


@ray.remote(num_cpus=0)
class StoppedDuringPublish:
    """A learner rank stopped (SIGSTOP) as a publish begins: its part of the publish is taken and never answered."""

    def state_dict_for_publish(self):
        time.sleep(120)

    def prepare_publish(self):
        time.sleep(120)


@pytest.mark.parametrize("method, part", [("object_store", "state_dict_for_publish"),
                                          ("collective", "prepare_publish")])
def test_a_learner_stopped_during_a_publish_is_named_within_the_publish_limit(method, part):
    """Until 2026-12-07, the learner's part of a publish (``LearnerGroup.state_dict_ref``, ``prepare_publish``) waited
    the group's long limit (``cluster.actor_setup_timeout_s``, 900 s by default) whatever ``cluster.progress_timeout_s``
    the user set. Now the publish phase's limit (``driver.limits.phase_limit``, given through ``create_publisher``)
    bounds it: one error line naming the learner and the publish. (The real process: tests/integration/
    test_publish_faults.py.)"""
    from driver.limits import model_bytes, phase_limit
    from learner.actor import LearnerGroup, LearnerTimeout

    cfg = load_config(None, ["cluster.actor_timeout_s=30", "cluster.actor_setup_timeout_s=60",
                             "cluster.progress_timeout_s=4", f"weight_sync.method={method}"])
    rank = StoppedDuringPublish.remote()
    learner = LearnerGroup([rank], 30, 60)
    publisher = create_publisher(method, [], learner, actor_timeout_s=phase_limit(cfg, "publish", model_bytes("x"))[0],
                                 backend="gloo", timeout_s=cfg.weight_sync.timeout_s)
    if method == "collective":
        publisher.connected = True  # no engine to join: the learner's part is what is tested
    t0 = time.monotonic()
    with pytest.raises(LearnerTimeout) as err:
        publisher.publish(1, learner.state_dict_ref() if method == "object_store" else None)
    took = time.monotonic() - t0
    assert error_line(err.value) == (f"error: the learner ({part}, a weight publish) did not answer within 4 s, the "
                                     "publish's limit (hung or stopped)")
    assert took < 15, f"named after {took:.0f} s: the publish's limit is 4 s, the group's long one 60 s"
    ray.kill(rank)


def test_a_stop_request_during_the_learners_part_of_a_publish_ends_it_at_once():
    """A SIGTERM while the learner gathers the weights to publish: the wait looks at the stop requests every second
    and ends (``StopRequested``), as the rollout actors' part of a publish does."""
    import threading

    from driver.stops import StopRequested, StopRequests
    from learner.actor import LearnerGroup

    stops = StopRequests(say(True), lambda: 1)
    rank = StoppedDuringPublish.remote()
    learner = LearnerGroup([rank], 30, 60)
    create_publisher("object_store", [], learner, actor_timeout_s=60, stops=stops)
    threading.Timer(1.0, stops._handle, (15, None)).start()  # SIGTERM, as its handler takes it
    t0 = time.monotonic()
    with pytest.raises(StopRequested):
        learner.state_dict_ref()
    assert time.monotonic() - t0 < 10, "the publish waited on after the stop request"
    ray.kill(rank)
