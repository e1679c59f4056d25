"""Bad inputs: resume verifies checkpoints (a checksum manifest written last, the folder renamed into place),
skips damaged ones with a warning for the newest intact one, and refuses a checkpoint whose config no longer matches
the run, naming the keys. Checkpoint folders here are laid out like the driver's, with stand-in file contents; the
real save/resume round trip is in tests/integration/test_bad_inputs_run.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as safetensors_bytes

from async_agent_rl.config import load_config
from driver.cli import main
from learner.checkpoint import (
    CheckpointError, commit_checkpoint, config_differences, newest_intact, verify_manifest, write_manifest,
)

pytestmark = pytest.mark.unit

FILES = {
    "policy/model.safetensors": safetensors_bytes({"w": np.frombuffer(os.urandom(4096), dtype=np.float32)}),
    "policy/config.json": b'{"model_type": "qwen2", "hidden_size": 128}',
    "deepspeed/policy/mp_rank_00_model_states.pt": os.urandom(2048),
    "replay_buffer.snapshot": os.urandom(1024),
    "driver_state.json": json.dumps({"step": 1, "version": 1}).encode(),
}


def make_run(tmp_path: Path, steps=(1, 2), overrides=()) -> Path:
    run = tmp_path / "run"
    cfg = load_config(None, list(overrides))
    cfg.save(run / "config.yaml")
    for step in steps:
        tmp = run / "checkpoints" / f".step_{step:06d}.tmp"
        for rel, data in FILES.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        cfg.save(tmp / "config.yaml")
        commit_checkpoint(tmp, run / "checkpoints" / f"step_{step:06d}")
    return run


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def random_bytes(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


def flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def half_json(p: Path) -> None:
    p.write_text(p.read_text()[:7])


DAMAGE = [
    ("policy/model.safetensors", truncate, "bytes"),
    ("deepspeed/policy/mp_rank_00_model_states.pt", random_bytes, "checksum mismatch"),
    ("replay_buffer.snapshot", flip_byte, "checksum mismatch"),
    ("driver_state.json", half_json, "bytes"),
    ("policy/config.json", os.remove, "missing"),
]


@pytest.mark.parametrize("rel,damage,says", DAMAGE, ids=[d[0] + ":" + d[1].__name__ for d in DAMAGE])
def test_damage_is_found_and_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, rel, damage, says):
    run = make_run(tmp_path)
    newest = run / "checkpoints" / "step_000002"
    verify_manifest(newest)
    damage(newest / rel)
    with pytest.raises(CheckpointError) as e:
        verify_manifest(newest)
    assert str(newest / rel) in str(e.value) and says in str(e.value)
    picked, skipped = newest_intact((run / "checkpoints").glob("step_*"))
    assert picked == run / "checkpoints" / "step_000001"
    assert len(skipped) == 1 and str(newest / rel) in skipped[0]


def test_no_intact_checkpoint_is_one_error_line(tmp_path, capsys):
    run = make_run(tmp_path)
    truncate(run / "checkpoints" / "step_000001" / "policy" / "model.safetensors")
    flip_byte(run / "checkpoints" / "step_000002" / "replay_buffer.snapshot")
    (run / "checkpoints" / ".step_000003.tmp").mkdir()  # a crash mid-checkpoint: never a candidate
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert "no intact checkpoint" in err and "model.safetensors" in err and "replay_buffer.snapshot" in err


def test_checkpoint_without_manifest_is_not_trusted(tmp_path):
    run = make_run(tmp_path, steps=(1,))
    (run / "checkpoints" / "step_000001" / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="no MANIFEST.json"):
        verify_manifest(run / "checkpoints" / "step_000001")


def test_config_that_no_longer_matches_the_checkpoint_names_the_keys(tmp_path, capsys):
    run = make_run(tmp_path)
    edited = load_config(run / "config.yaml", ["model.init.hidden_size=256", "learner.zero_stage=2",
                                                "learner.total_steps=99"])  # fmt: skip
    edited.save(run / "config.yaml")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert "model.init.hidden_size: checkpoint 128, run 256" in err and "learner.zero_stage" in err
    assert "total_steps" not in err  # more steps is what a resume is for: not a mismatch


def test_config_differences_ignore_keys_the_state_does_not_depend_on():
    a = load_config(None).to_dict()
    b = load_config(None, ["eval.num_questions=5", "model.path=elsewhere", "learner.lr=1e-3"]).to_dict()
    assert config_differences(a, b) == []


def test_commit_replaces_a_stale_folder_of_the_same_step(tmp_path):
    run = make_run(tmp_path, steps=(1,))
    truncate(run / "checkpoints" / "step_000001" / "policy" / "model.safetensors")
    make_run(tmp_path, steps=(1,))  # the step redone after a fallback writes it again
    verify_manifest(run / "checkpoints" / "step_000001")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]


def header(value) -> bytes:
    raw = json.dumps(value).encode()
    return len(raw).to_bytes(8, "little") + raw


def resealed(damage):
    """``damage`` applied to a checkpoint's policy folder, then the manifest written again over it: the checksums
    pass, only the weight check can tell."""
    def apply(ckpt: Path) -> None:
        damage(ckpt / "policy")
        write_manifest(ckpt)
    return apply


WEIGHTS = [
    ("header []", resealed(lambda d: (d / "model.safetensors").write_bytes(header([]))),
     "model.safetensors: not a safetensors file: its header is a JSON list"),
    ("header {}", resealed(lambda d: (d / "model.safetensors").write_bytes(header({}))),
     "model.safetensors: not a safetensors file: its header describes no tensors"),
    ("truncated", resealed(lambda d: truncate(d / "model.safetensors")), "model.safetensors: truncated safetensors"),
    ("shard missing", resealed(lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}}))),
     "model-00002-of-00002.safetensors: missing (named by model.safetensors.index.json)"),
    ("no weights", resealed(lambda d: (d / "model.safetensors").unlink()), "policy: no *.safetensors weights"),
]


@pytest.mark.parametrize("damage,says", [w[1:] for w in WEIGHTS], ids=[w[0] for w in WEIGHTS])
def test_resealed_damaged_weights_are_skipped_naming_the_file(tmp_path, capsys, damage, says):
    """Until this commit weights damaged and resealed into the manifest passed ``newest_intact``, and the resume's
    own weaker copy of the weight check ended in ``unexpected AttributeError`` (a header ``[]``) or let every actor
    start and fail in ``Engine core initialization failed`` naming no file (a header ``{}``, a missing shard). A
    resume now runs the one check ``eval --checkpoint`` runs: the newest checkpoint with whole weights is taken,
    and with none, one ``error:`` line names the file."""
    run = make_run(tmp_path)
    damage(run / "checkpoints" / "step_000002")
    verify_manifest(run / "checkpoints" / "step_000002")  # resealed: the checksums pass
    picked, skipped = newest_intact((run / "checkpoints").glob("step_*"))
    assert picked == run / "checkpoints" / "step_000001"
    assert len(skipped) == 1 and str(run / "checkpoints" / "step_000002" / "policy") in skipped[0], skipped
    assert says in skipped[0], skipped
    damage(run / "checkpoints" / "step_000001")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert "no intact checkpoint to resume from" in err and says in err, err


CRASH = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import learner.checkpoint as ck

    tmp, final, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    ck._after = lambda step: os._exit(70) if step == point and point != "aside" else None
    rename = os.rename

    def rename_then_maybe_die(src, dst):
        if point == "aside" and Path(src) == tmp:  # the old one is out of the way: the new one not yet in
            os._exit(70)
        rename(src, dst)

    os.rename = rename_then_maybe_die
    ck.commit_checkpoint(tmp, final)
""")


@pytest.mark.parametrize("point,kept", [("manifest", "old"), ("aside", "old"), ("in", "new"), ("removed", "new")])
def test_a_checkpoint_replaced_is_whole_on_disk_at_every_moment(tmp_path, point, kept):
    """Until this commit a step written again (the stall report's checkpoint after a resume) removed the old
    folder and then renamed the new one in: a crash between the two left no checkpoint of the step. Now the old
    one goes aside (``step_N.old``), the new one comes in, the old one goes; a process killed after each of these
    leaves a complete checkpoint that the resume picks: the old one until the new one is in, then the new one."""
    run = make_run(tmp_path, steps=(1, 2))
    ckpts = run / "checkpoints"
    tmp = ckpts / ".step_000002.tmp"
    for rel, data in FILES.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    (tmp / "driver_state.json").write_text(json.dumps({"step": 2, "version": "new"}))
    load_config(run / "config.yaml").save(tmp / "config.yaml")
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", CRASH, str(tmp), str(ckpts / "step_000002"), point], cwd=repo,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 70, r.stderr  # killed at that point
    picked, skipped = newest_intact(ckpts.glob("step_*"))
    assert skipped == [] and picked is not None and picked.name.startswith("step_000002"), (picked, skipped)
    verify_manifest(picked)
    version = json.loads((picked / "driver_state.json").read_text())["version"]
    assert version == (1 if kept == "old" else "new"), (point, picked)
    # the next write of the step finishes the job: one step_000002, the new one, nothing aside
    for rel, data in FILES.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    commit_checkpoint(tmp, ckpts / "step_000002")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002"]


def test_a_run_without_checkpoints_is_one_error_line(tmp_path, capsys):
    run = make_run(tmp_path, steps=())
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "no checkpoint under checkpoints/" in err and "Traceback" not in err, err
