"""The supervised warm start: masked NLL (shift and masking), a real short SFT run, and the format it teaches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from async_agent_rl.batch import pack_batch
from async_agent_rl.config import load_config
from async_agent_rl.data.corpus import read_corpus
from async_agent_rl.data.search_r1 import read_qa_parquet
from async_agent_rl.prompts import prompt_ids, render_question_prompt
from warm_start.demos import make_demonstrations
from warm_start.sft import (
    METRICS_FILE,
    entity_token_ids,
    evaluate_nll,
    masked_nll,
    right_padded_nll,
    run_sft,
    shared_prefix_length,
    shared_prefix_nll,
)
from retriever.backends import BM25Backend
from tests.helpers import world_overrides

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(world_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    cfg = load_config(
        None,
        [
            *world_overrides(world_dir, tiny_model_dir),
            "rollout.max_tokens_per_turn=48",
            "rollout.max_response_length=384",
            "rollout.max_obs_length=160",
            "sft.batch_size=16",
            "sft.epochs=3",
            "sft.lr=3e-3",
            "sft.warmup_steps=5",
        ],
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    train = read_qa_parquet(world_dir / "train.parquet")
    backend = BM25Backend.build(read_corpus(world_dir / "corpus.jsonl"))
    fit, held = train[:400], train[400:700]  # disjoint questions: the held-out NLL is not memorization
    demos = make_demonstrations(cfg, tok, fit, backend, 192, seed=0)
    held_demos = make_demonstrations(cfg, tok, held, backend, 48, seed=0)
    return cfg, tok, train, demos, held_demos, backend


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_masked_nll_is_the_shifted_causal_lm_loss_on_model_tokens(setup, tiny_model_dir):
    """Same number as transformers' own shifted loss with labels -100 outside model turns."""
    _, tok, _, demos, _, _ = setup
    model = _model(tiny_model_dir).eval()
    b = pack_batch(demos[:6], tok.pad_token_id)
    with torch.no_grad():
        ours, n = masked_nll(model, b.input_ids, b.attention_mask, b.loss_mask)
        labels = torch.where(b.loss_mask > 0, b.input_ids, torch.full_like(b.input_ids, -100))
        ref = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=labels).loss
    assert n == int(b.loss_mask.sum()) == sum(d.num_generated_tokens for d in demos[:6])
    assert torch.allclose(ours, ref, atol=1e-5)


def test_observation_and_prompt_targets_do_not_change_the_loss(setup, tiny_model_dir):
    _, tok, _, demos, _, _ = setup
    model = _model(tiny_model_dir).eval()
    b = pack_batch(demos[:4], tok.pad_token_id)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        base, _ = masked_nll(model, b.input_ids, b.attention_mask, b.loss_mask)
        noise = torch.randint(0, len(tok), b.input_ids.shape, generator=g)
        off = b.loss_mask == 0  # prompt, observation and padding positions
        assert off[b.attention_mask > 0].any()
        masked_changed = torch.where(off, noise, b.input_ids)
        same, _ = masked_nll(model, b.input_ids, b.attention_mask, b.loss_mask, targets=masked_changed)
        one_model_token = b.input_ids.clone()
        r, c = (b.loss_mask > 0).nonzero()[0].tolist()
        one_model_token[r, c] = (one_model_token[r, c] + 1) % len(tok)
        moved, _ = masked_nll(model, b.input_ids, b.attention_mask, b.loss_mask, targets=one_model_token)
    assert torch.equal(same, base)
    assert not torch.allclose(moved, base)


def test_the_shared_prefix_loss_and_gradients_equal_each_row_computing_its_own(setup, tiny_model_dir):
    """The warm start's step runs the demonstrations' common template once; same loss and gradients as the plain
    right-padded batch (float reassociation only), over fewer tokens through the model."""
    _, tok, _, demos, _, _ = setup
    model = _model(tiny_model_dir)
    seen: list[int] = []
    model.base_model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    b = pack_batch(demos[:8], tok.pad_token_id)
    p = shared_prefix_length(b.input_ids, b.loss_mask)
    assert 8 <= p and torch.equal(b.input_ids[:, :p], b.input_ids[:1, :p].expand(8, -1))
    first_target = int((b.loss_mask > 0).any(0).nonzero()[0])
    assert p < first_target, (p, first_target)

    grads = []
    for fn in (right_padded_nll, shared_prefix_nll):
        model.zero_grad()
        seen.clear()
        loss, n = fn(model, b)
        loss.backward()
        grads.append((float(loss.detach()), n, [q.grad.clone() for q in model.parameters()], sum(seen)))
    (l1, n1, g1, t1), (l2, n2, g2, t2) = grads
    assert n1 == n2 == int(b.loss_mask[:, 1:].sum())
    assert abs(l1 - l2) < 1e-5
    for a, c in zip(g1, g2):
        assert torch.allclose(a, c, rtol=1e-4, atol=1e-6)
    assert t1 == b.input_ids.numel() and t2 == p + 8 * (b.input_ids.shape[1] - p)


def test_shared_prefix_length_stops_before_the_first_target_and_needs_common_tokens():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 14]])
    mask = torch.zeros_like(ids)
    assert shared_prefix_length(ids, mask) == 10  # the common tokens
    mask[1, 9] = 1  # token 9 is a target: the hidden state at 8 must be each row's own
    assert shared_prefix_length(ids, mask) == 8
    mask[0, 5] = 1
    assert shared_prefix_length(ids, mask) == 0  # 4 < MIN_SHARED_PREFIX: not worth a pass
    assert shared_prefix_length(ids[:1], torch.zeros_like(ids[:1])) == 0  # one row shares nothing
    ids[1, 0] = 99
    assert shared_prefix_length(ids, torch.zeros_like(ids)) == 0


def test_sft_lowers_held_out_nll_and_teaches_the_search_format(setup, tmp_path):
    cfg, tok, train, demos, held, backend = setup
    before = evaluate_nll(_model(cfg.model.path), held, tok.pad_token_id)
    summary = run_sft(cfg, cfg.model.path, tmp_path / "sft", demos=demos, pretrain_steps=10)
    assert summary["steps"] == 3 * 192 // 16 and summary["demos"] == 192 and summary["pretrain_steps"] == 10
    lines = [json.loads(x) for x in (tmp_path / "sft" / METRICS_FILE).read_text().splitlines()]
    assert [(m["stage"], m["step"]) for m in lines] == [("pretrain", i) for i in range(1, 11)] + [
        ("sft", i) for i in range(1, summary["steps"] + 1)
    ]

    tuned = _model(tmp_path / "sft").eval()  # what save_pretrained wrote, tokenizer included
    after = evaluate_nll(tuned, held, tok.pad_token_id)
    assert after < 0.45 * before, (before, after)  # measured: 7.6 -> 2.2
    assert summary["final_loss"] < 0.5 * summary["first_loss"]

    from transformers import AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(tmp_path / "sft")
    question = render_question_prompt(train[900].question, "minimal")
    ids = torch.tensor([prompt_ids(tok2, [{"role": "user", "content": question}], True)])
    with torch.no_grad():
        out = tuned.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    text = tok2.decode(out[0, ids.shape[1] :])
    assert text.startswith(("<think>", "<search>")), text


def test_sft_is_deterministic_and_keeps_entity_embeddings_frozen(setup, tmp_path):
    cfg, tok, _, demos, _, backend = setup
    short = cfg.model_copy(deep=True)
    short.sft.epochs = 1
    kw = dict(demos=demos[:32], pretrain_steps=0, freeze_entity_embeddings=True, log_every=0)
    a = run_sft(short, cfg.model.path, tmp_path / "a", **kw)
    b = run_sft(short, cfg.model.path, tmp_path / "b", **kw)
    la = (tmp_path / "a" / METRICS_FILE).read_text().splitlines()
    lb = (tmp_path / "b" / METRICS_FILE).read_text().splitlines()
    assert [json.loads(x)["loss"] for x in la] == [json.loads(x)["loss"] for x in lb]
    assert a["final_loss"] == b["final_loss"]
    wa, wb = _model(tmp_path / "a").state_dict(), _model(tmp_path / "b").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # names keep their embeddings (no memorizing which names were train subjects); other tokens learn
    frozen = entity_token_ids(tok, [p.title for p in backend.passages])
    assert a["frozen_rows"] == len(frozen) > 100
    before = _model(cfg.model.path).get_input_embeddings().weight
    after = _model(tmp_path / "a").get_input_embeddings().weight
    assert torch.equal(after[frozen], before[frozen])
    tag = tok.convert_tokens_to_ids("<search>")
    assert tag not in frozen and not torch.equal(after[tag], before[tag])


def test_weight_decay_pulls_the_layers_matrices_only(tiny_model_dir):
    """``warm_start_optimizer``: with no gradient at all, a step shrinks every layer matrix by lr x decay and moves
    no embedding row (a frozen row must stay put) and no norm."""
    from warm_start.sft import warm_start_optimizer

    model = _model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = warm_start_optimizer(model, lr=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = model.state_dict()
    matrices = [k for k in after if "layers." in k and after[k].dim() == 2]
    assert len(matrices) >= 10 and all(torch.allclose(after[k], before[k] * 0.95) for k in matrices)
    kept = [k for k in after if k not in matrices]
    assert any("embed" in k for k in kept) and any("norm" in k for k in kept)
    assert all(torch.equal(after[k], before[k]) for k in kept)
    # no decay: nothing moves without a gradient
    model.load_state_dict(before)
    warm_start_optimizer(model, lr=0.1).step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_sft_weight_decay_keeps_names_frozen_and_changes_the_layers(setup, tmp_path):
    cfg, tok, _, demos, _, backend = setup
    short = cfg.model_copy(deep=True)
    short.sft.epochs = 1
    kw = dict(demos=demos[:32], pretrain_steps=0, freeze_entity_embeddings=True, log_every=0)
    run_sft(short, cfg.model.path, tmp_path / "plain", **kw)
    short.sft.weight_decay = 1.0
    run_sft(short, cfg.model.path, tmp_path / "decay", **kw)
    frozen = entity_token_ids(tok, [p.title for p in backend.passages])
    before = _model(cfg.model.path).get_input_embeddings().weight
    plain, decay = _model(tmp_path / "plain"), _model(tmp_path / "decay")
    assert torch.equal(decay.get_input_embeddings().weight[frozen], before[frozen])
    key = "model.layers.0.mlp.up_proj.weight"
    assert decay.state_dict()[key].norm() < plain.state_dict()[key].norm()
    inputs = json.loads((tmp_path / "decay" / "warm_start_inputs.json").read_text())
    assert inputs["sft"]["weight_decay"] == 1.0  # a warm start of its own, not the plain one's folder
    assert "weight_decay" not in json.loads((tmp_path / "plain" / "warm_start_inputs.json").read_text())["sft"]


def test_with_every_embedding_frozen_only_the_layers_learn(setup, tmp_path):
    """``sft.frozen_embeddings: all``: the demonstrations stage keeps every embedding row (and the tied output
    head) as it was and still learns, in the layers."""
    cfg, tok, _, demos, _, _ = setup
    short = cfg.model_copy(deep=True)
    short.sft.epochs = 1
    short.sft.frozen_embeddings = "all"
    got = run_sft(short, cfg.model.path, tmp_path / "all", demos=demos[:32], pretrain_steps=0,
                  freeze_entity_embeddings=True, log_every=0)
    before, after = _model(cfg.model.path), _model(tmp_path / "all")
    rows = before.get_input_embeddings().weight.shape[0]
    assert got["frozen_rows"] == rows
    assert torch.equal(after.get_input_embeddings().weight, before.get_input_embeddings().weight)
    assert torch.equal(after.get_output_embeddings().weight, before.get_output_embeddings().weight)
    wb, wa = before.state_dict(), after.state_dict()
    moved = [k for k in wa if "layers." in k and not torch.equal(wa[k], wb[k])]
    assert len(moved) > 10, moved


def test_frozen_corpus_rows_are_every_passage_token_and_not_the_turns_own_words(setup, tiny_model_dir):
    """``sft.frozen_embeddings: corpus``: names, values (a year's digits, an occupation) and the passages' words are
    fixed; the tags and the words only the expert's turns use still train."""
    from warm_start.sft import frozen_token_ids

    cfg, tok, _, _, _, backend = setup
    corpus = cfg.model_copy(deep=True)
    corpus.sft.frozen_embeddings = "corpus"
    model = _model(tiny_model_dir)
    rows = set(frozen_token_ids(corpus, tok, model, [p.title for p in backend.passages]))
    names = set(entity_token_ids(tok, [p.title for p in backend.passages]))
    assert names < rows < set(range(model.get_input_embeddings().weight.shape[0]))
    passage = backend.passages[-1].contents
    assert set(tok.encode(passage, add_special_tokens=False)) <= rows
    for own in ("<search>", "<answer>", "<think>"):
        assert tok.convert_tokens_to_ids(own) not in rows


def test_the_warm_start_computes_the_same_weights_at_one_and_at_two_threads(setup, tmp_path):
    """``ThreadTuner`` picks torch's thread count from step times (a timing-dependent choice): it may change only
    how fast the warm start runs, never what it computes, or two machines (or two runs on one loaded machine) get
    different warm starts from one config. Both stages (pretraining and SFT), pinned at 1 and at 2 threads."""
    from warm_start.sft import ThreadTuner

    cfg, _, _, demos, _, _ = setup
    short = cfg.model_copy(deep=True)
    short.sft.epochs, short.sft.pretrain_questions = 1, True  # the shipped pretraining, reading exercises included
    kw = dict(demos=demos[:48], pretrain_steps=12, log_every=0, progress=False)
    before = torch.get_num_threads()
    one = run_sft(short, cfg.model.path, tmp_path / "t1", threads=ThreadTuner([1]), **kw)
    two = run_sft(short, cfg.model.path, tmp_path / "t2", threads=ThreadTuner([2]), **kw)
    assert torch.get_num_threads() == before  # restored
    assert one["threads"] != two["threads"], (one["threads"], two["threads"])  # really ran at 1 and at 2
    w1, w2 = _model(tmp_path / "t1").state_dict(), _model(tmp_path / "t2").state_dict()
    assert [k for k in w1 if not torch.equal(w1[k], w2[k])] == []


def test_pretraining_on_whole_texts_learns_and_reports_what_it_reads(setup, tmp_path, monkeypatch):
    """``sft.pretrain_packing: texts``: pretraining rows are whole observations (their exercises with them); the
    loss falls, the steps are those asked for, and the summary carries the per-relation reading check."""
    import warm_start.sft as sft

    rows_drawn = []
    real_rows = sft.pretrain_rows
    monkeypatch.setattr(sft, "pretrain_rows", lambda *a, **k: (rows_drawn.append(r) or r for r in real_rows(*a, **k)))
    cfg, _, _, demos, _, _ = setup
    texts = cfg.model_copy(deep=True)
    texts.sft.epochs = 1
    texts.sft.pretrain_packing = "texts"
    texts.sft.pretrain_questions = True
    s = run_sft(texts, cfg.model.path, tmp_path / "t", demos=demos[:16], pretrain_steps=30, log_every=0)
    assert len(rows_drawn) == 30 and all(len(r) == cfg.sft.batch_size for r in rows_drawn)  # whole texts as rows
    pre = [json.loads(x) for x in (tmp_path / "t" / METRICS_FILE).read_text().splitlines()]
    pre = [m["loss"] for m in pre if m["stage"] == "pretrain"]
    assert len(pre) == 30 and sum(pre[-5:]) / 5 < sum(pre[:5]) / 5
    reading = s["reading_after_pretraining"]
    assert {"birth_year", "occupation", "all"} <= set(reading) and all(0.0 <= v <= 1.0 for v in reading.values())


def test_the_answer_weight_changes_the_pretraining_loss_and_a_weight_of_1_is_the_plain_mean(setup):
    """One step from the same weights on the same rows: weighting the exercises' answers moves the loss (the
    answers are harder to predict than the average token early on), and a weight of 1 is the plain mean."""
    from warm_start.demos import shuffled_world_observations
    from warm_start.sft import pretrain_on_texts

    cfg, tok, *_ = setup
    texts = shuffled_world_observations(Path(cfg.data.world_dir) / "world.json", 1, 0, questions=True)
    first = {w: pretrain_on_texts(_model(cfg.model.path), tok, texts, 1, 8, 1e-3, 0, 0, packing="texts",
                                  answer_weight=w)[0] for w in (1.0, 4.0)}  # fmt: skip
    plain = pretrain_on_texts(_model(cfg.model.path), tok, texts, 1, 8, 1e-3, 0, 0, packing="texts")[0]
    assert first[1.0] == pytest.approx(plain, rel=1e-6) and abs(first[4.0] - first[1.0]) > 1e-3, first


def test_reading_rounds_check_each_relation_and_train_while_one_reads_below_the_target(setup, tmp_path, capsys):
    """``sft.reading_target``: after the demonstrations the warm start checks reading per relation on a shuffled
    copy, trains a round while a relation is below the target (a tiny warm start reads almost nothing, so every
    relation is), says each check in one line and keeps them in the summary."""
    cfg, _, _, demos, _, _ = setup
    c = cfg.model_copy(deep=True)
    c.sft.epochs = 1
    c.sft.reading_target, c.sft.reading_round_steps, c.sft.reading_max_rounds = 0.99, 3, 1
    s = run_sft(c, cfg.model.path, tmp_path / "r", demos=demos[:16], pretrain_steps=0, log_every=0)
    rounds = s["reading_rounds"]
    assert [r["round"] for r in rounds] == [0, 1] and [r["steps"] for r in rounds] == [3, 0]
    assert {"birth_year", "occupation", "country", "all"} <= set(rounds[0]["scores"]) and rounds[-1]["below"]
    lines = [json.loads(x) for x in (tmp_path / "r" / METRICS_FILE).read_text().splitlines()]
    assert [(m["stage"], m["step"]) for m in lines if m["stage"] == "reading"] == [("reading", k) for k in (1, 2, 3)]
    out = capsys.readouterr().out
    assert out.count("[sft] reads (episodes on a shuffled copy") == 2 and "rounds used up" in out
    assert "reading checked 2 times" in out
