"""Text encoders of the dense backend: a local model folder turns texts into L2-normalized float32 vectors.

Two kinds of folder are read, told apart by their files:

- a sentence-transformers model (``modules.json``, e.g. all-MiniLM-L6-v2): sentence-transformers encodes with the
  pooling the model was trained with;
- a plain Hugging Face model (``config.json`` only, e.g. Search-R1's ``intfloat/e5-base-v2``): the mean of the last
  hidden state over the real tokens (weighted by the attention mask), as Search-R1's retrieval server pools e5.

Prefixes (e5's ``query: `` and ``passage: ``) are added by the caller. Encoding runs on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from async_agent_rl.errors import InputError
from async_agent_rl.optional import import_optional

MAX_LENGTH = 512  # tokens per text, at most (e5 and BERT-style encoders have 512 positions)


class TextEncoder(Protocol):
    dim: int

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """``(len(texts), dim)`` float32, each row of unit length."""
        ...


class MeanPoolingEncoder:
    """A plain Hugging Face encoder: attention-masked mean of the last hidden state, then L2 normalization."""

    def __init__(self, model_dir: str | Path):
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(model_dir), local_files_only=True).eval()
        self.max_length = min(MAX_LENGTH, self.tokenizer.model_max_length)
        self.dim = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        out = [np.zeros((0, self.dim), dtype=np.float32)]
        for start in range(0, len(texts), batch_size):
            batch = self.tokenizer(
                texts[start : start + batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            out.append(F.normalize(mean.float(), dim=-1).numpy())
        return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)


class SentenceTransformerEncoder:
    """A sentence-transformers model folder, encoded with its own modules and normalized."""

    def __init__(self, model_dir: str | Path):
        st = import_optional("sentence_transformers", "sentence-transformers")
        self.model = st.SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
        # the size of what the whole module stack outputs (the dimension getter's name differs across versions)
        self.dim = int(self._encode(["dimension probe"]).shape[1])

    def _encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        emb = self.model.encode(
            texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.ascontiguousarray(emb, dtype=np.float32)

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return self._encode(texts, batch_size).reshape(len(texts), self.dim)


def load_encoder(model_dir: str | Path) -> TextEncoder:
    """The encoder for a model folder (see the module docstring); ``InputError`` if it is not one."""
    path = Path(model_dir)
    if (path / "modules.json").is_file():
        return SentenceTransformerEncoder(path)
    if (path / "config.json").is_file():
        return MeanPoolingEncoder(path)
    raise InputError(f"encoder folder {model_dir} holds no model (neither modules.json nor config.json)")
