"""The weight broadcast group (``async_agent_rl.weight_group``) on real gloo, its members as threads of this process:
every receiver gets every tensor bit for bit, in the agreed order; a sender whose weights do not match the agreed
specs refuses before sending anything; everything listens on loopback."""

from __future__ import annotations

import os
import threading

import numpy as np
import psutil
import pytest
import torch

from async_agent_rl.weight_group import WeightGroup, backend_for, listen_socket, weight_specs

pytestmark = pytest.mark.integration


def test_backend_by_device():
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "nccl"
    assert backend_for("cuda", "gloo") == "gloo"
    with pytest.raises(ValueError, match="allowed"):
        backend_for("cpu", "mpi")


def test_specs_name_dtype_and_shape_in_order():
    state = {"b": np.zeros((2, 3), np.float32), "a": torch.zeros(4, dtype=torch.bfloat16)}
    assert weight_specs(state) == [("b", "float32", (2, 3)), ("a", "bfloat16", (4,))]


def listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(os.getpid()).net_connections("inet")
            if c.status == "LISTEN"}


def test_every_receiver_gets_every_tensor_on_loopback():
    rng = np.random.default_rng(0)
    state = {"embed": rng.normal(size=(7, 5)).astype(np.float32), "norm": rng.normal(size=(5,)).astype(np.float32),
             "head": torch.arange(6, dtype=torch.float64).reshape(2, 3)}
    specs = weight_specs(state)
    before = listening()
    sock = listen_socket()
    port = sock.getsockname()[1]
    received, errors = {}, []

    def member(rank: int) -> None:
        try:
            group = WeightGroup(port, rank, 3, "gloo", timeout_s=30, generation=1)
            received[rank] = dict(group.receive(specs))
            group.close()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = WeightGroup(port, 0, 3, "gloo", timeout_s=30, listen=sock, generation=1)
    opened = listening() - before
    assert opened and all(ip == "127.0.0.1" for ip, _ in opened), opened
    with pytest.raises(ValueError, match="do not match"):  # refused before a single broadcast
        sender.send({k: state[k] for k in ("norm", "embed", "head")}, specs)
    assert sender.send(state, specs) == sum(int(np.asarray(v).nbytes) for v in state.values())
    for t in threads:
        t.join(60)
    sender.close()
    assert not errors, errors
    for rank in (1, 2):
        assert list(received[rank]) == ["embed", "norm", "head"]
        for name, value in state.items():
            got = received[rank][name]
            assert got.dtype == torch.as_tensor(value).dtype
            assert torch.equal(got, torch.as_tensor(value)), name


def test_rank_zero_owns_the_socket_and_nccl_needs_gpus():
    with pytest.raises(ValueError, match="rank 0"):
        WeightGroup(1, 0, 2, "gloo", timeout_s=1)
    if not torch.cuda.is_available():
        sock = listen_socket()
        with pytest.raises(RuntimeError, match="needs CUDA"):
            WeightGroup(sock.getsockname()[1], 0, 1, "nccl", timeout_s=1, listen=sock)
