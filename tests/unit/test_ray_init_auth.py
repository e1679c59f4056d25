"""Bad inputs (the refusal half): the project never starts a local Ray cluster with authentication off (Ray
binds it to every interface), nor hands workers an authentication mode of their own. Nothing is started here; the
real cluster's sockets and authentication are checked in tests/integration/test_bad_inputs_run.py."""

from __future__ import annotations

import pytest

from async_agent_rl.config import load_config

pytestmark = pytest.mark.unit


def test_ray_init_refuses_a_local_cluster_without_authentication(monkeypatch):
    from async_agent_rl.errors import InputError
    from driver.cluster import ray_init

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(InputError, match="RAY_AUTH_MODE='disabled'"):
        ray_init(load_config(None))
    monkeypatch.delenv("RAY_AUTH_MODE")
    with pytest.raises(InputError, match="cluster.env_vars"):
        ray_init(load_config(None, ['cluster.env_vars={"RAY_AUTH_MODE": "disabled"}']))


@pytest.mark.parametrize("mode", ["", "none", "off", "Disabled", "tokens", " token"])
def test_ray_init_refuses_every_auth_mode_but_token(monkeypatch, mode):
    """Ray enables authentication only for RAY_AUTH_MODE=token (any case) or unset; every other value, the empty one
    included, turns it off. Until 2a19b0f (2026-11-25) only "disabled" was refused."""
    from async_agent_rl.errors import InputError, error_line
    from driver.cluster import ray_init

    monkeypatch.setenv("RAY_AUTH_MODE", mode)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(InputError) as info:
        ray_init(load_config(None))
    assert error_line(info.value).startswith(f"error: RAY_AUTH_MODE={mode!r} would start a local Ray cluster")


@pytest.mark.parametrize("mode", ["token", "TOKEN", "Token"])
def test_ray_init_accepts_token_in_any_case(monkeypatch, mode):
    """Accepted: the check passes on to ray.init (stubbed here: nothing is started)."""
    import ray

    from driver.cluster import ray_init

    monkeypatch.setenv("RAY_AUTH_MODE", mode)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from ray._private import ray_constants

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr("driver.cluster.require_token_auth", lambda: None)  # nothing started: no mode to ask Ray
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)  # restored after the test
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_init(load_config(None))
    assert len(calls) == 1
    # a local cluster on loopback only (tests/integration/test_ray_loopback.py checks the sockets)
    assert calls[0]["_node_ip_address"] == "127.0.0.1" and ray_constants.ENABLE_RAY_CLUSTER is False
