"""``learner.learner.require_finite``: the check before a policy is published or saved, and of each step's loss."""

from __future__ import annotations

import math

import pytest
import torch

from learner.learner import NonFiniteError, require_finite

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_bad_element_anywhere_is_named(bad, dtype):
    ok = torch.randn(64, 32).to(dtype)
    broken = torch.randn(64, 32).to(dtype)
    broken[37, 5] = bad
    with pytest.raises(NonFiniteError, match=r"learner step 3: non-finite parameters: b\.weight;"):
        require_finite(3, "parameters", iter([("a.weight", ok), ("b.weight", broken), ("c", 1.5)]))


def test_finite_values_whose_sum_overflows_are_finite():
    big = torch.full((8,), 3.0e38)  # float32: the sum is inf, every element finite
    half = torch.full((4096,), 60000.0, dtype=torch.float16)
    assert not math.isfinite(float(big.sum()))
    require_finite(1, "parameters", iter([("big", big), ("half", half), ("n", 2), ("empty", torch.empty(0))]))


def test_numbers_and_arrays_too():
    with pytest.raises(NonFiniteError, match="loss, grad_norm"):
        require_finite(2, "loss or gradient norm", iter([("loss", math.nan), ("grad_norm", float("inf")),
                                                         ("ok", 0.1)]))
