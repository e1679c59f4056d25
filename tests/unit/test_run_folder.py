"""Until e4918d9 (2026-11-26), two runs with the same ``run.name`` wrote into one folder (metrics.jsonl with steps
1,2,1,2, the second run's ``final/`` over the first's, both exiting 0); a resume read a non-UTF-8 metrics.jsonl or
resealed damaged weights and failed with an error naming no file; a ``cluster.ray_address`` with no cluster behind it
took Ray 14 minutes of reconnect warnings to fail. Each is now one ``error:`` line naming what is wrong, or (an earlier
run's results in the folder of a fresh run) moved aside in one line."""

from __future__ import annotations

import json
import struct

import pytest

from async_agent_rl.config import load_config
from async_agent_rl.errors import InputError, error_line
from driver.cluster import check_answers
from driver.run_folder import check_safetensors, earlier_runs, hold, read_metrics_lines, set_aside_earlier_run

pytestmark = pytest.mark.unit


def test_a_run_folder_in_use_is_refused_naming_the_other_runs_pid(tmp_path):
    import os

    run = tmp_path / "quickstart"
    with hold(run):
        with pytest.raises(InputError) as info:
            with hold(run):
                pass
        assert error_line(info.value) == (f"error: {run} is in use by another run (pid {os.getpid()}, lock "
                                          f"{run / '.run.lock'}): wait for it to end, or give this run another "
                                          "run.name")
    with hold(run):  # released when the first run ended
        pass


def test_an_earlier_runs_results_are_moved_aside_and_its_warm_start_stays(tmp_path):
    run = tmp_path / "quickstart"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "sft").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "summary.json").write_text("{}")
    line = set_aside_earlier_run(run)
    assert line == (f"{run} held a finished run: its results moved to {tmp_path / 'quickstart.1'} (kept; "
                    "run.delete_earlier_run=true deletes them instead); this run starts afresh, reusing the warm "
                    "start in sft/")
    assert sorted(p.name for p in run.iterdir()) == ["sft"]
    assert (tmp_path / "quickstart.1" / "metrics.jsonl").read_text().count("step") == 2
    assert set_aside_earlier_run(run) is None, "a folder with no results: nothing to move"
    (run / "eval.jsonl").write_text("{}\n")
    assert f"held an unfinished run (no summary.json): its results moved to {tmp_path / 'quickstart.2'}" in \
        set_aside_earlier_run(run)
    assert sorted(p.name for p in (tmp_path / "quickstart.2").iterdir()) == ["eval.jsonl"]
    assert (tmp_path / "quickstart.1" / "checkpoints" / "step_000002").is_dir(), "the earlier one is kept"
    assert earlier_runs(run) == [tmp_path / "quickstart.1", tmp_path / "quickstart.2"]


def test_crash_fresh_fresh_keeps_every_earlier_checkpoint(tmp_path):
    """Until this commit a second fresh start moved the run before it to ``<run>.previous`` "(replacing what was
    there)": the checkpoints of the run before that were deleted, although nobody asked. Each run now goes to a
    numbered folder of its own, the numbers going on past gaps and past other files of those names."""
    run = tmp_path / "quickstart"

    def a_run(tag: str, finished: bool) -> None:
        for step in (2, 4):
            ckpt = run / "checkpoints" / f"step_{step:06d}"
            ckpt.mkdir(parents=True)
            (ckpt / "MANIFEST.json").write_text(tag)
        (run / "metrics.jsonl").write_text(tag)
        if finished:
            (run / "summary.json").write_text(tag)

    (tmp_path / "quickstart.3").write_text("someone's notes")  # a name taken by something else: skipped
    (tmp_path / "quickstart.previous").mkdir()  # an older version's folder: left alone
    (tmp_path / "quickstart.previous" / "keep").write_text("x")
    a_run("crashed", finished=False)  # killed after its checkpoint of step 4
    assert set_aside_earlier_run(run) is not None
    a_run("first fresh", finished=True)
    assert set_aside_earlier_run(run) is not None
    a_run("second fresh", finished=True)
    assert f"moved to {tmp_path / 'quickstart.4'}" in set_aside_earlier_run(run)
    kept = {p.parent.parent.parent.name: p.read_text() for p in tmp_path.glob("quickstart.*/checkpoints/step_*/*")
            if p.parent.name == "step_000004"}  # fmt: skip
    assert kept == {"quickstart.1": "crashed", "quickstart.2": "first fresh", "quickstart.4": "second fresh"}
    assert len(list(tmp_path.glob("quickstart.*/checkpoints/step_*"))) == 6
    assert (tmp_path / "quickstart.3").read_text() == "someone's notes"
    assert (tmp_path / "quickstart.previous" / "keep").is_file()


def test_deleting_an_earlier_run_is_an_explicit_choice(tmp_path):
    run = tmp_path / "quickstart"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "sft").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    line = set_aside_earlier_run(run, delete=True)
    assert line == (f"{run} held an unfinished run (no summary.json): its results were deleted "
                    "(run.delete_earlier_run); this run starts afresh, reusing the warm start in sft/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quickstart"]
    assert sorted(p.name for p in run.iterdir()) == ["sft"]
    assert load_config(None).run.delete_earlier_run is False
    assert load_config(None, ["run.delete_earlier_run=true"]).run.delete_earlier_run is True


def test_an_empty_folder_made_ahead_of_the_run_is_no_earlier_run_and_stays_in_place(tmp_path):
    """A checkpoints folder made before the run (a mount of another disk; the fault suite mounts a small tmpfs
    there) is not an earlier run's result: moving it aside failed ("Device or resource busy") and ended the run."""
    run = tmp_path / "quickstart"
    (run / "checkpoints").mkdir(parents=True)
    assert set_aside_earlier_run(run) is None
    assert (run / "checkpoints").is_dir() and not (tmp_path / "quickstart.1").exists()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "held an unfinished run" in set_aside_earlier_run(run)
    assert (run / "checkpoints").is_dir(), "the empty folder stays where the user put it"
    assert sorted(p.name for p in (tmp_path / "quickstart.1").iterdir()) == ["metrics.jsonl"]


def test_a_metrics_file_that_is_not_utf8_is_one_error_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": \xff2}\n')
    with pytest.raises(InputError) as info:
        read_metrics_lines(path)
    assert error_line(info.value) == (f"error: {path}: line 2 is not UTF-8 text (byte 0xff at offset 9); fix or "
                                      "remove that line to resume")
    path.write_text('{"step": 1}\n\n')
    assert read_metrics_lines(path) == ['{"step": 1}']


def safetensors(path, header, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


W = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def test_damaged_safetensors_are_one_error_naming_the_file(tmp_path):
    """Until this commit the resume's own copy of the weight check raised ``AttributeError: 'list' object has no
    attribute 'items'`` on a header ``[]`` (``error: unexpected AttributeError``), passed a header ``{}`` with no
    data (the engine then failed, naming no file) and never looked at the index's shards; it is now the one check
    ``eval --checkpoint`` runs too (``learner.checkpoint.weights_problems``)."""
    path = tmp_path / "model.safetensors"
    safetensors(path, W, b"\0" * 8)
    check_safetensors(path)  # whole
    whole = path.stat().st_size
    cases = [
        (W, b"\0" * 4, f"{path}: truncated safetensors file: {whole - 4} bytes, its header describes {whole}"),
        (W, b"\0" * 12, f"{path}: damaged (padded) safetensors file: {whole + 4} bytes, its header describes {whole}"),
        ([], b"", f"{path}: not a safetensors file: its header is a JSON list, not an object of tensors"),
        ({}, b"", f"{path}: not a safetensors file: its header describes no tensors"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8,
         f"{path}: damaged safetensors file: tensor 'w' (F32 [3]) lies at bytes 0-8 of its data"),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8,
         f"{path}: not a safetensors file: tensor 'w' has no dtype, shape and two data offsets"),
    ]
    for header, data, says in cases:
        safetensors(path, header, data)
        with pytest.raises(InputError) as info:
            check_safetensors(path)
        assert error_line(info.value) == f"error: {says}", header
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(InputError, match="its header alone says 1000000000008"):
        check_safetensors(path)
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{x")
    with pytest.raises(InputError, match="its header is not JSON"):
        check_safetensors(path)
    safetensors(path, W, b"\0" * 8)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(InputError) as info:
        check_safetensors(path)
    assert error_line(info.value) == (f"error: {tmp_path / 'model-00002-of-00002.safetensors'}: missing (named by "
                                      "model.safetensors.index.json)")


def test_a_ray_address_with_nothing_behind_it_is_one_error_at_once():
    import time

    t0 = time.monotonic()
    with pytest.raises(InputError) as info:
        check_answers("127.0.0.1:1", "cluster.ray_address")
    assert time.monotonic() - t0 < 15
    assert error_line(info.value).startswith("error: cluster.ray_address=127.0.0.1:1: no Ray cluster answers there (")
    with pytest.raises(InputError, match="not a Ray address"):
        check_answers("nowhere", "cluster.ray_address")
    check_answers("auto", "cluster.ray_address")  # Ray's to find
    assert load_config(None, ["cluster.ray_address=127.0.0.1:1"]).cluster.ray_address == "127.0.0.1:1"


def test_a_port_that_answers_but_is_not_ray_is_one_error_naming_the_address():
    """Until this commit only a refused port was caught: a plain HTTP server at ``cluster.ray_address`` had Ray
    print "Failed to connect to GCS" every 5-40 s for minutes, no error, deaf to SIGTERM; so did a port that accepts
    and never answers (a stopped GCS). The check now speaks to the GCS (a gRPC call of its own), bounded."""
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    http = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel's backlog) and never says a word
    try:
        address = f"127.0.0.1:{http.server_address[1]}"
        t0 = time.monotonic()
        with pytest.raises(InputError) as info:
            check_answers(address, "cluster.ray_address")
        assert time.monotonic() - t0 < 15
        line = error_line(info.value)
        assert line.startswith(f"error: cluster.ray_address={address}: not a Ray cluster (what answers does not "
                               "speak Ray's protocol: "), line
        assert "\n" not in line
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(InputError) as info:
            check_answers(address, "RAY_ADDRESS", timeout_s=2)
        assert 1.5 < time.monotonic() - t0 < 10
        assert error_line(info.value) == (f"error: RAY_ADDRESS={address}: not a Ray cluster (the port accepts "
                                          "connections but nothing answers within 2 s: a stopped or hung GCS, or "
                                          "another service); start one with `ray start --head` or fix the address")
    finally:
        http.shutdown()
        silent.close()
