"""Weight publishing: deliver the learner's new policy version to every rollout actor. One interface, two paths.

``WeightPublisher.publish(version, state) -> PublishStats``; ``state`` maps HF parameter names to full tensors
(``Learner.state_dict_for_publish()`` or ``dict(Learner.full_parameters())``). ``publish`` returns once every actor
has applied the weights, and ``PublishStats.seconds`` is that latency (export it as a metric).

``ObjectStorePublisher`` (``weight_sync.method = "object_store"``, CPU and GPU): the numpy state dict is put in Ray's
object store ONCE per publish and every rollout actor gets ``update_weights.remote(version, ref)``. Ray resolves the
reference before the call, so the actor receives the dict itself, its arrays read zero-copy (read-only) from shared
memory; the actor reloads them into vLLM (``actors.engine.VLLMEngine.update_weights``). An ``ObjectRef`` to such a
dict (e.g. the return value of a learner actor's ``state_dict_for_publish``) is forwarded as it is, so the weights
never pass through the driver.

``NCCLPublisher`` (``weight_sync.method = "nccl"``, GPU only): the peers' path (verl, OpenRLHF, vLLM's RLHF example).
Rank 0 of the learner and every vLLM worker form one NCCL group (vLLM's ``StatelessProcessGroup`` +
``PyNcclCommunicator``, so the learner's own torch.distributed group is untouched); each tensor is broadcast from the
learner's GPU straight into the workers' GPUs, where ``NCCLWorkerExtension`` (the engine's ``worker_extension_cls``)
feeds it to the model's ``load_weights``. One RPC per publish, not per parameter. UNTESTED on the project's machines
(no GPU there); it raises ``RuntimeError`` without CUDA.

Rollout actor contract (methods on the actor handles given to a publisher; sync or async):

- object store: ``update_weights(version, weights: Mapping[str, np.ndarray])`` -> anything with ``seconds``
  (``WeightUpdateStats``) or a dict with ``"seconds"``, or None;
- NCCL: ``init_weight_update_group(master_address, master_port, rank_offset, world_size)``, forwarded to
  ``AsyncLLM.collective_rpc("init_weight_update_group", args=...)``, and ``update_weights_nccl(version, specs)``:
  pause generation, ``collective_rpc("receive_weights", args=(specs,))``, stamp ``version``, reset the prefix cache,
  resume (as ``VLLMEngine.update_weights`` does around its reload).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Protocol, Sequence, Union

import numpy as np
import ray
import torch

from async_agent_rl.stats import PublishStats

State = Mapping[str, Union[np.ndarray, torch.Tensor]]


class WeightPublisher(Protocol):
    def publish(self, version: int, state: Any) -> PublishStats: ...


def _nbytes(state: State) -> int:
    return sum(int(v.nbytes) if isinstance(v, np.ndarray) else v.numel() * v.element_size() for v in state.values())


def _reported_seconds(result: Any) -> float | None:
    if isinstance(result, Mapping):
        return result.get("seconds")
    return getattr(result, "seconds", None)


class ObjectStorePublisher:
    """Publish through Ray's object store to ``actors`` (handles with ``update_weights``; see module docstring)."""

    method = "object_store"

    def __init__(self, actors: Sequence[Any]):
        self.actors = list(actors)

    def publish(self, version: int, state: Union[Mapping[str, np.ndarray], "ray.ObjectRef"]) -> PublishStats:
        """Put ``state`` (numpy arrays, or a ref to such a dict) once and wait until every actor has applied it."""
        t0 = time.perf_counter()
        if isinstance(state, ray.ObjectRef):
            ref, size = state, -1  # its size is only known where it lives; -1 = not measured
        else:
            ref, size = ray.put(dict(state)), _nbytes(state)
        put_s = time.perf_counter() - t0
        results = ray.get([a.update_weights.remote(version, ref) for a in self.actors])
        reported = [s for s in map(_reported_seconds, results) if s is not None]
        return PublishStats(version, self.method, time.perf_counter() - t0, put_s, size, len(self.actors), reported)


# ------------------------------------------------------------------------------------------------------ NCCL
def _nccl_group(master_address: str, master_port: int, rank: int, world_size: int, device: Any):
    """A ``PyNcclCommunicator`` over a ``StatelessProcessGroup`` (outside torch.distributed's global group)."""
    # vLLM and NCCL only for the NCCL method on GPUs: the other methods (and CPU runs) never import them
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class NCCLWorkerExtension:
    """vLLM ``worker_extension_cls`` (``"learner.weight_sync.NCCLWorkerExtension"``): mixed into each vLLM worker,
    whose ``device`` and ``model_runner`` it uses; its methods run through ``collective_rpc``. GPU only, untested here.
    """

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int) -> None:
        """Join the learner's broadcast group as rank ``rank_offset + this worker's rank in its engine``."""
        from vllm.distributed.parallel_state import get_world_group  # runs inside a vLLM worker only

        rank = get_world_group().rank + rank_offset
        self._weight_group = _nccl_group(master_address, master_port, rank, world_size, self.device)

    def receive_weights(self, specs: Sequence[tuple[str, str, Sequence[int]]]) -> None:
        """Receive one broadcast per ``(name, dtype, shape)`` in order, streaming them into ``load_weights``."""

        def received():
            for name, dtype, shape in specs:
                tensor = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=self.device)
                self._weight_group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
                yield name, tensor

        self.model_runner.model.load_weights(weights=received())
        torch.cuda.synchronize()


class NCCLPublisher:
    """Broadcast from this process (learner rank 0, on ``device``) to every worker of every engine in ``actors``.

    ``workers_per_engine``: vLLM workers per engine (its tensor-parallel size); ranks are learner 0, then engine
    ``i``'s workers at ``1 + i * workers_per_engine``. UNTESTED on the project's machines (no GPU there).
    """

    method = "nccl"

    def __init__(self, actors: Sequence[Any], *, master_address: str, master_port: int,
                 workers_per_engine: int = 1, device: str = "cuda:0"):
        if not torch.cuda.is_available():
            raise RuntimeError("NCCLPublisher needs CUDA GPUs for the learner and the engines; "
                               "use weight_sync.method=object_store on CPU")
        self.actors = list(actors)
        self.device = torch.device(device)
        world_size = 1 + len(self.actors) * workers_per_engine
        joins = [a.init_weight_update_group.remote(master_address, master_port, 1 + i * workers_per_engine,
                                                   world_size) for i, a in enumerate(self.actors)]
        self._group = _nccl_group(master_address, master_port, 0, world_size, self.device)  # rendezvous
        ray.get(joins)

    def publish(self, version: int, state: State) -> PublishStats:
        t0 = time.perf_counter()
        tensors = {name: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v)
                   for name, v in state.items()}
        specs = [(name, _dtype_name(t.dtype), list(t.shape)) for name, t in tensors.items()]
        pending = [a.update_weights_nccl.remote(version, specs) for a in self.actors]
        for t in tensors.values():
            self._group.broadcast(t.to(self.device).contiguous(), src=0, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        sent_s = time.perf_counter() - t0
        results = ray.get(pending)
        reported = [s for s in map(_reported_seconds, results) if s is not None]
        return PublishStats(version, self.method, time.perf_counter() - t0, sent_s, _nbytes(tensors),
                            len(self.actors), reported)


def create_publisher(method: str, actors: Sequence[Any], **nccl_options: Any) -> WeightPublisher:
    """``weight_sync.method`` -> publisher. ``nccl_options``: ``NCCLPublisher``'s keyword arguments."""
    if method == "object_store":
        return ObjectStorePublisher(actors)
    if method == "nccl":
        return NCCLPublisher(actors, **nccl_options)
    raise ValueError(f"weight_sync.method {method!r}; allowed: object_store, nccl")
