"""The weight broadcast group: learner rank 0 and every rollout engine's workers in one process group of their own.

Used by the collective weight path (``weight_sync.method: collective``): the learner's rank 0 broadcasts each
tensor of the policy and the engines' workers receive it straight into memory they load from, with no copy through
Ray's object store or a file. The group is made outside torch.distributed's default group (DeepSpeed's group in
the learner, vLLM's own group in its workers stay untouched): a ``TCPStore`` for the rendezvous and a bare gloo
(CPU) or NCCL (GPU) process group over it, each call naming its root rank in the group.

Security: the store's server listens on a socket the learner binds to 127.0.0.1 itself (``listen_socket``), and
gloo's connections are made on the loopback device, so nothing of the group listens on another interface. The
store carries only gloo's rendezvous bytes and the broadcasts only raw tensor bytes: nothing is unpickled. A
multi-node deployment would need a routable address and, since the group has no authentication, a private network.

Both sides go through ``WeightSpec`` lists: ``(name, dtype, shape)`` in broadcast order, agreed before anything is
sent (a peer that refused the specs after the sender started would leave it blocked until the timeout).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

GROUP_HOST = "127.0.0.1"
BACKENDS = ("gloo", "nccl")

WeightSpec = tuple[str, str, tuple[int, ...]]


def backend_for(device: str, backend: str = "auto") -> str:
    """``weight_sync.backend`` -> the process group's backend: gloo on CPU, NCCL on GPU when ``auto``."""
    if backend == "auto":
        return "gloo" if device == "cpu" else "nccl"
    if backend not in BACKENDS:
        raise ValueError(f"weight group backend {backend!r}; allowed: auto, {', '.join(BACKENDS)}")
    return backend


def as_tensor(value: Any) -> torch.Tensor:
    """A numpy array or tensor as a contiguous tensor (numpy arrays are shared, not copied)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return value.detach().contiguous()


def weight_specs(state: Mapping[str, Any]) -> list[WeightSpec]:
    """``(name, dtype, shape)`` of each tensor of ``state``, in its order (the broadcast order)."""
    out = []
    for name, value in state.items():
        t = as_tensor(value)
        out.append((name, str(t.dtype).removeprefix("torch."), tuple(int(n) for n in t.shape)))
    return out


def listen_socket() -> socket.socket:
    """A listening socket on loopback, on a free port, for the group's store (its owner is rank 0)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((GROUP_HOST, 0))
    sock.listen(128)
    return sock


class WeightGroup:
    """This process's member of one broadcast group (rank 0: the sender, the learner's rank 0).

    ``listen``: rank 0's socket from ``listen_socket()`` (its port is the one the others are given). ``generation``
    names this incarnation of the group, so a group made again after a member restarted never reads the keys of
    the one before. Construction returns when every member has joined (or raises after ``timeout_s``).
    """

    def __init__(self, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                 listen: socket.socket | None = None, generation: int = 0):
        if backend not in BACKENDS:
            raise ValueError(f"weight group backend {backend!r}; allowed: {', '.join(BACKENDS)}")
        if (rank == 0) != (listen is not None):
            raise ValueError("rank 0 of a weight group owns its listening socket; the other ranks give none")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = timedelta(seconds=timeout_s)
        if listen is not None:
            store = dist.TCPStore(GROUP_HOST, port, world_size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=listen.detach())
        else:
            store = dist.TCPStore(GROUP_HOST, port, world_size, False, timeout)
        self._store = store  # keep the server (rank 0) alive as long as the group
        prefixed = dist.PrefixStore(f"aar_weights/{generation}", store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=GROUP_HOST)]
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
            self.device = torch.device("cpu")
        else:
            if not torch.cuda.is_available() or not hasattr(dist, "ProcessGroupNCCL"):
                raise RuntimeError("weight group backend nccl needs CUDA GPUs; use weight_sync.backend=gloo on CPU")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        # NCCL connects its members at the first collective: one now makes a member that never joined fail here,
        # at the join, rather than in the middle of the first publish
        self._broadcast(torch.zeros(1, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._pg.broadcast([tensor], opts).wait()

    def send(self, state: Mapping[str, Any], specs: Sequence[WeightSpec]) -> int:
        """Rank 0: broadcast each tensor of ``state`` in ``specs``' order; returns the bytes sent. Raises
        ``ValueError`` before sending anything when ``state`` does not match ``specs``."""
        tensors = {name: as_tensor(v) for name, v in state.items()}
        if weight_specs(tensors) != [(n, d, tuple(s)) for n, d, s in specs]:
            raise ValueError("the weights to send do not match the specs the receivers agreed to")
        sent = 0
        for t in tensors.values():
            self._broadcast(t.to(self.device))
            sent += t.numel() * t.element_size()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return sent

    def receive(self, specs: Iterable[WeightSpec]) -> Iterator[tuple[str, torch.Tensor]]:
        """The other ranks: ``(name, tensor)`` for each spec, received in order (consume it whole: the sender
        blocks on every receiver). On a GPU each tensor is moved to host memory as it arrives, so that a whole
        publish never sits in GPU memory beside the engine's own weights and KV cache."""
        for name, dtype, shape in specs:
            t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=self.device)
            self._broadcast(t)
            yield name, t.cpu() if t.is_cuda else t

    def close(self) -> None:
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # an already broken group: nothing left to release
                pass
        self._store = None
