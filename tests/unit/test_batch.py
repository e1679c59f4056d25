"""Packing trajectories into a TrainBatch (async_agent_rl.batch), checked against hand-written tensors."""

from __future__ import annotations

import pytest
import torch

from async_agent_rl.batch import TrainBatch, pack_batch
from async_agent_rl.records import OBS_VERSION, EpisodeMeta, Trajectory, TurnSpan, peek
from async_agent_rl.staleness import staleness

pytestmark = pytest.mark.unit

PAD = 0


def two_turn(group_id: str = "g0", reward: float = 1.0) -> Trajectory:
    """prompt [11, 12] | model [21, 22] | observation [31] | model [23]; versions 4, 4, -, 5."""
    return Trajectory(
        prompt_ids=[11, 12],
        response_ids=[21, 22, 31, 23],
        loss_mask=[1, 1, 0, 1],
        behavior_logprobs=[-0.5, -0.25, 0.0, -1.5],
        versions=[4, 4, -1, 5],
        turns=[TurnSpan("model", 0, 2), TurnSpan("observation", 2, 3), TurnSpan("model", 3, 4)],
        reward=reward,
        meta=EpisodeMeta(group_id=group_id, trajectory_id=f"{group_id}-two"),
    )


def one_turn(group_id: str = "g1", reward: float = 0.0) -> Trajectory:
    """prompt [7, 8, 9] | model [41]; version 2."""
    return Trajectory(
        prompt_ids=[7, 8, 9],
        response_ids=[41],
        loss_mask=[1],
        behavior_logprobs=[-2.0],
        versions=[2],
        turns=[TurnSpan("model", 0, 1)],
        reward=reward,
        meta=EpisodeMeta(group_id=group_id, trajectory_id=f"{group_id}-one"),
    )


def test_pack_two_rows_by_hand():
    b = pack_batch([two_turn(), one_turn()], pad_id=PAD)
    assert b.input_ids.tolist() == [[11, 12, 21, 22, 31, 23], [7, 8, 9, 41, PAD, PAD]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    # loss only on generated tokens: not on the prompt, the observation (31) or padding
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 0, 0, 1, 0, 0]]
    # position t holds the log-prob of token t
    assert b.behavior_logprobs.tolist() == [[0, 0, -0.5, -0.25, 0, -1.5], [0, 0, 0, -2.0, 0, 0]]
    assert b.versions.tolist() == [[-1, -1, 4, 4, -1, 5], [-1, -1, -1, 2, -1, -1]]
    assert b.turn_index.tolist() == [[-1, -1, 0, 0, -1, 1], [-1, -1, -1, 0, -1, -1]]
    assert b.prompt_lengths.tolist() == [2, 3]
    assert b.rewards.tolist() == [1.0, 0.0]
    assert b.group_index.tolist() == [0, 1]
    assert b.seq_lengths.tolist() == [6, 4]
    assert [m.trajectory_id for m in b.metas] == ["g0-two", "g1-one"]
    assert (b.input_ids.dtype, b.attention_mask.dtype, b.loss_mask.dtype) == (torch.long, torch.long, torch.float32)
    assert (b.behavior_logprobs.dtype, b.versions.dtype, b.turn_index.dtype) == (torch.float32, torch.long, torch.long)
    assert (b.prompt_lengths.dtype, b.rewards.dtype, b.group_index.dtype) == (torch.long, torch.float32, torch.long)


def test_summary_by_hand():
    two = two_turn()
    two.meta.num_searches, two.meta.num_turns = 1, 2
    one = one_turn()
    one.meta.num_turns, one.meta.finish_reason, one.meta.num_search_errors = 1, "max_turns", 2
    s = pack_batch([two, one], pad_id=PAD).summary()
    assert s == {"response_length": 2.5, "generated_tokens": 2.0, "searches": 0.5, "search_errors": 1.0,
                 "turns": 1.5, "answered": 0.5, "reward": 0.5}


def test_group_index_is_consecutive_per_group_id_and_empty_ids_stand_alone():
    trajs = [two_turn("q7"), one_turn("q3"), two_turn("q7"), one_turn(""), one_turn(""), one_turn("q3")]
    assert pack_batch(trajs, PAD).group_index.tolist() == [0, 1, 0, 2, 3, 1]


def test_pad_to_multiple_and_pad_id():
    b = pack_batch([one_turn()], pad_id=99, pad_to_multiple_of=8)
    assert b.input_ids.shape == (1, 8)
    assert b.input_ids[0].tolist() == [7, 8, 9, 41] + [99] * 4
    with pytest.raises(ValueError):
        pack_batch([], PAD)


def test_wire_round_trip_packs_the_same():
    trajs = [two_turn(), one_turn()]
    direct = pack_batch(trajs, PAD)
    wired = pack_batch([Trajectory.decode(t.encode()) for t in trajs], PAD)
    for name in ("input_ids", "loss_mask", "behavior_logprobs", "versions", "turn_index"):
        assert torch.equal(getattr(direct, name), getattr(wired, name))


def test_to_moves_every_field():
    b = pack_batch([two_turn("a"), one_turn("b"), one_turn("a")], PAD)
    moved = b.to("cpu")
    assert isinstance(moved, TrainBatch) and moved.input_ids.device.type == "cpu"
    assert torch.equal(moved.group_index, b.group_index) and [m.group_id for m in moved.metas] == ["a", "b", "a"]


def test_one_staleness_rule_for_the_record_the_buffer_index_and_the_learner_batch():
    """A trajectory's oldest generated version is the same from the record, from the buffer's index of its wire
    bytes and from the packed batch; one with no generated token has OBS_VERSION there and staleness 0 (the learner
    used to report a huge negative staleness for it)."""
    nothing = Trajectory(prompt_ids=[1, 2], response_ids=[31, 32], loss_mask=[0, 0], behavior_logprobs=[0.0, 0.0],
                         versions=[OBS_VERSION] * 2, turns=[TurnSpan("observation", 0, 2)],
                         meta=EpisodeMeta(group_id="g2"))
    trajs = [two_turn(), one_turn(), nothing]
    batch = pack_batch(trajs, PAD)
    assert batch.min_versions() == [t.min_version for t in trajs] == [peek(t.encode()).min_version for t in trajs]
    assert batch.min_versions() == [4, 2, OBS_VERSION]
    assert [staleness(6, v) for v in batch.min_versions()] == [2, 4, 0]
