"""The tiny model folder loads in transformers; tokenization seams behave as the rollout relies on.

vLLM loading of the same folder is covered by the rollout integration tests.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_agent_rl.prompts import TAGS, prompt_ids, prompt_text

pytestmark = pytest.mark.unit


def test_folder_loads_and_generates(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)
    ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": "Who founded X?"}], True)])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] >= ids.shape[1] + 1


def test_tags_are_single_non_special_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for tag in TAGS:
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        assert tok.decode(ids, skip_special_tokens=True) == tag  # survives skip_special_tokens


def test_chat_template_is_chatml_with_generation_prompt(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = prompt_text(tok, [{"role": "user", "content": "hi"}], True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert prompt_text(tok, [{"role": "user", "content": "hi"}], False) == "hi"


def _observation_seam(tok):
    """Tokenizing an observation on its own must give the same ids as tokenizing it after the model's turn,
    for the separator the rollout uses (observations start with a newline)."""
    turn = "<search> Aldo Venmar </search>"
    obs = '\n\n<information>Doc 1(Title: "Aldo Venmar") Aldo Venmar is a poet.</information>\n\n'
    joint = tok.encode(turn + obs, add_special_tokens=False)
    apart = tok.encode(turn, add_special_tokens=False) + tok.encode(obs, add_special_tokens=False)
    return joint, apart


def test_observation_tokenized_alone_matches_transcript_tiny(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    joint, apart = _observation_seam(tok)
    assert joint == apart


def test_observation_seam_with_real_qwen_tokenizer(qwen_tokenizer):
    """With Qwen's BPE, '>' + '\n\n' merge across the seam: re-tokenizing a transcript yields ids the model never
    produced (the multi-turn drift bug seen in TRL). The rollout therefore keeps the pieces' ids as they were; they
    decode to exactly the same text."""
    joint, apart = _observation_seam(qwen_tokenizer)
    assert joint != apart
    assert qwen_tokenizer.decode(apart) == qwen_tokenizer.decode(joint)


def test_real_qwen_chat_template_and_tags_as_text(qwen_tokenizer):
    ids = prompt_ids(qwen_tokenizer, [{"role": "user", "content": "Question: who?"}], True)
    text = qwen_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nQuestion: who?<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    # in Qwen's vocab the tags are plain text, several tokens each: stop strings (not ids) must be used
    assert len(qwen_tokenizer.encode("</search>", add_special_tokens=False)) > 1


def test_tiny_model_on_the_real_qwen_tokenizer(qwen_model_dir, qwen_tokenizer):
    """The folder built on a given tokenizer keeps it as is (vocabulary, special tokens, chat template) and the
    model's vocabulary is the tokenizer's, embedding tied to the head."""
    tok = AutoTokenizer.from_pretrained(qwen_model_dir)
    assert tok.get_vocab() == qwen_tokenizer.get_vocab() and tok.chat_template == qwen_tokenizer.chat_template
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(qwen_model_dir)
    assert model.config.vocab_size == len(tok) > 150_000 and model.config.hidden_size == 64
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": "Who founded X?"}], True)])
    assert tok.decode(ids[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] >= ids.shape[1] + 1


def test_tokenizer_file_says_how_the_folder_tokenizes(tiny_model_dir):
    """transformers 5 loads the folder as Qwen2Tokenizer, which splits numbers into digits whatever tokenizer.json
    says; the file must say the same split, or transformers 4 and the bare `tokenizers` library (which follow the
    file) would give a trained model other token ids for every number."""
    from tokenizers import Tokenizer

    text = 'Aldo Venmar was born in 1957 in "Falbeis". <answer> 1957 </answer>\nIt\'s 3.5'
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = loaded.encode(text, add_special_tokens=False)
    assert Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(text).ids == ids
    assert [loaded.decode([i]) for i in loaded.encode(" 1957", add_special_tokens=False)] == [" ", "1", "9", "5", "7"]


def test_qwen3_tiny_model_has_its_own_head_size(tiny_model_dir, tmp_path):
    """More heads than the width gives at a head size vLLM's CPU attention serves (32) take Qwen3's head_dim."""
    from async_agent_rl.config import TinyModelConfig
    from async_agent_rl.tiny_model import init_tiny_model
    from tests.helpers import TEST_TINY_MODEL

    shape = {**TEST_TINY_MODEL, "architecture": "qwen3", "head_dim": 32, "num_attention_heads": 8,
             "num_key_value_heads": 4}
    cfg = TinyModelConfig(**shape)
    out = init_tiny_model(tmp_path / "q3", cfg, tokenizer=tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(out)
    attn = model.model.layers[0].self_attn
    assert model.config.model_type == "qwen3" and model.config.head_dim == 32
    assert attn.q_proj.weight.shape == (8 * 32, cfg.hidden_size)
    assert attn.k_proj.weight.shape == (4 * 32, cfg.hidden_size)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_head_dim_needs_qwen3():
    from async_agent_rl.config import TinyModelConfig

    with pytest.raises(ValueError, match="use architecture: qwen3"):
        TinyModelConfig(head_dim=32, num_attention_heads=8, num_key_value_heads=4)
    assert TinyModelConfig(architecture="qwen3", head_dim=32, num_attention_heads=8, num_key_value_heads=4,
                           hidden_size=128).head_dim == 32
