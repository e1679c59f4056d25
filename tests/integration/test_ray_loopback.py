"""Exposure: the local Ray cluster a run starts (``driver.cluster.ray_init``, as ``async-agent-rl train``
without ``cluster.ray_address`` does) listens on loopback only, in every one of its processes (GCS, raylet,
dashboard and runtime-env agents, workers, actors), and runs with Ray's token authentication, as Ray itself reports
it. Before, Ray rewrote the loopback node address to the host's routable one and its GCS, raylet, workers and agents
listened on every interface. A whole training's sockets: tests/integration/test_train_stall_and_stop.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json, os
    import psutil, ray
    from async_agent_rl.config import load_config
    from driver.cluster import ray_init
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    ray_init(load_config(None, ["cluster.num_cpus=1"]))

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self):
            return os.getpid(), ray.util.get_node_ip_address(), os.environ.get("RAY_AUTH_MODE")

    actor_pid, actor_ip, actor_auth = ray.get(Probe.remote().where.remote(), timeout=180)
    me = psutil.Process()
    pids = {me.pid, *(c.pid for c in me.children(recursive=True))}
    assert actor_pid in pids, (actor_pid, pids)
    listening = sorted({(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN and c.pid in pids})
    names = {}
    for pid in {p for _, _, p in listening}:
        try:
            names[pid] = psutil.Process(pid).name()
        except psutil.Error:
            names[pid] = "?"
    print("RESULT " + json.dumps({
        "listening": [[ip, port, names[pid]] for ip, port, pid in listening],
        "node_ip": ray._private.worker._global_node.node_ip_address, "actor_ip": actor_ip, "actor_pid": actor_pid,
        "listening_pids": sorted({p for _, _, p in listening}),
        "token_auth": is_token_auth_enabled(), "actor_auth": actor_auth}))
    ray.shutdown()
''')


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "localhost") or ip.startswith("::ffff:127.")


def test_a_runs_local_ray_cluster_listens_on_loopback_only_with_token_auth():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "RAY_ENABLE_"))}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=400)  # fmt: skip
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    names = {name for _, _, name in res["listening"]}
    # the cluster's own servers and workers are among them: the check sees what it claims to check (the probe
    # actor's own port is not required: under load it was seen listening only after the scan)
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), res["listening"]
    public = [s for s in res["listening"] if not is_loopback(s[0])]
    assert not public, f"listening beyond loopback: {public}"
    assert res["node_ip"] == res["actor_ip"] == "127.0.0.1", res
    assert res["token_auth"] is True and res["actor_auth"] == "token", res
