"""Policy losses with off-policy correction, loss aggregation, entropy and the clipped value loss.

Three policies, named so everywhere (AReaL's pi_behave / pi_proximal / pi_theta):

- ``behavior_logprobs``  ``(B, T)``: what the inference engine used when it sampled (recorded per token);
- ``proximal_logprobs``  ``(B, T)``: recomputed by the learner with the current weights before the update;
- ``logprobs``           ``(B, T)``: live, with grad.

All are log-probs of the sampled tokens. ``advantages`` ``(B, T)``; ``response_mask`` ``(B, T)`` is 1 on action
tokens only. ``behavior_logprobs`` and ``proximal_logprobs`` are constants (detached here).

Families, each with one signature and a registry (names as ``AlgorithmConfig``):

- ``POLICY_LOSSES[name](logprobs, proximal_logprobs, behavior_logprobs, advantages, response_mask, *,
  clip_ratio_low, clip_ratio_high, dual_clip_c, behavior_weight_mode, behavior_weight_cap, loss_agg_mode,
  horizon, behavior_weight_level, icepop_band, behavior_weight_floor, turn_index, sampled_mask)``
  -> ``(loss, metrics)``: ``ppo``, ``decoupled_ppo``;
- ``BEHAVIOR_WEIGHT_MODES[name](weight, cap)`` -> ``(weight, affected)``: ``truncate``, ``mask``;
- ``BEHAVIOR_WEIGHT_LEVELS``: ``token``, ``sequence``, ``turn`` (what one weight covers; ``behavior_correction``);
- ``LOSS_AGGREGATORS[name](per_token_loss, mask, horizon)`` -> scalar, called through ``agg_loss``.

Metrics are detached 0-dim tensors (call ``.item()`` when logging; no device sync here).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Protocol

import torch
from torch import Tensor

from async_agent_rl.algorithms._registry import lookup
from async_agent_rl.algorithms.advantages import turn_index_from_mask
from async_agent_rl.algorithms.masked import masked_mean, masked_sum

# exp() of a log weight beyond this is only a metric-spoiling inf; the cap acts long before
BEHAVIOR_LOG_WEIGHT_CLAMP = 20.0


# ------------------------------------------------------------------------------------------------- aggregation
def token_mean(per_token_loss: Tensor, mask: Tensor, horizon: Optional[float] = None) -> Tensor:
    """``sum_{b,t} m L / sum_{b,t} m``: every action token of the batch weighs the same (DAPO, verl default)."""
    return masked_mean(per_token_loss, mask)


def _nonempty_mean(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """Mean over the sequences with at least one action token (others would add zeros and dilute the mean)."""
    return masked_mean(per_sequence, mask.bool().any(dim=-1))


def seq_mean_token_sum(per_token_loss: Tensor, mask: Tensor, horizon: Optional[float] = None) -> Tensor:
    """``mean_b sum_t m L``: sum over each sequence's action tokens, mean over sequences."""
    return _nonempty_mean(masked_sum(per_token_loss, mask, dim=-1), mask)


def seq_mean_token_mean(per_token_loss: Tensor, mask: Tensor, horizon: Optional[float] = None) -> Tensor:
    """``mean_b (sum_t m L / sum_t m)``: per-sequence token mean, then mean over sequences (original GRPO)."""
    return _nonempty_mean(masked_mean(per_token_loss, mask, dim=-1), mask)


def seq_mean_token_sum_norm(per_token_loss: Tensor, mask: Tensor, horizon: Optional[float] = None) -> Tensor:
    """``mean_b (sum_t m L) / H`` with a CONSTANT horizon ``H`` (Dr. GRPO: the generation budget).

    ``H`` defaults to ``T = mask.shape[-1]``, the padded width; pass the response token budget
    (``rollout`` max response tokens) so the scale does not change with how a batch happened to be padded.
    verl divides the sum over sequences by ``H`` without the ``1/B``; here the mean over sequences keeps the loss
    scale independent of the batch size, as in the Dr. GRPO paper.
    """
    H = float(mask.shape[-1] if horizon is None else horizon)
    if H <= 0:
        raise ValueError(f"horizon must be positive, got {H}")
    return _nonempty_mean(masked_sum(per_token_loss, mask, dim=-1), mask) / H


LossAggregator = Callable[[Tensor, Tensor, Optional[float]], Tensor]
LOSS_AGGREGATORS: Mapping[str, LossAggregator] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def agg_loss(per_token_loss: Tensor, mask: Tensor, mode: str, *, horizon: Optional[float] = None) -> Tensor:
    """Reduce ``(B, T)`` per-token losses over the ``(B, T)`` mask to a scalar by ``LOSS_AGGREGATORS[mode]``.

    Masked positions never contribute, even if they hold NaN or inf. Sequence-mean modes average over sequences
    with at least one action token; an all-empty batch gives 0. ``horizon`` is used by ``seq-mean-token-sum-norm``
    only. Reductions are over this call's tensors: with gradient accumulation over micro-batches, token-mean per
    micro-batch is not token-mean over the mini-batch unless micro-batches hold equal token counts.
    """
    return lookup(LOSS_AGGREGATORS, mode, "loss aggregation mode")(per_token_loss, mask, horizon)


# -------------------------------------------------------------------------------------------------- PPO pieces
def ppo_clip_per_token(ratio: Tensor, advantages: Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
                       dual_clip_c: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate per token, with asymmetric clip range and optional dual clip.

    ``L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` (Schulman et al. 2017; asymmetric "clip-higher" from
    DAPO). Dual clip (Ye et al. 2020, "Mastering complex control in MOBA games"): for ``A < 0`` only,
    ``L = min(L, c |A|)``, which bounds the loss of a token whose ratio exploded; for ``A >= 0`` the clipped loss
    is already below ``0 <= c|A|``, so it could not bite there anyway.
    Shapes: ``ratio``, ``advantages`` ``(B, T)`` -> ``(loss, clipped, dual_clipped)`` ``(B, T)``, the last two bool:
    where the clipped term is the active one, and where the dual clip replaced the loss.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    if dual_clip_c is None:
        return loss, clipped, torch.zeros_like(clipped)
    bound = -advantages * dual_clip_c  # = c |A| where A < 0
    dual_clipped = (advantages < 0) & (loss > bound)
    return torch.where(dual_clipped, bound, loss), clipped, dual_clipped


def _log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """``a - b`` on action tokens, 0 elsewhere, so ``exp`` of padding garbage cannot overflow or reach a grad."""
    return torch.where(mask, a - b, torch.zeros_like(a))


def _approx_kl(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """KL(anchor || live) by k3 on ``log_ratio = logprobs - anchor``: mean of ``(r - 1) - log r`` (CleanRL)."""
    return masked_mean(torch.expm1(log_ratio) - log_ratio, mask).detach()


def _clip_metrics(clipped: Tensor, dual_clipped: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    return {
        "clip_frac": masked_mean(clipped.float(), mask).detach(),
        "dual_clip_frac": masked_mean(dual_clipped.float(), mask).detach(),
        "approx_kl": _approx_kl(log_ratio.detach(), mask),
    }


# ------------------------------------------------------------------------------------------- behavior weights
def truncate_behavior_weight(weight: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """verl TIS (truncated importance sampling; threshold 2.0 there): ``w <- min(w, cap)``.

    ``(B, T)`` -> ``(weight, affected)``; ``affected = w > cap`` marks exactly the tokens changed.
    """
    affected = weight > cap
    return weight.clamp(max=cap), affected


def mask_behavior_weight(weight: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """AReaL (``behav_imp_weight_cap``, 5.0 there): tokens with ``w > cap`` are dropped (weight 0), others keep ``w``.

    Dropped tokens stay in the aggregation's denominator, as AReaL, so dropping does not rescale the others.
    ``(B, T)`` -> ``(weight, affected)``; ``affected = w > cap`` marks exactly the tokens changed.
    """
    affected = weight > cap
    return torch.where(affected, torch.zeros_like(weight), weight), affected


BehaviorWeightMode = Callable[[Tensor, float], tuple[Tensor, Tensor]]
BEHAVIOR_WEIGHT_MODES: Mapping[str, BehaviorWeightMode] = {
    "truncate": truncate_behavior_weight,
    "mask": mask_behavior_weight,
}


def get_behavior_weight_mode(name: str) -> BehaviorWeightMode:
    """``BEHAVIOR_WEIGHT_MODES[name]``; an unknown name raises ``UnknownAlgorithmError`` listing the allowed ones."""
    return lookup(BEHAVIOR_WEIGHT_MODES, name, "behavior weight mode")


def behavior_weight(proximal_logprobs: Tensor, behavior_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """``w = exp(proximal - behavior)``, detached; 1 at non-action positions; log-weight clamped to [-20, 20].

    Shapes: ``(B, T)`` each -> ``(B, T)``. ``w`` corrects for the sampling policy being older than (or numerically
    different from) the proximal policy; it is a constant of the loss.
    """
    mask = response_mask.bool()
    log_w = _log_ratio(proximal_logprobs.detach(), behavior_logprobs.detach(), mask)
    return log_w.clamp(-BEHAVIOR_LOG_WEIGHT_CLAMP, BEHAVIOR_LOG_WEIGHT_CLAMP).exp()


def behavior_weight_metrics(raw_weight: Tensor, affected: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """Statistics of the raw behavior weight over action tokens.

    ``iw_mean``, ``iw_max`` of ``w`` before the cap; ``iw_capped_frac``: fraction of action tokens with ``w > cap``
    (truncated or masked, by mode); ``behavior_kl``: KL(behavior || proximal) by k3, ``mean(w - 1 - log w)``,
    the staleness plus trainer/inference mismatch (prime-rl logs the same).
    """
    mask = response_mask.bool()
    log_w = raw_weight.log()
    return {
        "iw_mean": masked_mean(raw_weight, mask).detach(),
        # weights are positive, so the max over the zero-filled tensor is the max over action tokens (0 if none)
        "iw_max": torch.where(mask, raw_weight, torch.zeros_like(raw_weight)).max().detach(),
        "iw_capped_frac": masked_mean((affected & mask).float(), mask).detach(),
        "behavior_kl": masked_mean(raw_weight - 1 - log_w, mask).detach(),
    }


BEHAVIOR_WEIGHT_LEVELS: tuple[str, ...] = ("token", "sequence", "turn")


def _group_mean(x: Tensor, selected: Tensor, group: Tensor) -> Tensor:
    """Per row, the mean of ``x`` over the ``selected`` positions of each group, broadcast back to every position
    of the group; 0 for a group with no selected position. ``group`` ``(B, T)`` long, ``-1`` a group of its own."""
    idx = group.long() + 1
    K = int(idx.max()) + 1 if idx.numel() else 1
    picked = torch.where(selected, x, torch.zeros_like(x))
    sums = x.new_zeros(x.shape[0], K).scatter_add_(1, idx, picked)
    counts = x.new_zeros(x.shape[0], K).scatter_add_(1, idx, selected.to(x.dtype))
    return (sums / counts.clamp(min=1)).gather(1, idx)


def level_log_weight(log_weight: Tensor, sampled: Tensor, level: str, turn_index: Optional[Tensor] = None) -> Tensor:
    """The log behavior weight each position takes at ``level`` (``(B, T)`` -> ``(B, T)``):

    - ``token``: ``log w_t`` itself;
    - ``sequence``: ``mean_t log w_t`` over the row's sampled tokens (the log of the geometric mean ``W``), at every
      position of the row;
    - ``turn``: the same mean over each turn's sampled tokens, at every position of the turn. ``turn_index``
      numbers the turns (``-1``: no turn); without it a turn is a maximal run of ``sampled`` tokens (an assistant
      turn between observations).
    """
    if level == "token":
        return log_weight
    if level == "sequence":
        group = torch.zeros_like(log_weight, dtype=torch.long)
    elif level == "turn":
        if turn_index is None:
            turn_index = turn_index_from_mask(sampled)
        group = turn_index
    else:
        allowed = ", ".join(repr(k) for k in BEHAVIOR_WEIGHT_LEVELS)
        raise ValueError(f"unknown behavior weight level {level!r}; allowed: {allowed}")
    return _group_mean(log_weight, sampled, group)


def behavior_correction(proximal_logprobs: Tensor, behavior_logprobs: Tensor, response_mask: Tensor, *,
                        level: str = "token", mode: str = "truncate", cap: float = 2.0,
                        icepop_band: Optional[tuple[float, float]] = None, floor: Optional[float] = None,
                        turn_index: Optional[Tensor] = None, sampled_mask: Optional[Tensor] = None
                        ) -> tuple[Tensor, dict[str, Tensor]]:
    """The behavior weight of every loss position, corrected; ``(weight (B, T) detached, metrics)``.

    ``w_t = exp(proximal_t - behavior_t)`` (log clamped to [-20, 20]). Over the *sampled* tokens (``sampled_mask``,
    default ``response_mask``: unmasked observation tokens were never sampled and do not enter a mean):

    1. level (``level_log_weight``): ``token`` keeps ``w_t``; ``sequence`` gives every position of a row
       ``W = exp(mean_t log w_t)``, ``turn`` every position of a turn the same over the turn's tokens;
    2. cap (``BEHAVIOR_WEIGHT_MODES[mode]``): ``truncate`` ``min(W, cap)``; ``mask`` 0 where ``W > cap``;
    3. IcePop band ``[low, high]`` (None: off): a token whose own ``w_t`` lies outside it gets weight 0;
    4. floor veto (None: off): every position of a row with any sampled ``w_t < floor`` gets weight 0.

    Metrics (0-dim, detached): those of ``behavior_weight_metrics`` (``iw_capped_frac``: loss tokens the cap
    changed), ``iw_capped_seq_frac`` (rows with a loss token the cap changed, over rows with a loss token), with a
    band ``icepop_masked_frac``, with a floor ``floor_veto_frac`` (loss tokens) and ``floor_veto_seq_frac`` (rows).
    """
    if not cap > 1.0:
        raise ValueError(f"behavior_weight_cap must be > 1, got {cap}")
    if icepop_band is not None and not 0 <= icepop_band[0] < 1 < icepop_band[1]:
        raise ValueError(f"icepop_band needs 0 <= low < 1 < high, got {list(icepop_band)}")
    if floor is not None and not 0 < floor < 1:
        raise ValueError(f"behavior_weight_floor needs 0 < floor < 1, got {floor}")
    cap_weight = get_behavior_weight_mode(mode)
    mask = response_mask.bool()
    sampled = mask if sampled_mask is None else sampled_mask.bool() & mask
    log_w = _log_ratio(proximal_logprobs.detach(), behavior_logprobs.detach(), sampled)
    log_w = log_w.clamp(-BEHAVIOR_LOG_WEIGHT_CLAMP, BEHAVIOR_LOG_WEIGHT_CLAMP)
    raw_weight = log_w.exp()
    level_weight = level_log_weight(log_w, sampled, level, turn_index).exp()
    weight, affected = cap_weight(level_weight, cap)
    affected = affected & mask
    rows = mask.any(dim=-1)
    metrics = behavior_weight_metrics(raw_weight, affected, mask)
    metrics["iw_capped_seq_frac"] = masked_mean(affected.any(dim=-1).float(), rows).detach()
    if icepop_band is not None:
        low, high = icepop_band
        outside = sampled & ((raw_weight < low) | (raw_weight > high))
        weight = torch.where(outside, torch.zeros_like(weight), weight)
        metrics["icepop_masked_frac"] = masked_mean(outside.float(), mask).detach()
    if floor is not None:
        vetoed = (sampled & (raw_weight < floor)).any(dim=-1)
        weight = torch.where(vetoed.unsqueeze(-1), torch.zeros_like(weight), weight)
        metrics["floor_veto_frac"] = masked_mean(vetoed.unsqueeze(-1).expand(mask.shape).float(), mask).detach()
        metrics["floor_veto_seq_frac"] = masked_mean(vetoed.float(), rows).detach()
    return weight.detach(), metrics


# ---------------------------------------------------------------------------------------------- policy losses
class PolicyLoss(Protocol):
    def __call__(self, logprobs: Tensor, proximal_logprobs: Optional[Tensor], behavior_logprobs: Tensor,
                 advantages: Tensor, response_mask: Tensor, *, clip_ratio_low: float = 0.2,
                 clip_ratio_high: float = 0.2, dual_clip_c: Optional[float] = 3.0,
                 behavior_weight_mode: str = "truncate", behavior_weight_cap: float = 2.0,
                 loss_agg_mode: str = "token-mean", horizon: Optional[float] = None,
                 behavior_weight_level: str = "token", icepop_band: Optional[tuple[float, float]] = None,
                 behavior_weight_floor: Optional[float] = None, turn_index: Optional[Tensor] = None,
                 sampled_mask: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]: ...


def ppo_loss(logprobs: Tensor, proximal_logprobs: Optional[Tensor], behavior_logprobs: Tensor, advantages: Tensor,
             response_mask: Tensor, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
             dual_clip_c: Optional[float] = 3.0, behavior_weight_mode: str = "truncate",
             behavior_weight_cap: float = 2.0, loss_agg_mode: str = "token-mean",
             horizon: Optional[float] = None, behavior_weight_level: str = "token",
             icepop_band: Optional[tuple[float, float]] = None, behavior_weight_floor: Optional[float] = None,
             turn_index: Optional[Tensor] = None, sampled_mask: Optional[Tensor] = None
             ) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain PPO: the policy that sampled is the trust-region anchor, ``r = exp(logprobs - behavior_logprobs)``.

    ``loss = agg(ppo_clip_per_token(r, A))``. This is the standard (coupled) PPO that AReaL compares against: with
    stale data the anchor is old and clipping stalls learning. It is ``decoupled_ppo_loss`` at zero staleness
    (``proximal == behavior``); ``proximal_logprobs`` and every ``behavior_weight_*`` argument, ``icepop_band``,
    ``turn_index`` and ``sampled_mask`` are unused (``proximal_logprobs`` may be None).
    Shapes: log-probs, ``advantages``, ``response_mask`` ``(B, T)`` -> ``(scalar loss, metrics)``; metrics
    ``clip_frac``, ``dual_clip_frac``, ``approx_kl`` (KL(behavior || live), k3).
    """
    mask = response_mask.bool()
    log_ratio = _log_ratio(logprobs, behavior_logprobs.detach(), mask)
    per_token, clipped, dual_clipped = ppo_clip_per_token(
        log_ratio.exp(), advantages, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        dual_clip_c=dual_clip_c)
    loss = agg_loss(per_token, mask, loss_agg_mode, horizon=horizon)
    return loss, _clip_metrics(clipped, dual_clipped, log_ratio, mask)


def decoupled_ppo_loss(logprobs: Tensor, proximal_logprobs: Optional[Tensor], behavior_logprobs: Tensor,
                       advantages: Tensor, response_mask: Tensor, *, clip_ratio_low: float = 0.2,
                       clip_ratio_high: float = 0.2, dual_clip_c: Optional[float] = 3.0,
                       behavior_weight_mode: str = "truncate", behavior_weight_cap: float = 2.0,
                       loss_agg_mode: str = "token-mean", horizon: Optional[float] = None,
                       behavior_weight_level: str = "token", icepop_band: Optional[tuple[float, float]] = None,
                       behavior_weight_floor: Optional[float] = None, turn_index: Optional[Tensor] = None,
                       sampled_mask: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL, Fu et al. 2025): clip around the proximal policy, reweight by the behavior policy.

    ``r = exp(logprobs - proximal_logprobs)``, ``L_t = ppo_clip_per_token(r, A)`` (asymmetric clip, dual clip),
    ``w = exp(proximal_logprobs - behavior_logprobs)`` detached, corrected by ``behavior_correction`` at
    ``behavior_weight_level`` (token, sequence or turn) with ``BEHAVIOR_WEIGHT_MODES[mode]`` (``truncate``:
    ``min(w, cap)``; ``mask``: 0 where ``w > cap``), an optional IcePop band and floor veto; ``loss = agg(w_t L_t)``.
    With ``behavior == proximal``, ``w = 1`` and this is exactly ``ppo_loss`` (value and gradient).
    Shapes: log-probs, ``advantages``, ``response_mask``, ``turn_index``, ``sampled_mask`` ``(B, T)`` ->
    ``(scalar loss, metrics)``; metrics ``clip_frac``, ``dual_clip_frac``, ``approx_kl`` (KL(proximal || live), k3)
    and those of ``behavior_correction``.
    """
    if proximal_logprobs is None:
        raise ValueError("decoupled_ppo needs proximal_logprobs (B, T), recomputed with the current weights")
    mask = response_mask.bool()
    weight, weight_metrics = behavior_correction(
        proximal_logprobs, behavior_logprobs, mask, level=behavior_weight_level, mode=behavior_weight_mode,
        cap=behavior_weight_cap, icepop_band=icepop_band, floor=behavior_weight_floor, turn_index=turn_index,
        sampled_mask=sampled_mask)
    log_ratio = _log_ratio(logprobs, proximal_logprobs.detach(), mask)
    per_token, clipped, dual_clipped = ppo_clip_per_token(
        log_ratio.exp(), advantages, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        dual_clip_c=dual_clip_c)
    loss = agg_loss(per_token * weight, mask, loss_agg_mode, horizon=horizon)
    metrics = _clip_metrics(clipped, dual_clipped, log_ratio, mask)
    metrics.update(weight_metrics)
    return loss, metrics


POLICY_LOSSES: Mapping[str, PolicyLoss] = {"ppo": ppo_loss, "decoupled_ppo": decoupled_ppo_loss}


def get_policy_loss(name: str) -> PolicyLoss:
    """``POLICY_LOSSES[name]``; an unknown name raises ``UnknownAlgorithmError`` listing the allowed ones."""
    return lookup(POLICY_LOSSES, name, "policy loss")


# ------------------------------------------------------------------------------------------ entropy and value
def entropy_from_logits(logits: Tensor, response_mask: Optional[Tensor] = None) -> Tensor:
    """Entropy of the softmax at each position: ``H = logsumexp(z) - sum softmax(z) * z``.

    Shapes: ``logits`` ``(B, T, V)``, ``response_mask`` ``(B, T)`` or None -> ``(B, T)``, 0 where the mask is 0
    (observations take no entropy bonus). Computed in the logits' dtype: upcast bf16 logits first if precision
    matters. Aggregate with ``agg_loss(entropy, mask, mode)``; the bonus is ``-entropy_coef * that``.
    """
    probs = torch.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
    if response_mask is None:
        return entropy
    return torch.where(response_mask.bool(), entropy, torch.zeros_like(entropy))


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, *,
                       value_clip: float, loss_agg_mode: str = "token-mean", horizon: Optional[float] = None
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO value clipping (OpenAI baselines ``ppo2``, verl ``compute_value_loss``).

    ``V_clip = old + clamp(V - old, -eps, eps)``,
    ``loss = 0.5 * agg(max((V - R)^2, (V_clip - R)^2))``.
    Shapes: ``values`` (live critic, with grad), ``old_values`` (the critic values the advantages were computed
    with), ``returns`` (``gae_advantages``' target), ``response_mask`` ``(B, T)`` -> ``(scalar loss, metrics)``;
    metrics ``vf_clip_frac`` (fraction of action tokens where the clipped term is the larger).
    """
    mask = response_mask.bool()
    old_values = old_values.detach()
    returns = returns.detach()
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped_values - returns).square()
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    loss = 0.5 * agg_loss(per_token, mask, loss_agg_mode, horizon=horizon)
    return loss, {"vf_clip_frac": masked_mean((loss_clipped > loss_unclipped).float(), mask).detach()}
