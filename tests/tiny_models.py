"""Tiny random-weight models of real mlx-lm architectures for fast unit tests.

Seeded, so two calls with the same arguments build identical weights.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama


def tiny_llama(*, seed: int = 0, vocab_size: int = 256, layers: int = 2, dtype: Any = None) -> nn.Module:
    """A 2-layer Llama (grouped-query attention, tied embeddings) with random weights."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model
