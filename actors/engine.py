"""Inference engines behind one small Protocol: vLLM's ``AsyncLLM`` (the engine) and transformers' ``generate``
(a correctness reference for tests, not a substitute).

An engine generates ONE model turn from a list of token ids and returns the engine's own token ids, the
log-prob of each sampled token under the sampling distribution (``logprobs_mode="processed_logprobs"``: after
temperature, so importance weights compare like with like), and the policy version of each token.

Per-token versions come from vLLM itself: the engine core stamps every step's output with its current weight
version (``set_weight_version``) and returns contiguous ``weight_versions`` spans on the final output. A weight
update applied while a request is running therefore labels exactly the tokens sampled after it.

Weight updates (``update_weights``), two modes. Both freeze the scheduler for the reload (``pause_generation(
mode="keep")``: running requests stay alive, no step runs while weights and the version label change, so the label
is exact; tens of milliseconds on a tiny model) and both stamp the new version before resuming:

- ``pause``: the KV cache and the prefix cache are cleared while paused (vLLM preempts the running requests, so
  their KV is recomputed with the new weights; AReaL-style interruptible generation). vLLM raises if the reset
  fails. vLLM's per-token version spans are then exact.
- ``inflight``: the KV cache is kept; running requests continue on keys/values computed by the old weights
  (PipelineRL-style in-flight update; cheaper). Their tokens after the update depend on the old weights, so every
  token of a request that an in-flight update overtook is labelled with the version the request started at (the
  safe side for staleness), not with vLLM's spans.

Prefix cache: every request is salted with the engine version at its start (vLLM's ``cache_salt`` enters the hash
of the first block, hence of every block), so a request is only ever served cached KV computed for its own start
version. vLLM's ``reset_prefix_cache()`` cannot serve here: it returns False and resets nothing while any request
holds blocks, which in continuous rollout is almost always.

When vLLM reports no version spans, tokens are labelled with the version at the request's start.

Every reload is checked first: each parameter of the model must arrive with its shape and a float dtype the loader
converts exactly (float32 or the model's dtype), and no unknown name may come; otherwise ``WeightsError`` names
every problem and the engine keeps its weights and version (a partial reload would keep old layers while the
version advances).

Why not reload without pausing: the reload and the version stamp are two engine-core calls, and a step between
them would label new-weight tokens with the old version.

Two ways in (``weight_sync.method``). Collective (``update_weights_collective``): the engine's workers are members
of the learner's broadcast group and receive the tensors themselves (``actors/vllm_worker.py``), no copy anywhere
between. Object store (``update_weights``): the reload goes through vLLM's ``reload_weights`` from a safetensors
file in a tmpfs folder: ``collective_rpc`` does
not carry tensors across the engine-core process boundary, files do. That file is a full copy of the policy in RAM
(``/dev/shm``): it lives only for the reload. Each update writes it into a fresh ``aar_weights_<pid>_*`` folder and
removes the folder as soon as the engine has loaded it, whatever happens; a process killed in that window leaves the
folder behind, and the next engine started on the machine removes every such folder whose owner process is gone.

The engine's processes and files (``EngineProcesses``). With ``rollout.multiprocess_engine`` the engine core is a
process of its own (``VLLM::EngineCore``) with a worker process under it (``VLLM::Worker``); they talk through vLLM's
shared-memory message queues (``/dev/shm/psm_*``, Python's ``SharedMemory``) and multiprocessing's named semaphores
(``/dev/shm/sem.mp-*``). A process killed (SIGKILL: Ray ending a worker, the driver ending a hung actor) never
unlinks what it created, so every run used to leave a few hundred MB of them behind. The engine records its processes
(those this process gained while the engine started) and the files they map, and ``close`` ends the processes (vLLM's
own shutdown within ``ENGINE_CLOSE_S``, then SIGKILL by pid) and unlinks the files. A small watcher process of its
own (``actors.processes``), told the pids and files, does the same when this process dies without closing the engine
(Ray ending the actor at the end of a run, the driver killing it for a restart): nothing of an engine outlives the
process that made it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from actors.processes import GONE_S, alive, descendants, kill_processes, mapped_files, unlink_files
from async_agent_rl.config import Config, RolloutConfig
from async_agent_rl.episode import TurnEngine, TurnOutput, TurnRequest
from async_agent_rl.waits import WaitTimeout, within

log = logging.getLogger(__name__)


@dataclass
class WeightUpdateStats:
    version: int
    mode: str
    seconds: float
    pause_seconds: float = 0.0
    bytes: int = 0


class WeightsError(ValueError):
    """A weight update is incomplete or does not fit the model; nothing was loaded."""


class Engine(TurnEngine, Protocol):
    """An episode's engine (``async_agent_rl.episode.TurnEngine``) that also takes weight updates."""

    async def update_weights(self, version: int, weights: Mapping[str, Any], mode: str = "pause") -> WeightUpdateStats: ...

    async def close(self) -> None: ...


def cpu_engine_env(cfg: RolloutConfig) -> dict[str, str]:
    """Environment vLLM's CPU build needs (seen on the CPU build: KV cache size, no thread binding); applied with setdefault so users can override."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if cfg.multiprocess_engine else "0",
    }


def _tensor_dict(weights: Mapping[str, Any]) -> dict[str, Any]:
    """Name -> contiguous torch tensor. Tied parameters (one storage under two names, e.g. lm_head and the
    embedding) are kept once: the loader re-ties them, and safetensors refuses shared storage."""
    import warnings

    import torch

    out, seen = {}, set()
    for name, w in weights.items():
        if isinstance(w, np.ndarray):
            with warnings.catch_warnings():  # object-store arrays are read-only; they are only read here
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                t = torch.from_numpy(np.ascontiguousarray(w))
        else:
            t = w
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def model_parameters(model: Any) -> tuple[dict[str, Any], set[str]]:
    """``(parameters, aliases)`` of a torch model: each parameter once by name (tied ones once, as the learner
    publishes them), and the other names its state dict knows them by (a tied ``lm_head.weight``)."""
    params = dict(model.named_parameters())
    return params, set(model.state_dict()) - set(params)


def check_weights(tensors: Mapping[str, Any], params: Mapping[str, Any], aliases: set[str]) -> None:
    """Raise ``WeightsError`` naming every parameter of ``params`` missing from ``tensors``, every name that is
    neither a parameter nor an alias, and every tensor of the wrong shape or dtype (float32, the publish format, or
    the parameter's own dtype)."""
    import torch

    problems = []
    missing = [n for n in params if n not in tensors]
    if missing:
        problems.append(f"missing {len(missing)} of {len(params)} parameters, e.g. {missing[:3]}")
    unknown = sorted(set(tensors) - set(params) - aliases)
    if unknown:
        problems.append(f"unknown parameters, e.g. {unknown[:3]}")
    for name, t in tensors.items():
        p = params.get(name)
        if p is None:
            continue
        if tuple(t.shape) != tuple(p.shape):
            problems.append(f"{name}: shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
        elif t.dtype not in (torch.float32, p.dtype):
            problems.append(f"{name}: dtype {t.dtype}, expected torch.float32 or {p.dtype}")
    if problems:
        raise WeightsError("weight update refused, weights and version unchanged: " + "; ".join(problems))


def _meta_model(model_path: str, cfg: Config) -> Any:
    """The model of ``model_path`` on the meta device (shapes and names only, no memory), in ``model.dtype``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.model.dtype),
                                                trust_remote_code=cfg.model.trust_remote_code)


WEIGHTS_PREFIX = "aar_weights_"


def weights_tmp_root() -> Path | None:
    """Where weight files for a reload are written: RAM-backed ``/dev/shm`` when there is one."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_orphaned_weights(root: Path | None = None) -> list[Path]:
    """Remove the ``aar_weights_<pid>_*`` folders whose owner process is gone (killed mid-reload); returns them."""
    root = root or weights_tmp_root() or Path(tempfile.gettempdir())
    removed = []
    for d in root.glob(f"{WEIGHTS_PREFIX}*_*"):
        owner = d.name[len(WEIGHTS_PREFIX):].split("_", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        log.warning("removed %d weight folder(s) left by processes that were killed: %s", len(removed),
                    ", ".join(str(d) for d in removed))
    return removed


ENGINE_CLOSE_S = 10.0  # vLLM's own shutdown of the engine's processes gets this long; then they are SIGKILLed by pid
ENGINE_FILES = ("psm_", "sem.mp-")  # the /dev/shm files of vLLM's queues and multiprocessing's semaphores


class EngineProcesses:
    """The processes an engine started (pid -> start time: those this process gained while the engine started) and
    the ``/dev/shm`` files they map (``ENGINE_FILES``), kept so that none of them outlives the engine: ``end``
    SIGKILLs the processes still alive and unlinks the files; the watcher process does the same if this process dies
    first (module docstring)."""

    def __init__(self, procs: Mapping[int, float]):
        self.procs = dict(procs)
        self.files: set[str] = set()
        self._watcher: subprocess.Popen | None = None
        if self.procs:
            self._watcher = self._start_watcher()
            self._tell("".join(f"pid {pid} {started!r}\n" for pid, started in self.procs.items()))
            self.note_files()

    @property
    def pids(self) -> list[int]:
        return sorted(self.procs)

    def alive(self) -> list[int]:
        return alive(self.procs)

    def note_files(self) -> None:
        """Record the files the engine's processes map now (the watcher is told of new ones)."""
        new = mapped_files(self.alive(), ENGINE_FILES) - self.files
        if new:
            self.files |= new
            self._tell("".join(f"file {path}\n" for path in sorted(new)))

    def end(self, gone_s: float = GONE_S) -> list[int]:
        """SIGKILL the engine's processes still alive, unlink their files, release the watcher; the pids killed."""
        killed = kill_processes(self.procs, gone_s)
        unlink_files(self.files)
        self._tell("done\n")
        if self._watcher is not None and self._watcher.stdin is not None:
            try:
                self._watcher.stdin.close()
            except OSError:
                pass
        self._watcher = None
        return killed

    def _start_watcher(self) -> subprocess.Popen | None:
        try:
            watcher = subprocess.Popen([sys.executable, "-m", "actors.processes"], stdin=subprocess.PIPE, text=True,
                                       start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            watcher.wait(timeout=30)  # its first process, which only forks the watcher and exits
            return watcher
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("the engine's watcher process did not start (%s): an engine whose owner is killed may leave "
                        "processes and /dev/shm files behind", e)
            return None

    def _tell(self, text: str) -> None:
        if self._watcher is not None and self._watcher.stdin is not None:
            try:
                self._watcher.stdin.write(text)
                self._watcher.stdin.flush()
            except OSError:
                pass


def one_token_ids(tokenizer: Any, strings: Sequence[str]) -> list[int]:
    """The token id of each of ``strings`` that the tokenizer spells as exactly one token decoding back to it."""
    ids = []
    for s in strings:
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1 and tokenizer.decode(enc) == s:
            ids.append(int(enc[0]))
    return ids


class VLLMEngine:
    """vLLM ``AsyncLLM`` (CPU build via ``vllm-cpu``, CUDA build via ``vllm``; same code)."""

    def __init__(self, llm: Any, version: int, device: str, params: Mapping[str, Any], aliases: set[str]):
        self.llm = llm
        self.version = version
        self._device = device
        self._params, self._aliases = params, aliases
        self._update_lock = asyncio.Lock()
        self._inflight_updates = 0  # in-flight (KV-keeping) updates so far
        self._stop_ids: dict[tuple[str, ...], list[int]] = {}  # stop strings -> their one-token spellings' ids
        self.processes = EngineProcesses({})  # the engine's own processes and files (create() records them)

    @classmethod
    async def create(cls, model_path: str, cfg: Config, version: int = 0) -> "VLLMEngine":
        if cfg.run.device == "cpu":
            for k, v in cpu_engine_env(cfg.rollout).items():
                os.environ.setdefault(k, v)
        # imported here, after the env vars above: vLLM reads them when it is imported
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(model_path),
            dtype=cfg.model.dtype,
            max_model_len=cfg.model.max_model_len,
            enforce_eager=cfg.rollout.enforce_eager,
            seed=cfg.rollout.seed,
            logprobs_mode="processed_logprobs",
            max_logprobs=1,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            trust_remote_code=cfg.model.trust_remote_code,
            disable_log_stats=True,
            worker_extension_cls="actors.vllm_worker.PolicyReloadExtension",
        )
        before = descendants()
        llm = AsyncLLM.from_engine_args(args)
        processes = EngineProcesses({pid: t for pid, t in descendants().items() if before.get(pid) != t})
        sweep_orphaned_weights()
        engine = cls(llm, version, cfg.run.device, *model_parameters(_meta_model(model_path, cfg)))
        engine.processes = processes
        await llm.update_weight_version(str(version))
        return engine

    async def generate(self, req: TurnRequest) -> TurnOutput:
        from vllm import SamplingParams, TokensPrompt  # local: importing this module must not import vLLM
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=list(req.stop),
            stop_token_ids=self._stop_token_ids(tuple(req.stop)),
            include_stop_str_in_output=True,
            logprobs=0,
            # vLLM's CPU build fails on per-request generators ("CPU Generator does not use offset"): there the
            # engine-level seed (rollout.seed) is the only one.
            seed=req.seed if self._device != "cpu" else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        start, inflight_before = self.version, self._inflight_updates
        prompt = TokensPrompt(prompt_token_ids=req.prompt_ids, cache_salt=f"v{start}")
        final = None
        async for out in self.llm.generate(prompt, params, uuid.uuid4().hex):
            final = out
        assert final is not None
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(comp.logprobs or [], ids)]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
        if self._inflight_updates != inflight_before:  # the tail was computed on KV of older weights
            versions = [start] * len(ids)
        else:
            versions = _expand_versions(comp.weight_versions, len(ids), start)
        return TurnOutput(ids, logprobs, versions, comp.text, str(comp.finish_reason), comp.stop_reason)

    def _stop_token_ids(self, stop: tuple[str, ...]) -> list[int]:
        """The ids of the stop strings that are one token of the vocabulary (``</search>`` in the shipped one).

        vLLM matches stop strings in the front end, after the engine core has streamed the token: the core goes on
        decoding the finished sequence until the front end's abort reaches it. A stop token id the core checks
        itself, at the step that samples it. The strings stay in ``stop``, so a multi-token spelling still stops the
        turn, and the front end still finds the string in the text: same tokens, text and ``stop_reason`` (the
        string) as with the strings alone."""
        if stop not in self._stop_ids:
            tok = getattr(self.llm, "tokenizer", None)
            self._stop_ids[stop] = [] if tok is None else one_token_ids(tok, stop)
        return self._stop_ids[stop]

    async def update_weights(self, version: int, weights: Mapping[str, Any], mode: str = "pause") -> WeightUpdateStats:
        """The object-store path: ``weights`` (name -> array) written to a RAM folder and reloaded from it."""
        from safetensors.torch import save_file

        _check_mode(mode)
        async with self._update_lock:
            t0 = time.perf_counter()
            tensors = _tensor_dict(weights)
            check_weights(tensors, self._params, self._aliases)
            # a folder of its own per update, named after this process (see sweep_orphaned_weights)
            weights_dir = Path(tempfile.mkdtemp(prefix=f"{WEIGHTS_PREFIX}{os.getpid()}_", dir=weights_tmp_root()))
            try:
                await asyncio.to_thread(save_file, tensors, str(weights_dir / "model.safetensors"))
                # vLLM's reload, then the tied head and CPU-packed kernels (actors/vllm_worker.py)
                pause_s = await self._paused_reload(version, mode, "reload_policy_weights",
                                                    {"weights_path": str(weights_dir)})
            finally:
                shutil.rmtree(weights_dir, ignore_errors=True)  # loaded (or failed): the RAM copy goes now
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            return WeightUpdateStats(version, mode, time.perf_counter() - t0, pause_s, size)

    # ----------------------------------------------------------------------------------- the collective path
    async def join_weight_group(self, port: int, rank_offset: int, world_size: int, backend: str,
                                timeout_s: float, generation: int) -> list[int]:
        """Make this engine's workers members of the learner's broadcast group (``async_agent_rl.weight_group``);
        returns their ranks. Returns when every member has joined."""
        return await self.llm.collective_rpc("join_weight_group", kwargs=dict(
            port=port, rank_offset=rank_offset, world_size=world_size, backend=backend, timeout_s=timeout_s,
            generation=generation))

    def check_weight_specs(self, specs: Sequence[tuple[str, str, Sequence[int]]]) -> None:
        """``check_weights`` on a publish's ``(name, dtype, shape)`` list, before anything is sent."""
        import torch

        malformed = [f"{name}: dtype {dtype!r}, shape {shape!r}" for name, dtype, shape in specs
                     if not isinstance(getattr(torch, str(dtype), None), torch.dtype) or any(int(n) < 0 for n in shape)]
        if malformed:
            raise WeightsError("weight update refused, weights and version unchanged: malformed specs, e.g. "
                               + "; ".join(malformed[:3]))
        tensors = {name: torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta")
                   for name, dtype, shape in specs}
        check_weights(tensors, self._params, self._aliases)

    async def update_weights_collective(self, version: int, specs: Sequence[tuple[str, str, Sequence[int]]],
                                        mode: str = "pause") -> WeightUpdateStats:
        """The collective path: pause, receive the learner's broadcast of ``specs`` in the workers and reload it
        in place, stamp ``version``, resume. The specs must have passed ``check_weight_specs`` on every engine
        before the learner sends (``driver.weight_sync.CollectivePublisher`` does that)."""
        _check_mode(mode)
        async with self._update_lock:
            t0 = time.perf_counter()
            pause_s = await self._paused_reload(version, mode, "receive_policy_weights", {"specs": list(specs)})
            size = sum(int(np.prod(shape)) * _itemsize(dtype) for _, dtype, shape in specs)
            return WeightUpdateStats(version, mode, time.perf_counter() - t0, pause_s, size)

    async def _paused_reload(self, version: int, mode: str, method: str, kwargs: dict) -> float:
        """Freeze the scheduler, run the workers' reload ``method``, stamp ``version``, resume; returns the
        seconds paused. ``pause`` mode clears the KV and prefix caches (see the module docstring)."""
        tp = time.perf_counter()
        await self.llm.pause_generation(mode="keep", clear_cache=mode == "pause")
        try:
            await self.llm.collective_rpc(method, kwargs=kwargs)
            await self.llm.update_weight_version(str(version))
            self.version = version
            self._inflight_updates += mode == "inflight"
        finally:
            await self.llm.resume_generation()
        return time.perf_counter() - tp

    @property
    def pids(self) -> list[int]:
        """The engine's own processes (the engine core and its workers with ``rollout.multiprocess_engine``)."""
        return self.processes.pids

    async def close(self, timeout_s: float = ENGINE_CLOSE_S) -> list[int]:
        """Shut the engine down: vLLM's own shutdown, waited for ``timeout_s`` at most (a hung engine core may not
        act on it), then every process of the engine still alive is SIGKILLed by pid and its ``/dev/shm`` files are
        unlinked. Returns the pids that had to be killed. A second call does nothing."""
        llm, self.llm = self.llm, None
        if llm is None:
            return []
        self.processes.note_files()
        try:
            await within(asyncio.to_thread(llm.shutdown, timeout=timeout_s), timeout_s + 5.0, "vLLM's shutdown")
        except WaitTimeout as e:
            log.warning("the engine did not shut down: %s; its processes are killed", e)
        except Exception as e:  # noqa: BLE001 - a dead engine may fail its own shutdown; its processes go below
            log.warning("the engine's shutdown failed (%s: %s); its processes are killed", type(e).__name__, e)
        # AsyncLLM.__del__ calls shutdown() again, at interpreter exit when module globals are gone already
        # (a "'NoneType' object is not callable" traceback): the engine is down, make that second call a no-op.
        llm.shutdown = lambda *args, **kwargs: None
        killed = await asyncio.to_thread(self.processes.end)
        if killed:
            log.warning("the engine's processes %s did not end with its shutdown; killed", killed)
        return killed


def _check_mode(mode: str) -> None:
    if mode not in ("pause", "inflight"):
        raise ValueError(f"weight update mode {mode!r}; allowed: pause, inflight")


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _expand_versions(spans: Any, n: int, fallback: int) -> list[int]:
    """vLLM's ``[WeightVersionSpan(version, start, end)]`` -> one int per token."""
    if not spans:
        return [fallback] * n
    out = [fallback] * n
    for s in spans:
        v = int(s.version) if str(s.version).lstrip("-").isdigit() else fallback
        for i in range(s.start, min(s.end, n)):
            out[i] = v
    return out


@dataclass
class HFEngine:
    """transformers ``generate`` with the same contract (a correctness reference for tests).

    Sampling uses the model's own logits / temperature; log-probs are of the sampled tokens under that
    distribution, so they are comparable with vLLM's ``processed_logprobs`` at top_p=1, top_k=-1.
    """

    model: Any
    tokenizer: Any
    version: int = 0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def load(cls, model_path: str, version: int = 0) -> "HFEngine":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        return cls(model, AutoTokenizer.from_pretrained(model_path), version)

    async def generate(self, req: TurnRequest) -> TurnOutput:
        async with self._lock:  # one forward at a time; this engine is a reference, not a server
            return await asyncio.to_thread(self._generate, req)

    def _generate(self, req: TurnRequest) -> TurnOutput:
        import torch

        gen = torch.Generator().manual_seed(req.seed if req.seed is not None else 0)
        ids = torch.tensor([req.prompt_ids])
        out_ids: list[int] = []
        logprobs: list[float] = []
        past = None
        finish = "length"
        eos = self.tokenizer.eos_token_id
        with torch.no_grad():
            for _ in range(req.max_tokens):
                res = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                logits = res.logits[0, -1].float()
                if req.temperature > 0:
                    lp = torch.log_softmax(logits / req.temperature, -1)
                    tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
                else:
                    lp = torch.log_softmax(logits, -1)
                    tok = int(lp.argmax())
                out_ids.append(tok)
                logprobs.append(float(lp[tok]))
                ids = torch.tensor([[tok]])
                text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                if tok == eos or any(s in text for s in req.stop):
                    finish = "stop"
                    break
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        return TurnOutput(out_ids, logprobs, [self.version] * len(out_ids), text, finish)

    async def update_weights(self, version: int, weights: Mapping[str, Any], mode: str = "pause") -> WeightUpdateStats:
        t0 = time.perf_counter()
        async with self._lock:
            tensors = _tensor_dict(weights)
            check_weights(tensors, *model_parameters(self.model))
            self.model.load_state_dict(tensors, strict=False)
            self.version = version
        return WeightUpdateStats(version, mode, time.perf_counter() - t0)

    async def close(self, timeout_s: float = 0.0) -> list[int]:
        return []  # in this process: nothing to end


async def create_engine(cfg: Config, model_path: str | None = None, version: int = 0) -> Engine:
    path = model_path or cfg.model.path
    if cfg.rollout.engine == "vllm":
        return await VLLMEngine.create(path, cfg, version)
    return HFEngine.load(path, version)
