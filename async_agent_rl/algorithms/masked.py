"""Reductions over the positions a mask selects.

Every function here selects with ``torch.where`` rather than multiplying by the mask, so a NaN or inf at an
unselected position (padding, an observation token's garbage log-prob) cannot leak into the result.
Masks may be bool, int or float; nonzero means selected.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` over selected positions; over everything (0-dim) or along ``dim``."""
    selected = torch.where(mask.bool(), x, torch.zeros_like(x))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over selected positions. An empty selection gives 0, not NaN."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased (Bessel-corrected, divide by n-1) variance over all selected positions; 0 for n <= 1."""
    n = mask.bool().sum()
    centered = x - masked_mean(x, mask)
    return masked_sum(centered * centered, mask) / (n - 1).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with batch-global mean and unbiased variance over selected positions.

    Shapes: ``x``, ``mask`` any identical shape; returns the same shape with 0 at unselected positions.
    As verl's ``masked_whiten``; ``shift_mean=False`` adds the mean back (scale only).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
