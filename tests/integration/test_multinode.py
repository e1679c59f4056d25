"""The system on a multi-node Ray cluster. The cluster is one Ray's own tests build
(``ray.cluster_utils.Cluster``, here ``tests/multinode.py``): several raylets on this machine, each a node with its
own resources and its own object store, all on 127.0.0.1, with token authentication; the drivers are separate
processes that connect to it by address, as on a real cluster.

- Placement and weights: the learner rank goes to the node that offers ``cluster.learner_resources``, two vLLM
  engines to the two nodes that offer ``cluster.rollout_resources`` (Ray's record of where each actor runs is
  checked, not the config); the learner's weights reach both engines across nodes by the object store (the object
  is then held in the engines' nodes' stores) and by the collective broadcast, and each engine then computes with
  exactly the learner's weights (its log-probs are those of the learner's state in transformers).
- A rollout node lost mid-run: its actor is restarted on a node with room, or, with none, the run goes on with
  fewer actors; lost episodes are counted, every batch keeps the staleness bound and the run finishes. Asks no node
  can meet end the run before anything starts, in one ``error:`` line naming the key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import Run, world_overrides
from tests.multinode import LocalNodes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRAINER = {"num_cpus": 2, "resources": {"trainer": 2}}
ROLLOUT = {"num_cpus": 1, "resources": {"rollout": 1}}


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip.startswith("::ffff:127.") or ip == "::1"


PUBLISH = textwrap.dedent('''
    import json, sys
    import numpy as np
    import ray
    from async_agent_rl.batch import pack_batch
    from async_agent_rl.config import build_config
    from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
    from driver.cluster import check_placement, ray_init
    from driver.weight_sync import CollectivePublisher, ObjectStorePublisher
    from learner.actor import create_learner_group
    from tests.helpers import VLLM_ENV, EngineHost
    from tests.integration.test_weight_publish import reference_logprobs

    address, model_dir = sys.argv[1], sys.argv[2]
    PROMPT, TARGET = [101, 102, 103, 104], [501, 502, 503, 504, 505, 506]
    cfg = build_config({
        "model": {"path": model_dir, "max_model_len": 256},
        "data": {"max_prompt_length": 128},
        "rollout": {"group_size": 1, "max_response_length": 128, "max_obs_length": 64},
        "learner": {"batch_size": 1, "mini_batch_size": 1, "micro_batch_size": 1, "ppo_epochs": 2, "lr": 1e-3},
        "algorithm": {"advantage_estimator": "grpo", "policy_loss": "decoupled_ppo"},
        "weight_sync": {"method": "collective"},
        "cluster": {"ray_address": address, "learner_cpus": 0.5, "learner_resources": {"trainer": 1},
                    "rollout_resources": {"rollout": 1}},
    })
    ray_init(cfg)  # the run's own path to a cluster at an address
    check_placement(cfg, ray.nodes())
    node = lambda actor: ray.get(actor.__ray_call__.remote(lambda a: ray.get_runtime_context().get_node_id()))
    hosts = [ray.remote(num_cpus=0)(EngineHost).options(resources=cfg.cluster.rollout_resources,
                                                        runtime_env={"env_vars": VLLM_ENV}).remote()
             for _ in range(2)]
    ray.get([h.start.remote(model_dir, cfg) for h in hosts], timeout=600)
    learner = create_learner_group(cfg)
    n = len(TARGET)
    episode = Trajectory(prompt_ids=PROMPT, response_ids=TARGET, loss_mask=[1] * n, behavior_logprobs=[-8.0] * n,
                         versions=[0] * n, turns=[TurnSpan("model", 0, n)], reward=1.0, meta=EpisodeMeta())
    batch = pack_batch([episode], pad_id=0)
    out = {"driver": ray.get_runtime_context().get_node_id(), "learner": node(learner.actors[0]),
           "engines": [node(h) for h in hosts], "before": ray.get(hosts[0].greedy.remote(PROMPT, n))[0]}

    def check(tag, version):
        state = ray.get(learner.state_dict_ref())
        ref = reference_logprobs(model_dir, state, PROMPT, TARGET)
        res = [ray.get(h.greedy.remote(PROMPT, n)) for h in hosts]
        out[tag] = {"ids": [r[0] for r in res], "versions": [r[2] for r in res], "engine_version": [r[3] for r in res],
                    "max_diff": [float(np.max(np.abs(np.array(r[1]) - ref))) for r in res],
                    "logprobs": [list(map(float, r[1])) for r in res], "version": version}

    for _ in range(6):
        learner.train_step(batch)
    version = learner.bump_version()
    ref = learner.state_dict_ref()
    stats = ObjectStorePublisher(hosts, 300).publish(version, ref)
    out["store_locations"] = ray.experimental.get_object_locations([ref])[ref]["node_ids"]
    out["store_stats"] = {"num_actors": stats.num_actors, "seconds": stats.seconds}
    check("object_store", version)

    learner.train_step(batch)
    version = learner.bump_version()
    collective = CollectivePublisher(hosts, learner, backend="gloo", timeout_s=120)
    stats = collective.publish(version)
    out["collective_stats"] = {"num_actors": stats.num_actors, "bytes": stats.bytes}
    check("collective", version)
    collective.close()
    print("RESULT " + json.dumps(out))
    ray.shutdown()
''')


def driver(script: str, nodes: LocalNodes, *args: str, timeout_s: float = 900) -> dict:
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=nodes.env, capture_output=True,
                       text=True, timeout=timeout_s)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, f"exit {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(1200)
def test_weights_reach_engines_on_other_nodes_by_both_paths(tiny_model_dir):
    with LocalNodes(TRAINER, {"r1": ROLLOUT, "r2": ROLLOUT}) as nodes:
        ids = nodes.node_ids
        res = driver(PUBLISH, nodes, nodes.address, str(tiny_model_dir))
        # placed by the config's resources, as Ray itself reports it: the learner beside the driver on the trainer
        # node, one engine on each rollout node
        assert res["learner"] == res["driver"] == ids["head"]
        assert sorted(res["engines"]) == sorted([ids["r1"], ids["r2"]])
        table = {a["class"]: a for a in nodes.actors() if a["class"] == "LearnerActor"}
        assert table["LearnerActor"]["node"] == "head"

        target = [501, 502, 503, 504, 505, 506]
        assert res["before"] != target
        for path in ("object_store", "collective"):
            got = res[path]
            # each engine computes with exactly the learner's weights: its greedy tokens are the trained response
            # and its log-probs the learner's state's own (transformers); the version stamps are the publish's
            assert got["ids"] == [target, target], (path, got)
            assert max(got["max_diff"]) < 2e-3, (path, got["max_diff"])
            assert got["versions"] == [[got["version"]] * len(target)] * 2 and got["engine_version"] == [got["version"]] * 2
        # the second publish carried other weights than the first (one more learner step)
        assert max(abs(a - b) for a, b in zip(res["object_store"]["logprobs"][0], res["collective"]["logprobs"][0])) > 1e-4
        # the object crossed object-store boundaries: both rollout nodes' stores hold a copy of the learner's state
        assert {ids["r1"], ids["r2"]} <= set(res["store_locations"]), (res["store_locations"], ids)
        assert res["store_stats"]["num_actors"] == res["collective_stats"]["num_actors"] == 2
        # every raylet, GCS and worker of the cluster listens on loopback only
        listening = nodes.listening()
        assert listening and not [s for s in listening if not is_loopback(s[0])], listening


# ------------------------------------------------------------------------------------------------ a node lost
SMALL = [
    "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8",
    "rollout.group_size=4", "rollout.max_concurrent_episodes=16", "eval.num_questions=8", "eval.every_steps=0",
    "eval.at_start=false", "monitoring.enabled=false", "sft.enabled=false",
    "buffer.group_filter=none",  # the random-init policy never scores: every group would be filtered
]  # fmt: skip
ETA = 1
STEPS = 8


def placed(nodes: LocalNodes) -> dict[str, dict]:
    """Ray's record of the run's actors by name (rollout-I) or class (BufferActor, LearnerActor), the live ones
    first (an actor of an earlier run on the same cluster is dead)."""
    out: dict[str, dict] = {}
    for a in sorted(nodes.actors(), key=lambda a: a["state"] == "DEAD"):
        out.setdefault(a["name"] or a["class"], a)
    return out


def wait_until(check, timeout_s: float, what: str, run: Run) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if run.proc.poll() is not None or time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"{what}: not within {timeout_s} s (exit {run.proc.returncode}):\n{run.text()}")
        time.sleep(0.5)


@pytest.mark.timeout(1500)
def test_a_rollout_node_lost_mid_run(tmp_path, world_dir, tiny_model_dir):
    """A training on 4 nodes (learner and buffer on the head, 2 rollout actors on 2 of 3 rollout nodes). Rollout
    actor 0's node is lost at step 2: Ray restarts the actor on the spare node, the driver sets it up again, its
    in-flight episodes counted lost. Then actor 1's node is lost and no node has room for it: the run goes on with
    actor 0 alone, said in one [fault] line. The run finishes every step, exit 0, the staleness bound held on every
    batch. Before it, a run asking for a resource no node has is refused in one error line."""
    from async_agent_rl.config import load_config
    from driver.plots import read_jsonl

    def config(*extra: str) -> Path:
        cfg = load_config(REPO / "configs/quickstart.yaml", [
            *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir),
            "rollout.num_actors=2", f"buffer.max_staleness={ETA}", f"learner.total_steps={STEPS}",
            "cluster.rollout_resources={rollout: 1}", "cluster.learner_resources={trainer: 1}",
            "cluster.buffer_resources={trainer: 1}", "weight_sync.method=object_store", *extra])  # fmt: skip
        return cfg.save(tmp_path / f"cfg{len(extra)}.yaml")

    rollout_node = {"num_cpus": 1, "resources": {"rollout": 1}}
    with LocalNodes(TRAINER, {"r1": rollout_node, "r2": rollout_node, "r3": rollout_node}) as nodes:
        address = f"cluster.ray_address={nodes.address}"
        # resources no node offers: one error line, before any actor waits for them
        bad = Run([sys.executable, "-m", "driver.cli", "train", "--config", str(config(address,
                   "cluster.rollout_resources={gpu_node: 1}"))], env=nodes.env)  # fmt: skip
        assert bad.finish(300) == 2, bad.text()
        errors = [x for x in bad.err if x.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(
            "error: cluster.rollout_resources={gpu_node: 1}: the run's 2 rollout actors each ask Ray for {CPU: 0.5, "
            "gpu_node: 1} on one node, and the cluster's nodes can hold 0 of them"), bad.text()
        assert not [a for a in nodes.actors() if a["class"] == "RolloutActor"]

        run = Run([sys.executable, "-m", "driver.cli", "train", "--config", str(config(address))], env=nodes.env)
        try:
            metrics = tmp_path / "run" / "metrics.jsonl"
            steps = lambda: len(read_jsonl(metrics)) if metrics.is_file() else 0  # noqa: E731
            wait_until(lambda: steps() >= 2, 600, "step 2", run)
            where = placed(nodes)
            assert where["LearnerActor"]["node"] == where["BufferActor"]["node"] == "head", where
            first, second = where["rollout-0"]["node"], where["rollout-1"]["node"]
            assert {first, second} < {"r1", "r2", "r3"} and first != second, where
            spare = ({"r1", "r2", "r3"} - {first, second}).pop()

            lost = nodes.remove(first)
            wait_until(lambda: any(x.startswith("[fault] rollout actor 0 restarted") for x in run.out), 400,
                       "actor 0's restart", run)
            where = placed(nodes)
            assert where["rollout-0"]["state"] == "ALIVE" and where["rollout-0"]["node"] == spare, where
            assert where["rollout-0"]["restarts"] == 1, where
            at_restart = steps()

            wait_until(lambda: steps() > at_restart, 300, "a step after the restart", run)
            nodes.remove(second)
            rc = run.finish(600)
            assert rc == 0, run.text()
        finally:
            run.kill()

    out = run.out
    faults = [x for x in out if x.startswith("[fault]")]
    # actor 0: its node named as lost, restarted on the spare node
    assert any(x.startswith(f"[fault] rollout actor 0: its node {lost[:8]} at 127.0.0.1 was lost (") and
               x.endswith("; restarting it") for x in faults), "\n".join(faults)
    restarted = next(x for x in faults if x.startswith("[fault] rollout actor 0 restarted"))
    assert f"on node {nodes.node_ids[spare][:8]};" in restarted, "\n".join(faults)
    # actor 1: no node has room; the run goes on with one actor, in one line
    gone = [x for x in faults if x.startswith("[fault] rollout actor 1: no live node has room for it (CPU 0.5, "
                                              "rollout 1) for 10 s; the run goes on with 1 rollout actor(s) of 2")]
    assert len(gone) == 1, "\n".join(faults)
    assert not any(x.startswith("[fault] rollout actor 1 restarted") for x in faults), "\n".join(faults)

    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["actor_restarts"] == {"actor0": 1, "actor1": 1}, summary
    # the episodes in flight on each lost node are counted lost, as each [fault] line says: how many depends on
    # the moment (an actor waiting for admission has none in flight), so the count is checked, not its size
    said = [int(x.rsplit("; ", 1)[1].split()[0]) for x in faults if x.endswith(" in-flight episodes lost")]
    assert len(said) == 2, "\n".join(faults)
    assert summary["lost_episodes"] == rows[-1]["lost_episodes"] == sum(said), (summary, said)
    # every batch within the staleness bound, before and after each loss
    assert all(r["learner"]["staleness_max"] <= ETA for r in rows), [r["learner"]["staleness_max"] for r in rows]
    # after actor 1 was given up the restarted actor 0 alone fed the learner
    last = rows[-1]["per_actor"]
    assert last["actor0"]["finished"] > rows[at_restart - 1]["per_actor"]["actor0"]["finished"], rows[-1]
    assert Path(summary["final_policy"], "config.json").is_file()


@pytest.mark.timeout(1500)
def test_losing_the_node_of_the_learner_and_buffer_ends_the_run_in_one_line_and_it_resumes(tmp_path, world_dir,
                                                                                            tiny_model_dir):
    """The learner and the replay buffer on node t1 (the driver on the head), one rollout actor on r1. t1 is lost
    after the step-2 checkpoint: Ray restarts neither, and the run ends in one error line naming the node, what it
    held and the checkpoint to resume from (exit 2, no traceback). Once a new node offers what they ask, the run
    resumes from that checkpoint and finishes."""
    from async_agent_rl.config import load_config
    from driver.plots import read_jsonl

    trainer_node = {"num_cpus": 2, "resources": {"trainer": 2}}
    with LocalNodes({"num_cpus": 1}, {"t1": trainer_node, "r1": ROLLOUT}) as nodes:
        cfg = load_config(REPO / "configs/quickstart.yaml", [
            *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir),
            f"buffer.max_staleness={ETA}", "learner.total_steps=6", "learner.checkpoint_every=2",
            f"cluster.ray_address={nodes.address}", "cluster.rollout_resources={rollout: 1}",
            "cluster.learner_resources={trainer: 1}", "cluster.buffer_resources={trainer: 1}"])  # fmt: skip
        run_dir = tmp_path / "run"
        run = Run([sys.executable, "-m", "driver.cli", "train", "--config", str(cfg.save(tmp_path / "cfg.yaml"))],
                  env=nodes.env)
        try:
            saved = run_dir / "checkpoints" / "step_000002"
            wait_until(lambda: saved.is_dir() and len(read_jsonl(run_dir / "metrics.jsonl")) >= 3, 600,
                       "the step-2 checkpoint and step 3", run)
            where = placed(nodes)
            assert where["LearnerActor"]["node"] == where["BufferActor"]["node"] == "t1", where
            lost = nodes.remove("t1")
            assert run.finish(300) == 2, run.text()
        finally:
            run.kill()
        errors = [x for x in run.err if x.startswith("error:")]
        assert len(errors) == 1, run.text()
        assert errors[0].startswith(f"error: the node {lost[:8]} at 127.0.0.1 holding the replay buffer and the "
                                    "learner was lost at step "), errors
        ckpt = errors[0].split("resume from ", 1)[1].split(" ", 1)[0]
        assert errors[0].endswith(f"with `async-agent-rl train --resume {run_dir}` once nodes offer what they ask")
        assert Path(ckpt).parent == run_dir / "checkpoints" and Path(ckpt).name >= "step_000002", errors
        assert not [x for x in run.err if x.startswith("Traceback")], run.text()

        nodes.add("t2", trainer_node)
        again = Run([sys.executable, "-m", "driver.cli", "train", "--resume", str(run_dir)], env=nodes.env)
        try:
            assert again.finish(600) == 0, again.text()
        finally:
            again.kill()
        step = int(Path(ckpt).name.removeprefix("step_"))
        assert any(x.startswith(f"[resume] {ckpt}: step {step}, version ") for x in again.out), again.text()
        assert any(a["class"] == "LearnerActor" and a["node"] == "t2" for a in nodes.actors())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
