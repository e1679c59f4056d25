"""A rollout actor is created from plain values only: Ray re-runs a restarted actor's
``__init__`` with the arguments it was created with, and with ``max_restarts > 0`` it logs an error-level line for any
argument it keeps by reference (``core_worker.cc: ... has constructor arguments in the object store and max_restarts
> 0``). The buffer actor's handle was one: every training start showed that line. The handle now comes with
``setup(buffer)``, which the driver calls at the start and after every restart."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import actors.rollout_actor as rollout_actor
from actors.rollout_actor import RolloutActor, create_rollout_actors
from async_agent_rl.config import load_config

pytestmark = pytest.mark.unit


def plain(value: Any) -> bool:
    """Data Ray sends inline, by value: no ObjectRef, no actor handle, nothing else it could keep by reference."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def test_rollout_actors_are_created_from_plain_values_and_given_the_buffer_at_setup(monkeypatch):
    created: list[tuple[tuple, dict]] = []

    class Recorder:  # stands for ray.remote(...)(RolloutActor): records what .options(...).remote(...) is given
        def __call__(self, cls):
            assert cls is RolloutActor
            return self

        def options(self, **options):
            return self

        def remote(self, *args, **kwargs):
            created.append((args, kwargs))

    monkeypatch.setattr(rollout_actor.ray, "remote", lambda **options: Recorder())
    cfg = load_config(None, ["rollout.num_actors=2"])
    create_rollout_actors(cfg, retriever_url="http://127.0.0.1:8000", model_path="model-dir", version=3,
                          max_restarts=2)
    assert len(created) == 2
    for args, kwargs in created:
        assert plain(list(args)) and plain(kwargs), [type(a).__name__ for a in args]
    assert "buffer" in inspect.signature(RolloutActor.setup).parameters
    assert "buffer" not in inspect.signature(RolloutActor.__init__).parameters
