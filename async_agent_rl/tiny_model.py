"""Tiny models built from a config (no hub): a byte-level BPE tokenizer trained on the corpus and a randomly
initialised Qwen2 causal LM, saved with ``save_pretrained`` so transformers and vLLM both load the folder.

The agent's tags (``<think>``, ``<search>``, ``</search>``, ``<information>``, ``<answer>``, ...) are added as
single, NON-special tokens when ``tags_as_tokens`` is on (the default). Why:

- a tiny model learns the format from a few thousand demonstrations far faster when each tag is one token
  instead of 4-6 byte-pieces;
- tokenization is stable at the seams: an observation block tokenized on its own starts with the
  ``<information>`` token whatever text precedes it, so never re-tokenizing the transcript is exact;
- non-special means ``skip_special_tokens=True`` decoding still shows them, and the same stop *strings*
  (``</search>``, ``</answer>``) work for this tokenizer and for real ones (Qwen) where the tags are plain text.

Chat template: ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), the format Qwen instruct models use; ``<|im_end|>``
is EOS, ``<|endoftext|>`` is padding.

``init_tiny_model(..., tokenizer=...)`` builds the same random model on a given tokenizer instead (a real one, e.g.
Qwen's 151k-token BPE with its chat template), used as is: no corpus fitting, no added tags, so the tags are plain
text of several tokens each and every seam (observations, stop strings, special tokens) is the real model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from async_agent_rl.config import TinyModelConfig
from async_agent_rl.prompts import MINIMAL_TEMPLATE, SEARCH_R1_TEMPLATE, TAGS

TINY_MODEL_FILE = "tiny_model.json"  # the model.init a tiny model folder was built from
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus_texts(corpus_file: str | Path | None, extra_texts: Iterable[str]) -> Iterator[str]:
    yield SEARCH_R1_TEMPLATE
    yield MINIMAL_TEMPLATE
    yield from extra_texts
    if corpus_file:
        with open(corpus_file) as f:
            for line in f:
                line = line.strip()
                if line:
                    yield json.loads(line)["contents"]


# The pre-tokenizer a tiny model's folder is used with. The folder's config.json says Qwen2, and transformers 5
# loads it as Qwen2Tokenizer, which splits text with this pattern (one digit per token) and NFC-normalizes,
# whatever tokenizer.json says; transformers 4 and the bare `tokenizers` library follow tokenizer.json. So
# tokenizer.json says this too, and every loader tokenizes alike. The BPE merges are still learned on the
# byte-level default split (digit runs whole, quotes apart from the letters after them), as the shipped vocabulary
# always was: its merges of digit runs (about 300 tokens such as " 1957") are never produced, since a number is
# split into digits before merging, as Qwen's tokenizer does.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def train_tokenizer(cfg: TinyModelConfig, corpus_file: str | Path | None, extra_texts: Iterable[str] = ()):
    """Byte-level BPE trained on the corpus (plus the prompt templates), wrapped as a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(_corpus_texts(corpus_file, extra_texts))
    tok.train_from_iterator(texts, trainer=trainer)
    # What the folder is loaded as decides the split, so the saved file states the loaded one (see QWEN2_SPLIT).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    if cfg.tags_as_tokens:
        from tokenizers import AddedToken

        hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    hf.chat_template = CHATML_TEMPLATE
    hf.model_max_length = cfg.max_position_embeddings
    return hf


def build_model(cfg: TinyModelConfig, tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if cfg.architecture == "qwen3":
        head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, **shape))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def init_tiny_model(
    out_dir: str | Path,
    cfg: TinyModelConfig,
    corpus_file: str | Path | None = None,
    extra_texts: Iterable[str] = (),
    tokenizer: Any = None,
) -> Path:
    """Train the tokenizer (or take ``tokenizer`` as is: a transformers tokenizer or a folder holding one; then
    ``cfg.vocab_size`` and ``cfg.tags_as_tokens`` are not used), build the model on it, ``save_pretrained`` both into
    ``out_dir``; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = train_tokenizer(cfg, corpus_file, extra_texts)
    elif isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    model = build_model(cfg, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / TINY_MODEL_FILE).write_text(json.dumps(cfg.model_dump(), indent=1))
    return out


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
