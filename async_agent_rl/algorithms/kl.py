"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence", 2020).

Signature of every estimator: ``fn(logprobs, ref_logprobs)`` with both ``(B, T)`` (log-probs of the sampled
tokens under the live policy and the reference) -> ``(B, T)``. Values at observation or padding positions are
meaningless: aggregate with the action mask (``losses.agg_loss``). Names as ``AlgorithmConfig.kl_estimator``.

With ``d = logprobs - ref_logprobs``:

- ``k1``  ``d``                          unbiased, high variance, can be negative
- ``abs`` ``|d|``                        biased, non-negative
- ``k2``  ``0.5 * d**2``                 biased, low variance (verl "mse")
- ``k3``  ``exp(-d) + d - 1``            unbiased, non-negative, low variance (verl "low_var_kl", GRPO's KL
  loss, Search-R1's default); clamped to [-10, 10] as verl, and ``d`` to [-20, 20] before ``exp`` so extreme
  tokens cannot overflow.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from async_agent_rl.algorithms._registry import lookup

K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0

KLEstimator = Callable[[Tensor, Tensor], Tensor]


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``logprobs - ref_logprobs``. ``(B, T), (B, T)`` -> ``(B, T)``."""
    return logprobs - ref_logprobs


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``|logprobs - ref_logprobs|``. ``(B, T), (B, T)`` -> ``(B, T)``."""
    return (logprobs - ref_logprobs).abs()


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """``0.5 * (logprobs - ref_logprobs)**2``. ``(B, T), (B, T)`` -> ``(B, T)``."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Low-variance ``exp(ref - lp) - (ref - lp) - 1``, clamped to [-10, 10]. ``(B, T), (B, T)`` -> ``(B, T)``."""
    log_ratio = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    # expm1: exp(x) - 1 - x rounds to tiny negatives near x = 0, expm1(x) - x does not
    return (torch.expm1(log_ratio) - log_ratio).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


KL_ESTIMATORS: Mapping[str, KLEstimator] = {"k1": kl_k1, "abs": kl_abs, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> KLEstimator:
    """``KL_ESTIMATORS[name]``; an unknown name raises ``UnknownAlgorithmError`` listing the allowed ones."""
    return lookup(KL_ESTIMATORS, name, "KL estimator")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL by estimator name. ``(B, T), (B, T)`` -> ``(B, T)``."""
    return get_kl_estimator(estimator)(logprobs, ref_logprobs)
