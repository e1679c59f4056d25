"""benchmarks/learner_vs_torch.py's arithmetic: medians and ratios, the rotated order of a round, the bare loop's
gradient accumulation (any cut into micro-batches gives the update of the whole mini-batch), and its bad input."""

from __future__ import annotations

import pytest
import torch

from benchmarks import learner_vs_torch as bench
from benchmarks.learner_bench import synthetic_batch

pytestmark = pytest.mark.unit


def test_medians_and_ratios():
    s = bench.median_summary([2.0, 1.0, 4.0], [1.5, 1.0, 3.0], tokens=600)
    assert s == {"step_s": 2.0, "cpu_s_per_step": 1.5, "tokens_per_s": 300.0, "tokens_per_cpu_s": 400.0}
    learner = {"tokens_per_s": 80.0, "tokens_per_cpu_s": 90.0}
    bare = {"tokens_per_s": 100.0, "tokens_per_cpu_s": 100.0}
    # per pair: bare wall / learner wall, back to back; the median of 0.5, 0.8, 1.0
    r = bench.ratios(learner, bare, [(2.0, 1.0), (1.25, 1.0), (1.0, 1.0)])
    assert r == pytest.approx({"tokens_per_s": 0.8, "tokens_per_cpu_s": 0.9, "pairwise_median": 0.8})


def test_every_arm_goes_first_in_turn():
    arms = ["learner", "learner_patched", "bare"]
    orders = [bench.rotated(arms, i) for i in range(4)]
    assert [o[0] for o in orders] == ["learner", "learner_patched", "bare", "learner"]
    assert all(sorted(o) == sorted(arms) for o in orders)


def test_phase_table_puts_the_rest_in_other():
    t = bench.phase_table({"targets": 2.0, "forward": 4.0, "backward": 6.0, "optimizer": 1.0}, total=14.0, steps=2)
    assert t == pytest.approx({"targets": 1.0, "forward": 2.0, "backward": 3.0, "optimizer": 0.5, "other": 0.5})


def test_bare_loop_accumulates_micro_batches_to_the_whole_mini_batch(tiny_model_dir):
    """One step on 4 rows as one micro-batch of 4 or as two of 2 (gradient accumulation, the learner's scaling)
    gives the same loss, gradient norm and parameters; a wrong scale (e.g. no division by the accumulation steps,
    or weighting micro-batches equally instead of by their loss tokens) would not."""
    torch.manual_seed(0)
    vocab = 2048
    batch = synthetic_batch(4, 16, 24, vocab, seed=1)
    batch.loss_mask[1, -10:] = 0  # rows with unequal loss tokens: micro-batches must weigh by their units
    steps = {}
    for micro in (4, 2):
        loop = bench.BareLoop(bench.learner_config(tiny_model_dir, rows=4, micro=micro, lr=1e-3))
        steps[micro] = loop.train_step(batch), {n: p.detach().clone() for n, p in loop.model.named_parameters()}
    (one, p_one), (two, p_two) = steps[4], steps[2]
    assert two["policy_loss"] == pytest.approx(one["policy_loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    moved = max(float((p_one[n] - p.detach()).abs().max()) for n, p in bench.BareLoop(
        bench.learner_config(tiny_model_dir, rows=4, micro=4, lr=1e-3)).model.named_parameters())
    assert moved > 1e-4  # the step changed the weights, so equal parameters below mean something
    assert max(float((p_one[n] - p_two[n]).abs().max()) for n in p_one) < 1e-5


@pytest.mark.parametrize("argv, what", [
    (["--models", "quickstart,7b"], "--models"),
    (["--shape-100m", "3:2:64:192"], "--shape-100m"),
    (["--shape-quickstart", "16:8:96"], "--shape-quickstart"),
    (["--steps", "0"], "--steps"),
])
def test_bad_arguments_are_one_error_line(argv, what, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    message = str(exit_.value.code)
    assert message.startswith("error: ") and what in message and "\n" not in message
