"""What the run viewer serves from a run folder (``monitoring.viewer.runs.RunFiles``), read while a run writes:
series from metrics.jsonl and eval.jsonl, episodes from episodes/step_*.jsonl, bad lines skipped and counted, a line
still being written left for the next read, malformed parameters refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from monitoring.viewer.runs import QueryError, RunFiles

pytestmark = pytest.mark.unit


def metrics_row(step: int, searches: int, tool_wait: float) -> dict:
    return {
        "step": step, "version": step, "elapsed_s": 10.0 * step, "batch_reward": 0.1 * step,
        "rollout_exact_match": 0.05 * step, "episodes_total": 32 * step, "searches_total": searches,
        "episodes_per_s": 3.2, "gen_tokens_per_s": 100.0, "rollout_tool_wait_s": tool_wait,
        "rollout_tool_wait_share": 0.1, "buffer_staleness_histogram": {"0": 16 * step, "1": 4 * step},
        "learner": {"staleness_mean": 0.5, "staleness_max": 1.0, "tokens_per_s": 900.0},
        "learning": {"by_kind": {"world_single": {"exact_match": 0.2}, "world_bridge": {"exact_match": 0.1}}},
    }


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))


def episode_line(step: int, i: int, kind: str, reward: float) -> str:
    turns = [{"kind": "prompt", "text": "Question: q?", "tokens": 4, "loss": False},
             {"kind": "model", "text": "<search>x</search>", "tokens": 5, "loss": True,
              "runs": [{"text": "<search>x</search>", "version": step - 1, "tokens": 5}]},
             {"kind": "search", "text": "x"},
             {"kind": "information", "text": "<information>doc</information>", "tokens": 6, "loss": False},
             {"kind": "model", "text": "<answer>y</answer>", "tokens": 5, "loss": True,
              "runs": [{"text": "<answer>y</answer>", "version": step, "tokens": 5}]},
             {"kind": "answer", "text": "y"}]
    return json.dumps({"schema": 1, "step": step, "trajectory_id": f"s{step}/{i}", "kind": kind, "question": "q?",
                       "reward": reward, "min_version": step - 1, "max_version": step, "turns": turns}) + "\n"


@pytest.fixture
def run(tmp_path) -> Path:
    run = tmp_path / "run"
    (run).mkdir()
    (run / "config.yaml").write_text("learner:\n  total_steps: 10\nalgorithm:\n  policy_loss: decoupled_ppo\n")
    write_lines(run / "metrics.jsonl", [
        json.dumps(metrics_row(1, 8, 4.0)) + "\n",
        "{not json\n",                                      # a damaged line: skipped, counted
        "[1, 2]\n",                                         # JSON but not a record: skipped, counted
        json.dumps(metrics_row(2, 12, 2.0)) + "\n",
        json.dumps(metrics_row(3, 20, 1.0))[:40],           # the run is writing this one: not read yet
    ])
    write_lines(run / "eval.jsonl", [json.dumps({"step": 0, "when": "start", "all": {"exact_match": 0.03},
                                                 "world_single": {"exact_match": 0.04}}) + "\n"])
    write_lines(run / "episodes" / "step_000001.jsonl", [episode_line(1, 0, "world_single", 1.0),
                                                        episode_line(1, 1, "world_bridge", 0.0)])
    write_lines(run / "episodes" / "step_000002.jsonl", [episode_line(2, 0, "world_bridge", 1.0), "oops\n"])
    (run / "episodes" / ".step_000003.jsonl.tmp").write_text("half")  # a sample being written: not a step file
    return run


def test_series_from_the_files_bad_lines_counted_and_the_partial_line_left(run):
    files = RunFiles(run)
    s = files.series()
    assert s["steps"] == [1, 2]
    assert s["reward"]["batch_reward"] == [0.1, 0.2]
    assert s["kinds"] == ["world_bridge", "world_single"]
    assert s["rollout_em_by_kind"]["world_single"] == [0.2, 0.2]
    assert s["eval"] == [{"step": 0, "when": "start", "exact_match": 0.03, "by_kind": {"world_single": 0.04}}]
    # throughput since the previous step: 32 episodes in 10 s; tool latency: seconds awaited over searches made
    assert s["throughput"]["episodes_per_s"] == [3.2, 3.2]
    assert s["tool"]["seconds_per_search"] == [0.5, 0.5]  # 4 s / 8 searches, then 2 s / 4 searches
    assert s["staleness"]["histogram"] == [{"staleness": 0, "count": 32}, {"staleness": 1, "count": 8}]
    assert s["skipped"] == {"metrics.jsonl": 2}
    # the run finishes the line: read on the next request (the file changed), and nothing counted twice
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(metrics_row(3, 20, 1.0))[40:] + "\n")
    st = (run / "metrics.jsonl").stat()
    os.utime(run / "metrics.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with open(run / "metrics.jsonl", "a") as f:  # step 4: the actors' totals did not reach the driver this step
        f.write(json.dumps({**metrics_row(4, 20, 0.0), "episodes_total": 96}) + "\n")
    with open(run / "metrics.jsonl", "a") as f:  # step 5: they did, for two steps
        f.write(json.dumps(metrics_row(5, 28, 1.6)) + "\n")
    st = (run / "metrics.jsonl").stat()
    os.utime(run / "metrics.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    s = files.series()
    assert s["steps"] == [1, 2, 3, 4, 5] and s["tool"]["seconds_per_search"][2:] == [1.0 / 8, None, 0.2]
    assert s["throughput"]["episodes_per_s"] == [3.2, 3.2, 3.2, None, 64 / 20]
    assert s["skipped"] == {"metrics.jsonl": 2}
    run_info = files.run()
    assert (run_info["step"], run_info["total_steps"], run_info["finished"]) == (5, 10, False)
    assert run_info["episode_steps"] == 2


def test_episodes_filtered_by_kind_reward_and_step_newest_first(run):
    files = RunFiles(run)
    allof = files.episodes()
    assert [(e["step"], e["index"]) for e in allof["episodes"]] == [(2, 0), (1, 0), (1, 1)]
    assert allof["kinds"] == ["world_bridge", "world_single"] and allof["steps"] == [1, 2]
    assert allof["skipped"] == {"episodes/step_000002.jsonl": 1}
    first = allof["episodes"][0]
    assert (first["searches"], first["turns"], first["versions"]) == (1, 2, [1, 2])
    assert [e["trajectory_id"] for e in files.episodes(kind="world_bridge")["episodes"]] == ["s2/0", "s1/1"]
    assert [e["trajectory_id"] for e in files.episodes(reward="zero")["episodes"]] == ["s1/1"]
    assert [e["trajectory_id"] for e in files.episodes(reward="positive", step_max="1")["episodes"]] == ["s1/0"]
    assert [e["trajectory_id"] for e in files.episodes(step_min="2")["episodes"]] == ["s2/0"]
    page = files.episodes(offset="1", limit="1")
    assert page["total"] == 3 and [e["trajectory_id"] for e in page["episodes"]] == ["s1/0"]


def test_one_episode_whole_and_none_where_there_is_none(run):
    files = RunFiles(run)
    ep = files.episode("1", "1")
    assert ep["trajectory_id"] == "s1/1" and [t["kind"] for t in ep["turns"]][:4] == ["prompt", "model", "search",
                                                                                     "information"]
    assert files.episode("1", "2") is None and files.episode("9", "0") is None and files.episode("1", "-1") is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"step_min": "x"}, "step_min='x' is not an integer"),
    ({"limit": "0"}, "limit between 1 and"),
    ({"limit": "501"}, "limit between 1 and"),
    ({"offset": "-1"}, "offset must be >= 0"),
    ({"reward": "high"}, "reward='high'"),
])  # fmt: skip
def test_malformed_parameters_are_refused_by_name(run, kwargs, message):
    with pytest.raises(QueryError, match=message):
        RunFiles(run).episodes(**kwargs)
    with pytest.raises(QueryError, match="step and index are required"):
        RunFiles(run).episode("", "0")


def test_an_empty_or_just_started_run_folder_reads_as_empty(tmp_path):
    files = RunFiles(tmp_path)
    assert files.series()["steps"] == [] and files.episodes()["total"] == 0
    info = files.run()
    assert info["step"] is None and info["total_steps"] is None and info["episode_steps"] == 0
    (tmp_path / "config.yaml").write_text("!!python/object/apply:os.system ['echo no']\n")  # never executed
    assert files.run()["total_steps"] is None
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe not utf-8\n")
    assert files.series()["skipped"] == {"metrics.jsonl": 1}
