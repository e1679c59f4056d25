"""``ray job submit`` against a real ``ray start`` cluster of two nodes (a head, and a second raylet joined with
``ray start --address`` and a temp dir of its own, as another machine would): a short training runs to completion
as a job, the rollout actor on the second node, and the quickstart's relative paths are refused in one line.

The cluster is this test's own: ``ray start --head`` from the venv (so the job's bare ``async-agent-rl`` is the
venv's), its own ``--temp-dir`` and free ports, the dashboard (job server) on 127.0.0.1, and Ray's token
authentication on (``RAY_AUTH_MODE=token`` with the test's own token file in ``RAY_AUTH_TOKEN_PATH``, so the user's
``~/.ray/auth_token`` is neither read nor written; see docs/OPERATIONS.md, "ray job submit"). The ``ray job`` CLI
reads the token from that file; without it, or with another token, the job server refuses the request. The job is submitted with ``--working-dir .`` (the repository, without
``.venv``/``runs``/``.git``: Ray honours ``.gitignore`` and its default excludes), polled with ``ray job status``
until it ends, and its run folder checked.

Teardown ends only this cluster's processes. ``ray stop --force`` is NOT used: in Ray 2.60 it kills every Ray
process on the machine by name (other sessions' clusters included), whatever ``--temp-dir`` says. Instead
``ray start`` runs in a session of its own, and the processes of that session (GCS, raylet, dashboard, agents,
monitors, the client server), those whose command line names this cluster's temp dir, and all their descendants
(workers, the job's driver, vLLM engine cores) are terminated, then killed; none may be left.

About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import cluster_processes, plain_env, stop_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
TOTAL_STEPS = 2
JOB_TIMEOUT_S = 420
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_cli() -> str:
    exe = VENV_BIN / "ray"
    assert exe.is_file(), f"no `ray` beside {sys.executable}"
    return str(exe)


def run(cmd: list[str], env: dict, timeout_s: float, cwd: Path = REPO,
        check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd[:4])} ... did not return within {timeout_s} s; output:\n{e.stdout}\n{e.stderr}")
    if check and res.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return res


def start_node(cmd: list[str], env: dict) -> subprocess.Popen:
    """A `ray start` in a session of its own: every daemon it leaves behind stays in that session (``pid``)."""
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def started(proc: subprocess.Popen, what: str) -> None:
    """Fail unless the `ray start` of ``proc`` returned 0 within 180 s."""
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not return within 180 s")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-4000:]}"


@pytest.fixture()
def ray_cluster():
    """A head node of our own: ``(dashboard_url, env, temp_dir)``; torn down whatever happens."""
    # A short path: Ray's unix sockets live under it (the AF_UNIX limit is ~107 characters).
    temp_dir = Path(tempfile.mkdtemp(prefix="aar-ray-"))
    token = temp_dir / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**plain_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(VENV_BIN.parent),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    dash, gcs = free_port(), free_port()
    cmd = [ray_cli(), "start", "--head", f"--port={gcs}", "--num-cpus=2", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}",
           f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}", f"--node-manager-port={free_port()}",
           f"--object-manager-port={free_port()}", "--disable-usage-stats", '--resources={"trainer": 2}']
    # a second node (a raylet of its own, joining the head as a machine of its own would) for the rollout actor
    worker = [ray_cli(), "start", f"--address=127.0.0.1:{gcs}", "--num-cpus=1", '--resources={"rollout": 1}',
              f"--temp-dir={temp_dir / 'n2'}",  # its own, as another machine's: its own copy of a job's working dir
              f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
              f"--runtime-env-agent-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
              f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
              "--disable-usage-stats"]
    sid = worker_sid = None
    try:
        head = start_node(cmd, env)
        sid = head.pid  # every daemon it leaves behind can be found (and only those)
        started(head, "`ray start --head`")
        join = start_node(worker, env)
        worker_sid = join.pid
        started(join, "`ray start --address` (the second node)")
        url = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 90
        while True:  # the job server answers once `ray job list` does
            res = run([ray_cli(), "job", "list", "--address", url], env, timeout_s=60, check=False)
            if res.returncode == 0:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the job server on {url} did not answer within 90 s:\n{res.stdout}\n{res.stderr}")
            time.sleep(2)
        # authentication is enforced: no token, or another one, is refused
        wrong = temp_dir / "wrong_token"
        wrong.write_text(secrets.token_hex(32))
        for bad_env in ({**env, "RAY_AUTH_TOKEN_PATH": str(wrong)},
                        {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}):  # fmt: skip
            res = run([ray_cli(), "job", "list", "--address", url], bad_env, timeout_s=60, check=False)
            assert res.returncode != 0 and "Authentication" in res.stdout + res.stderr, res.stdout + res.stderr
        yield url, env, temp_dir
    finally:
        stop_cluster(temp_dir, worker_sid)
        stop_cluster(temp_dir, sid)
        left = cluster_processes(temp_dir, sid) + cluster_processes(temp_dir, worker_sid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"cluster processes still alive after teardown: {[p.pid for p in left]}"


ANSI = re.compile(r"\x1b\[[0-9;]*m")
ENDED = {"succeeded": "SUCCEEDED", "failed": "FAILED", "was stopped": "STOPPED"}


def job_status(url: str, job_id: str, env: dict) -> str:
    """What ``ray job status`` says: "Job 'ID' succeeded / failed / was stopped" for an ended job, else
    "Status for job 'ID': PENDING|RUNNING"."""
    res = run([ray_cli(), "job", "status", "--address", url, job_id], env, timeout_s=60, check=False)
    text = ANSI.sub("", res.stdout + res.stderr)
    ended = re.search(rf"Job '{re.escape(job_id)}' (succeeded|failed|was stopped)", text)
    if ended:
        return ENDED[ended.group(1)]
    m = re.search(rf"Status for job '{re.escape(job_id)}': (\w+)", text)
    return m.group(1) if m else f"UNKNOWN ({res.returncode}: {text[-500:]})"


def submit(url: str, env: dict, job_id: str, entrypoint: list[str]) -> tuple[str, str]:
    """Submit ``entrypoint`` as job ``job_id`` with the repository as its working dir, wait for it to end; returns
    its final status and its log."""
    cmd = [ray_cli(), "job", "submit", "--address", url, "--working-dir", ".", "--submission-id", job_id,
           "--no-wait", "--", *entrypoint]
    res = run(cmd, env, timeout_s=120)
    assert job_id in res.stdout + res.stderr
    status, deadline = "PENDING", time.monotonic() + JOB_TIMEOUT_S
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(3)
        status = job_status(url, job_id, env)
    logs = run([ray_cli(), "job", "logs", "--address", url, job_id], env, timeout_s=60, check=False).stdout
    if status not in TERMINAL:
        run([ray_cli(), "job", "stop", "--address", url, "--no-wait", job_id], env, timeout_s=60, check=False)
        pytest.fail(f"job {job_id} not finished after {JOB_TIMEOUT_S} s (status {status}); log tail:\n{logs[-6000:]}")
    return status, ANSI.sub("", logs)


def test_ray_job_submit_runs_a_short_training_to_completion(ray_cluster, tmp_path):
    """On a cluster of two nodes (the learner and buffer on the head, the rollout actor on the other, placed by
    resources as on several machines): the quickstart's relative paths are refused in one error line (each node
    resolves them in its own copy of the working dir), and the documented command with absolute paths trains to
    the end."""
    url, env, temp_dir = ray_cluster
    out_dir = tmp_path / "runs"
    run_dir = out_dir / "job"
    shared = tmp_path / "shared"  # model and world at absolute paths, as on a filesystem every node mounts
    # The documented command with a short run's overrides. The job's cwd is Ray's unpacked copy of the working dir
    # on the driver's node: every path is given absolute (docs/OPERATIONS.md), and the job builds the world and the
    # model there itself.
    entrypoint = [
        "async-agent-rl", "train", "--config", "configs/quickstart.yaml",
        "run.name=job", f"run.output_dir={out_dir}",
        f"learner.total_steps={TOTAL_STEPS}", "learner.batch_size=16", "learner.mini_batch_size=16",
        "learner.micro_batch_size=8", "eval.num_questions=8", "sft.enabled=false", "monitoring.log_every_s=1",
        "cluster.ray_address=auto",
        "buffer.group_filter_max_streak=4",  # the random-init policy never scores: the filter must stand aside
        # placed as on a cluster of several machines (docs/OPERATIONS.md): learner and buffer on the head, the
        # rollout actor on the other node
        "cluster.rollout_resources={rollout: 1}", "cluster.learner_resources={trainer: 1}",
        "cluster.buffer_resources={trainer: 1}",
    ]
    paths = [f"model.path={shared}/model", f"data.world_dir={shared}/world",
             f"data.train_files=[{shared}/world/train.parquet]", f"data.test_files=[{shared}/world/test.parquet]",
             f"data.corpus_file={shared}/world/corpus.jsonl"]

    # the quickstart's relative model and data paths: refused before any actor starts, in one line
    status, logs = submit(url, env, f"aar-relative-{uuid.uuid4().hex[:8]}", [*entrypoint, "run.name=relative"])
    errors = [x for x in logs.splitlines() if x.startswith("error:")]
    assert status == "FAILED" and len(errors) == 1 and "Traceback" not in logs, logs[-4000:]
    assert errors[0].startswith("error: model.path=runs/quickstart/model, data.world_dir=runs/quickstart/world, ") \
        and "on a cluster of 2 nodes" in errors[0], errors[0]

    job_id = f"aar-train-{uuid.uuid4().hex[:8]}"
    submitted = time.time()
    status, logs = submit(url, env, job_id, [*entrypoint, *paths])
    assert status == "SUCCEEDED", f"job {job_id} ended {status}; log:\n{logs[:4000]}\n...\n{logs[-4000:]}"

    # the driver connected to this cluster (cluster.ray_address=auto) and trained to the end, its rollout actor on
    # the second node: weights and trajectories crossed between raylets (object stores of their own)
    assert "[done]" in logs, logs[-3000:]
    nodes = run([ray_cli(), "list", "nodes", "--address", url, "--format", "json", "--detail"], env, timeout_s=60).stdout
    nodes = json.loads(nodes[nodes.index("["):])
    second = [n["node_id"] for n in nodes if not n.get("is_head_node") and n.get("state") == "ALIVE"]
    assert len(nodes) == 2 and len(second) == 1, nodes
    placed = re.search(r"\[start\] rollout actor 0 on node ([0-9a-f]+):", logs)
    assert placed and second[0].startswith(placed.group(1)), (placed and placed.group(0), second)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS and summary["episodes"] > 0, summary
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in lines] == list(range(1, TOTAL_STEPS + 1))
    assert (run_dir / "config.yaml").is_file() and "ray_address: auto" in (run_dir / "config.yaml").read_text()
    assert list((run_dir / "plots").glob("*.png"))
    assert (run_dir / "final").is_dir()
    assert (run_dir / "prometheus" / "targets.json").is_file()
    listed = run([ray_cli(), "job", "list", "--address", url], env, timeout_s=60).stdout
    assert job_id in listed

    # the uploaded working dir is the repository's sources only (Ray honours .gitignore and excludes .git/.venv):
    # small, and its runs/ holds only what the job built there (a fresh world and model), nothing uploaded
    pkgs = sorted({p.resolve() for p in temp_dir.glob("session_*/runtime_resources/working_dir_files/*")
                   if p.is_dir()})  # session_latest is a link to the session
    assert len(pkgs) == 1, f"expected one unpacked working dir under {temp_dir}, found {pkgs}"
    pkg = pkgs[0]
    assert (pkg / "configs" / "quickstart.yaml").is_file() and (pkg / "driver" / "train.py").is_file()
    for excluded in (".venv", ".git"):
        assert not (pkg / excluded).exists(), f"{excluded} was uploaded with --working-dir ."
    # and .rayignore keeps the benchmarks' committed result files (~19 MB of figures, reports, warm starts) out
    assert not (pkg / "benchmarks" / "results").exists(), "benchmarks/results was uploaded with --working-dir ."
    uploaded = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file() and "runs" not in f.relative_to(pkg).parts)
    # the sources (~3 MiB) and the quickstart's shipped warm start (4.7 MiB: a job of the quickstart starts from it)
    assert (pkg / "configs" / "warm_starts" / "quickstart" / "model.safetensors").is_file()
    assert uploaded < 10 * 2**20, f"working dir upload is {uploaded / 2**20:.1f} MiB"
    built = shared / "model" / "config.json"
    assert built.is_file() and built.stat().st_mtime >= submitted, "the job should have built the tiny model itself"
    assert sorted(p.name for p in (pkg / "runs").iterdir()) == ["quickstart"], list((pkg / "runs").iterdir())
