"""Advantage estimators for multi-turn episodes whose responses interleave model turns and observations.

Conventions (every function in this module):

- ``B`` trajectories, ``T`` response token positions; tensors are ``(B, T)`` unless stated.
- ``response_mask`` ``(B, T)``: 1 on action (model-generated) tokens only; 0 on observation tokens and padding.
- ``token_level_rewards`` ``(B, T)``: the outcome reward sits on the LAST action token of each trajectory
  (``place_outcome_rewards``). Rewards at non-action positions are ignored everywhere.
- ``group_index`` ``(B,)`` long: trajectories with equal values form one GRPO group (the rollouts of one prompt).
  Values need not be contiguous, sorted or small.
- ``turn_index`` ``(B, T)`` long: index (0, 1, ...) of the model turn each action token belongs to, -1 elsewhere.
- Results are 0 at non-action positions. All estimators run under ``torch.no_grad()``: advantages are targets.

Families, each with one signature and a registry:

- ``ADVANTAGE_ESTIMATORS[name](token_level_rewards, response_mask, *, group_index, values, gamma, lam)``
  -> ``(advantages, returns)``, both ``(B, T)``. Names as ``AlgorithmConfig.advantage_estimator``.
- ``GROUP_NORMALIZERS[name](scores, group_index)`` -> ``(N,)``: the group-relative part of the outcome estimators,
  reused by the step-wise ``per_step`` mode.
- ``STEPWISE_MODES[name](advantages, token_level_rewards, response_mask, turn_index, *, group_index, estimator,
  gamma)`` -> ``advantages``. Names as ``AlgorithmConfig.stepwise_advantage``.

``compute_advantages`` chains them in the order the learner needs: estimator, step-wise mode, batch whitening.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Protocol

import torch
from torch import Tensor

from async_agent_rl.algorithms._registry import lookup
from async_agent_rl.algorithms.masked import masked_mean, masked_whiten

GRPO_EPS = 1e-6  # added to the group std (docs/ALGORITHMS.md section 2)


# ------------------------------------------------------------------------------------------------- token helpers
def place_outcome_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Put each trajectory's outcome score on its last action token.

    Shapes: ``scores`` ``(B,)``, ``response_mask`` ``(B, T)`` -> ``(B, T)`` float, zero elsewhere.
    Raises ``ValueError`` if a row has no action token: an episode must end on a model token (docs/ALGORITHMS.md
    section 2), otherwise its reward would sit on a masked position and reach nothing.
    """
    mask = response_mask.bool()
    empty = ~mask.any(dim=-1)
    if empty.any():
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} have no action token to carry the outcome reward")
    T = mask.shape[-1]
    # argmax returns the first maximal index; on the flipped mask that is the last action token
    last = T - 1 - mask.flip(-1).to(torch.int8).argmax(dim=-1)
    rewards = torch.zeros(mask.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32,
                          device=mask.device)
    rewards[torch.arange(mask.shape[0], device=mask.device), last] = scores.to(rewards.dtype)
    return rewards


def turn_index_from_mask(response_mask: Tensor) -> Tensor:
    """Number the maximal runs of action tokens 0, 1, ... per row; -1 at non-action positions.

    Shapes: ``(B, T)`` -> ``(B, T)`` long. A model turn is a maximal run of action tokens when every two model turns
    are separated by an observation, as in Search-R1; build ``turn_index`` from the record's ``turns`` otherwise.
    """
    mask = response_mask.bool()
    prev = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    starts = mask & ~prev
    index = starts.long().cumsum(dim=-1) - 1
    return torch.where(mask, index, torch.full_like(index, -1))


def sequence_scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Outcome score of each trajectory: the sum of its rewards on action tokens. ``(B, T)`` -> ``(B,)``."""
    mask = response_mask.bool()
    return torch.where(mask, token_level_rewards, torch.zeros_like(token_level_rewards)).sum(dim=-1)


def _on_actions(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """Broadcast ``(B,)`` to every action token of its row; ``(B, T)`` with zeros elsewhere."""
    mask = response_mask.bool()
    return torch.where(mask, per_sequence.unsqueeze(-1).expand(mask.shape), per_sequence.new_zeros(()))


# --------------------------------------------------------------------------------------- group-relative scores
def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-item group mean, unbiased group std and group size, each ``(N,)``. Groups are keyed by value."""
    if scores.shape != group_index.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and group_index {tuple(group_index.shape)} must be (N,)")
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    counts = counts.to(scores.dtype)
    sums = scores.new_zeros(counts.shape).index_add_(0, inverse, scores)
    mean = (sums / counts)[inverse]
    squares = scores.new_zeros(counts.shape).index_add_(0, inverse, (scores - mean) ** 2)
    std = (squares / (counts - 1).clamp(min=1)).sqrt()[inverse]
    return mean, std, counts[inverse]


def grpo_scores(scores: Tensor, group_index: Tensor) -> Tensor:
    """GRPO (DeepSeekMath): ``A_i = (s_i - mean_g) / (std_g + 1e-6)``, std unbiased (n-1).

    Shapes: ``(N,)``, ``(N,)`` -> ``(N,)``. A group of one keeps its raw score (verl sets mean 0, std 1 there),
    so a lone rollout still pushes in the direction of its reward.
    """
    mean, std, n = _group_stats(scores, group_index)
    return torch.where(n > 1, (scores - mean) / (std + GRPO_EPS), scores)


def grpo_no_std_scores(scores: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): ``A_i = s_i - mean_g``, no std division,
    which removes the question-difficulty bias. ``(N,)`` -> ``(N,)``; a group of one keeps its raw score."""
    mean, _, n = _group_stats(scores, group_index)
    return torch.where(n > 1, scores - mean, scores)


def rloo_scores(scores: Tensor, group_index: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean_g)``.

    ``(N,)`` -> ``(N,)``; a group of one has no leave-one-out baseline and keeps its raw score (as verl).
    """
    mean, _, n = _group_stats(scores, group_index)
    return torch.where(n > 1, n / (n - 1).clamp(min=1) * (scores - mean), scores)


GroupNormalizer = Callable[[Tensor, Tensor], Tensor]
GROUP_NORMALIZERS: Mapping[str, GroupNormalizer] = {
    "grpo": grpo_scores,
    "grpo_no_std": grpo_no_std_scores,
    "rloo": rloo_scores,
}


# ------------------------------------------------------------------------------------------ the observation skip
def _scan_skipping_observations(rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float,
                                lam: float) -> Tensor:
    """Backward GAE recursion in which observation positions neither consume nor emit TD error.

    Walking backwards with ``next_value = 0`` and ``last = 0`` after the final token::

        delta_t = r_t + gamma * next_value - V_t
        cand_t  = delta_t + gamma * lam * last
        action token:       next_value <- V_t,  last <- cand_t,  A_t = cand_t
        observation token:  next_value, last unchanged

    so the TD error of the first action token after an observation span flows straight to the last action token
    before it, and values, rewards at observation positions never enter (docs/ALGORITHMS.md section 2; the DeepEyes GAE
    fix, seed 002). Equivalently: delete the observation columns, run textbook GAE, put the columns back.
    Shapes: all ``(B, T)`` -> ``(B, T)`` with zeros at non-action positions.
    """
    mask = response_mask.bool()
    B, T = rewards.shape
    next_value = rewards.new_zeros(B)
    last = rewards.new_zeros(B)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        cand = delta + gamma * lam * last
        m = mask[:, t]
        next_value = torch.where(m, values[:, t], next_value)
        last = torch.where(m, cand, last)
        advantages[:, t] = last
    return torch.where(mask, advantages, torch.zeros_like(advantages))


# ------------------------------------------------------------------------------------------------- estimators
class AdvantageEstimator(Protocol):
    def __call__(self, token_level_rewards: Tensor, response_mask: Tensor, *, group_index: Optional[Tensor] = None,
                 values: Optional[Tensor] = None, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]: ...


def _require(x: Optional[Tensor], what: str, estimator: str) -> Tensor:
    if x is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {what}")
    return x


def _group_relative(normalize: GroupNormalizer, name: str, token_level_rewards: Tensor, response_mask: Tensor,
                    group_index: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    scores = sequence_scores(token_level_rewards, response_mask)
    adv = _on_actions(normalize(scores, _require(group_index, "group_index (B,)", name)), response_mask)
    return adv, adv


@torch.no_grad()
def grpo_advantages(token_level_rewards: Tensor, response_mask: Tensor, *, group_index: Optional[Tensor] = None,
                    values: Optional[Tensor] = None, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage (``grpo_scores`` of each trajectory's score) on every action token.

    Shapes: ``token_level_rewards``, ``response_mask`` ``(B, T)``, ``group_index`` ``(B,)`` (required) ->
    ``(advantages, returns)`` ``(B, T)``; ``returns`` is ``advantages`` (no critic, as verl). ``values``, ``gamma``
    and ``lam`` are unused: the outcome is not discounted.
    """
    return _group_relative(grpo_scores, "grpo", token_level_rewards, response_mask, group_index)


@torch.no_grad()
def grpo_no_std_advantages(token_level_rewards: Tensor, response_mask: Tensor, *,
                           group_index: Optional[Tensor] = None, values: Optional[Tensor] = None, gamma: float = 1.0,
                           lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Dr. GRPO outcome advantage (``grpo_no_std_scores``); shapes and unused arguments as ``grpo_advantages``."""
    return _group_relative(grpo_no_std_scores, "grpo_no_std", token_level_rewards, response_mask, group_index)


@torch.no_grad()
def rloo_advantages(token_level_rewards: Tensor, response_mask: Tensor, *, group_index: Optional[Tensor] = None,
                    values: Optional[Tensor] = None, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """RLOO outcome advantage (``rloo_scores``); shapes and unused arguments as ``grpo_advantages``."""
    return _group_relative(rloo_scores, "rloo", token_level_rewards, response_mask, group_index)


@torch.no_grad()
def reinforce_pp_advantages(token_level_rewards: Tensor, response_mask: Tensor, *,
                            group_index: Optional[Tensor] = None, values: Optional[Tensor] = None,
                            gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over all action tokens of the batch.

    ``G_t = r_t + gamma * G_{t'}`` where ``t'`` is the next ACTION token (observations are skipped, so with
    ``gamma = 1`` every action token of a trajectory gets its outcome score), then
    ``A = (G - mean) / sqrt(var + 1e-8)`` with batch-global mean and unbiased variance over action tokens.
    Unlike verl's loop this does not reset the return at the first masked token, which would zero every turn but
    the last (seed 002). Shapes: ``(B, T)`` in, ``(advantages, returns = G)`` ``(B, T)`` out; groups, values and
    ``lam`` are unused.
    """
    returns = _scan_skipping_observations(token_level_rewards, torch.zeros_like(token_level_rewards), response_mask,
                                          gamma, 1.0)
    return masked_whiten(returns, response_mask), returns


@torch.no_grad()
def gae_advantages(token_level_rewards: Tensor, response_mask: Tensor, *, group_index: Optional[Tensor] = None,
                   values: Optional[Tensor] = None, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016) with a critic, skipping observation tokens (``_scan_skipping_observations``).

    Shapes: ``token_level_rewards``, ``response_mask``, ``values`` (required, the critic's ``V_t``) ``(B, T)`` ->
    ``(advantages, returns)`` ``(B, T)`` with ``returns = advantages + values`` on action tokens (the critic's
    target) and 0 elsewhere. The value after the last action token is 0 (episodes end there). Neither output
    depends on ``values`` at non-action positions, for any ``gamma, lam`` in (0, 1]. Raw, not whitened: use
    ``compute_advantages(..., whiten=True)`` for PPO's usual whitening.
    """
    values = _require(values, "the critic's values (B, T)", "gae").to(token_level_rewards.dtype)
    advantages = _scan_skipping_observations(token_level_rewards, values, response_mask, gamma, lam)
    returns = torch.where(response_mask.bool(), advantages + values, torch.zeros_like(advantages))
    return advantages, returns


ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "grpo_no_std": grpo_no_std_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "gae": gae_advantages,
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """``ADVANTAGE_ESTIMATORS[name]``; an unknown name raises ``UnknownAlgorithmError`` listing the allowed ones."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


# ------------------------------------------------------------------------------------------------ step-wise modes
class StepwiseMode(Protocol):
    def __call__(self, advantages: Tensor, token_level_rewards: Tensor, response_mask: Tensor,
                 turn_index: Optional[Tensor], *, group_index: Optional[Tensor] = None, estimator: str = "grpo",
                 gamma: float = 1.0) -> Tensor: ...


def stepwise_none(advantages: Tensor, token_level_rewards: Tensor, response_mask: Tensor,
                  turn_index: Optional[Tensor], *, group_index: Optional[Tensor] = None, estimator: str = "grpo",
                  gamma: float = 1.0) -> Tensor:
    """Trajectory-level credit: the estimator's token advantages unchanged. ``(B, T)`` -> ``(B, T)``."""
    return advantages


@torch.no_grad()
def stepwise_broadcast(advantages: Tensor, token_level_rewards: Tensor, response_mask: Tensor,
                       turn_index: Optional[Tensor], *, group_index: Optional[Tensor] = None, estimator: str = "grpo",
                       gamma: float = 1.0) -> Tensor:
    """rLLM ``broadcast`` (seed 003): every step gets the trajectory-level advantage of the final step.

    The final step is the model turn with the largest ``turn_index`` (it holds the outcome reward); its advantage
    is the mean of ``advantages`` over its action tokens, and every action token of the trajectory receives it.
    For GRPO/RLOO outcome advantages this is the identity; for GAE or REINFORCE++ it replaces per-token credit
    with one scalar per trajectory. Shapes: ``advantages``, ``response_mask``, ``turn_index`` ``(B, T)`` ->
    ``(B, T)``; ``token_level_rewards``, groups, ``estimator`` and ``gamma`` are unused.
    """
    if turn_index is None:
        raise ValueError("stepwise 'broadcast' needs turn_index (B, T)")
    mask = response_mask.bool()
    turns = torch.where(mask, turn_index, torch.full_like(turn_index, -1))
    final_turn = turns.max(dim=-1, keepdim=True).values
    in_final = mask & (turns == final_turn)
    return _on_actions(masked_mean(advantages, in_final, dim=-1), response_mask)


@torch.no_grad()
def stepwise_per_step(advantages: Tensor, token_level_rewards: Tensor, response_mask: Tensor,
                      turn_index: Optional[Tensor], *, group_index: Optional[Tensor] = None, estimator: str = "grpo",
                      gamma: float = 1.0) -> Tensor:
    """rLLM ``per_step`` (seed 003): per-step Monte-Carlo returns, normalized per step index across the group.

    ``r_i`` = rewards on the action tokens of model turn ``i`` (the outcome sits in the last turn);
    ``G_i = r_i + gamma * G_{i+1}`` (so ``G_i = gamma**(K-1-i) * R`` for an outcome reward ``R`` and ``K`` turns).
    Then for each step index ``i``, the ``G_i`` of the rollouts in one group that HAVE a step ``i`` are normalized
    together with the estimator's group normalizer (``GROUP_NORMALIZERS[estimator]``: grpo, grpo_no_std, rloo;
    a step held by one rollout only keeps its raw ``G_i``), and the result goes to every action token of step ``i``.
    Turns are indexed from the start of the episode, ``turn_index`` contiguous from 0.
    Shapes: ``token_level_rewards``, ``response_mask``, ``turn_index`` ``(B, T)``, ``group_index`` ``(B,)`` ->
    ``(B, T)``; the incoming ``advantages`` are replaced.
    """
    normalize = lookup(GROUP_NORMALIZERS, estimator, "per-step advantage normalizer (stepwise 'per_step')")
    if turn_index is None or group_index is None:
        raise ValueError("stepwise 'per_step' needs turn_index (B, T) and group_index (B,)")
    mask = response_mask.bool()
    if not mask.any():
        return torch.zeros_like(token_level_rewards)
    B = mask.shape[0]
    K = int(turn_index[mask].max()) + 1
    step_of_token = torch.where(mask, turn_index, torch.zeros_like(turn_index))
    on_actions = torch.where(mask, token_level_rewards, torch.zeros_like(token_level_rewards))
    step_rewards = token_level_rewards.new_zeros(B, K).scatter_add_(1, step_of_token, on_actions)
    step_present = torch.zeros(B, K, dtype=torch.long, device=mask.device).scatter_add_(
        1, step_of_token, mask.long()) > 0

    returns = torch.zeros_like(step_rewards)
    running = step_rewards.new_zeros(B)
    for i in reversed(range(K)):
        running = step_rewards[:, i] + gamma * running
        returns[:, i] = running

    # one normalization group per (prompt group, step index) pair
    step_ids = torch.arange(K, device=mask.device).expand(B, K)
    pairs = torch.stack([group_index.unsqueeze(1).expand(B, K)[step_present], step_ids[step_present]])
    _, pair_group = torch.unique(pairs, dim=1, return_inverse=True)
    step_advantages = torch.zeros_like(returns)
    step_advantages[step_present] = normalize(returns[step_present], pair_group)
    return torch.where(mask, step_advantages.gather(1, step_of_token), torch.zeros_like(token_level_rewards))


STEPWISE_MODES: Mapping[str, StepwiseMode] = {
    "none": stepwise_none,
    "broadcast": stepwise_broadcast,
    "per_step": stepwise_per_step,
}


def get_stepwise_mode(name: str) -> StepwiseMode:
    """``STEPWISE_MODES[name]``; an unknown name raises ``UnknownAlgorithmError`` listing the allowed ones."""
    return lookup(STEPWISE_MODES, name, "step-wise advantage mode")


# ------------------------------------------------------------------------------------------------------ pipeline
def whiten_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Batch whitening: ``(A - mean) / sqrt(var + 1e-8)``, batch-global over action tokens, unbiased variance.

    Shapes: ``(B, T)`` -> ``(B, T)``, 0 at non-action positions.
    """
    return masked_whiten(advantages, response_mask)


@torch.no_grad()
def compute_advantages(token_level_rewards: Tensor, response_mask: Tensor, *, estimator: str,
                       stepwise: str = "none", group_index: Optional[Tensor] = None, values: Optional[Tensor] = None,
                       turn_index: Optional[Tensor] = None, gamma: float = 1.0, lam: float = 1.0,
                       whiten: bool = False) -> tuple[Tensor, Tensor]:
    """Estimator, then step-wise mode, then optional batch whitening: the ``AlgorithmConfig`` pipeline.

    Arguments map to config fields: ``estimator`` = ``advantage_estimator``, ``stepwise`` = ``stepwise_advantage``,
    ``gamma``, ``lam``, ``whiten`` = ``whiten_advantages``. Shapes as the module docstring; returns
    ``(advantages, returns)`` ``(B, T)``; ``returns`` (the critic's target for GAE) is never step-wise-modified or
    whitened.
    """
    advantages, returns = get_advantage_estimator(estimator)(
        token_level_rewards, response_mask, group_index=group_index, values=values, gamma=gamma, lam=lam)
    advantages = get_stepwise_mode(stepwise)(advantages, token_level_rewards, response_mask, turn_index,
                                             group_index=group_index, estimator=estimator, gamma=gamma)
    if whiten:
        advantages = whiten_advantages(advantages, response_mask)
    return advantages, returns
