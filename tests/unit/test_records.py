import msgpack
import pytest

from async_agent_rl.records import OBS_VERSION, SCHEMA_VERSION, EpisodeMeta, RecordError, Trajectory, TurnSpan

pytestmark = pytest.mark.unit


def make_traj() -> Trajectory:
    # prompt | model(3) | observation(2) | model(2)
    return Trajectory(
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 20, 21, 13, 14],
        loss_mask=[1, 1, 1, 0, 0, 1, 1],
        behavior_logprobs=[-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5],
        versions=[3, 3, 4, OBS_VERSION, OBS_VERSION, 4, 5],
        turns=[TurnSpan("model", 0, 3), TurnSpan("observation", 3, 5), TurnSpan("model", 5, 7)],
        reward=1.0,
        reward_components={"exact_match": 1.0},
        meta=EpisodeMeta(data_source="world_single", question_id="q1", group_id="g1", gold_answers=["Zolgon"],
                         num_searches=1, finish_reason="answer", trajectory_id="t1"),
    )


def test_round_trip_is_exact():
    t = make_traj()
    back = Trajectory.decode(t.encode())
    assert back.response_ids == t.response_ids and back.loss_mask == t.loss_mask
    assert back.versions == t.versions and back.turns == t.turns and back.meta == t.meta
    assert back.behavior_logprobs == pytest.approx(t.behavior_logprobs, abs=1e-7)
    assert back.reward_components == {"exact_match": 1.0}


def test_derived_views():
    t = make_traj()
    assert t.min_version == 3 and t.max_version == 5  # observation versions are ignored
    assert t.num_generated_tokens == 5
    assert t.full_loss_mask() == [0, 0, 0] + t.loss_mask


def test_json_round_trip():
    t = make_traj()
    assert Trajectory.from_json(t.to_json()).response_ids == t.response_ids


def _wire(**changes):
    d = make_traj().to_wire()
    d.update(changes)
    return msgpack.packb(d, use_bin_type=True)


def test_decode_rejects_unknown_schema_version():
    with pytest.raises(RecordError, match="schema version 99"):
        Trajectory.decode(_wire(schema=99))


def test_decode_rejects_length_mismatch():
    import numpy as np

    short = np.asarray([1, 1], dtype="u1").tobytes()
    with pytest.raises(RecordError, match="loss_mask has 2 entries, response_ids has 7"):
        Trajectory.decode(_wire(loss_mask=short))


def test_decode_rejects_ragged_bytes_and_garbage():
    with pytest.raises(RecordError, match="multiple of 4"):
        Trajectory.decode(_wire(versions=b"\x00\x01\x02"))
    with pytest.raises(RecordError):
        Trajectory.decode(b"\xc1 not msgpack")
    with pytest.raises(RecordError, match="missing field"):
        d = make_traj().to_wire()
        del d["versions"]
        Trajectory.decode(msgpack.packb(d))


def test_validate_checks_turn_spans_against_mask():
    t = make_traj()
    t.loss_mask[3] = 1  # an observation token marked as trainable
    with pytest.raises(RecordError, match="observation turn"):
        t.validate()
    t = make_traj()
    t.turns = [TurnSpan("model", 0, 3), TurnSpan("model", 5, 7)]
    with pytest.raises(RecordError, match="does not continue"):
        t.validate()


def test_schema_version_constant_is_written():
    assert msgpack.unpackb(make_traj().encode())["schema"] == SCHEMA_VERSION
