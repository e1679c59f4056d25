"""Ray's own line of a worker's death is not on the console: the driver of Ray prints every error message of the
cluster (``log_to_driver=False`` notwithstanding), so a killed engine core put a ``(raylet) A worker died or was
killed ...`` line beside the run's one ``[fault]`` line of that death. ``cluster_errors_to_log`` (called right after
``ray.init``) sends that message to Ray's logger (the run's log file) and leaves the cluster's other messages on the
console. Ray's real printer is called, without a cluster."""

from __future__ import annotations

import logging

import pytest
import ray._private.worker as ray_worker

from driver.cluster import cluster_errors_to_log

pytestmark = pytest.mark.unit

DEATH = ("A worker died or was killed while executing a task by an unexpected system error. To troubleshoot the "
         "problem, check the logs for the dead worker. Lease ID: 01 Worker ID: 02 Node ID: 03 Worker exit type: "
         "SYSTEM_ERROR")
OTHER = "The node with node id: 04 has been marked dead because the detector has missed too many heartbeats."


def test_a_workers_death_goes_to_the_log_and_other_cluster_messages_stay_on_the_console(monkeypatch, capsys, caplog):
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored after the test
    cluster_errors_to_log()
    cluster_errors_to_log()  # idempotent: one wrapper, not two
    with caplog.at_level(logging.WARNING, logger="ray.raylet"):
        ray_worker.print_to_stdstream({"lines": [DEATH], "pid": "raylet", "is_err": False}, ignore_prefix=False)
        ray_worker.print_to_stdstream({"lines": [OTHER], "pid": "raylet", "is_err": False}, ignore_prefix=False)
        ray_worker.print_to_stdstream({"lines": ["a worker's own line"], "pid": 1234, "is_err": False,
                                       "actor_name": "", "task_name": "", "ip": "127.0.0.1"}, ignore_prefix=False)
    out = capsys.readouterr()
    console = out.out + out.err
    assert "A worker died" not in console, console
    assert OTHER in console and "a worker's own line" in console, console
    logged = [r for r in caplog.records if r.name == "ray.raylet"]
    assert [r.getMessage() for r in logged] == [DEATH] and logged[0].levelno == logging.WARNING
