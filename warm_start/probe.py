"""Turn-by-turn probe of a policy on held-out questions: what it does at each decision of a thorough episode.

Greedy evaluation says how often an agent is right, not where it goes wrong. The probe replays, for every held-out
question of the embedded world, the scripted expert's thorough episode (``warm_start.demos``: search the subject,
on a bridge question search the bridge entity next, then answer; real retrieval, the rollouts' own episode loop) and
asks the model, greedily, what it would emit at the start of each model turn given everything before it::

    t0   the first turn, after the prompt: does it search, and is the query the question's subject?
    t1   after the first observation. Single-hop: does it answer the gold answer (reading)? Bridge: does it search
         again, with the bridge entity as query (second query formed from the first passage), or answer the bridge
         entity (stopping after one hop)?
    t2   bridge only, after the second observation: does it answer the gold answer (reading the second passage)?

Each decision is scored on the expert's prefix, so a wrong earlier turn does not hide a later one. Numbers are
shares per question kind and per relation. Beside the greedy choices, ``P(t0 searches)`` and ``P(t1 searches
again)`` are the sampled policy's odds (temperature 1) of taking the search branch at those two turns: RL's groups
only carry a signal where both branches get sampled. ``P(sampled answer = gold)`` is the same odds for the value at
the reading turn (given the answer turn up to its ``<answer>`` tag), and ``P(a group of 4 differs)`` what it means
for RL: the chance that a group of four sampled answers there holds a right one and a wrong one. A warm start that reads well (t1 single, t2 bridge) but does not search
(t0) or stops after one hop (t1 bridge) is what RL should fix; one that reads badly leaves RL groups without a
reward to find. ``async-agent-rl probe --checkpoint DIR`` prints the table and writes the per-question outputs.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch

from async_agent_rl.config import Config

_TAG = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.S) for name in ("search", "answer")}
_STOP = re.compile(r"</search>|</answer>")

# per kind: (column, what it counts) in print order
COLUMNS = {
    "single": [("p_t0_search", "P(t0 searches)"), ("t0_search", "t0 searches"), ("t0_subject", "t0 query = subject"),
               ("t1_gold", "t1 answers gold"), ("p_gold", "P(sampled answer = gold)"),
               ("rl_signal", "P(a group of 4 differs)")],
    "bridge": [("p_t0_search", "P(t0 searches)"), ("t0_search", "t0 searches"), ("t0_subject", "t0 query = subject"),
               ("p_t1_search", "P(t1 searches again)"), ("t1_search", "t1 searches again"), ("t1_bridge_query", "t1 query = bridge"),
               ("t1_answers_bridge", "t1 answers the bridge"), ("t2_gold", "t2 answers gold"),
               ("p_gold", "P(sampled answer = gold)"), ("rl_signal", "P(a group of 4 differs)")],
}
GROUP = 4  # rollout.group_size of the quickstart: the rl_signal column's group


def tag(text: str, name: str) -> str | None:
    m = _TAG[name].search(text)
    return m.group(1).strip() if m else None


def greedy_turn(model: Any, tokenizer: Any, ids: Sequence[int], max_tokens: int) -> str:
    """The model's greedy turn after ``ids``, up to a stop string, EOS or ``max_tokens``."""
    out: list[int] = []
    past = None
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        for _ in range(max_tokens):
            o = model(input_ids=x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            t = int(o.logits[0, -1].argmax())
            if t == tokenizer.eos_token_id:
                break
            out.append(t)
            if _STOP.search(tokenizer.decode(out[-8:], skip_special_tokens=True)):
                break
            x = torch.tensor([[t]])
    return tokenizer.decode(out, skip_special_tokens=True)


def branch_probability(model: Any, tokenizer: Any, ids: Sequence[int], take: str, other: str) -> float:
    """The probability, sampling at temperature 1, that the turn after ``ids`` starts like ``take`` up to the first
    token where ``take`` and ``other`` part: the share of sampled turns that choose ``take``'s branch."""
    a = tokenizer.encode(take, add_special_tokens=False)
    b = tokenizer.encode(other, add_special_tokens=False)
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) - 1)
    x = torch.tensor([list(ids) + a[: k + 1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
    n = len(ids)
    return float(torch.exp(sum(logp[n - 1 + i, a[i]] for i in range(k + 1))))


def answer_probability(model: Any, tokenizer: Any, ids: Sequence[int], answers: Sequence[str], turn: str) -> float:
    """The probability, sampling at temperature 1, that the answer turn after ``ids`` (``turn``, an answer turn of
    the demonstrations with its ``{answer}`` slot) answers one of ``answers`` exactly, given that it is that turn up
    to its ``<answer>`` tag: whether the policy reads the value, apart from whether it chooses to answer."""
    head = turn.split("{answer}")[0].rstrip()  # up to and including the <answer> tag
    pre = tokenizer.encode(head, add_special_tokens=False)
    total = 0.0
    for answer in dict.fromkeys(answers):
        full = tokenizer.encode(turn.format(answer=answer), add_special_tokens=False)
        if full[: len(pre)] != pre:  # the tag is an added token, so the answer's text cannot merge into it
            raise ValueError(f"{turn!r}: the tokens of its head are not a prefix of the turn's")
        x = torch.tensor([list(ids) + full])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        n = len(ids) + len(pre)
        total += float(torch.exp(sum(logp[n - 1 + i, full[len(pre) + i]] for i in range(len(full) - len(pre)))))
    return min(total, 1.0)


def score_question(outs: Sequence[str], extra: dict[str, Any], gold: Sequence[str]) -> dict[str, bool]:
    """The probe's columns for one question from the model's greedy turns ``outs`` (t0, t1[, t2])."""
    golds = {g.strip().lower() for g in gold}
    s0 = tag(outs[0], "search")
    r = {"t0_search": s0 is not None, "t0_subject": s0 == extra["subject"]}
    if extra["hops"] == 1:
        a1 = tag(outs[1], "answer")
        r["t1_gold"] = a1 is not None and a1.lower() in golds
        return r
    s1, a1 = tag(outs[1], "search"), tag(outs[1], "answer")
    a2 = tag(outs[2], "answer")
    r.update(t1_search=s1 is not None, t1_bridge_query=s1 == extra["bridge"], t1_answers_bridge=a1 == extra["bridge"],
             t2_gold=a2 is not None and a2.lower() in golds)
    return r


def probe(cfg: Config, model_dir: str | Path, limit: int = 0, threads: int = 1) -> dict[str, Any]:
    """Probe the model in ``model_dir`` on ``cfg.data.test_files`` (the first ``limit`` questions when > 0).
    Returns ``{"kinds": {kind: {column: share, "n": n}}, "relations": {...}, "questions": [...], "skipped": {...}}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_agent_rl.data.corpus import read_corpus
    from async_agent_rl.data.search_r1 import read_qa_files
    from retriever.backends import open_backend
    from warm_start.demos import ANSWER_TURN, BRIDGE_TURN, GUESS_TURN, SEARCH_TURN, THOROUGH, DemoError, DemoExpert

    torch.set_num_threads(max(1, threads))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    examples, _ = read_qa_files(cfg.data.test_files, cfg.data.on_bad_row)
    examples = [ex for ex in examples if ex.extra.get("hops") in (1, 2)]
    if limit > 0:
        examples = examples[:limit]
    r = cfg.retriever
    backend = open_backend(r.backend, read_corpus(cfg.data.corpus_file), r.index_dir, r.dense_model, r.faiss_index,
                           r.query_prefix, r.passage_prefix)
    expert = DemoExpert(cfg, tokenizer, backend)
    expert.prefetch(examples)
    counts: dict[str, Counter] = defaultdict(Counter)
    skipped: Counter = Counter()
    questions = []
    for ex in examples:
        try:  # the expert's episode of a held-out question; never trained on, only used as the prefix
            traj = expert.demonstrate(dataclasses.replace(ex, split="probe"), behaviour=THOROUGH)
        except DemoError as e:
            skipped[e.reason] += 1
            continue
        spans = [s for s in traj.turns if s.kind == "model"]
        outs = [greedy_turn(model, tokenizer, list(traj.prompt_ids) + list(traj.response_ids[: s.start]),
                            cfg.rollout.max_tokens_per_turn) for s in spans]
        scores: dict[str, Any] = score_question(outs, ex.extra, ex.gold_answers)
        # the sampled policy's odds at the two choices RL is meant to make: search at all, search a second time
        before = [list(traj.prompt_ids) + list(traj.response_ids[: s.start]) for s in spans]
        scores["p_t0_search"] = branch_probability(model, tokenizer, before[0], SEARCH_TURN.format(query="x"),
                                                   GUESS_TURN.format(answer="x"))
        if ex.extra["hops"] == 2:
            scores["p_t1_search"] = branch_probability(model, tokenizer, before[1], BRIDGE_TURN.format(query="x"),
                                                       ANSWER_TURN.format(answer="x"))
        # the sampled policy's odds of answering right where it reads (t1 single-hop, t2 bridge), and so of a group
        # of GROUP samples there holding both a right and a wrong answer: the only groups that carry a gradient
        scores["p_gold"] = p = answer_probability(model, tokenizer, before[-1], ex.gold_answers, ANSWER_TURN)
        scores["rl_signal"] = 1.0 - p**GROUP - (1.0 - p) ** GROUP
        kind = "single" if ex.extra["hops"] == 1 else "bridge"
        for key in (kind, f"{kind}/{ex.extra.get('relation', '?')}"):
            counts[key]["n"] += 1
            counts[key].update({k: float(v) for k, v in scores.items()})
        questions.append({"id": ex.id, "question": ex.question, "gold": ex.gold_answers, "kind": kind,
                          "relation": ex.extra.get("relation"), "turns": outs, **scores})
    shares = {key: {"n": c["n"], **{k: c[k] / c["n"] for k, _ in COLUMNS[key.split("/")[0]]}}
              for key, c in counts.items() if c["n"]}
    return {"model": str(model_dir), "kinds": {k: v for k, v in shares.items() if "/" not in k},
            "relations": {k: v for k, v in sorted(shares.items()) if "/" in k}, "skipped": dict(skipped),
            "questions": questions}


def probe_table(result: dict[str, Any]) -> str:
    """Markdown tables, one per kind: a line for the kind and one per relation."""
    lines = []
    for kind, cols in COLUMNS.items():
        if kind not in result["kinds"]:
            continue
        lines += ["| " + " | ".join([kind, "n", *(c[1] for c in cols)]) + " |", "|" + "---|" * (len(cols) + 2)]
        rows = [(f"**all {kind}**", result["kinds"][kind])]
        rows += [(k.split("/", 1)[1], v) for k, v in result["relations"].items() if k.startswith(kind + "/")]
        for name, v in rows:
            lines.append("| " + " | ".join([name, str(v["n"]), *(f"{v[c]:.2f}" for c, _ in cols)]) + " |")
        lines.append("")
    return "\n".join(lines)


def write_probe(result: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({k: v for k, v in result.items() if k != "questions"}, indent=1) + "\n")
    with (out / "probe_questions.jsonl").open("w") as f:
        for q in result["questions"]:
            f.write(json.dumps(q) + "\n")
    (out / "probe.md").write_text(f"# probe of {result['model']}\n\n" + probe_table(result))
    return out / "probe.md"
