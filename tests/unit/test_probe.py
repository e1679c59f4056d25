"""The turn-by-turn probe (``warm_start.probe``): its scoring of each decision, and its sampled branch odds against
the model's own next-token probabilities."""

import pytest
import torch

from warm_start.probe import branch_probability, score_question

pytestmark = pytest.mark.unit

BRIDGE = {"hops": 2, "subject": "Aldo Venmar", "bridge": "Krelo", "relation": "birth_country"}
SINGLE = {"hops": 1, "subject": "Aldo Venmar", "relation": "birth_city"}


def test_a_thorough_bridge_episode_scores_every_decision_right():
    outs = ["<think> I need to search Aldo Venmar. </think>\n<search> Aldo Venmar </search>",
            "<think> Now I need to search Krelo. </think>\n<search> Krelo </search>",
            "<think> I found the answer. </think>\n<answer> Zandia </answer>"]
    assert score_question(outs, BRIDGE, ["Zandia"]) == {
        "t0_search": True, "t0_subject": True, "t1_search": True, "t1_bridge_query": True,
        "t1_answers_bridge": False, "t2_gold": True}


def test_stopping_after_one_hop_and_a_wrong_query_are_told_apart():
    outs = ["<search> Aldo </search>", "<answer> Krelo </answer>", "<answer> zandia </answer>"]
    r = score_question(outs, BRIDGE, ["Zandia"])
    assert r["t0_search"] and not r["t0_subject"]
    assert not r["t1_search"] and r["t1_answers_bridge"] and r["t2_gold"]  # gold compared without case
    r = score_question(["<answer> 1850 </answer>", "<answer> Krelo </answer>"], SINGLE, ["Krelo"])
    assert r == {"t0_search": False, "t0_subject": False, "t1_gold": True}


def test_branch_probability_is_the_models_probability_of_the_first_token_where_the_branches_part(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    ids = tok.encode("Question: where? ", add_special_tokens=False)
    take, other = "<think> I need to search x.", "<think> I know the answer."
    a, b = tok.encode(take, add_special_tokens=False), tok.encode(other, add_special_tokens=False)
    k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids + a[: k + 1]])).logits[0], dim=-1)
    want = float(torch.exp(sum(logp[len(ids) - 1 + i, a[i]] for i in range(k + 1))))
    got = branch_probability(model, tok, ids, take, other)
    assert got == pytest.approx(want, rel=1e-5) and 0.0 < got < 1.0
    # the two branches' odds sum to at most 1 (they part at one token)
    assert got + branch_probability(model, tok, ids, other, take) <= 1.0 + 1e-6


def test_answer_probability_is_the_models_probability_of_the_answer_after_the_answer_tag(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from warm_start.demos import ANSWER_TURN
    from warm_start.probe import answer_probability

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    ids = tok.encode("Question: when? ", add_special_tokens=False)
    head = tok.encode(ANSWER_TURN.split("{answer}")[0].rstrip(), add_special_tokens=False)
    full = tok.encode(ANSWER_TURN.format(answer="1982"), add_special_tokens=False)
    assert full[: len(head)] == head and len(full) > len(head) + 4  # " 1", "9", "8", "2", " </answer>" at least
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids + full])).logits[0], dim=-1)
    n = len(ids) + len(head)
    want = float(torch.exp(sum(logp[n - 1 + i, full[len(head) + i]] for i in range(len(full) - len(head)))))
    got = answer_probability(model, tok, ids, ["1982"], ANSWER_TURN)
    assert got == pytest.approx(want, rel=1e-5) and 0.0 < got < 1.0
    # two different gold strings add up; the same one twice counts once
    other = answer_probability(model, tok, ids, ["1873"], ANSWER_TURN)
    assert answer_probability(model, tok, ids, ["1982", "1873", "1982"], ANSWER_TURN) == pytest.approx(got + other)
