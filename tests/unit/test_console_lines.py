"""The console speaks in words. Until 2026-12, every start printed one line with a raw Python structure,
``[start] buffer, 1 learner rank(s), rollout actors [{'index': 0, 'node': '8579a15d', 'examples': 2197, ...}]``, a
stalled wait printed ``admission {'started': ...}``, and a failed weight publish showed twice on the terminal: its
``[fault]`` line and a logging ``WARNING`` line saying the same."""

from __future__ import annotations

import logging
import re

import pytest

from async_agent_rl.config import load_config
from async_agent_rl.stats import AdmissionStats, BufferStats
from driver.console import start_lines, wait_line
from driver.versions import PolicyVersions

pytestmark = pytest.mark.unit

RAW = re.compile(r"[{}\[\]]|': |\w+=\w")  # a dict, a list or a dataclass' repr


def words(line: str) -> bool:
    tag, _, rest = line.partition("] ")
    return tag.startswith("[") and not RAW.search(rest)


def test_the_start_lines_say_what_started_in_words_one_line_per_component():
    infos = [{"index": 0, "node": "8579a15d", "examples": 2197, "skipped_rows": 0, "skipped_too_long": 0},
             {"index": 1, "node": "1122867b", "examples": 2196, "skipped_rows": 2, "skipped_too_long": 1}]
    lines = start_lines(1, infos)
    assert lines == [
        "[start] replay buffer",
        "[start] learner: 1 rank",
        "[start] rollout actor 0 on node 8579a15d: 2,197 questions",
        "[start] rollout actor 1 on node 1122867b: 2,196 questions; 2 bad rows skipped (data.on_bad_row); "
        "1 question longer than data.max_prompt_length skipped",
    ]
    assert start_lines(2, [])[1] == "[start] learner: 2 ranks"
    assert all(words(line) for line in lines), lines
    old = "[start] buffer, 1 learner rank(s), rollout actors [{'index': 0, 'node': '8579a15d', 'examples': 2197}]"
    assert not words(old)


def test_the_wait_line_says_the_buffer_and_admission_counts_in_words():
    admission = AdmissionStats(started=40, accepted=30, rejected=2, evicted=1, running=7, groups_started=10,
                               groups_dropped=1, groups_consumed=6, groups_open=3, oldest_open_version=4)
    line = wait_line(61.4, BufferStats(size=12, ready_groups=1, pending_groups=2, evicted=1, admission=admission))
    assert line == ("[wait] no batch for 61 s: buffer size 12, ready groups 1, pending 2, evicted 1; admission: 40 "
                    "episodes started (30 accepted, 2 rejected, 1 evicted), 7 running; 10 groups started "
                    "(6 consumed, 1 dropped, 3 open, the oldest open at version 4)")
    assert words(line), line


class FailingPublisher:
    def publish(self, version, state=None):
        raise OSError(28, "No space left on device")


def test_a_failed_publish_is_one_fault_line_and_no_logging_warning_saying_it_again(caplog):
    said: list[str] = []
    versions = PolicyVersions(load_config(None), None, FailingPublisher(), said.append)
    versions.version = 1
    with caplog.at_level(logging.INFO, logger="driver.versions"):
        assert versions.publish() is None
    assert said == ["[fault] weight publish of version 1 failed (1 in a row): OSError: [Errno 28] No space left on "
                    "device"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert [r.getMessage() for r in caplog.records] == [said[0].removeprefix("[fault] ")]  # the log file's copy


def test_the_closing_lines_count_trajectories_dropped_at_the_stop():
    """A run that ends with a full buffer drops what the buffer still refuses at once (the workers count it): the
    summary adds the actors' counts and the closing lines say it, and say nothing when none was dropped."""
    from pathlib import Path

    from async_agent_rl.stats import RolloutStats
    from driver.console import closing_lines
    from driver.records import Records

    class Log:
        said: list[str] = []

        def say(self, line: str) -> None:
            self.said.append(line)

    records = Records.__new__(Records)  # only summary()'s inputs
    records.history, records.log, records.mon = [], Log(), None
    records.versions = type("V", (), {"version": 3})()
    records.fleet = type("F", (), {"restarts": {}, "lost_episodes": 0, "retriever": None})()
    rollout = [RolloutStats(index=0, dropped_at_stop=5), RolloutStats(index=1, dropped_at_stop=2)]
    summary = records.summary("run", 3, None, None, rollout, 10.0, "run/final", None)
    assert summary["dropped_at_stop"] == 7
    lines = closing_lines(summary, None, None, [], Path("run"))
    assert [line for line in lines if "dropped at the stop" in line] == [
        "[done] 7 finished trajectories dropped at the stop: the buffer was full and the learner done"]
    summary["dropped_at_stop"] = 0
    assert not [line for line in closing_lines(summary, None, None, [], Path("run")) if "dropped" in line]
