"""A multi-node Ray cluster on this machine, as Ray's own tests build one (``ray.cluster_utils.Cluster``): several
raylets, each a node with its own resources and object store, all on 127.0.0.1, with Ray's token authentication on
(a token file of the cluster's own, never ``~/.ray/auth_token``).

The cluster lives in a process of its own (``python -m tests.multinode SPEC``), in a session of its own, so that
the test process never becomes a Ray driver with another cluster's authentication and every process of the
cluster can be found and ended. ``LocalNodes`` (a context manager) starts it and talks to it over its stdin and
stdout, one JSON line each way:

- ``{"cmd": "remove", "node": NAME}``: the node's raylet, object store and workers are killed
  (``Cluster.remove_node``), as when a machine is lost;
- ``{"cmd": "add", "node": NAME, "num_cpus": N, "resources": {...}}``: a new node joins;
- ``{"cmd": "actors"}``: Ray's own record of every actor (the GCS actor table): name, class, state, restarts and
  the node it is (or was last) on, by node name;
- ``{"cmd": "listening"}``: every listening socket of the cluster's processes;
- ``{"cmd": "quit"}`` (or end of input): the cluster is shut down.

Drivers (a training, a script) connect with ``LocalNodes.address`` and ``LocalNodes.env`` (the token's mode and
path). ``SPEC``: ``{"temp_dir": DIR, "head": {"num_cpus": N, "resources": {...}}, "nodes": {NAME: {...}, ...}}``
(a node may also give ``object_store_memory`` in bytes; Ray's test default is 150 MiB); the head node's name is
``head``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.helpers import plain_env

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 240.0
COMMAND_TIMEOUT_S = 120.0


# ------------------------------------------------------------------------------------------------ the host process
def serve(spec: dict) -> None:
    """Build the cluster of ``spec``, say ``ready`` with its address and node ids, then answer commands until
    ``quit`` or the end of stdin."""
    import psutil
    import ray
    import ray._private.utils
    from ray.cluster_utils import Cluster

    from driver.cluster import loopback_only

    assert os.environ.get("RAY_AUTH_MODE") == "token" and os.environ.get("RAY_AUTH_TOKEN_PATH"), \
        "the cluster starts with token authentication only"
    loopback_only()  # every node binds 127.0.0.1 (and every process the nodes start inherits the switch)
    # Cluster.add_node writes the head's address to /tmp/ray/ray_current_cluster, where `ray.init(address="auto")`
    # and `ray status` of anyone on this machine would find it: not this test's business
    ray._private.utils.write_ray_address = lambda *a, **k: None
    common = {"node_ip_address": LOOPBACK, "temp_dir": spec["temp_dir"]}

    def args(node: dict) -> dict:  # Cluster.add_node's defaults otherwise (a 150 MiB object store)
        return {k: node[k] for k in ("num_cpus", "resources", "object_store_memory") if k in node}

    cluster = Cluster(initialize_head=True, head_node_args={**args(spec.get("head", {})), "include_dashboard": False,
                                                            **common})
    nodes = {"head": cluster.head_node}
    for name, node in spec.get("nodes", {}).items():
        nodes[name] = cluster.add_node(**args(node), **common)
    cluster.wait_for_nodes()
    names = {n.node_id: name for name, n in nodes.items()}
    say({"ready": True, "address": cluster.address, "nodes": {name: n.node_id for name, n in nodes.items()},
         "pid": os.getpid()})

    def answer(msg: dict) -> dict:
        cmd = msg.get("cmd")
        if cmd == "remove":
            node = nodes.pop(msg["node"])
            cluster.remove_node(node, allow_graceful=False)  # SIGKILL: a machine that is lost says no goodbye
            return {"removed": msg["node"], "node_id": node.node_id}
        if cmd == "add":
            node = cluster.add_node(**args(msg), **common)
            nodes[msg["node"]], names[node.node_id] = node, msg["node"]
            return {"added": msg["node"], "node_id": node.node_id}
        if cmd == "actors":
            table = cluster.global_state.actor_table(None)
            return {"actors": [{"name": a["Name"], "class": a["ActorClassName"], "state": a["State"],
                                "restarts": a["NumRestarts"], "node_id": a["Address"]["NodeID"],
                                "node": names.get(a["Address"]["NodeID"])} for a in table.values()]}
        if cmd == "listening":
            me = psutil.Process()
            pids = {me.pid, *(c.pid for c in me.children(recursive=True))}
            return {"listening": sorted({(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
                                         if c.status == psutil.CONN_LISTEN and c.pid in pids})}
        return {"error": f"unknown command {cmd!r}"}

    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("cmd") == "quit":
                break
            try:
                say(answer(msg))
            except Exception as e:  # noqa: BLE001 - the test reads it
                say({"error": f"{type(e).__name__}: {e}"})
    finally:
        cluster.shutdown()
        say({"bye": True})


def say(msg: dict) -> None:
    sys.stdout.write("AAR " + json.dumps(msg) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------------ the test's side
class LocalNodes:
    """The cluster of ``head`` (``{"num_cpus": N, "resources": {...}}``) and ``nodes`` (name -> the same), started in
    a process of its own (see the module docstring); ``address``, ``node_ids`` (name -> id) and ``env`` (for a
    driver) once entered. Leaving ends every process of the cluster, stragglers included."""

    def __init__(self, head: dict, nodes: dict[str, dict]):
        self.head, self.nodes = head, nodes
        self.proc: subprocess.Popen | None = None
        self.lines: list[dict] = []
        self.log: list[str] = []
        self._cond = threading.Condition()

    def __enter__(self) -> "LocalNodes":
        # a short path: Ray's unix sockets live under it (the AF_UNIX limit is ~107 characters)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="aar-nodes-"))
        token = self.temp_dir / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {**plain_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "PYTHONUNBUFFERED": "1"}
        spec = {"temp_dir": str(self.temp_dir), "head": self.head, "nodes": self.nodes}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.multinode", json.dumps(spec)], cwd=REPO,
                                     env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            ready = self._next("ready", START_TIMEOUT_S)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.address, self.node_ids, self.host_pid = ready["address"], ready["nodes"], ready["pid"]
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                if line.startswith("AAR "):
                    self.lines.append(json.loads(line[4:]))
                else:
                    self.log.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append({"eof": True})
            self._cond.notify_all()

    def _next(self, key: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, msg in enumerate(self.lines):
                    if key in msg or "error" in msg or "eof" in msg:
                        del self.lines[: i + 1]
                        if key not in msg:
                            raise RuntimeError(f"the cluster's host answered {msg} (waiting for {key!r}); its log:\n"
                                               + "\n".join(self.log[-60:]))
                        return msg
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {key!r} from the cluster's host within {timeout_s:g} s; its log:\n"
                                       + "\n".join(self.log[-60:]))
                self._cond.wait(left)

    def ask(self, key: str, **msg: Any) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._next(key, COMMAND_TIMEOUT_S)

    def remove(self, name: str) -> str:
        """Kill node ``name`` (its raylet, object store and workers); its id."""
        return self.ask("removed", cmd="remove", node=name)["node_id"]

    def add(self, name: str, spec: dict) -> str:
        """Start node ``name`` (``{"num_cpus": N, "resources": {...}}``) and join it to the cluster; its id."""
        node_id = self.ask("added", cmd="add", node=name, **spec)["node_id"]
        self.node_ids[name] = node_id
        return node_id

    def actors(self) -> list[dict]:
        return self.ask("actors", cmd="actors")["actors"]

    def listening(self) -> list[tuple[str, int]]:
        return [tuple(x) for x in self.ask("listening", cmd="listening")["listening"]]

    def __exit__(self, *exc: Any) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                proc.stdin.close()
                proc.wait(60)
            except (OSError, subprocess.TimeoutExpired, AssertionError):
                pass
        if proc is not None:
            from tests.helpers import stop_cluster  # lazy: this file also runs as the cluster host

            stop_cluster(self.temp_dir, proc.pid)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
