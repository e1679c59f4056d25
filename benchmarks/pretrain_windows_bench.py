"""How many of pretraining's reading exercises can be answered from what a training row shows.

    python benchmarks/pretrain_windows_bench.py --config configs/quickstart.yaml
    python benchmarks/pretrain_windows_bench.py --config configs/quickstart.yaml --seq-lens 128,256 \
        --out benchmarks/results/pretrain_windows/        # also write the run's files there

The warm start's pretraining texts (``sft.pretrain_questions``: each group of fact-shuffled passages followed by
questions about them and their answers) are made for the config's world as ``run_sft`` makes them, tokenized with
its model's tokenizer. With ``sft.pretrain_packing: windows`` a row is a random ``seq_len``-token window of the
concatenated texts; this counts, over ``--windows`` seeded windows, the exercises whose answer lies in a window and,
of those, the share whose passage (the document the question is about) lies in the same window before the answer:
the others can only be guessed, and teach guessing. With ``packing: texts`` (one whole text per row) that share is
1 by construction; the text lengths are reported too. Nothing is trained: a minute or so on one core.

``--out DIR`` also writes DIR/result.json (the printed numbers), DIR/output.txt (what was printed) and DIR/run.json
(command, commit, versions): ``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import bisect
import random
import re
import statistics
import sys
from typing import Any

from transformers import AutoTokenizer

from async_agent_rl.config import load_config
from warm_start.exercises import encode_with_offsets, token_span
from warm_start.exercises import exercises as exercises_of
from warm_start.sft import PRETRAIN_SEQ_LEN, _pretrain_texts

if __package__:  # imported as benchmarks.pretrain_windows_bench
    from benchmarks import record
else:  # run as python benchmarks/pretrain_windows_bench.py: this folder is sys.path[0]
    import record

_DOC = re.compile(r'Doc \d+\(Title: "([^"]+)"\)[^\n<]*')


def exercises(tokenizer: Any, texts: list[str]) -> tuple[list[tuple[int, int, int, int]], int, list[int]]:
    """Every exercise as (answer start, answer end, passage start, passage end) in stream token positions, the
    stream's length, and each text's length in tokens."""
    items, pos, lengths = [], 0, []
    for t, (ids, offsets) in zip(texts, encode_with_offsets(tokenizer, texts)):
        n = len(ids)
        docs = [(m.start(), m.end(), m.group(1)) for m in _DOC.finditer(t)]
        for ex in exercises_of(t):
            doc = next((d for d in docs if d[2] in ex.question), None)
            if doc is None:
                continue
            a0, a1 = token_span(offsets, ex.answer_start, ex.answer_end)
            d0, d1 = token_span(offsets, doc[0], doc[1])
            items.append((pos + a0, pos + a1, pos + d0, pos + d1))
        pos += n
        lengths.append(n)
    return items, pos, lengths


def evidence_share(items: list[tuple[int, int, int, int]], total: int, seq_len: int, windows: int,
                   seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    items = sorted(items)
    starts = [it[0] for it in items]
    held = answerable = 0
    for _ in range(windows):
        s = rng.randrange(0, total - seq_len - 1)
        e = s + seq_len
        for a0, a1, d0, d1 in items[bisect.bisect_left(starts, s + 1) : bisect.bisect_right(starts, e)]:
            if a1 <= e:  # the answer is a target in this window
                held += 1
                answerable += d0 >= s and d1 <= a0
    return {"seq_len": seq_len, "exercises_per_window": held / windows,
            "share_with_their_passage": answerable / held if held else 0.0}


def bench(config: str, overrides: list[str], seq_lens: list[int], windows: int) -> dict[str, Any]:
    cfg = load_config(config, overrides)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    s = cfg.sft
    texts = _pretrain_texts(cfg.model_copy(update={"sft": s.model_copy(update={"pretrain_packing": "windows"})}),
                            s.pretrain_steps, s.batch_size, PRETRAIN_SEQ_LEN, tokenizer)
    items, total, lengths = exercises(tokenizer, texts)
    rows = [evidence_share(items, total, n, windows, s.seed) for n in seq_lens]
    out = {"world_dir": cfg.data.world_dir, "questions_per_doc": s.pretrain_questions_per_doc, "texts": len(texts),
           "exercises": len(items), "text_tokens_mean": statistics.mean(lengths), "text_tokens_max": max(lengths),
           "windows": rows}
    print(f"{len(texts)} pretraining texts ({statistics.mean(lengths):.0f} tokens on average, at most "
          f"{max(lengths)}), {len(items)} reading exercises")
    for r in rows:
        print(f"  windows of {r['seq_len']} tokens: {r['exercises_per_window']:.2f} exercise answers per window, "
              f"{r['share_with_their_passage']:.2f} of them with their passage in the window")
    print("  whole texts (sft.pretrain_packing: texts): 1.00 with their passage, by construction")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--seq-lens", default=str(PRETRAIN_SEQ_LEN), help="comma-separated window lengths")
    p.add_argument("--windows", type=int, default=5000)
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    record.add_out_argument(p)
    a = p.parse_args(argv)
    try:
        seq_lens = [int(x) for x in a.seq_lens.split(",")]
    except ValueError:
        print(f"error: --seq-lens must be comma-separated integers, got {a.seq_lens!r}", file=sys.stderr)
        return 2
    if a.windows < 1 or min(seq_lens) < 2:
        print("error: --windows must be at least 1 and every --seq-lens at least 2", file=sys.stderr)
        return 2
    with record.Recording(a.out, __file__, argv, vars(a)) as rec:
        rec.result = bench(a.config, a.overrides, seq_lens, a.windows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
