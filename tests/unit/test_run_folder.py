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
from driver.run_folder import check_safetensors, hold, read_metrics_lines, set_aside_earlier_run

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
    assert line == (f"{run} held a finished run: its results moved to {tmp_path / 'quickstart.previous'} (replacing "
                    "what was there); this run starts afresh, reusing the warm start in sft/")
    assert sorted(p.name for p in run.iterdir()) == ["sft"]
    assert (tmp_path / "quickstart.previous" / "metrics.jsonl").read_text().count("step") == 2
    assert set_aside_earlier_run(run) is None, "a folder with no results: nothing to move"
    (run / "eval.jsonl").write_text("{}\n")
    assert "held an unfinished run (no summary.json)" in set_aside_earlier_run(run)
    assert sorted(p.name for p in (tmp_path / "quickstart.previous").iterdir()) == ["eval.jsonl"], "replaced"


def test_an_empty_folder_made_ahead_of_the_run_is_no_earlier_run_and_stays_in_place(tmp_path):
    """A checkpoints folder made before the run (a mount of another disk; the fault suite mounts a small tmpfs
    there) is not an earlier run's result: moving it aside failed ("Device or resource busy") and ended the run."""
    run = tmp_path / "quickstart"
    (run / "checkpoints").mkdir(parents=True)
    assert set_aside_earlier_run(run) is None
    assert (run / "checkpoints").is_dir() and not (tmp_path / "quickstart.previous").exists()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "held an unfinished run" in set_aside_earlier_run(run)
    assert (run / "checkpoints").is_dir(), "the empty folder stays where the user put it"
    assert sorted(p.name for p in (tmp_path / "quickstart.previous").iterdir()) == ["metrics.jsonl"]


def test_a_metrics_file_that_is_not_utf8_is_one_error_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": \xff2}\n')
    with pytest.raises(InputError) as info:
        read_metrics_lines(path)
    assert error_line(info.value) == (f"error: {path}: line 2 is not UTF-8 text (byte 0xff at offset 9); fix or "
                                      "remove that line to resume")
    path.write_text('{"step": 1}\n\n')
    assert read_metrics_lines(path) == ['{"step": 1}']


def safetensors(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_damaged_safetensors_are_one_error_naming_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    check_safetensors(path)  # whole
    safetensors(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4)
    with pytest.raises(InputError, match=r"model.safetensors: damaged safetensors file \(tensor 'w' lies at bytes "
                                         r"0-8 of 4 bytes of data\)"):
        check_safetensors(path)
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(InputError, match="its header says 1000000000000 bytes of header"):
        check_safetensors(path)
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{x")
    with pytest.raises(InputError, match="its header is not JSON"):
        check_safetensors(path)


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
