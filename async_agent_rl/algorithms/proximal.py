"""Where the proximal log-probs come from (``algorithm.proximal``; docs/ALGORITHMS.md section 3, "Proximal policy").

The decoupled loss needs ``log pi_prox`` of every sampled token under the proximal policy, the learner's weights at the
start of the step. ``recompute`` runs a no-grad forward pass over the batch for it; the others need none, always or
when it is exact:

- ``recompute``: the pass, every step;
- ``skip_fresh``: no pass for a batch whose loss tokens are all *fresh* (their version is the one the learner's
  weights were published as, ``Learner.proximal_version``: the engine sampled them with the very weights the pass
  would run): ``log pi_prox := log pi_behav``, exact up to the engine/trainer numerical mismatch; any other batch
  runs the pass;
- ``interpolate`` (AReaL's log-linear approximation): ``log pi_prox = log pi_behav + alpha (log pi_theta -
  log pi_behav)`` per token, ``alpha = (v_prox - v_behav) / (v_theta - v_behav)`` clamped to [0, 1], with
  ``log pi_theta`` the training forward's detached log-probs (``interpolated_proximal``, ``interpolation_alpha``);
- ``behavior`` (verl's bypass): ``log pi_prox := log pi_behav`` for every token; the behaviour weight is then 1 and
  the PPO clip of ``pi_theta / pi_behav`` is the only correction (``ppo_loss``).

Pure tensor functions; the learner decides and applies them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

PROXIMAL_MODES: tuple[str, ...] = ("recompute", "skip_fresh", "interpolate", "behavior")


def all_loss_tokens_fresh(loss_mask: Tensor, sampled_mask: Tensor, versions: Tensor,
                          proximal_version: Optional[int]) -> bool:
    """True when every loss position is a sampled token of version ``proximal_version`` (the exact skip). False when
    the learner's weights are no published version (``proximal_version`` None), or a loss position is an unmasked
    observation (never sampled: no behaviour log-prob to stand for the proximal one). A batch without a loss token is
    all fresh. Shapes: ``(B, T)`` each."""
    if proximal_version is None:
        return False
    loss = loss_mask.bool()
    fresh = sampled_mask.bool() & (versions == proximal_version)
    return bool((fresh | ~loss).all())


def interpolation_alpha(versions: Tensor, sampled_mask: Tensor, v_prox: float, v_theta: float) -> Tensor:
    """``alpha = (v_prox - v_behav) / (v_theta - v_behav)`` per sampled token, clamped to [0, 1]; 0 at positions not
    sampled and where ``v_theta <= v_behav``. ``versions`` ``(B, T)`` (``v_behav``, -1 where nothing was sampled) ->
    ``(B, T)`` float. A fresh token (``v_behav == v_prox``) gets 0, so its proximal log-prob is its behaviour one, as
    ``skip_fresh`` sets it; a very stale one gets close to 1 (``pi_prox`` close to ``pi_theta``)."""
    if not v_theta > v_prox:
        raise ValueError(f"interpolation needs v_theta > v_prox, got v_theta={v_theta}, v_prox={v_prox}")
    v_behav = versions.to(torch.float64)
    gap = v_theta - v_behav
    ok = sampled_mask.bool() & (gap > 0)
    alpha = torch.where(ok, (v_prox - v_behav) / torch.where(ok, gap, torch.ones_like(gap)), torch.zeros_like(gap))
    return alpha.clamp(0.0, 1.0).to(torch.float32)


def interpolated_proximal(behavior_logprobs: Tensor, logprobs: Tensor, alpha: Tensor) -> Tensor:
    """AReaL's log-linear interpolation ``log pi_behav + alpha (log pi_theta - log pi_behav)``, detached (a constant
    of the loss like a recomputed proximal log-prob). ``logprobs``: the live log-probs (``log pi_theta``, detached
    here). Shapes: ``(B, T)`` each."""
    behavior = behavior_logprobs.detach()
    return (behavior + alpha * (logprobs.detach() - behavior)).detach()
