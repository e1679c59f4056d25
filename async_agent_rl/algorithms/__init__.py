"""RL algorithms as pure tensor functions, registered by the names ``AlgorithmConfig`` uses.

No Ray, no DeepSpeed, no I/O: the learner calls these on ``(B, T)`` tensors over response token positions, with
``response_mask`` 1 on model-generated (action) tokens only (docs/ALGORITHMS.md sections 2 and 3).

=========================  ==================================================  =====================================
registry                   names                                                config field
=========================  ==================================================  =====================================
ADVANTAGE_ESTIMATORS       grpo, grpo_no_std, rloo, reinforce_pp, gae          algorithm.advantage_estimator
STEPWISE_MODES             none, broadcast, per_step                           algorithm.stepwise_advantage
POLICY_LOSSES              ppo, decoupled_ppo                                  algorithm.policy_loss
BEHAVIOR_WEIGHT_MODES      truncate, mask                                      algorithm.behavior_weight_mode
BEHAVIOR_WEIGHT_LEVELS     token, sequence, turn                               algorithm.behavior_weight_level
LOSS_AGGREGATORS           token-mean, seq-mean-token-sum, seq-mean-token-     algorithm.loss_agg_mode
                           mean, seq-mean-token-sum-norm
KL_ESTIMATORS              k1, abs, k2, k3                                     algorithm.kl_estimator
PROXIMAL_MODES             recompute, skip_fresh, interpolate, behavior        algorithm.proximal
=========================  ==================================================  =====================================

``proximal``: the proximal log-probs without a forward pass (the exact skip of an all-fresh batch, AReaL's
log-linear interpolation, the behavior policy as proximal). ``mismatch.mismatch_metrics``: the engine/trainer
mismatch of fresh tokens apart from the stale ones' (the learner logs it every step with a proximal pass). Each
``get_*(name)`` raises ``UnknownAlgorithmError`` (a ``ValueError``) listing the allowed names.
"""

from async_agent_rl.algorithms._registry import UnknownAlgorithmError
from async_agent_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_NORMALIZERS,
    STEPWISE_MODES,
    compute_advantages,
    gae_advantages,
    get_advantage_estimator,
    get_stepwise_mode,
    grpo_advantages,
    grpo_no_std_advantages,
    grpo_no_std_scores,
    grpo_scores,
    place_outcome_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    rloo_scores,
    sequence_scores,
    stepwise_broadcast,
    stepwise_none,
    stepwise_per_step,
    turn_index_from_mask,
    whiten_advantages,
)
from async_agent_rl.algorithms.kl import KL_ESTIMATORS, get_kl_estimator, kl_abs, kl_k1, kl_k2, kl_k3, kl_penalty
from async_agent_rl.algorithms.losses import (
    BEHAVIOR_WEIGHT_LEVELS,
    BEHAVIOR_WEIGHT_MODES,
    LOSS_AGGREGATORS,
    POLICY_LOSSES,
    agg_loss,
    behavior_correction,
    behavior_weight,
    behavior_weight_metrics,
    clipped_value_loss,
    decoupled_ppo_loss,
    entropy_from_logits,
    get_behavior_weight_mode,
    get_policy_loss,
    level_log_weight,
    mask_behavior_weight,
    ppo_clip_per_token,
    ppo_loss,
    truncate_behavior_weight,
)
from async_agent_rl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from async_agent_rl.algorithms.mismatch import MISMATCH_METRICS, mismatch_metrics
from async_agent_rl.algorithms.proximal import (
    PROXIMAL_MODES,
    all_loss_tokens_fresh,
    interpolated_proximal,
    interpolation_alpha,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BEHAVIOR_WEIGHT_LEVELS",
    "BEHAVIOR_WEIGHT_MODES",
    "GROUP_NORMALIZERS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATORS",
    "MISMATCH_METRICS",
    "POLICY_LOSSES",
    "PROXIMAL_MODES",
    "STEPWISE_MODES",
    "UnknownAlgorithmError",
    "agg_loss",
    "all_loss_tokens_fresh",
    "behavior_correction",
    "behavior_weight",
    "behavior_weight_metrics",
    "clipped_value_loss",
    "compute_advantages",
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "gae_advantages",
    "get_advantage_estimator",
    "get_behavior_weight_mode",
    "get_kl_estimator",
    "get_policy_loss",
    "get_stepwise_mode",
    "grpo_advantages",
    "grpo_no_std_advantages",
    "grpo_no_std_scores",
    "grpo_scores",
    "interpolated_proximal",
    "interpolation_alpha",
    "kl_abs",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "level_log_weight",
    "mask_behavior_weight",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "place_outcome_rewards",
    "ppo_clip_per_token",
    "ppo_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "rloo_scores",
    "sequence_scores",
    "stepwise_broadcast",
    "stepwise_none",
    "stepwise_per_step",
    "truncate_behavior_weight",
    "turn_index_from_mask",
    "whiten_advantages",
]
