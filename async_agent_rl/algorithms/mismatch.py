"""Train/inference mismatch apart from staleness: how far the inference engine's log-probs are from the trainer's.

``behavior_logprobs`` are what the engine computed when it sampled; ``proximal_logprobs`` what the learner computes
for the same tokens with its current weights. For a token sampled by the very weights the learner holds (a *fresh*
token: its version is the proximal policy's), the two differ only by numerics (kernels, precision, batching): that
is the engine/trainer mismatch. For a *stale* token they differ by that plus the updates since it was sampled.

With ``d_t = proximal_t - behavior_t`` over sampled tokens (clamped to [-20, 20]):

- ``mismatch_kl_{fresh,stale}``: KL(behavior || proximal) by k3, ``mean(exp(d) - 1 - d)``;
- ``mismatch_abs_logprob_{fresh,stale}``: ``mean |d|``;
- ``seq_log_ratio_mean``: mean over rows with a sampled token of ``S = sum_t d_t``, the log of the sequence's
  importance ratio (the product of its token weights); ``seq_log_ratio_max``: ``max |S|`` (drift either way);
- ``fresh_token_fraction``: fresh tokens over sampled tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_agent_rl.algorithms.masked import masked_mean, masked_sum

MISMATCH_LOG_RATIO_CLAMP = 20.0
MISMATCH_METRICS: tuple[str, ...] = (
    "mismatch_kl_fresh", "mismatch_abs_logprob_fresh", "mismatch_kl_stale", "mismatch_abs_logprob_stale",
    "seq_log_ratio_mean", "seq_log_ratio_max", "fresh_token_fraction",
)


def mismatch_metrics(proximal_logprobs: Tensor, behavior_logprobs: Tensor, sampled_mask: Tensor,
                     fresh_mask: Tensor) -> tuple[dict[str, Tensor], dict[str, float]]:
    """``(values, counts)``: every metric of the module docstring as a detached 0-dim tensor, and the number of
    items it is a mean over (fresh tokens, stale tokens, rows, sampled tokens; for ``seq_log_ratio_max`` the rows).
    A metric over no item is 0 with count 0: the caller reports it as not computed, and combines parts (micro-batches,
    ranks) by count-weighted means (maxima for ``seq_log_ratio_max``).
    Shapes: ``(B, T)`` each; ``fresh_mask`` is taken only where ``sampled_mask`` is set."""
    sampled = sampled_mask.bool()
    fresh = sampled & fresh_mask.bool()
    stale = sampled & ~fresh
    d = (proximal_logprobs.detach() - behavior_logprobs.detach()).float()
    d = torch.where(sampled, d, torch.zeros_like(d)).clamp(-MISMATCH_LOG_RATIO_CLAMP, MISMATCH_LOG_RATIO_CLAMP)
    k3 = torch.expm1(d) - d
    rows = sampled.any(dim=-1)
    seq = masked_sum(d, sampled, dim=-1)
    n_fresh, n_stale, n_rows = float(fresh.sum()), float(stale.sum()), float(rows.sum())
    values = {
        "mismatch_kl_fresh": masked_mean(k3, fresh),
        "mismatch_abs_logprob_fresh": masked_mean(d.abs(), fresh),
        "mismatch_kl_stale": masked_mean(k3, stale),
        "mismatch_abs_logprob_stale": masked_mean(d.abs(), stale),
        "seq_log_ratio_mean": masked_mean(seq, rows),
        "seq_log_ratio_max": torch.where(rows, seq.abs(), torch.zeros_like(seq)).amax() if seq.numel() else seq.sum(),
        "fresh_token_fraction": masked_mean(fresh.float(), sampled),
    }
    counts = {
        "mismatch_kl_fresh": n_fresh, "mismatch_abs_logprob_fresh": n_fresh,
        "mismatch_kl_stale": n_stale, "mismatch_abs_logprob_stale": n_stale,
        "seq_log_ratio_mean": n_rows, "seq_log_ratio_max": n_rows,
        "fresh_token_fraction": n_fresh + n_stale,
    }
    return {k: v.detach() for k, v in values.items()}, counts
