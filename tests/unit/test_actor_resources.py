"""What the run's actors ask of a local Ray cluster it starts: all of them must fit at once, or the run is refused
before anything starts (Ray leaves an actor it cannot place pending for ever)."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_agent_rl.config import ConfigError, load_config
from async_agent_rl.errors import InputError, error_line
from driver.cluster import check_actors_fit, check_placement

pytestmark = pytest.mark.unit


def test_actors_that_cannot_all_fit_on_the_local_cluster_are_refused_before_they_start():
    """A learner or rollout actor asking for more than the local cluster has stayed pending for ever."""
    cfg = load_config(None, ["rollout.num_actors=2", "learner.num_ranks=2"])  # 2 x 0.5 + 2 x 0.5 CPUs
    check_actors_fit(cfg, {"CPU": 2.0})
    with pytest.raises(InputError) as err:
        check_actors_fit(cfg, {"CPU": 1.0})
    assert error_line(err.value) == (
        "error: the run's actors ask the local Ray cluster for 2 CPUs (rollout actors 2 x 0.5, learner ranks 2 x 0.5) "
        "and it has 1: raise cluster.num_cpus or lower cluster.*_cpus")
    with pytest.raises(InputError, match=r"for 1 GPUs \(learner ranks 1 x 1\) and it has 0: lower cluster\.\*_gpus"):
        check_actors_fit(load_config(None, ["cluster.learner_gpus=1"]), {"CPU": 8.0})


# ------------------------------------------------------------------------------------------------ custom resources
def node(node_id: str, alive: bool = True, **resources: float) -> dict:
    """A ``ray.nodes()`` entry."""
    return {"NodeID": node_id * 7, "Alive": alive, "NodeManagerAddress": "127.0.0.1",
            "Resources": {"node:127.0.0.1": 1.0, "memory": 1e9, **resources}}


PLACED = ["rollout.num_actors=2", "cluster.rollout_resources={rollout: 1}", "cluster.learner_resources={trainer: 1}",
          "cluster.buffer_resources={trainer: 1}"]


def test_actors_placed_by_custom_resources_are_checked_against_the_nodes():
    cfg = load_config(None, PLACED)
    nodes = [node("aaaaaaaa", CPU=2, trainer=2), node("bbbbbbbb", CPU=1, rollout=1), node("cccccccc", CPU=1, rollout=1)]
    check_placement(cfg, nodes)
    check_placement(load_config(None, []), [node("aaaaaaaa", CPU=1)])  # no custom resource asked: not checked

    # one rollout node lost: two actors asking one `rollout` each cannot both be placed
    with pytest.raises(InputError) as err:
        check_placement(cfg, [nodes[0], nodes[1], node("cccccccc", alive=False, CPU=1, rollout=1)])
    line = error_line(err.value)
    assert line.startswith("error: cluster.rollout_resources={rollout: 1}: the run's 2 rollout actors each ask Ray "
                           "for {CPU: 0.5, rollout: 1} on one node, and the cluster's nodes can hold 1 of them "
                           "(node aaaaaaaa at 127.0.0.1: {CPU: 2, trainer: 2}; node bbbbbbbb at 127.0.0.1: {CPU: 1, "
                           "rollout: 1})"), line
    assert "cccccccc" not in line and "memory" not in line
    # the resource is there, but not together with the CPUs an actor asks on the same node
    with pytest.raises(InputError, match=r"cluster.rollout_resources=.*can hold 0 of them"):
        check_placement(cfg, [nodes[0], node("bbbbbbbb", rollout=2)])
    # a local cluster has no custom resource at all
    with pytest.raises(InputError, match=r"cluster.learner_resources=\{trainer: 1\}: the run's 1 learner ranks .* "
                                         r"can hold 0 of them"):
        check_placement(load_config(None, ["cluster.learner_resources={trainer: 1}"]), [node("aaaaaaaa", CPU=2)])
    # each kind fits on its own, but the learner and the buffer share the one `trainer` the node has
    with pytest.raises(InputError, match=r"ask the Ray cluster for 2 of the custom resource 'trainer' \(buffer 1 x "
                                         r"1, learner ranks 1 x 1\) and its nodes have 1"):
        check_placement(cfg, [node("aaaaaaaa", CPU=2, trainer=1), *nodes[1:]])


@pytest.mark.parametrize("override, match", [
    ("cluster.rollout_resources={CPU: 1}", "one of Ray's own resources"),
    ("cluster.learner_resources={GPU: 1}", "one of Ray's own resources"),
    ("cluster.buffer_resources={memory: 1000}", "one of Ray's own resources"),
    ("cluster.rollout_resources={rollout: 0}", "above 0"),
    ("cluster.rollout_resources={rollout: -1}", "above 0"),
    ("cluster.rollout_resources={rollout: .nan}", "cluster.rollout_resources"),
    ("cluster.rollout_resources={'': 1}", "must not be empty"),
    ("cluster.rollout_resources=[rollout]", "cluster.rollout_resources"),
])
def test_custom_resource_keys_refuse_bad_values(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_custom_resources_reach_the_actor_asks():
    cfg = load_config(None, [*PLACED, "cluster.rollout_actor_cpus=0.25"])
    assert cfg.placement() == [("buffer", 1, {"trainer": 1.0}), ("rollout actors", 2, {"CPU": 0.25, "rollout": 1.0}),
                               ("learner ranks", 1, {"CPU": 0.5, "trainer": 1.0})]
    assert cfg.actor_asks("trainer") == [("buffer", 1, 1.0), ("rollout actors", 2, 0.0), ("learner ranks", 1, 1.0)]
    assert cfg.actor_asks("CPU") == load_config(None, ["rollout.num_actors=2",
                                                       "cluster.rollout_actor_cpus=0.25"]).actor_asks("CPU")


# ------------------------------------------------------------------------------------------------ several machines
def machine(node_id: str, address: str, **resources: float) -> dict:
    return node(node_id, **resources) | {"NodeManagerAddress": address}


HEAD, OTHER = "10.0.0.5", "10.0.0.6"
MACHINES = [machine("aaaaaaaa", HEAD, CPU=8, trainer=2), machine("bbbbbbbb", OTHER, CPU=8, rollout=2)]
ACROSS = [*PLACED, "weight_sync.method=object_store", f"retriever.host={HEAD}"]  # the recipe of OPERATIONS.md


def test_a_run_on_several_machines_is_refused_what_listens_on_loopback():
    from driver.cluster import check_machines

    check_machines(load_config(None, ACROSS), MACHINES, HEAD)  # the documented recipe passes
    # one machine, several raylets (every node at one address): nothing to refuse, whatever the config
    check_machines(load_config(None, ["weight_sync.method=collective", "learner.num_ranks=2"]),
                   [node("aaaaaaaa", CPU=8), node("bbbbbbbb", CPU=8)], "127.0.0.1")
    refused = {
        "weight_sync.method=collective": [*ACROSS, "weight_sync.method=collective"],
        "retriever.host=127.0.0.1": [*ACROSS, "retriever.host=127.0.0.1"],
        "learner.num_ranks=2": [*ACROSS, "learner.num_ranks=2", "cluster.learner_resources={}"],
    }
    for key, overrides in refused.items():
        with pytest.raises(InputError) as e:
            check_machines(load_config(None, overrides), MACHINES, HEAD)
        line = error_line(e.value)
        assert line.startswith(f"error: {key}: the Ray cluster's nodes are on 2 machines (10.0.0.5, 10.0.0.6)"), line
    # a retriever the user runs, or rollout actors kept on the driver's machine, need no reachable server of the run's
    check_machines(load_config(None, [*ACROSS, "retriever.host=127.0.0.1", "retriever.url=http://10.0.0.7:8000"]),
                   MACHINES, HEAD)
    check_machines(load_config(None, [*ACROSS, "retriever.host=127.0.0.1", "cluster.rollout_resources={trainer: 1}",
                                      "cluster.learner_resources={}", "cluster.buffer_resources={}"]), MACHINES, HEAD)
    # two learner ranks kept on one machine by a resource only it offers
    check_machines(load_config(None, [*ACROSS, "learner.num_ranks=2"]), MACHINES, HEAD)


QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def test_a_job_on_several_nodes_is_refused_relative_paths():
    from driver.cluster import check_job_paths

    quickstart = load_config(QUICKSTART, [])  # relative model and data paths, built by the driver
    two = [node("aaaaaaaa", CPU=2), node("bbbbbbbb", CPU=1)]
    job = {"working_dir": "gcs://_ray_pkg_0123.zip", "env_vars": {}}
    with pytest.raises(InputError) as e:
        check_job_paths(quickstart, two, job)
    line = error_line(e.value)
    assert line.startswith("error: run.output_dir=runs, model.path=runs/quickstart/model, data.world_dir=runs/quickstart"
                           "/world, data.train_files=runs/quickstart/world/train.parquet, "), line
    assert "on a cluster of 2 nodes" in line
    check_job_paths(quickstart, two, None)  # not a job: the actors share the driver's folder
    check_job_paths(quickstart, two, {"env_vars": {}})  # a job without a working dir
    check_job_paths(quickstart, [two[0], node("bbbbbbbb", alive=False, CPU=1)], job)  # one live node
    absolute = load_config(QUICKSTART, [
        "run.output_dir=/shared/runs", "model.path=/shared/model", "data.world_dir=/shared/world",
        "data.train_files=[/shared/world/train.parquet]", "data.test_files=[/shared/world/test.parquet]",
        "data.corpus_file=/shared/world/corpus.jsonl"])
    check_job_paths(absolute, two, job)


def test_the_evaluator_beside_training_asks_what_a_rollout_actor_asks_and_counts_in_the_fit():
    beside = ["eval.every_steps=5", "eval.beside=true", "cluster.rollout_actor_cpus=0.5"]
    cfg = load_config(None, [*PLACED, *beside])
    assert cfg.evaluators == 1
    assert ("evaluator", 1, {"CPU": 0.5, "rollout": 1.0}) in cfg.placement()
    assert ("evaluator", 1, 0.5) in cfg.actor_asks("CPU")
    # not beside, or no evaluation due before the last step (the end one runs on rollout actor 0): no evaluator
    assert load_config(None, ["eval.every_steps=5", "eval.beside=true", "learner.total_steps=5"]).evaluators == 0
    with pytest.raises(ConfigError, match="eval.beside=true needs eval.every_steps > 0"):
        load_config(None, ["eval.beside=true"])
    assert load_config(None, ["eval.every_steps=5"]).evaluators == 0
    assert all(w != "evaluator" for w, _, _ in load_config(None, ["eval.every_steps=5"]).actor_asks("CPU"))
    # buffer 0 + a rollout actor 0.5 + a learner rank 0.5 fit 1 CPU; with the evaluator they need 1.5
    small = ["cluster.buffer_cpus=0", "cluster.learner_cpus=0.5", "cluster.rollout_actor_cpus=0.5"]
    check_actors_fit(load_config(None, small), {"CPU": 1.0})
    with pytest.raises(InputError, match=r"1.5 CPUs .*evaluator 1 x 0.5"):
        check_actors_fit(load_config(None, [*small, *beside[:2]]), {"CPU": 1.0})
