"""Search-R1's training-data format (parquet, one row per question), read and written unchanged.

Columns (docs/ALGORITHMS.md section 1)::

    data_source   str                      e.g. "nq", "hotpotqa", "world_single"
    prompt        list<{role, content}>    [{"role": "user", "content": <template with the question>}]
    ability       str                      "fact-reasoning"
    reward_model  {style, ground_truth: {target: list<str>}}
    extra_info    {split, index, ...}

Search-R1's own files also keep the source columns ``id``, ``question`` and ``golden_answers``; we write them too
and read them when present. ``extra_info.index`` restarts per data source, so it is not a unique id: the question id
is ``id`` when present, else ``{data_source}/{split}/{index}``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from async_agent_rl.errors import InputError
from async_agent_rl.prompts import render_question_prompt

log = logging.getLogger(__name__)

_QUESTION_IN_PROMPT = re.compile(r"Question:\s*(.*?)\s*$", re.DOTALL)


class DataFormatError(InputError):
    """A data file or row does not follow the expected format. The message names the file and row."""


@dataclass
class QAExample:
    id: str
    question: str
    gold_answers: list[str]
    data_source: str = ""
    split: str = ""
    index: int = 0
    prompt_messages: list[dict[str, str]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReadReport:
    rows: int = 0
    skipped: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("question", pa.string()),
        ("golden_answers", pa.list_(pa.string())),
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        (
            "reward_model",
            pa.struct([("style", pa.string()), ("ground_truth", pa.struct([("target", pa.list_(pa.string()))]))]),
        ),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("subject", pa.string()),
                    ("hops", pa.int64()),
                    ("relation", pa.string()),
                    ("bridge", pa.string()),
                ]
            ),
        ),
    ]
)


def write_qa_parquet(path: str | Path, examples: Iterable[QAExample], template: str = "search_r1") -> Path:
    rows = []
    for ex in examples:
        rows.append(
            {
                "id": ex.id,
                "question": ex.question,
                "golden_answers": list(ex.gold_answers),
                "data_source": ex.data_source,
                "prompt": [{"role": "user", "content": render_question_prompt(ex.question, template)}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": list(ex.gold_answers)}},
                "extra_info": {
                    "split": ex.split,
                    "index": ex.index,
                    "subject": ex.extra.get("subject", ""),
                    "hops": ex.extra.get("hops", 0),
                    "relation": ex.extra.get("relation", ""),
                    "bridge": ex.extra.get("bridge", ""),
                },
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=_SCHEMA), path)
    return path


def _row_to_example(row: dict[str, Any]) -> QAExample:
    prompt = row.get("prompt")
    if prompt is None or len(prompt) == 0:
        raise ValueError("missing 'prompt'")
    messages = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("'prompt' must be a list of {role, content} strings")
        messages.append({"role": m["role"], "content": m["content"]})
    rm = row.get("reward_model") or {}
    gt = (rm.get("ground_truth") or {}) if isinstance(rm, dict) else {}
    target = gt.get("target") if isinstance(gt, dict) else None
    if target is None:
        target = row.get("golden_answers")
    if isinstance(target, str):
        target = [target]
    if not target or not all(isinstance(t, str) for t in target):
        raise ValueError("missing gold answers (reward_model.ground_truth.target)")
    if not all(t.strip() for t in target):
        raise ValueError(f"empty gold answer in reward_model.ground_truth.target {list(target)!r}")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        user = [m["content"] for m in messages if m["role"] == "user"]
        found = _QUESTION_IN_PROMPT.search(user[-1]) if user else None
        if not found:
            raise ValueError("no 'question' column and no 'Question:' in the prompt")
        question = found.group(1)
    extra = dict(row.get("extra_info") or {})
    data_source = str(row.get("data_source") or "")
    split = str(extra.get("split") or "")
    index = int(extra.get("index") or 0)
    qid = row.get("id")
    qid = str(qid) if qid not in (None, "") else f"{data_source}/{split}/{index}"
    return QAExample(
        id=qid,
        question=question.strip(),
        gold_answers=list(target),
        data_source=data_source,
        split=split,
        index=index,
        prompt_messages=messages,
        extra={k: v for k, v in extra.items() if k not in ("split", "index")},
    )


def read_qa_parquet(
    path: str | Path, on_bad_row: str = "error", report: ReadReport | None = None
) -> list[QAExample]:
    """Read a Search-R1 parquet file. A bad row raises ``DataFormatError`` naming the file and row; with
    ``on_bad_row="skip"`` it is skipped, counted in ``report`` and logged."""
    path = Path(path)
    if path.is_dir():
        raise DataFormatError(f"{path}: a folder, not a parquet file")
    if not path.is_file():
        raise DataFormatError(f"{path}: file not found")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataFormatError(f"{path}: not a readable parquet file: {e}") from None
    if table.num_rows == 0:
        raise DataFormatError(f"{path}: no rows (an empty data file)")
    report = report if report is not None else ReadReport()
    out = []
    for i, row in enumerate(table.to_pylist()):
        report.rows += 1
        try:
            out.append(_row_to_example(row))
        except (ValueError, TypeError) as e:
            if on_bad_row != "skip":
                raise DataFormatError(f"{path}: row {i}: {e}") from None
            report.skipped += 1
            report.reasons[str(e)] = report.reasons.get(str(e), 0) + 1
            log.warning("skipping %s row %d: %s", path, i, e)
    if report.skipped:
        log.warning("%s: skipped %d of %d rows", path, report.skipped, report.rows)
    if not out:
        raise DataFormatError(f"{path}: every one of its {report.rows} rows is bad")
    return out


def read_qa_files(paths: Iterable[str | Path], on_bad_row: str = "error") -> tuple[list[QAExample], ReadReport]:
    report = ReadReport()
    out: list[QAExample] = []
    for p in paths:
        out.extend(read_qa_parquet(p, on_bad_row, report))
    return out, report
