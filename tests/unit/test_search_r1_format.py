import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from async_agent_rl.data.search_r1 import DataFormatError, QAExample, ReadReport, read_qa_parquet, write_qa_parquet
from async_agent_rl.prompts import SEARCH_R1_TEMPLATE, render_question_prompt

pytestmark = pytest.mark.unit


def search_r1_row(i, question, answers, source="nq"):
    """A row exactly as Search-R1's data_process/nq_search.py writes it (source columns kept)."""
    return {
        "id": f"train_{i}",
        "question": question,
        "golden_answers": answers,
        "data_source": source,
        "prompt": [{"role": "user", "content": SEARCH_R1_TEMPLATE.format(question=question + "?")}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": "train", "index": i},
    }


def test_reads_search_r1_parquet_unchanged(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([search_r1_row(0, "who wrote hamlet", ["Shakespeare"]),
                                         search_r1_row(1, "capital of france", ["Paris", "paris, france"])]), path)
    rows = read_qa_parquet(path)
    assert [r.gold_answers for r in rows] == [["Shakespeare"], ["Paris", "paris, france"]]
    assert rows[0].id == "train_0" and rows[0].data_source == "nq" and rows[0].question == "who wrote hamlet"


def test_question_recovered_from_prompt_when_column_absent(tmp_path):
    row = search_r1_row(3, "who wrote hamlet", ["Shakespeare"])
    for k in ("id", "question", "golden_answers"):
        row.pop(k)
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    (r,) = read_qa_parquet(path)
    assert r.question == "who wrote hamlet?" and r.id == "nq/train/3"


def test_bad_row_error_names_file_and_row(tmp_path):
    good = search_r1_row(0, "q one", ["a"])
    bad = search_r1_row(1, "q two", ["a"])
    bad["reward_model"] = {"style": "rule", "ground_truth": {"target": []}}
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([good, bad]), path)
    with pytest.raises(DataFormatError, match=r"bad\.parquet: row 1: missing gold answers"):
        read_qa_parquet(path)
    report = ReadReport()
    rows = read_qa_parquet(path, on_bad_row="skip", report=report)
    assert len(rows) == 1 and report.skipped == 1 and report.rows == 2


def test_not_parquet(tmp_path):
    p = tmp_path / "x.parquet"
    p.write_text("hello")
    with pytest.raises(DataFormatError, match="not a readable parquet"):
        read_qa_parquet(p)


def test_write_then_read_round_trip(tmp_path):
    ex = [QAExample(id="a", question="Who founded X", gold_answers=["Y"], data_source="world_single", split="train")]
    rows = read_qa_parquet(write_qa_parquet(tmp_path / "w.parquet", ex))
    assert rows[0].gold_answers == ["Y"] and rows[0].question == "Who founded X"
    assert rows[0].prompt_messages[0]["content"] == render_question_prompt("Who founded X")


def test_template_matches_search_r1_wording():
    p = render_question_prompt("who wrote hamlet")
    assert p.startswith("Answer the given question. You must conduct reasoning inside <think> and </think> first")
    assert "For example, <answer> Beijing </answer>." in p and p.endswith("Question: who wrote hamlet?\n")
