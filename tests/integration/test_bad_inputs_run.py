"""Bad inputs on real components (real Ray, vLLM CPU engine, DeepSpeed learner), started the way a user does: the
``async-agent-rl`` console script from an environment with no ``RAY_AUTH_*`` variable.

- The local Ray cluster that ``ray_init`` starts keeps Ray's token authentication on, in the driver and in every
  worker, and refuses an unauthenticated HTTP request; if authentication were off, every listening socket of the
  cluster would have to be on loopback.
- One short training whose ``retriever.url`` points at a closed port: it warns about the failed searches while it
  runs and reports their counts in summary.json and the ``[done]`` line; it leaves no copy of the policy
  in /dev/shm. Its newest checkpoint is then damaged and ``--resume`` falls back to the one before with a
  warning naming the file.
- A training set where no prompt fits ``data.max_prompt_length`` stops with one ``error:`` line and exit 2
  instead of hanging.

About 5 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from async_agent_rl.config import load_config
from tests.helpers import leaked_weight_dirs, plain_env, shm_weight_dirs, world_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).parent / "async-agent-rl")
SMALL = [
    "learner.batch_size=16", "learner.mini_batch_size=16", "learner.micro_batch_size=8",
    "rollout.group_size=4", "rollout.max_concurrent_episodes=16", "eval.num_questions=8", "eval.at_start=false",
    "monitoring.enabled=false", "sft.enabled=false", "buffer.group_filter=none",
]  # fmt: skip


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> set[int]:
    try:
        p = psutil.Process(pid)
        return {pid, *(c.pid for c in p.children(recursive=True))}
    except psutil.Error:
        return set()


def run_cli(args: list[str], cwd: Path, timeout_s: float) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Run the console script; returns its result and every pid of its process tree seen while it ran."""
    proc = subprocess.Popen([CLI, *args], cwd=cwd, env=plain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            pids |= tree(proc.pid)
            if time.monotonic() > deadline:
                os.killpg(proc.pid, 9)
                pytest.fail(f"`async-agent-rl {' '.join(args[:2])}` still running after {timeout_s} s")
            time.sleep(0.5)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), pids


SOCKETS_SCRIPT = textwrap.dedent('''
    import json, os, subprocess, sys
    import psutil, ray
    from async_agent_rl.config import load_config
    from driver.cluster import ray_init

    ray_init(load_config(None, ["cluster.num_cpus=1"]))

    @ray.remote(num_cpus=0)
    def worker_auth_mode():
        return os.environ.get("RAY_AUTH_MODE")

    try:
        worker = ray.get(worker_auth_mode.remote(), timeout=120)
    except Exception as e:
        worker = f"unreachable: {type(e).__name__}"
    me = psutil.Process()
    listening = []
    for p in [me, *me.children(recursive=True)]:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening.append([c.laddr.ip, c.laddr.port, p.name()])
        except psutil.Error:
            pass
    # a peer without the cluster's token asks the GCS (on loopback) for a key: refused?
    gcs_port = ray._private.worker._global_node.gcs_address.rsplit(":", 1)[1]
    probe = ("import sys\\nfrom ray._raylet import GcsClient\\ntry:\\n"
             "    GcsClient(address=sys.argv[1]).internal_kv_get(b'session_name', b'session', timeout=10)\\n"
             "    print('ANSWERED')\\nexcept Exception as e:\\n    print('REFUSED', type(e).__name__)")
    probes = {}
    for name, extra in [("wrong token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}),
                        ("no token", {"RAY_AUTH_MODE": "disabled"})]:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}, **extra}
        r = subprocess.run([sys.executable, "-c", probe, f"127.0.0.1:{gcs_port}"], env=env, capture_output=True,
                           text=True, timeout=120)
        probes[name] = (r.stdout.strip().splitlines() or ["no answer"])[-1]
    print("RESULT " + json.dumps({"driver": os.environ.get("RAY_AUTH_MODE"), "worker": worker,
                                  "listening": listening, "probes": probes}))
    ray.shutdown()
''')


def test_local_ray_cluster_authenticates_every_process():
    r = subprocess.run([sys.executable, "-c", SOCKETS_SCRIPT], cwd=REPO, env=plain_env(), capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    public = [s for s in res["listening"] if not (s[0].startswith("127.") or s[0] == "::1")]
    auth_on = res["driver"] == "token" and res["worker"] == "token"
    # Ray binds the cluster's gRPC servers to every interface: then authentication must be on, in every process
    assert auth_on or not public, f"authentication {res['driver']}/{res['worker']} with public sockets {public}"
    assert auth_on, res  # and the project never turns it off
    assert res["probes"] == {"wrong token": "REFUSED AuthenticationError", "no token": "REFUSED AuthenticationError"}


def test_short_run_warns_on_failed_searches_and_cleans_shm(
    tmp_path, world_dir, searching_model_dir
):
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, searching_model_dir),
        "learner.total_steps=2", f"retriever.url=http://127.0.0.1:{closed_port()}",
        "retriever.client.timeout_s=0.5", "retriever.client.retries=0", "retriever.client.deadline_s=1",
    ])  # fmt: skip
    cfg_file = cfg.save(tmp_path / "cfg.yaml")
    run_dir = tmp_path / "run"
    shm_before = shm_weight_dirs()
    r, pids = run_cli(["train", "--config", str(cfg_file)], REPO, timeout_s=480)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["searches"] > 0, summary
    assert summary["search_errors"] == summary["searches"], summary  # nothing answers on that port
    assert "[warn]" in r.stdout and "searches failed" in r.stdout, r.stdout[-3000:]
    done = [x for x in r.stdout.splitlines() if x.startswith("[done] ")]
    assert done and f"{summary['searches']} searches, {summary['search_errors']} failed" in done[0], done
    assert len(pids) > 5 and not leaked_weight_dirs(shm_before, pids)  # the policy copies are gone
    # (a resume past a damaged checkpoint: tests/integration/test_train_faults.py, after a crash)


def test_no_training_prompt_fits_is_an_error_not_a_hang(tmp_path, world_dir, tiny_model_dir):
    cfg = load_config(REPO / "configs/quickstart.yaml", [
        *SMALL, f"run.output_dir={tmp_path}", "run.name=run", *world_overrides(world_dir, tiny_model_dir),
        "data.max_prompt_length=16", "learner.total_steps=2",
    ])  # fmt: skip
    cfg_file = cfg.save(tmp_path / "cfg.yaml")
    t0 = time.monotonic()
    r, _ = run_cli(["train", "--config", str(cfg_file)], REPO, timeout_s=400)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "data.max_prompt_length=16" in lines[0] and "RolloutActor.setup" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr.split(lines[0])[-1]
    assert len(r.stdout) + len(r.stderr) < 200_000  # a few lines, not a flood
    assert time.monotonic() - t0 < 400
