"""The progress helper (async_agent_rl.progress): time-based lines on a terminal, sparse ones in a log, a readable
closing line; and the warm start's thread tuner (warm_start.sft.ThreadTuner) on made-up step times."""

from __future__ import annotations

import io

import pytest

from async_agent_rl.progress import Progress, duration

from tests.helpers import Clock

pytestmark = pytest.mark.unit


def test_duration() -> None:
    assert [duration(x) for x in (0, 42.4, 187, 3720)] == ["0s", "42s", "3m07s", "1h02m"]


def test_terminal_prints_every_interval_with_rate_and_eta() -> None:
    out, clock = io.StringIO(), Clock(0.0)
    p = Progress("[sft] pretraining", 100, stream=out, interactive=True, interval_s=5, clock=clock)
    printed = []
    for step in range(1, 100):
        clock.now += 1.0  # one step per second
        printed.append(p.update(step, tokens=step * 2048, loss=5.0 - step / 100))
    lines = [x for x in printed if x]
    assert len(lines) == 19  # at 5, 10, ..., 95 seconds; the last step is left to the closing line
    assert lines[0].startswith("[sft] pretraining 5/100 (5%)")
    assert "1.00 steps/s" in lines[0] and "2,048 tokens/s" in lines[0] and "loss 4.950" in lines[0]
    assert "left 1m35s" in lines[0]
    assert out.getvalue().splitlines() == lines


def test_log_gets_one_line_per_tenth() -> None:
    out, clock = io.StringIO(), Clock(0.0)
    p = Progress("[sft] demonstrations", 30, stream=out, interactive=False, clock=clock)
    for step in range(1, 31):
        clock.now += 100.0  # slow steps: no time-based lines in a log anyway
        p.update(step, loss=1.0)
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == [f"{3 * k}/30" for k in range(1, 10)]


def test_closing_line_is_text_with_steps_time_rate_and_loss() -> None:
    out, clock = io.StringIO(), Clock(0.0)
    p = Progress("[sft] pretraining", 10, stream=out, interactive=False, clock=clock)
    for step in range(1, 11):
        clock.now += 12.5
        p.update(step, tokens=step * 1000, loss=2.0)
    text = p.close(final_loss=1.9876, extra="threads 1")
    assert text == "[sft] pretraining done: 10 steps in 2m05s, 80 tokens/s, final loss 1.988; threads 1"
    assert out.getvalue().splitlines()[-1] == text
    assert "{" not in text


def test_not_a_terminal_by_default_for_a_string_buffer() -> None:
    assert Progress("x", 5, stream=io.StringIO()).interactive is False


def _drive(monkeypatch, tuner, steps: int, cost_at) -> tuple[list[int], list[int]]:
    """Run ``tuner`` for ``steps`` steps of one token each costing ``cost_at(step)[threads]`` seconds; returns the
    thread count in effect at each step and every count handed to torch (which stays patched for the test)."""
    import torch

    set_to: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    used = []
    for step in range(steps):
        tuner.before_step(step)
        used.append(set_to[-1])
        tuner.after_step(cost_at(step)[set_to[-1]], 1)
    return used, set_to


def test_thread_tuner_keeps_the_cheaper_count_and_reprobes_later(monkeypatch) -> None:
    from warm_start.sft import ThreadTuner

    tuner = ThreadTuner([1, 2], probe_steps=2, every=10)
    used, _ = _drive(monkeypatch, tuner, 40, lambda step: {1: 1.0, 2: 3.0})  # two threads slower (a loaded machine)
    assert used[0] == 1  # warm-up at the fewest threads
    assert used[1:4] == [1, 1, 2]  # probes; 2 is dropped after one step 3x slower
    assert tuner.kept()[0] == 1 and all(c == 1 for c in used[4:13])
    assert used.count(2) >= 2  # probed again in a later round
    assert set(tuner.kept()) == {1}


def test_thread_tuner_keeps_its_count_unless_another_is_clearly_cheaper(monkeypatch) -> None:
    """Probe steps are different batches: a count 10% cheaper in one round is noise, not a reason to halve speed."""
    from warm_start.sft import ThreadTuner

    tuner = ThreadTuner([1, 2], probe_steps=2, every=5)
    # two threads win the first round; later rounds see one thread 10% cheaper, then 2x cheaper (a real load)
    _drive(monkeypatch, tuner, 60,
           lambda step: {1: 1.0, 2: 0.6} if step < 5 else ({1: 1.0, 2: 1.1} if step < 30 else {1: 1.0, 2: 2.0}))
    kept = tuner.kept()
    assert kept[0] == 2 and kept[-1] == 1
    assert all(c == 2 for (step, c) in tuner.choices if step < 30)


def test_thread_tuner_follows_the_load_and_can_be_pinned(monkeypatch) -> None:
    from warm_start.sft import THREADS_ENV, ThreadTuner

    tuner = ThreadTuner([1, 2], probe_steps=2, every=5)
    _, set_to = _drive(monkeypatch, tuner, 60, lambda step: {1: 1.0, 2: 3.0 if step < 20 else 0.6})
    assert tuner.kept()[0] == 1 and tuner.kept()[-1] == 2
    monkeypatch.setenv(THREADS_ENV, "3")
    pinned = ThreadTuner.for_machine()
    assert pinned.candidates == [3]
    for step in range(5):
        pinned.before_step(step)
        pinned.after_step(1.0, 1)
    assert set_to[-1] == 3 and pinned.kept() == [3]
