"""Issue 33: the system on a multi-node Ray cluster. The cluster is one Ray's own tests build
(``ray.cluster_utils.Cluster``, here ``tests/multinode.py``): several raylets on this machine, each a node with its
own resources and its own object store, all on 127.0.0.1, with token authentication; the drivers are separate
processes that connect to it by address, as on a real cluster.

- Placement and weights: the learner rank goes to the node that offers ``cluster.learner_resources``, two vLLM
  engines to the two nodes that offer ``cluster.rollout_resources`` (Ray's record of where each actor runs is
  checked, not the config); the learner's weights reach both engines across nodes by the object store (the object
  is then held in the engines' nodes' stores) and by the collective broadcast, and each engine then computes with
  exactly the learner's weights (its log-probs are those of the learner's state in transformers).
- Asks no node can meet end the run before anything starts, in one ``error:`` line naming the key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
