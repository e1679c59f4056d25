"""The run's sample of training episodes (``monitoring.episode_sample``): decoded turn by turn with the project's
tokenizer (the committed warm start's), at most ``per_step`` a step spread over groups, one atomic file a step,
never an exception into the training loop; and the buffer's ``latest_batch`` that hands it the learner's batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from async_agent_rl.config import BufferConfig
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from buffer.actor import BufferActor
from monitoring.episode_sample import EpisodeSample, episode_record, spread, step_file
from tests.helpers import LONGEST, traj

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "data" / "learns_warm_start"

PROMPT = "Answer the question. Question: where was ada lovelace born?\n"
SEARCH = "<think>i should look it up</think><search>ada lovelace birthplace</search>"
INFO = "\n\n<information>Doc 1(Title: Ada Lovelace) Ada Lovelace was born in London.</information>\n\n"
ANSWER = "<answer>london</answer>"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def episode(tok, gid: str = "g0", member: int = 0, reward: float = 1.0, switch_at: int = 3) -> Trajectory:
    """prompt | model (search, a weight update after ``switch_at`` tokens) | information | model (answer)."""
    p = tok.encode(PROMPT, add_special_tokens=False)
    s, i, a = (tok.encode(x, add_special_tokens=False) for x in (SEARCH, INFO, ANSWER))
    response = s + i + a
    versions = [2] * switch_at + [3] * (len(s) - switch_at) + [-1] * len(i) + [3] * len(a)
    turns = [TurnSpan("model", 0, len(s)), TurnSpan("observation", len(s), len(s) + len(i)),
             TurnSpan("model", len(s) + len(i), len(response))]
    return Trajectory(
        prompt_ids=p, response_ids=response, loss_mask=[1] * len(s) + [0] * len(i) + [1] * len(a),
        behavior_logprobs=[-0.5] * len(response), versions=versions, turns=turns, reward=reward,
        reward_components={"exact_match": reward},
        meta=EpisodeMeta(data_source="world_single", question_id="q7", group_id=gid, gold_answers=["london"],
                         num_searches=1, num_turns=2, trajectory_id=f"{gid}/{member}", actor_id="actor0"),
    ).validate()


def test_an_episode_is_kept_turn_by_turn_with_its_kinds_and_token_versions(tok):
    rec = episode_record(episode(tok), tok, step=12)
    kinds = [t["kind"] for t in rec["turns"]]
    assert kinds == ["prompt", "model", "search", "information", "model", "answer"]
    prompt, search_turn, query, info, answer_turn, answer = rec["turns"]
    assert "where was ada lovelace born" in prompt["text"] and prompt["loss"] is False
    assert rec["question"] == "where was ada lovelace born?"
    assert query["text"] == "ada lovelace birthplace" and answer["text"] == "london"
    assert "Ada Lovelace was born in London" in info["text"] and info["loss"] is False
    # the weight update inside the first model turn: two runs, versions 2 then 3, covering the turn's tokens
    runs = search_turn["runs"]
    assert [r["version"] for r in runs] == [2, 3] and [r["tokens"] for r in runs] == [3, search_turn["tokens"] - 3]
    assert "".join(r["text"] for r in runs) == search_turn["text"]
    assert [r["version"] for r in answer_turn["runs"]] == [3]
    assert (rec["step"], rec["kind"], rec["reward"], rec["exact_match"]) == (12, "world_single", 1.0, 1.0)
    assert (rec["min_version"], rec["max_version"], rec["gold"]) == (2, 3, ["london"])
    assert rec["generated_tokens"] == search_turn["tokens"] + answer_turn["tokens"]
    json.dumps(rec)  # plain JSON


def test_at_most_per_step_episodes_a_step_spread_over_groups_in_one_file(tok, tmp_path):
    sample = EpisodeSample(tmp_path, tok, per_step=4)
    batch = [episode(tok, f"g{g}", m, reward=float(m == 0)) for g in range(3) for m in range(4)]
    assert sample.record(7, batch) == 4
    lines = step_file(tmp_path, 7).read_text().splitlines()
    got = [json.loads(x)["trajectory_id"] for x in lines]
    assert got == ["g0/0", "g1/0", "g2/0", "g0/1"]  # every group first, then second members
    # the same step again (a resumed run redoing it) replaces the file; wire bytes are taken as well
    assert sample.record(7, [batch[5].encode()]) == 1
    assert [json.loads(x)["trajectory_id"] for x in step_file(tmp_path, 7).read_text().splitlines()] == ["g1/1"]
    assert sorted(p.name for p in (tmp_path / "episodes").iterdir()) == ["step_000007.jsonl"]  # no temp file left
    assert sample.recorded == 5 and sample.failures == sample.skipped == 0


def test_bad_input_is_counted_never_raised(tok, tmp_path):
    sample = EpisodeSample(tmp_path, tok, per_step=2)
    assert sample.record(1, [b"not a record", episode(tok)]) == 1  # the malformed one skipped
    assert sample.skipped == 1
    assert sample.record(2, 42) == 0 and sample.failures == 1  # neither a list nor an object reference
    assert sample.record(3, []) == 0 and not step_file(tmp_path, 3).exists()
    blocked = EpisodeSample(tmp_path / "file", tok)
    (tmp_path / "file").write_text("a file where the run folder should be")
    assert blocked.record(4, [episode(tok)]) == 0 and blocked.failures == 1
    with pytest.raises(ValueError, match="per_step must be at least 1"):
        EpisodeSample(tmp_path, tok, per_step=0)


def test_a_tokenizer_folder_is_loaded_at_the_first_record(tmp_path):
    sample = EpisodeSample(tmp_path, str(TOKENIZER), per_step=1)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    assert sample.record(1, [episode(tok)]) == 1
    assert json.loads(step_file(tmp_path, 1).read_text())["turns"][5]["text"] == "london"


def test_spread_takes_each_groups_members_in_turn():
    items = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)]
    assert spread(items, 4, lambda x: x[0]) == [("a", 0), ("b", 0), ("c", 0), ("a", 1)]
    assert spread(items, 10, lambda x: x[0]) == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]
    assert spread([], 3, lambda x: x) == []


def test_the_buffer_hands_out_a_few_of_the_batch_it_gave_the_learner():
    b = BufferActor(BufferConfig(max_staleness=4), group_size=2, consumed_per_version=4, max_concurrent=64,
                    batch_size=4, max_trajectory_tokens=LONGEST)
    assert b.latest_batch(3) == []  # no batch yet
    for g in ("g1", "g2", "g3"):
        b.try_start(2, 0, g, "actor0")
        b.push_many([traj(g, 0, reward=1.0, em=1.0), traj(g, 1)])
    blobs = b.sample(4, 0)
    trained = [Trajectory.decode(x).meta.trajectory_id for x in blobs]
    picked = [Trajectory.decode(x).meta.trajectory_id for x in b.latest_batch(3)]
    assert len(picked) == 3 and set(picked) <= set(trained)
    assert len({p.split("/")[0] for p in picked[:2]}) == 2  # both groups before a second member of either
    assert b.latest_batch(0) == [] and len(b.latest_batch(10)) == 4
