"""``ray.init`` is bounded (``driver.cluster.RAY_INIT_TIMEOUT_S`` through ``waits.alarm_within``): a connection or a
local start that never finishes ends in one ``error:`` line naming it. ``ray.init`` is replaced by a stand-in that
waits for ever, as a connection to a cluster whose GCS answers and then stops does (Ray's retry loops): this tests
the caller; the real cluster and a port that is not Ray are in tests/integration/test_ray_address.py."""

from __future__ import annotations

import time

import pytest

from async_agent_rl.config import load_config
from async_agent_rl.errors import error_line

pytestmark = pytest.mark.unit


def _hangs(**kwargs):
    while True:  # Ray's connection loops: short sleeps and retries
        time.sleep(0.01)


@pytest.mark.parametrize("address", [None, "127.0.0.1:6390"])
def test_a_ray_init_that_never_finishes_ends_in_one_error_line_within_its_limit(monkeypatch, address):
    import driver.cluster as cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster.ray, "init", _hangs)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster, "check_address", lambda cfg: None)  # its GCS answered the check
    monkeypatch.setattr(cluster, "RAY_INIT_TIMEOUT_S", 0.5)
    overrides = [f"cluster.ray_address={address}"] if address else []
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        cluster.ray_init(load_config(None, overrides))
    assert time.monotonic() - t0 < 5
    line = error_line(info.value)
    assert line is not None and "did not answer within 0.5 s" in line
    assert (f"cluster.ray_address={address}" in line) if address else ("a local Ray cluster's start" in line)
