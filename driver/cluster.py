"""The Ray cluster a run uses: connecting to ``cluster.ray_address`` (or the job's cluster under ``ray job
submit``), else starting a local one bound to loopback with token authentication; the check that every actor of the
run fits on it; the link from the run folder to the session's logs."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import ray
import ray._private.state
from ray._private.worker import global_worker

from async_agent_rl.config import Config, is_loopback
from async_agent_rl.errors import InputError
from async_agent_rl.waits import WaitTimeout, alarm_within

log = logging.getLogger(__name__)


def check_actors_fit(cfg: Config, resources: dict[str, float]) -> None:
    """On the local cluster the run starts, every actor must fit at once (a dead rollout actor's share is freed
    for its restart): Ray leaves an actor it cannot place pending for ever. One ``InputError`` naming the keys."""
    for res in ("CPU", "GPU"):
        parts = cfg.actor_asks(res)
        need, have = sum(n * each for _, n, each in parts), resources.get(res, 0.0)
        if need > have + 1e-9:
            detail = ", ".join(f"{name} {n} x {each:g}" for name, n, each in parts if each)
            fix = "raise cluster.num_cpus or lower cluster.*_cpus" if res == "CPU" else "lower cluster.*_gpus"
            raise InputError(f"the run's actors ask the local Ray cluster for {need:g} {res}s ({detail}) and it has "
                             f"{have:g}: {fix}")


RESOURCE_KEYS = {"buffer": "cluster.buffer_resources", "rollout actors": "cluster.rollout_resources",
                 "learner ranks": "cluster.learner_resources", "evaluator": "cluster.rollout_resources"}


def check_placement(cfg: Config, nodes: list[dict]) -> None:
    """The actors that name custom resources (``cluster.*_resources``) can be placed on the cluster's live nodes
    (``ray.nodes()``), local or connected: Ray leaves an actor no node can take pending for ever. Only what must
    hold is checked, against each node's total resources: each such actor fits whole on one node (its CPUs, GPUs
    and custom resources together), the nodes hold as many of a kind as the run starts, and every custom resource
    the run asks for adds up to no more than the cluster has. Anything else is an ``InputError`` naming the key, the
    ask and the nodes. A run that names no custom resource is not checked here (``check_actors_fit`` is the local
    cluster's CPU and GPU check)."""
    alive = [n.get("Resources") or {} for n in nodes if n.get("Alive")]
    asked = [(which, n, asks) for which, n, asks in cfg.placement() if set(asks) - {"CPU", "GPU"}]
    if not asked:
        return

    where = "; ".join(_node_line(n) for n in nodes if n.get("Alive")) or "no live node"
    for which, n, asks in asked:
        room = sum(fits(node, asks) for node in alive)
        if room < n:
            key = RESOURCE_KEYS[which]
            custom = {k: v for k, v in asks.items() if k not in ("CPU", "GPU")}
            raise InputError(f"{key}={_plain(custom)}: the run's {n} {which} each ask Ray for {_plain(asks)} on one "
                             f"node, and the cluster's nodes can hold {room} of them ({where}); start nodes with "
                             f"`ray start --resources='{json.dumps(custom)}'` or change {key}")
    for res in sorted({r for _, _, asks in asked for r in asks} - {"CPU", "GPU"}):
        need, have = sum(n * asks.get(res, 0.0) for _, n, asks in asked), sum(node.get(res, 0.0) for node in alive)
        if need > have + 1e-9:
            parts = ", ".join(f"{which} {n} x {asks[res]:g}" for which, n, asks in asked if res in asks)
            raise InputError(f"the run's actors ask the Ray cluster for {need:g} of the custom resource {res!r} "
                             f"({parts}) and its nodes have {have:g} ({where}): change cluster.*_resources or add "
                             "nodes that offer it")


def check_machines(cfg: Config, nodes: list[dict], driver_address: str | None = None) -> None:
    """On a cluster of several machines (live nodes at more than one address), refuse what only works on one:
    the parts that listen on loopback cannot be reached from another machine, and a run would wait on them until
    its watchdog. One ``InputError`` naming the key and the fix:

    - ``weight_sync.method=collective``: the group's store listens on 127.0.0.1 of the learner's machine;
    - a retrieval server the run starts (no ``retriever.url``) on a loopback ``retriever.host``, when a rollout
      actor can be placed on another machine than the driver's (``driver_address``; None: on more than one);
    - ``learner.num_ranks > 1`` whose ranks can be placed on more than one machine (they rendezvous on loopback).

    Nodes of one machine (a multi-raylet cluster on loopback, every node at the same address) are not checked."""
    alive = [n for n in nodes if n.get("Alive")]
    addresses = sorted({str(n.get("NodeManagerAddress", "")) for n in alive})
    if len(addresses) < 2:
        return
    where = f"the Ray cluster's nodes are on {len(addresses)} machines ({', '.join(addresses)})"
    if cfg.weight_sync.method == "collective":
        raise InputError(f"weight_sync.method=collective: {where}, and the collective group listens on loopback of "
                         "the learner's machine, where engines on other machines cannot join it; use "
                         "weight_sync.method=object_store")
    asks = {which: a for which, _, a in cfg.placement()}

    def machines(which: str) -> list[str]:
        return sorted({str(n.get("NodeManagerAddress", "")) for n in alive if fits(n.get("Resources") or {},
                                                                                    asks[which])})

    on = machines("rollout actors")
    elsewhere = len(on) > 1 if driver_address is None else any(a != driver_address for a in on)
    if not cfg.retriever.url and is_loopback(cfg.retriever.host) and elsewhere:
        raise InputError(f"retriever.host={cfg.retriever.host}: {where}, rollout actors can be placed on "
                         f"{', '.join(on)}, and the retrieval server the run starts listens on loopback of the "
                         "driver's machine, where actors on other machines cannot reach it; set retriever.host to "
                         "this machine's private address (the server has no authentication: keep the firewall to "
                         "the cluster) or retriever.url to a server every node reaches")
    on = machines("learner ranks")
    if cfg.learner.num_ranks > 1 and len(on) > 1:
        raise InputError(f"learner.num_ranks={cfg.learner.num_ranks}: {where}, the ranks can be placed on "
                         f"{', '.join(on)}, and they form their group on loopback of one machine; name a resource "
                         "that only one machine offers in cluster.learner_resources")


def fits(node: dict, asks: dict[str, float]) -> int:
    """How many actors asking ``asks`` (resource: amount) a node of total resources ``node`` holds, empty."""
    return int(min(node.get(r, 0.0) / v + 1e-9 for r, v in asks.items())) if asks else 1 << 30


def _plain(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in d.items()) + "}"


def _node_line(node: dict) -> str:
    res = node.get("Resources") or {}
    shown = {k: v for k, v in res.items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")
             and not k.startswith("accelerator_type:")}
    return f"node {str(node.get('NodeID', '?'))[:8]} at {node.get('NodeManagerAddress', '?')}: {_plain(shown)}"


def actor_record(actor: Any) -> dict:
    """Ray's own record of ``actor`` (the GCS actor table): its ``State`` (ALIVE, RESTARTING, PENDING_CREATION,
    DEAD, ...) and ``Address.NodeID``, the node it runs on (while it restarts: the node it ran on, then the one Ray
    tries to place it on, placed or not); {} when Ray has none."""
    try:
        return ray._private.state.actors(actor._actor_id.hex()) or {}
    except Exception:  # noqa: BLE001 - a developer API: no record is an answer too
        return {}


def live_nodes() -> dict[str, dict]:
    """node id -> ``ray.nodes()`` entry, for the nodes alive now."""
    return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}


def actor_node(actor: Any) -> str | None:
    """The id of the node ``actor`` runs on, from Ray's record (``actor_record``: while it restarts, not always the
    node it ran on: note it while it runs)."""
    return (actor_record(actor).get("Address") or {}).get("NodeID") or None


def node_gone(node: str | None) -> str | None:
    """"node ID8 at IP" when node ``node`` is no longer alive (it was lost), else None."""
    if not node or node in live_nodes():
        return None
    ip = next((n.get("NodeManagerAddress") for n in ray.nodes() if n.get("NodeID") == node), None)
    return f"node {node[:8]}" + (f" at {ip}" if ip else "")


def capacity(asks: dict[str, float]) -> int:
    """How many actors asking ``asks`` the live nodes could hold, by their total resources (what other actors
    hold not subtracted: fewer than needed means they can never all be placed)."""
    return sum(fits(n.get("Resources") or {}, asks) for n in live_nodes().values())


def resources_line(res: dict) -> str:
    return f"{res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs"


def job_runtime_env() -> dict[str, Any] | None:
    """The runtime env of the ``ray job submit`` job this driver runs in ({} when unreadable), or None outside a
    job."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if raw is None:
        return None
    try:
        return dict(json.loads(raw).get("runtime_env") or {})
    except (ValueError, AttributeError, TypeError):
        return {}


def job_env_vars() -> dict[str, str] | None:
    """The runtime-env variables of the ``ray job submit`` job this driver runs in, or None outside a job."""
    runtime_env = job_runtime_env()
    if runtime_env is None:
        return None
    try:
        return dict(runtime_env.get("env_vars") or {})
    except (ValueError, TypeError):
        return {}


def check_job_paths(cfg: Config, nodes: list[dict], runtime_env: dict[str, Any] | None) -> None:
    """Under ``ray job submit --working-dir`` on a cluster of more than one node, every path the actors read or
    write must be absolute: each node unpacks the working dir into a copy of its own, so a relative path (the
    quickstart's ``runs/quickstart/model``, which the driver builds in its copy) names another folder, or none, on
    every other node, and the learner or a rollout actor fails to load it. One ``InputError`` naming the keys.
    ``runtime_env``: the job's (``job_runtime_env``; None outside a job)."""
    if not runtime_env or not runtime_env.get("working_dir") or sum(bool(n.get("Alive")) for n in nodes) < 2:
        return
    d = cfg.data
    paths = {"run.output_dir": [cfg.run.output_dir], "model.path": [cfg.model.path], "data.world_dir": [d.world_dir],
             "data.train_files": list(d.train_files), "data.test_files": list(d.test_files),
             "data.corpus_file": [d.corpus_file]}
    relative = [f"{key}={p}" for key, ps in paths.items() for p in ps if p and not Path(str(p)).is_absolute()]
    if relative:
        n = sum(bool(x.get("Alive")) for x in nodes)
        raise InputError(f"{', '.join(relative)}: relative under `ray job submit --working-dir` on a cluster of {n} "
                         "nodes, where each node resolves it in its own copy of the working dir (the driver's files "
                         "are in its copy only); give absolute paths that every node reads, on a filesystem all of "
                         "them mount at one path (docs/OPERATIONS.md, \"A cluster of several machines\")")


RAY_INIT_TIMEOUT_S = 180.0  # ray.init, local start or connection (after check_address's 10 s), gets this long


def ray_init(cfg: Config) -> None:
    """Connect to ``cluster.ray_address`` (or the job's cluster under ``ray job submit``), else start a local Ray.

    Authentication is Ray's own token authentication and is never turned off here: a local ``ray.init`` turns it on
    (creating ``~/.ray/auth_token`` once) and every process of the cluster, workers included, inherits it.
    ``RAY_AUTH_MODE`` is never put into the workers' runtime env, which is what used to get them rejected. Ray binds
    the local cluster's gRPC servers to every interface (it rewrites a loopback node address to the host's), so a
    local cluster with authentication disabled would let anyone on the network run code here: refused.

    An address on loopback (``127.0.0.1:PORT``: a cluster whose nodes all bind loopback, as the multi-node cluster of
    the tests does) is connected to as it is: Ray would otherwise rewrite it to the host's routable address, where
    nothing answers, and retry for ever (``loopback_only``).
    """
    if ray.is_initialized():
        return
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    mode = os.environ.get("RAY_AUTH_MODE")
    if not address and mode is not None and mode.lower() != "token":  # Ray: any set value but "token" is no auth
        raise InputError(f"RAY_AUTH_MODE={mode!r} would start a local Ray cluster that listens on every network "
                         "interface without authentication (Ray turns authentication on only for RAY_AUTH_MODE=token "
                         "or unset); unset it or set it to token")
    if any(k.startswith("RAY_AUTH") for k in cfg.cluster.env_vars):
        raise InputError("cluster.env_vars: RAY_AUTH_* must not be set per worker (workers whose mode differs from "
                         "the cluster's are rejected); set it in the environment of `ray start` instead")
    env = dict(cfg.cluster.env_vars)
    if cfg.run.device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    job_env = job_env_vars()
    if job_env is not None:
        env = {k: v for k, v in env.items() if k not in job_env}  # Ray refuses to merge a key the job's env sets
        if not Path(cfg.run.output_dir).is_absolute():
            log.warning("run.output_dir=%r is relative: under `ray job submit` it lands in the job's temporary copy "
                        "of the working dir; pass an absolute run.output_dir to keep the run", cfg.run.output_dir)
    if address:
        check_address(cfg)
        if is_loopback(address.split("://", 1)[-1].rpartition(":")[0].strip("[]")):
            loopback_only()  # else Ray rewrites 127.0.0.1 to the host's address, where a loopback cluster is not
        # the actors' engine and library lines stay in the session's log folder (the run folder links it), as in
        # a local run: forwarded, they were most of the console (196 of 260 lines for 10 steps)
        try:
            alarm_within(ray.init, address=address, runtime_env={"env_vars": env}, log_to_driver=False,
                         timeout_s=RAY_INIT_TIMEOUT_S, what=f"the Ray cluster at {address}")
        except WaitTimeout as e:
            raise InputError(f"cluster.ray_address={address}: {e}: its GCS answered the check, but connecting "
                             "did not finish; check the cluster (`ray status`) and that this machine reaches every "
                             "port of its head node") from None
        cluster_errors_to_log()
    else:
        if cfg.run.device != "cpu":  # one machine: NCCL's bootstrap and socket transport stay on loopback too
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        local_ray(cfg.cluster.num_cpus, env)


def local_ray(num_cpus: int | None = None, env_vars: dict[str, str] | None = None) -> None:
    """A local Ray cluster, the one a training starts (``ray_init`` with no address) and a benchmark's or a tool's:
    bound to loopback, token authentication required, the workers' output (vLLM, DeepSpeed, Ray) left in the
    session's log folder (a run folder links it). ``env_vars``: the workers' environment."""
    loopback_only()
    runtime_env = {"env_vars": env_vars} if env_vars is not None else None
    try:
        alarm_within(ray.init, num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
                     log_to_driver=False, logging_level=logging.WARNING, _node_ip_address=LOOPBACK,
                     timeout_s=RAY_INIT_TIMEOUT_S, what="a local Ray cluster's start")
    except WaitTimeout as e:
        raise InputError(f"{e}: see Ray's session logs (session_latest/logs: raylet.err, gcs_server.err)") from None
    cluster_errors_to_log()
    require_token_auth()


RAYLET_LOG = logging.getLogger("ray.raylet")  # a child of Ray's logger: the run's log file (driver.console)
WORKER_DEATH = "A worker died or was killed"  # how Ray's message of a worker process's death begins


def cluster_errors_to_log() -> None:
    """Ray's message of a worker's death goes to Ray's logger (``RAYLET_LOG``, at WARNING), not to stdout. The driver
    of Ray prints each error message of the cluster itself, ``log_to_driver=False`` notwithstanding (its error
    listener thread calls ``print_to_stdstream`` with the pid ``raylet``), so a killed engine core put a colored
    ``(raylet) A worker died or was killed while executing a task by an unexpected system error ... Lease ID ...``
    line between the run's own lines, beside the one ``[fault]`` line the run says of the same death (the fleet's
    supervision restarts the actor and says so). During a run Ray's logger writes to the run's log file
    (``driver.console.logs_to_file``); the cluster's other messages (a node marked dead, the memory monitor's kills)
    stay on the console. Idempotent; a Ray without that function is left as it is."""
    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "cluster_errors_to_log", False):
        return

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            lines = [line for line in data.get("lines", []) if WORKER_DEATH not in str(line)]
            for line in data.get("lines", []):
                if WORKER_DEATH in str(line):
                    RAYLET_LOG.warning("%s", line)
            if not lines:
                return
            data = {**data, "lines": lines}
        printer(data, ignore_prefix)

    print_to_stdstream.cluster_errors_to_log = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT_S = 10.0


def check_address(cfg: Config) -> None:
    """The run's Ray address (``cluster.ray_address``, else ``RAY_ADDRESS``), if any, answers (``check_answers``):
    checked before the run prepares anything, so a typo costs seconds, not a warm start and Ray's retries."""
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address and os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") is None:  # a job's own cluster is there
        check_answers(address, "cluster.ray_address" if cfg.cluster.ray_address else "RAY_ADDRESS")


def check_answers(address: str, key: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """``InputError`` naming the address unless a Ray cluster answers at ``address`` (``host:port`` or
    ``ray://host:port``; ``auto`` is Ray's to find) within about ``timeout_s``: nothing listens there (refused), or
    the port accepts connections but what answers is not Ray's GCS (a web server, another service) or nothing answers
    at all (a stopped GCS). Ray itself retries such an address for many minutes, printing reconnect warnings and
    deaf to SIGTERM: its GCS client waits up to ``py_gcs_connect_timeout_s`` per try, 20 tries."""
    if address == "auto":
        return
    scheme, _, hostport = address.rpartition("://")
    hostport = hostport.rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"{key}={address!r}: not a Ray address (host:port, ray://host:port or auto)")
    fix = "start one with `ray start --head` or fix the address"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise InputError(f"{key}={address}: no Ray cluster answers there ({e.strerror or e}); {fix}") from None
    why = probe_gcs(hostport, timeout_s, client=scheme == "ray")
    if why is not None:
        raise InputError(f"{key}={address}: not a Ray cluster ({why}); {fix}")


def probe_gcs(hostport: str, timeout_s: float, client: bool = False) -> str | None:
    """None when Ray's GCS answers at ``hostport`` (a gRPC call of its own service, ``GetClusterId``; a GCS that wants
    an authentication token refuses it, and that is its answer too), else why not, within ``timeout_s``. With
    ``client``: a Ray Client server (``ray://``), judged by its gRPC handshake alone."""
    import grpc

    channel = grpc.insecure_channel(hostport)
    try:
        if client:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                return f"no gRPC answer within {timeout_s:g} s"
            return None
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return (f"the port accepts connections but nothing answers within {timeout_s:g} s: a stopped or hung "
                        "GCS, or another service")
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return "a gRPC server answers, not Ray's GCS"
            details = (e.details() or "").rpartition(": ")[2] or code.name
            return f"what answers does not speak Ray's protocol: {details}"
        return None
    finally:
        channel.close()


def loopback_only() -> None:
    """Make the local cluster Ray is about to start bind loopback only: its GCS, raylet, workers and agents listen
    on the node's address, and Ray 2.60 rewrites a loopback ``_node_ip_address`` to the host's routable one unless
    "clusters" are off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's switch for single-machine Windows and macOS,
    read by ``ray._private.services.get_node_ip_address``). Ray reads that variable once at import: the driver's
    copy of the constant is set too, and the variable goes to every process the cluster starts."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def require_token_auth() -> None:
    """The mode the started cluster really runs in (Ray's own report, not the environment): anything but token
    authentication is refused, the cluster shut down."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        ray.shutdown()
        raise InputError(f"Ray {ray.__version__} has no token authentication; the project needs Ray >= 2.52") from None
    if not is_token_auth_enabled():
        ray.shutdown()
        raise InputError("the local Ray cluster started without token authentication (Ray reports another mode); "
                         "check RAY_AUTH_MODE and ~/.ray/auth_token")


def link_ray_logs(link: Path) -> None:
    """``link`` -> this Ray session's log folder (every actor's stdout and stderr), replacing an older link."""
    node = getattr(global_worker, "node", None)
    logs = node.get_logs_dir_path() if node is not None else None
    if not logs or not Path(logs).is_dir():
        return
    if link.is_symlink():
        link.unlink()
    if not link.exists():
        link.symlink_to(Path(logs).resolve(), target_is_directory=True)
