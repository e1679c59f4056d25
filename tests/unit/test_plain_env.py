"""The environment tests give to the Ray processes they start (``tests.helpers.plain_env``)."""

from __future__ import annotations

import os

import pytest

from tests.helpers import CLUSTERS_SWITCH, plain_env

pytestmark = pytest.mark.unit


def test_a_training_run_in_process_before_does_not_turn_clusters_off_for_a_second_node(monkeypatch):
    # what the driver does before starting its local cluster, in the pytest process (as an in-process training
    # test does): a `ray start --address` given this process's environment as is would refuse to join
    from ray._private import ray_constants

    from driver.cluster import loopback_only

    monkeypatch.setenv(CLUSTERS_SWITCH, "1")  # restored (with the constant) after the test
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x")
    loopback_only()
    assert os.environ[CLUSTERS_SWITCH] == "0"
    env = plain_env()
    assert CLUSTERS_SWITCH not in env and "RAY_ADDRESS" not in env and "RAY_AUTH_TOKEN" not in env
    assert env["PATH"] == os.environ["PATH"]
