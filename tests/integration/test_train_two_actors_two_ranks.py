"""Two rollout actors and two learner ranks in one REAL training run: Ray, two vLLM CPU engines, the BM25 server, the
buffer actor, two DeepSpeed ZeRO-3 learner ranks (gloo) and collective weight publishing (``weight_sync.method:
collective``: learner rank 0 broadcasts into both engines' workers over gloo; every other training test publishes
through the object store), driven by ``driver.train.Trainer``. Everything checked is what the run produced; a
test-side ``Trainer`` subclass records what passes through the driver (the batch object the buffer handed to the
ranks, the weights the ranks held just before each step, every published state, the publishers' and actors' own
reports), without changing any of it.

1. Every actor received every published version: each publish reached both actors, each actor's engine applied
   every version (its own reload records) and ends at the learner's final version, and each actor's sampled tokens
   are what the weights of the version stamped on them give: the behavior log-probs the engine recorded equal a
   transformers model's under the published weights of that version (and differ under the previous version's).
   Publishes land inside model turns (at least one such turn; ~10 per run seen), and under
   ``weight_update_mode=pause`` such a turn is labelled token by token: the version it started at, then newer ones,
   contiguous and never going back, each token with its own version's log-prob.
2. The staleness bound holds on every consumed batch: the learner version at consumption minus the oldest version
   of each trajectory's tokens is at most ``buffer.max_staleness``, no token comes from a future version, and
   metrics.jsonl and the buffer's own staleness histogram say the same. The run is off-policy up to the bound (a
   batch at staleness ``max_staleness`` was consumed), so the bound was reached, not vacuously met.
3. The two-rank learner's steps are a single rank's: a plain ``Learner`` (one rank) replays the consumed batches
   from the same start; before each step its weights are the ones the two ranks held, the step's metrics (losses,
   entropy, clip and importance-weight statistics, grad norm) are the ones metrics.jsonl recorded, and its updated
   weights are the published ones up to float summation order.

Each check can fail, measured by breaking the system from the test side: a buffer built with max_staleness=100 (no
bound) handed the learner a batch at staleness 2 at step 3; actor 1 given the previous version's weights under the
new version number sampled tokens off by up to 0.11 in log-prob (against 2e-6 otherwise); the metrics of rank 0's
rows alone (before the learner reduced them over ranks) were another loss (0.45 against -0.25 in
test_learner_two_ranks).

About 65 s on 2 idle cores, plus the session's hot SFT warm start (``searching_model_dir``, ~15 s); on 2 cores
shared with a training job, 260 s (210-245 s with 16 or 8 episodes at a time per actor, which produced no turn
with a publish inside).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from async_agent_rl.batch import TrainBatch
from async_agent_rl.config import load_config
from async_agent_rl.records import OBS_VERSION, Trajectory
from async_agent_rl.staleness import staleness
from async_agent_rl.stats import LearnerStats, PublishStats, RolloutStats
from buffer.actor import BufferActor
from learner.actor import LearnerGroup
from tests.helpers import world_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 4  # <= 5: RolloutStats keeps an actor's latest five weight reloads
ETA = 1  # buffer.max_staleness
LR = 3e-4
# |behavior log-prob - transformers' under the stamped version's weights|, vLLM's CPU engine and transformers on
# the same fp32 weights: measured at most 2e-6 over ~4500 sampled tokens (under the previous version's: 0.03 mean)
LOGPROB_TOL = 5e-4
# metrics of a step that must equal a single rank's on the same batch (lr and counts too)
COMPARED = ("policy_loss", "entropy", "approx_kl", "clip_frac", "iw_mean", "iw_max", "iw_capped_frac", "behavior_kl",
            "grad_norm", "lr", "reward_mean", "advantage_mean", "loss_tokens", "staleness_mean", "staleness_max")


# ------------------------------------------------------------------------------------------------ recording
@dataclass
class Step:
    batch: TrainBatch  # what the buffer handed to the ranks (the same object reference)
    before: dict[str, np.ndarray]  # rank 0's full weights just before the step (ZeRO-3: gathered from both ranks)
    rank_versions: list[int]  # every rank's learner version at consumption
    stats: LearnerStats  # what the group returned (rank 0's)


@dataclass
class Recording:
    steps: list[Step] = dataclasses.field(default_factory=list)
    published: dict[int, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)  # version -> weights
    bumped: list[int] = dataclasses.field(default_factory=list)
    publishes: list[PublishStats] = dataclasses.field(default_factory=list)
    final_rollout: list[RolloutStats] = dataclasses.field(default_factory=list)
    final_buffer: Any = None
    pushed: list[Trajectory] = dataclasses.field(default_factory=list)  # every trajectory the buffer took


def owned(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies of arrays read zero-copy from the object store (they must outlive ``ray.shutdown``)."""
    return {k: np.array(v, copy=True) for k, v in state.items()}


def owned_batch(batch: TrainBatch) -> TrainBatch:
    tensors = {f.name: getattr(batch, f.name).clone() for f in dataclasses.fields(batch) if f.name != "metas"}
    return dataclasses.replace(batch, **tensors, metas=list(batch.metas))


class RecordingLearnerGroup(LearnerGroup):
    """The run's learner group (same rank actors); records each consumed batch with the weights and versions the
    ranks had before it, and each published state."""

    def __init__(self, actors: list, rec: Recording):
        super().__init__(actors, 120.0, 900.0)
        self.rec = rec

    def train_step(self, batch, timeout_s=None):
        consumed = ray.get(batch) if isinstance(batch, ray.ObjectRef) else batch
        if consumed is None:  # no batch within the buffer's timeout: the ranks get None as well
            return super().train_step(batch, timeout_s)
        before = owned(ray.get(LearnerGroup.state_dict_ref(self)))
        # a lambda travels by value (Ray workers cannot import a test module)
        versions = ray.get([a.__ray_call__.remote(lambda rank: rank.learner.version) for a in self.actors])
        stats = super().train_step(batch, timeout_s)  # the buffer's reference, as the driver passed it
        if stats is not None:
            self.rec.steps.append(Step(owned_batch(consumed), before, versions, stats))
        return stats

    def bump_version(self) -> int:
        version = super().bump_version()
        self.rec.bumped.append(version)
        return version

    def state_dict_ref(self):
        ref = super().state_dict_ref()  # the object-store path publishes this reference
        self.rec.published[self.rec.bumped[-1]] = owned(ray.get(ref))
        return ref

    def prepare_publish(self):
        # the collective path: the ranks take the weights rank 0 then broadcasts; record the same state
        self.rec.published[self.rec.bumped[-1]] = owned(ray.get(LearnerGroup.state_dict_ref(self)))
        return super().prepare_publish()


class RecordingBufferActor(BufferActor):
    """The run's buffer actor, also keeping every trajectory it took from the rollout actors (wire bytes)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._taken: list[bytes] = []

    def push_many(self, blobs):
        result = super().push_many(blobs)
        self._taken.extend(result.taken(blobs))
        return result

    def taken(self) -> list[bytes]:
        return self._taken


class RecordingPublisher:
    def __init__(self, inner: Any, rec: Recording):
        self.inner, self.rec = inner, rec

    def publish(self, version: int, state: Any = None) -> PublishStats:
        stats = self.inner.publish(version, state)
        self.rec.publishes.append(stats)
        return stats

    def member_restarted(self) -> None:
        self.inner.member_restarted()

    def close(self) -> None:
        self.inner.close()


def recording_trainer(cfg, rec: Recording):
    from driver.train import Trainer

    class RecordingTrainer(Trainer):
        def start_components(self, stack) -> None:
            super().start_components(stack)
            self.learner = self.versions.learner = RecordingLearnerGroup(self.learner.actors, rec)
            publisher = self.versions.publisher
            if hasattr(publisher, "learner"):  # the collective path sends from the (recording) learner group
                publisher.learner = self.learner
            self.versions.publisher = RecordingPublisher(publisher, rec)

        def stop_rollouts(self) -> list[RolloutStats]:
            out = super().stop_rollouts()
            rec.final_rollout = out  # in-flight episodes finished and pushed
            rec.final_buffer = ray.get(self.buffer.stats.remote())
            rec.pushed = [Trajectory.decode(b) for b in ray.get(self.buffer.taken.remote())]
            return out

    return RecordingTrainer(cfg, quiet=True)


# --------------------------------------------------------------------------------------------------- the test
@pytest.fixture
def recording_buffer(monkeypatch):
    """``create_buffer_actor`` builds the recording subclass (sent to Ray by value: workers cannot import tests)."""
    import buffer.actor

    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    monkeypatch.setattr(buffer.actor, "BufferActor", RecordingBufferActor)
    yield
    ray.cloudpickle.unregister_pickle_by_value(module)


def test_two_actors_two_ranks_every_version_everywhere_bounded_staleness_single_rank_steps(
    tmp_path, world_dir, searching_model_dir, recording_buffer
):
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        f"run.output_dir={tmp_path}", "run.name=two_by_two", *world_overrides(world_dir, searching_model_dir),
        "sft.enabled=false", "monitoring.enabled=false", "eval.at_start=false", "eval.at_end=false",
        # 4 episodes at a time per actor: the two batches the bound admits take several waves, so the actors are still
        # generating while the learner steps and publishes (with 16 or 8 at a time they finished first and idled: no
        # publish landed inside a turn, one run each; with 4, ten such turns)
        # two batches in flight: the rollouts can run ahead of the learner, so only the staleness bound (the
        # buffer's admission and eviction) keeps a batch from reaching the learner two versions late
        "rollout.num_actors=2", "rollout.group_size=4", "rollout.max_concurrent_episodes=4",
        "learner.num_ranks=2", "learner.zero_stage=3", f"learner.total_steps={STEPS}", f"learner.lr={LR}",
        "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=4",
        f"buffer.max_staleness={ETA}", "buffer.group_filter=none", "weight_sync.every_steps=1",
        "weight_sync.method=collective",
        "rollout.weight_update_mode=pause",  # a publish inside a turn recomputes its cache: exact per-token versions
        "cluster.rollout_actor_cpus=0.5", "cluster.learner_cpus=0.5",
        # graded rewards (searching, reading the answer, the tag format) so every batch has an advantage spread: the
        # steps move the weights, and versions are told apart by what they compute
        "reward.terms=[{name: exact_match, weight: 1.0}, {name: retrieval_hit, weight: 0.5}, "
        "{name: tag_count, weight: 0.5}]",
    ])  # fmt: skip
    rec = Recording()
    summary = recording_trainer(cfg, rec).run()
    run_dir = tmp_path / "two_by_two"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    assert summary["steps"] == STEPS and summary["version"] == STEPS and summary["actor_restarts"] == {}
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert len(rec.steps) == STEPS and rec.bumped == list(range(1, STEPS + 1))
    weights = {0: rec.steps[0].before, **rec.published}  # version -> the policy of that version

    check_every_actor_got_every_version(rec, rows, weights, searching_model_dir)
    check_staleness(rec, rows)
    check_single_rank_replay(rec, rows, cfg, searching_model_dir)


# ------------------------------------------------------------------------------------------- 1. publishing
def check_every_actor_got_every_version(rec: Recording, rows: list[dict], weights: dict, model_dir: Path) -> None:
    final = STEPS
    # each publish went to both actors, and both reported applying it
    assert [p.version for p in rec.publishes] == list(range(1, STEPS + 1))
    assert all(p.method == "collective" and p.num_actors == 2 and len(p.actor_seconds) == 2
               for p in rec.publishes), rec.publishes
    assert [r["publish"]["publish_version"] for r in rows] == [float(v) for v in range(1, STEPS + 1)]
    # each actor's engine applied every version, in order, and ends at the learner's final version
    actors = sorted(rec.final_rollout, key=lambda s: s.index)
    assert [s.index for s in actors] == [0, 1]
    for s in actors:
        assert s.version == final, (s.index, s.version)
        assert [u.version for u in s.weight_updates] == list(range(1, final + 1)), (s.index, s.weight_updates)
        assert s.finished > 0 and s.failed == 0, s
    assert set(rows[-1]["per_actor"]) == {"actor0", "actor1"}

    # what the learner consumed is what the actors pushed
    pushed = {t.meta.trajectory_id: t for t in rec.pushed}
    assert len(pushed) == len(rec.pushed) == sum(s.finished for s in actors)
    for step in rec.steps:
        for meta in step.batch.metas:
            assert pushed[meta.trajectory_id].meta.actor_id == meta.actor_id

    # every token each actor sampled was sampled with the weights of the version stamped on it: the engine's
    # log-probs are a transformers model's under that version's published weights (and not the previous version's).
    # Under weight_update_mode=pause a publish that overtakes a turn recomputes its cache with the new weights, so
    # this holds token by token, also across a publish inside a turn (counted in ``spanning``)
    models = {v: hf_model(model_dir, state) for v, state in weights.items()}
    diffs: dict[tuple[str, int], list[float]] = defaultdict(list)  # (actor, version) -> |behavior - reference|
    prev_diffs: dict[tuple[str, int], list[float]] = defaultdict(list)  # the same tokens under version - 1
    spanning: list[tuple[str, list[int]]] = []  # (actor, the versions of a model turn's tokens) with a publish inside
    for traj in rec.pushed:
        ids = torch.tensor(traj.prompt_ids + traj.response_ids)
        p = len(traj.prompt_ids)
        behavior = torch.tensor(traj.behavior_logprobs)
        versions = torch.tensor(traj.versions)
        generated = torch.tensor(traj.loss_mask) > 0
        for t in traj.turns:
            turn_versions = traj.versions[t.start:t.end]
            if t.kind == "model" and len(set(turn_versions)) > 1:  # a publish landed inside this turn
                spanning.append((traj.meta.actor_id, turn_versions))
        reference: dict[int, torch.Tensor] = {}  # version -> log-probs of the response's tokens
        for version in sorted(set(versions[generated].tolist())):
            positions = torch.nonzero(generated & (versions == version)).flatten()
            for v in (version, version - 1) if version > 0 else (version,):
                if v not in reference:
                    reference[v] = logprobs(models[v], ids)[p - 1:]
            key = (traj.meta.actor_id, version)
            diffs[key] += (behavior[positions] - reference[version][positions]).abs().tolist()
            if version > 0:
                prev_diffs[key] += (behavior[positions] - reference[version - 1][positions]).abs().tolist()
    report = {k: (len(v), max(v), float(np.mean(v)), float(np.mean(prev_diffs[k])) if prev_diffs[k] else None)
              for k, v in sorted(diffs.items())}
    print(f"(actor, version): (tokens, max |behavior - reference|, mean, mean under version - 1): {report}; "
          f"model turns with a publish inside: {[(a, Counter(v)) for a, v in spanning]}")
    for actor in ("actor0", "actor1"):
        seen = sorted(v for a, v in diffs if a == actor)
        assert set(seen) <= set(range(final + 1)) and len(seen) >= 2 and seen[-1] >= 1, (actor, seen)
    # publishes landed inside model turns, and under weight_update_mode=pause such a turn is labelled token by token:
    # its tokens before the publish carry the version it started at, those after it the newer one (contiguous,
    # never going back), and every token's log-prob is its own version's (checked below with all the others)
    assert spanning, "no publish landed inside a model turn: the pause-mode relabelling went untested"
    for actor, turn_versions in spanning:
        assert turn_versions == sorted(turn_versions) and turn_versions[0] < turn_versions[-1], (actor, turn_versions)
        assert turn_versions[-1] - turn_versions[0] == len(set(turn_versions)) - 1, (actor, turn_versions)
    for key, d in diffs.items():
        assert max(d) < LOGPROB_TOL, (key, report[key])
        if prev_diffs[key]:  # the check tells versions apart: the previous version's weights compute other log-probs
            assert np.mean(prev_diffs[key]) > 10 * np.mean(d), (key, report[key])


def hf_model(model_dir: Path, state: dict[str, np.ndarray]):
    """The transformers model with ``state`` loaded (the tied output head is the embedding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """``log p(ids[t + 1] | ids[:t + 1])`` for every ``t``."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]


# --------------------------------------------------------------------------------------------- 2. staleness
def check_staleness(rec: Recording, rows: list[dict]) -> None:
    consumed: Counter = Counter()
    for k, (step, row) in enumerate(zip(rec.steps, rows), 1):
        v = step.stats.version
        assert v == k - 1 and step.rank_versions == [v, v], (k, v, step.rank_versions)  # publishes every step
        per_traj = [staleness(v, m) for m in step.batch.min_versions()]
        assert step.batch.batch_size == 16 and OBS_VERSION not in step.batch.min_versions()
        assert max(per_traj) <= ETA, (k, v, per_traj)
        tokens = step.batch.versions[step.batch.loss_mask > 0]
        assert int(tokens.min()) >= v - ETA and int(tokens.max()) <= v, (k, v, tokens.unique().tolist())
        # what the run recorded for this batch agrees
        assert row["learner"]["staleness_max"] == max(per_traj), (k, row["learner"], per_traj)
        assert row["learner"]["staleness_mean"] == pytest.approx(np.mean(per_traj)), (k, row["learner"], per_traj)
        consumed.update(per_traj)
    assert dict(consumed) == dict(rec.final_buffer.staleness_histogram), (consumed, rec.final_buffer)
    # off-policy up to the bound: the asynchrony was real and the bound was reached
    assert max(consumed) == ETA, consumed


# ------------------------------------------------------------------------------------------ 3. single rank
def check_single_rank_replay(rec: Recording, rows: list[dict], cfg, model_dir: Path) -> None:
    from learner.learner import Learner

    one = cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"path": str(model_dir)}),
        "learner": cfg.learner.model_copy(update={"num_ranks": 1}),
    })  # fmt: skip
    single = Learner(one)
    assert single.world_size == 1
    for k, (step, row) in enumerate(zip(rec.steps, rows), 1):
        mine = single.state_dict_for_publish()
        # given the weights the two ranks had before this step (step 1: exactly the same start)
        if k == 1:
            for name, value in step.before.items():
                np.testing.assert_array_equal(mine[name], value, err_msg=name)
        else:
            assert_close_weights(mine, step.before, rec.steps[k - 2].before, f"before step {k}")
            for name, value in rec.published[k - 1].items():  # the ranks held exactly what they had published
                np.testing.assert_array_equal(step.before[name], value, err_msg=name)
        assert single.version == step.stats.version
        stats = single.train_step(step.batch)
        single.bump_version()
        two = row["learner"]
        assert two == step.stats.as_dict()  # metrics.jsonl has what the two ranks returned
        for key in COMPARED:
            assert getattr(stats, key) == pytest.approx(two[key], rel=1e-4, abs=1e-6), (k, key, getattr(stats, key),
                                                                                      two[key])
        assert two["grad_norm"] > 0  # the step had a gradient: the weights moved
        assert_close_weights(single.state_dict_for_publish(), rec.published[k], step.before, f"after step {k}")


def assert_close_weights(mine: dict, theirs: dict, start: dict, when: str) -> None:
    """``mine`` and ``theirs`` are the same update from ``start``, up to float summation order: the total difference
    is a tiny fraction of the update's size, and no element differs by more than a fraction of the learning rate
    (Adam turns float noise in a near-zero gradient into up to a fraction of lr, as test_learner_two_ranks says)."""
    assert mine.keys() == theirs.keys()
    moved = sum(float(np.abs(theirs[n] - start[n]).sum()) for n in theirs)
    apart = sum(float(np.abs(mine[n] - theirs[n]).sum()) for n in theirs)
    worst = max(float(np.abs(mine[n] - theirs[n]).max()) for n in theirs)
    print(f"{when}: weights moved {moved:.4g} in total, single rank apart {apart:.4g}, worst element {worst:.3g}")
    assert moved > 0, when
    assert apart < 1e-3 * moved, (when, apart, moved)
    assert worst < 0.3 * LR, (when, worst)
