"""The benchmarks' result folders (``benchmarks/record.py``, ``--out DIR`` on every ``benchmarks/*_bench.py``): the three
files, what they hold, the command line as typed from the repo root, and no absolute path of the machine in any of
them. No benchmark runs here."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks import record

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "buffer_bench.py"
ABSOLUTE = re.compile(r"(?<![\w.~$/-])/[\w.-]+")  # a "/" that starts a path, not one inside "traj/s" or a URL
HOME = os.path.expanduser("~")


def strict_json(path: Path):
    def refuse(constant):
        raise ValueError(f"{path.name}: {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def run_recorded(out: Path, monkeypatch, body=None) -> tuple[dict, str]:
    """A Recording of a made-up benchmark run whose argv, printed text, result and environment hold absolute paths."""
    monkeypatch.setenv("VLLM_BENCH_TEST_DIR", "/opt/elsewhere/vllm-cache")
    monkeypatch.setenv("VLLM_BENCH_TEST_API_KEY", "do-not-write")
    scratch = Path(tempfile.gettempdir()) / "bench_scratch"
    argv = ["--tokens", "64", "--out", str(out), f"--work={REPO}/runs/x", "--model", "/opt/models/tiny"]
    args = {"tokens": 64, "out": str(out), "work": f"{REPO}/runs/x", "model": "/opt/models/tiny"}
    with record.Recording(out, SCRIPT, argv, args) as rec:
        assert strict_json(out / "run.json")["status"] == "running"  # written at the start
        print(f"model at {REPO}/runs/x/model and /opt/models/tiny/config.json")
        print(f"writing {out}/result.json")
        print(f"scratch {scratch}/w, cache {HOME}/.cache")
        print("push 3840 trajectories = 7,807 traj/s (184 MiB/s)")
        if body:
            body(rec)
        rec.result = {"traj_per_s": 7807.2, "p50_ms": float("nan"), "shape": np.array([40, 2048]),
                      "count": np.int64(3), "world": scratch / "world", "model": "/opt/models/tiny"}
    return args, scratch.name


def test_no_out_changes_nothing(capsys):
    stdout = sys.stdout
    with record.Recording(None, SCRIPT, ["--tokens", "64"], {"tokens": 64}) as rec:
        assert sys.stdout is stdout
        print("as before")
        rec.result = {"x": 1}
    assert sys.stdout is stdout and capsys.readouterr().out == "as before\n"


def test_out_writes_the_three_files_and_still_prints(tmp_path, monkeypatch, capsys):
    out = tmp_path / "res"
    run_recorded(out, monkeypatch)
    assert sorted(p.name for p in out.iterdir()) == ["output.txt", "result.json", "run.json"]
    printed = capsys.readouterr().out
    assert "push 3840 trajectories = 7,807 traj/s (184 MiB/s)\n" in printed and str(REPO) in printed  # as printed

    result = strict_json(out / "result.json")
    assert result == {"traj_per_s": 7807.2, "p50_ms": None, "shape": [40, 2048], "count": 3,
                      "world": "$TMPDIR/bench_scratch/world", "model": "tiny"}
    assert (out / "output.txt").read_text() == (
        "model at runs/x/model and tiny/config.json\n"
        "writing res/result.json\n"
        "scratch $TMPDIR/bench_scratch/w, cache ~/.cache\n"
        "push 3840 trajectories = 7,807 traj/s (184 MiB/s)\n")

    run = strict_json(out / "run.json")
    assert run["status"] == "completed" and run["files"] == ["result.json", "output.txt", "run.json"]
    assert run["cpu_count"] == os.cpu_count()
    assert len(run["load_average_start"]) == 3 and len(run["load_average_end"]) == 3
    assert set(run["versions"]) == {"python", "torch", "ray", "vllm", "deepspeed"}
    assert run["versions"]["python"] == sys.version.split()[0]
    assert re.fullmatch(r"[0-9a-f]{40}", run["git"]["commit"]) and isinstance(run["git"]["dirty"], bool)
    assert all(not os.path.isabs(f) for f in run["git"]["changed_files"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", run["started_utc"])
    assert run["finished_utc"] >= run["started_utc"] and run["seconds"] >= 0
    assert run["environment"]["VLLM_BENCH_TEST_DIR"] == "vllm-cache"
    assert "VLLM_BENCH_TEST_API_KEY" not in run["environment"]  # names that look like secrets are never written


def test_the_command_line_is_relative_to_the_repo_root(tmp_path, monkeypatch):
    out = tmp_path / "res"
    run_recorded(out, monkeypatch)
    run = strict_json(out / "run.json")
    assert run["command"] == "python benchmarks/buffer_bench.py --tokens 64 --out res --work=runs/x --model tiny"
    assert run["argv"] == ["python", "benchmarks/buffer_bench.py", "--tokens", "64", "--out", "res",
                           "--work=runs/x", "--model", "tiny"]
    assert run["arguments"] == {"tokens": 64, "out": "res", "work": "runs/x", "model": "tiny"}
    assert run["paths_outside_repo"] == ["res", "tiny", "vllm-cache"]
    relative = record.command_line(SCRIPT, ["--out", "benchmarks/results/buffer/", "--latency", "none,web", "--x", "a b"])
    assert relative[0] == ("python benchmarks/buffer_bench.py --out benchmarks/results/buffer/ --latency none,web "
                           "--x 'a b'")


def test_no_absolute_path_in_any_file(tmp_path, monkeypatch):
    out = tmp_path / "res"
    run_recorded(out, monkeypatch)
    machine = {str(REPO), str(tmp_path), tempfile.gettempdir(), "/opt/"} | ({HOME} if len(HOME) > 1 else set())
    for path in out.iterdir():
        text = path.read_text()
        assert not [m for m in machine if m in text], f"{path.name}: {[m for m in machine if m in text]}"
        assert not ABSOLUTE.findall(text), f"{path.name}: absolute paths {ABSOLUTE.findall(text)}"


def test_a_failed_run_says_so_and_writes_no_result(tmp_path, monkeypatch):
    out = tmp_path / "res"
    out.mkdir()
    (out / "result.json").write_text('{"from": "an earlier run"}')
    stdout = sys.stdout

    def fail(rec):
        raise RuntimeError(f"engine died in {REPO}/runs/x")

    with pytest.raises(RuntimeError, match="engine died"):
        run_recorded(out, monkeypatch, fail)
    assert sys.stdout is stdout
    assert sorted(p.name for p in out.iterdir()) == ["output.txt", "run.json"]  # the earlier result is gone
    run = strict_json(out / "run.json")
    assert run["status"] == "failed: RuntimeError: engine died in runs/x" and run["files"] == ["output.txt", "run.json"]
    assert "push 3840 trajectories" in (out / "output.txt").read_text()


def test_out_names_a_folder():
    parser = argparse.ArgumentParser()
    record.add_out_argument(parser)
    assert parser.parse_args(["--out", "benchmarks/results/buffer/"]).out == "benchmarks/results/buffer/"
    assert parser.parse_args([]).out is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "runs/bench/weight_sync.json"])


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("*_bench.py")))
def test_every_benchmark_script_takes_out(script):
    source = (REPO / "benchmarks" / script).read_text()
    assert "record.add_out_argument(" in source and "with record.Recording(" in source, script
    assert "--out DIR" in source.split('"""')[1], f"{script}: --out is not in its docstring"


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("*_bench.py")))
def test_every_benchmark_starts_its_local_ray_cluster_on_loopback_with_authentication(script):
    """Until 2026-11-28 the buffer, learner and weight-sync benchmarks started Ray with a bare ``ray.init``, which
    binds the cluster's servers to every interface; a benchmark starts its cluster as a training does
    (``driver.cluster.local_ray`` or ``ray_init``)."""
    source = (REPO / "benchmarks" / script).read_text()
    assert "ray.init(" not in source, f"{script}: a bare ray.init; use driver.cluster.local_ray"
