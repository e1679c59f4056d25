import json

import pytest

from async_agent_rl.config import WorldConfig
from async_agent_rl.data.search_r1 import read_qa_parquet
from async_agent_rl.data.world import generate_world
from async_agent_rl.rewards import normalize_answer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def world():
    return generate_world(WorldConfig(seed=3))


def test_deterministic_for_a_seed():
    a, b = generate_world(WorldConfig(seed=5)), generate_world(WorldConfig(seed=5))
    assert [q.question for q in a.train] == [q.question for q in b.train]
    assert a.passages() == b.passages()
    assert [q.question for q in generate_world(WorldConfig(seed=6)).train] != [q.question for q in a.train]


def test_every_answer_is_stated_in_the_corpus_passage_that_holds_it(world):
    by_title = {e.name: f" {normalize_answer(p['contents'])} " for e, p in zip(world.entities.values(), world.passages())}
    for q in world.train + world.test:
        holder = q.bridge if q.hops == 2 else q.subject
        assert any(f" {normalize_answer(a)} " in by_title[holder] for a in q.answers), q


def test_questions_do_not_contain_their_answers(world):
    for q in world.train + world.test:
        qn = f" {normalize_answer(q.question)} "
        assert not any(f" {normalize_answer(a)} " in qn for a in q.answers), q


def test_train_and_test_subjects_are_disjoint(world):
    train_subjects = {q.subject for q in world.train}
    test_subjects = {q.subject for q in world.test}
    assert train_subjects and test_subjects and not (train_subjects & test_subjects)


def test_both_single_hop_and_bridge_questions(world):
    hops = [q.hops for q in world.train]
    share = hops.count(2) / len(hops)
    assert 0.15 < share < 0.45  # default two_hop_fraction 0.3
    assert all(q.bridge for q in world.train if q.hops == 2)


def test_sizes_follow_config():
    small = generate_world(WorldConfig(num_people=20, num_cities=8, num_companies=4, num_countries=2))
    kinds = [e.kind for e in small.entities.values()]
    assert kinds.count("person") == 20 and kinds.count("city") == 8


def test_cli_writes_search_r1_files(tmp_path):
    from driver.cli import main

    assert main(["data", "make-world", "--out", str(tmp_path), "--seed", "1", "data.world.num_people=30"]) == 0
    rows = read_qa_parquet(tmp_path / "train.parquet")
    assert rows and rows[0].prompt_messages[0]["role"] == "user"
    assert rows[0].prompt_messages[0]["content"].rstrip().endswith(rows[0].question)
    first = json.loads((tmp_path / "corpus.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "contents"} and first["contents"].startswith('"')


def test_a_larger_world_gets_longer_names_instead_of_failing():
    """600 people ran out of one-syllable first names (a RuntimeError before); every name stays unique and no name
    is a substring of another."""
    w = generate_world(WorldConfig(seed=11, num_countries=8, num_cities=40, num_people=600, num_companies=90))
    people = [e.name for e in w.entities.values() if e.kind == "person"]
    assert len(people) == len(set(people)) == 600
    words = {part.lower() for name in people for part in name.split()}
    assert not any(a != b and a in b for a in words for b in words)
