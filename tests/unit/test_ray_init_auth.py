"""Issue 13, cause 2 (the refusal half): the project never starts a local Ray cluster with authentication off (Ray
binds it to every interface), nor hands workers an authentication mode of their own. Nothing is started here; the
real cluster's sockets and authentication are checked in tests/integration/test_bad_inputs_run.py."""

from __future__ import annotations

import pytest

from async_agent_rl.config import load_config


def test_ray_init_refuses_a_local_cluster_without_authentication(monkeypatch):
    from async_agent_rl.errors import InputError
    from driver.train import _ray_init

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(InputError, match="RAY_AUTH_MODE=disabled"):
        _ray_init(load_config(None))
    monkeypatch.delenv("RAY_AUTH_MODE")
    with pytest.raises(InputError, match="cluster.env_vars"):
        _ray_init(load_config(None, ['cluster.env_vars={"RAY_AUTH_MODE": "disabled"}']))
