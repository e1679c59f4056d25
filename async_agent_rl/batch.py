"""``TrainBatch``: the typed message from the replay buffer to the learner, and how trajectories are packed into it.

Each row is one trajectory as the model reads it, ``prompt_ids | response_ids``, right-padded to ``L`` (the longest
row, rounded up to ``pad_to_multiple_of``). Shapes and dtypes (``B`` rows):

=====================  ========  =======  =====================================================================
field                  shape     dtype    content
=====================  ========  =======  =====================================================================
``input_ids``          (B, L)    int64    prompt + response token ids, ``pad_id`` after the end
``attention_mask``     (B, L)    int64    1 on prompt and response tokens, 0 on padding
``loss_mask``          (B, L)    float32  1 on model-generated tokens; 0 on prompt, observation and padding
``behavior_logprobs``  (B, L)    float32  position ``t`` holds the sampling log-prob of token ``t`` (0 elsewhere)
``versions``           (B, L)    int64    policy version that generated token ``t``; -1 where not generated
``turn_index``         (B, L)    int64    index (0, 1, ...) of the model turn token ``t`` belongs to; -1 elsewhere
``prompt_lengths``     (B,)      int64    number of prompt tokens
``rewards``            (B,)      float32  scalar episode reward
``group_index``        (B,)      int64    0, 1, 2, ... per distinct ``meta.group_id`` in order of first appearance;
                                          an empty group id makes a group of its own
=====================  ========  =======  =====================================================================

Log-prob alignment: a causal LM's logits at position ``t - 1`` predict token ``t``, so the learner shifts its own
log-probs by one to compare them with ``behavior_logprobs[:, t]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from async_agent_rl.records import OBS_VERSION, EpisodeMeta, Trajectory

_PER_TOKEN = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "versions", "turn_index")
_PER_ROW = ("prompt_lengths", "rewards", "group_index")


@dataclass
class TrainBatch:
    """A packed learner batch; see the module docstring for shapes. ``metas[i]`` describes row ``i``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    versions: torch.Tensor
    turn_index: torch.Tensor
    prompt_lengths: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    metas: list[EpisodeMeta]

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def real_rows(self) -> int:
        """Rows holding a trajectory (``len(metas)``); the rest are filler (``pack_batch``), always last."""
        return len(self.metas)

    @property
    def seq_lengths(self) -> torch.Tensor:
        """(B,) int64: prompt + response tokens of each row (padding excluded)."""
        return self.attention_mask.sum(dim=1)

    def min_versions(self) -> list[int]:
        """Per trajectory row (filler rows excluded), the oldest policy version among its generated tokens;
        ``OBS_VERSION`` for a row that generated nothing (what ``staleness.staleness`` measures from)."""
        never = torch.iinfo(torch.int64).max
        oldest = torch.where(self.versions != OBS_VERSION, self.versions, never).min(dim=1).values[: self.real_rows]
        return [OBS_VERSION if v == never else int(v) for v in oldest.tolist()]

    def summary(self) -> dict[str, float]:
        """What the batch's episodes looked like (means over rows): ``response_length`` (model + observation
        tokens), ``generated_tokens``, ``searches``, ``search_errors``, ``turns``, ``answered`` (fraction that
        ended with an answer) and ``reward``. Logged per step; the ablation report plots them."""
        n = max(1, self.real_rows)
        return {
            "response_length": float((self.seq_lengths - self.prompt_lengths)[: self.real_rows].float().mean()),
            "generated_tokens": float(self.loss_mask.sum()) / n,
            "searches": sum(m.num_searches for m in self.metas) / n,
            "search_errors": sum(m.num_search_errors for m in self.metas) / n,
            "turns": sum(m.num_turns for m in self.metas) / n,
            "answered": sum(m.finish_reason == "answer" for m in self.metas) / n,
            "reward": float(self.rewards[: self.real_rows].float().mean()),
        }

    def to(self, device: str | torch.device) -> "TrainBatch":
        moved = {name: getattr(self, name).to(device) for name in _PER_TOKEN + _PER_ROW}
        return dataclasses.replace(self, **moved)


def pack_batch(trajs: Sequence[Trajectory], pad_id: int, pad_to_multiple_of: int = 1,
               rows: int | None = None) -> TrainBatch:
    """Right-pad ``trajs`` into a ``TrainBatch`` (row ``i`` is ``trajs[i]``). With ``rows`` above ``len(trajs)``
    (a batch of whole groups some of which lost members), the missing rows are *filler*: ``pad_id`` over the
    shortest prompt's length, no response, no loss token, reward 0, a group of their own and no ``metas`` entry;
    they keep the learner's shapes fixed and change no gradient (``TrainBatch.real_rows`` counts the others)."""
    if not trajs:
        raise ValueError("pack_batch needs at least one trajectory")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    real = len(trajs)
    rows = real if rows is None else rows
    if rows < real:
        raise ValueError(f"pack_batch got {real} trajectories for {rows} rows")
    longest = max(t.total_length for t in trajs)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of

    input_ids = np.full((rows, width), pad_id, dtype=np.int64)
    attention_mask = np.zeros((rows, width), dtype=np.int64)
    loss_mask = np.zeros((rows, width), dtype=np.float32)
    behavior_logprobs = np.zeros((rows, width), dtype=np.float32)
    versions = np.full((rows, width), OBS_VERSION, dtype=np.int64)
    turn_index = np.full((rows, width), -1, dtype=np.int64)
    prompt_lengths = np.zeros(rows, dtype=np.int64)
    rewards = np.zeros(rows, dtype=np.float32)
    group_index = np.zeros(rows, dtype=np.int64)
    group_ids: dict[str, int] = {}

    for i, t in enumerate(trajs):
        p, total = len(t.prompt_ids), t.total_length
        generated = np.asarray(t.loss_mask, dtype=bool)
        input_ids[i, :p] = t.prompt_ids
        input_ids[i, p:total] = t.response_ids
        attention_mask[i, :total] = 1
        loss_mask[i, p:total] = generated
        behavior_logprobs[i, p:total] = np.where(generated, t.behavior_logprobs, 0.0)
        versions[i, p:total] = np.where(generated, t.versions, OBS_VERSION)
        model_turns = (span for span in t.turns if span.kind == "model")
        for k, span in enumerate(model_turns):
            turn_index[i, p + span.start : p + span.end] = k
        prompt_lengths[i] = p
        rewards[i] = t.reward
        key = t.meta.group_id or f"\0row{i}"  # an empty group id is a group of one
        group_index[i] = group_ids.setdefault(key, len(group_ids))
    filler_prompt = int(prompt_lengths[:real].min())
    for i in range(real, rows):
        attention_mask[i, :filler_prompt] = 1
        prompt_lengths[i] = filler_prompt
        group_index[i] = len(group_ids) + i - real

    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        loss_mask=torch.from_numpy(loss_mask),
        behavior_logprobs=torch.from_numpy(behavior_logprobs),
        versions=torch.from_numpy(versions),
        turn_index=torch.from_numpy(turn_index),
        prompt_lengths=torch.from_numpy(prompt_lengths),
        rewards=torch.from_numpy(rewards),
        group_index=torch.from_numpy(group_index),
        metas=[t.meta for t in trajs],
    )
