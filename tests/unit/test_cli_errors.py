"""Bad inputs: every CLI failure on bad input is one ``error: ...`` line naming the file, row or key, and
exit status 2; never a traceback. The CLI runs in-process (``main(argv)``); nothing here starts Ray, an engine or
a server."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from async_agent_rl.data.search_r1 import QAExample, write_qa_parquet
from driver.cli import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def assert_one_error_line(code: int, err: str, *names: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    good = QAExample(id="q1", question="Where is X?", gold_answers=["Paris"])
    write_qa_parquet(tmp_path / "zero_rows.parquet", [])
    out["zero_rows"] = tmp_path / "zero_rows.parquet"
    write_qa_parquet(tmp_path / "empty_target.parquet", [good, QAExample(id="q2", question="Who?", gold_answers=["  "])])
    out["empty_target"] = tmp_path / "empty_target.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "prompt": None}]), tmp_path / "no_prompt.parquet")
    out["no_prompt"] = tmp_path / "no_prompt.parquet"
    (tmp_path / "not_parquet.parquet").write_bytes(b"PAR1 this is not parquet")
    out["not_parquet"] = tmp_path / "not_parquet.parquet"
    (tmp_path / "latin1.yaml").write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    out["latin1"] = tmp_path / "latin1.yaml"
    (tmp_path / "episodes.jsonl").write_text(json.dumps({"not": "an episode"}) + "\n{truncated\n")
    out["bad_episodes"] = tmp_path / "episodes.jsonl"
    (tmp_path / "empty_run").mkdir()
    out["empty_run"] = tmp_path / "empty_run"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    out["model"] = tmp_path / "model"
    return out


def test_missing_and_unreadable_files_name_the_file(files, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert_one_error_line(*run_cli(["show", str(missing)], capsys), str(missing))
    assert_one_error_line(*run_cli(["show", str(files["bad_episodes"])], capsys), str(files["bad_episodes"]), ":1:")
    assert_one_error_line(*run_cli(["config", "show", "--config", str(files["latin1"])], capsys),
                          str(files["latin1"]), "UTF-8")  # fmt: skip


def test_resume_from_a_missing_or_empty_folder(files, tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert_one_error_line(*run_cli(["train", "--resume", str(missing)], capsys), str(missing))
    assert_one_error_line(*run_cli(["train", "--resume", str(files["empty_run"])], capsys), str(files["empty_run"]))


def test_eval_checkpoint_that_does_not_exist_is_not_sent_to_the_hub(tmp_path, capsys):
    missing = tmp_path / "final" / "policy"
    code, err = run_cli(["eval", "--checkpoint", str(missing), "--config", QUICKSTART], capsys)
    assert_one_error_line(code, err, str(missing))
    code, err = run_cli(["eval", "--checkpoint", "org/model-name", "--config", QUICKSTART], capsys)
    assert_one_error_line(code, err, "org/model-name")


@pytest.mark.parametrize("name,expect", [
    ("zero_rows", "no rows"), ("empty_target", "row 1"), ("no_prompt", "row 0"), ("not_parquet", "parquet"),
])  # fmt: skip
def test_data_format_errors_name_the_file_and_row(files, capsys, name, expect):
    argv = ["eval", "--checkpoint", str(files["model"]), "--data", str(files[name]), "--config", QUICKSTART]
    assert_one_error_line(*run_cli(argv, capsys), str(files[name]), expect)


def test_bad_corpus_rows_name_the_line(tmp_path, capsys):
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "1", "contents": "\\"A\\"\\na"}\n{"id": "2", "contents": "\\"B\\"\\nb"}\n'
                   '{"id": "1", "contents": "\\"C\\"\\nc"}\n')  # fmt: skip
    argv = ["retriever", "index", "--corpus", str(dup), "--out", str(tmp_path / "idx")]
    assert_one_error_line(*run_cli(argv, capsys), str(dup), "duplicate passage id '1'", ":3")


def test_failures_inside_ray_actors_are_unwrapped_and_name_the_component():
    from ray.exceptions import RayActorError, RayTaskError

    from async_agent_rl.data.search_r1 import DataFormatError
    from async_agent_rl.errors import error_line

    cause = DataFormatError("train.parquet: row 7: missing 'prompt'")
    remote = RayTaskError("RolloutActor.setup", "Traceback (most recent call last):\n  ...", cause,
                          proctitle="ray::RolloutActor.setup").as_instanceof_cause()  # what ray.get raises
    line = error_line(remote)
    assert line == "error: in RolloutActor.setup: train.parquet: row 7: missing 'prompt'"
    bug = RayTaskError("LearnerActor.train_step", "Traceback ...", KeyError("logprobs"),
                       proctitle="ray::LearnerActor.train_step").as_instanceof_cause()  # fmt: skip
    assert error_line(bug) == "error: in LearnerActor.train_step: KeyError: 'logprobs'"
    # a dead actor is named by its class (Ray's message has it on a line of its own), so a killed buffer or learner
    # is blamed by name, also when another actor's task failed on it
    text = "The actor died unexpectedly before finishing this task.\n\tclass_name: BufferActor\n\tactor_id: 1a"
    dead = RayActorError(error_msg=text)
    assert error_line(dead) == ("error: the Ray actor BufferActor died: The actor died unexpectedly before finishing "
                                "this task.")
    downstream = RayTaskError("LearnerActor.train_step", "Traceback ...", dead,
                              proctitle="ray::LearnerActor.train_step").as_instanceof_cause()
    assert error_line(downstream) == ("error: in LearnerActor.train_step: the Ray actor BufferActor died: The actor "
                                      "died unexpectedly before finishing this task.")
    anonymous = RayActorError(error_msg="The actor died unexpectedly before finishing this task.")
    assert error_line(anonymous) == "error: a Ray actor died: The actor died unexpectedly before finishing this task."
    assert error_line(KeyError("x")) is None  # a bug in the driver itself is not dressed up as bad input


def test_an_unexpected_exception_is_one_line_too(monkeypatch, capsys):
    import driver.cli as cli

    def boom(args):
        raise KeyError("surprise")

    monkeypatch.setattr(cli, "cmd_config_show", boom)
    code = main(["config", "show"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: unexpected KeyError: 'surprise' (rerun with -v for the traceback)"]


@pytest.mark.parametrize("argv, flag", [
    (["eval", "--config", QUICKSTART, "--limit", "-5"], "--limit"),
    (["eval", "--config", QUICKSTART, "--limit", "0"], "--limit"),
    (["rollout", "--config", QUICKSTART, "--num-episodes", "-1"], "--num-episodes"),
    (["show", "episodes.jsonl", "--limit", "0"], "--limit"),
])
def test_counts_below_one_are_refused_before_anything_starts(argv, flag, capsys):
    """Before: ``eval --limit -5`` and ``rollout --num-episodes -1`` were taken at face value."""
    code, err = run_cli(argv, capsys)
    assert_one_error_line(code, err, flag, "at least 1")


def test_a_folder_where_a_file_is_wanted_is_named_as_a_folder(files, tmp_path, capsys):
    """Until 54b4bb0 (2026-11-26), a folder given as the config said "does not exist"; one given as a parquet file
    (``--data``, ``data.test_files``) said "file not found"."""
    folder = tmp_path / "configs"
    folder.mkdir()
    code, err = run_cli(["config", "show", "--config", str(folder)], capsys)
    assert_one_error_line(code, err, f"config file {folder} is a folder, not a YAML file")
    argv = ["eval", "--checkpoint", str(files["model"]), "--data", str(folder), "--config", QUICKSTART]
    assert_one_error_line(*run_cli(argv, capsys), f"{folder}: a folder, not a parquet file")
    argv = ["eval", "--checkpoint", str(files["model"]), "--config", QUICKSTART, f"data.test_files=[{folder}]"]
    assert_one_error_line(*run_cli(argv, capsys), f"{folder}: a folder, not a parquet file")


def test_a_file_where_an_output_folder_is_wanted_is_named(tmp_path, capsys):
    """Until 54b4bb0 (2026-11-26), an existing file given as an output folder said "File exists" (a path through a file:
    "Not a directory")."""
    from async_agent_rl.errors import error_line

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": '"Alpha"\nAlpha is a city.'}) + "\n")
    in_the_way = tmp_path / "index"
    in_the_way.write_text("a file, not a folder")
    argv = ["retriever", "index", "--corpus", str(corpus), "--out", str(in_the_way)]
    assert_one_error_line(*run_cli(argv, capsys), f"{in_the_way}: a file, not a folder")
    assert error_line(NotADirectoryError(20, "Not a directory", str(in_the_way / "sub" / "x"))) == (
        f"error: {in_the_way / 'sub' / 'x'}: {in_the_way} is a file, not a folder")
    # an existing folder (mkdir without exist_ok) is not dressed up as a file
    assert error_line(FileExistsError(17, "File exists", str(tmp_path))) == f"error: {tmp_path}: File exists"


def test_a_listen_address_that_cannot_be_is_named(tmp_path, capsys):
    """Until 54b4bb0 (2026-11-26), ``retriever serve --host 999.1.1.1`` ended in ``unexpected OSError``; now refused
    before the corpus is read. An address no interface has (EADDRNOTAVAIL) is one line too."""
    import errno

    from async_agent_rl.errors import error_line

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": '"Alpha"\nAlpha is a city.'}) + "\n")
    argv = ["retriever", "serve", "--corpus", str(corpus), "--host", "999.1.1.1", "--port", "0"]
    assert_one_error_line(*run_cli(argv, capsys), "--host", "'999.1.1.1' is not an IP address")
    code, err = run_cli(["config", "show", "retriever.host=999.1.1.1"], capsys)
    assert_one_error_line(code, err)  # the config's report: one error: line, the key on the line below
    assert "retriever.host: Value error, '999.1.1.1' is not an IP address" in err
    line = error_line(OSError(errno.EADDRNOTAVAIL, "cannot listen on 192.0.2.7:8000: cannot assign requested address"))
    assert line is not None and "192.0.2.7:8000" in line and "no network interface" in line


def _safetensors_model(folder: Path) -> Path:
    from safetensors.numpy import save_file
    import numpy as np

    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"a": np.zeros((64, 64), dtype=np.float32), "b": np.ones(16, dtype=np.float32)},
              str(folder / "model.safetensors"))
    return folder / "model.safetensors"


def test_eval_on_a_truncated_checkpoint_names_the_file_before_an_engine_starts(tmp_path, capsys, monkeypatch):
    """Until 54b4bb0 (2026-11-26), ``eval --checkpoint DIR`` with a truncated ``model.safetensors`` printed the engine's
    traceback and ``unexpected RuntimeError: Engine core initialization failed``."""
    import actors.stack

    from driver.check import model_weights_problems

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started on a damaged checkpoint")

    monkeypatch.setattr(actors.stack, "local_stack", no_engine)
    weights = _safetensors_model(tmp_path / "policy")
    assert model_weights_problems(weights.parent) == []
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])
    argv = ["eval", "--checkpoint", str(weights.parent), "--config", QUICKSTART]
    assert_one_error_line(*run_cli(argv, capsys), f"--checkpoint {weights}: truncated safetensors file",
                          f"{len(intact) // 2} bytes, its header describes {len(intact)}")
    weights.write_bytes(intact[:5])  # not even the header's length
    assert_one_error_line(*run_cli(argv, capsys), str(weights), "truncated")
    weights.write_bytes(intact + b"\0" * 10)
    assert_one_error_line(*run_cli(argv, capsys), str(weights), "padded")
    weights.write_bytes(b"\x10" + b"\0" * 7 + b"{not json at all}")
    assert_one_error_line(*run_cli(argv, capsys), str(weights), "not a safetensors file")
    weights.write_bytes(intact)
    (weights.parent / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert_one_error_line(*run_cli(argv, capsys), "model-00002-of-00002.safetensors: missing")


def test_a_stuck_ray_shutdown_of_an_earlier_call_does_not_end_a_later_command(monkeypatch, capsys):
    """``main`` ends the process at once (``os._exit``) when the run it just made could not shut Ray down. The flag
    is a module global: a stuck shutdown in an earlier in-process call (an integration test's run) made every later
    ``main`` call end the whole test process with no report, seen as the fast tier stopping in the middle."""
    import driver.cli as cli
    import driver.train as train

    exits = []
    monkeypatch.setattr(cli.os, "_exit", lambda rc: exits.append(rc))
    monkeypatch.setattr(train, "ray_shutdown_stuck", True)
    assert cli.main(["config", "show", "--config", "configs/quickstart.yaml"]) == 0
    assert exits == [], "the earlier call's stuck shutdown ended this command"
    capsys.readouterr()
