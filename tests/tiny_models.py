"""Tiny random-weight models of real mlx-lm architectures for fast unit tests.

Seeded, so two calls with the same arguments build identical weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models import llama

if TYPE_CHECKING:
    from mlx_lm.models import gemma3_text, mamba


ATTENTION_GAIN = 4.0
""":func:`kv_llama`'s gain: how much the tiny Llama's attention is sharpened after init.

NOTE: at random init its answer barely depends on its KV cache: greedy, 16
tokens after a 30-token prompt came out identical with another prompt's KV
in 13 of 20 prompts and with one cached token missing in 16 of 20, so a test
restoring a wrong or short cache would still pass. Sharper attention (queries
x16: scores as with queries and keys x4) whose output counts (``o_proj`` x4)
makes both differ in 20 of 20 (``tests/test_tiny_models.py`` keeps it so).
Tests whose point is the cache's content (restores, resumes, lent
prefixes) build :func:`kv_llama`; the plain :func:`tiny_llama` stays as it
was for the rest, whose expectations (answers running to ``max_tokens``,
absolute tolerances) were set on it."""

SPECIAL_IDS = (96, 97)
""":func:`tiny_tokenizer`'s ``<s>`` and ``</s>``: the tiny Llama embeds them as zeros.

NOTE: tied embeddings make their logit 0, below the top token's, so greedy
answers run to ``max_tokens`` as the tests expect (the sharper attention
otherwise brings ``</s>`` up now and then)."""


def tiny_llama(
    *,
    seed: int = 0,
    vocab_size: int = 256,
    layers: int = 2,
    dtype: Any = None,
    head_dim: int | None = None,
    attention_gain: float = 1.0,
) -> llama.Model:
    """A 2-layer Llama (grouped-query attention, tied embeddings) with random weights.

    ``head_dim`` defaults to 16 (64 / 4 heads); quantized-KV tests pass 32 so
    K/V rows divide into MLX's smallest quantization group. ``attention_gain``
    sharpens its attention (:data:`ATTENTION_GAIN`, :func:`kv_llama`).
    """
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
        head_dim=head_dim,
    )
    model = llama.Model(args)
    for layer in model.model.layers:
        attn = layer.self_attn
        # NOTE: the queries take the whole sharpening, so the cached keys and
        # values keep their usual size (tests compare them with absolute tolerances).
        attn.q_proj.weight = attn.q_proj.weight * attention_gain**2
        attn.o_proj.weight = attn.o_proj.weight * attention_gain
    if attention_gain != 1.0 and vocab_size > max(SPECIAL_IDS):
        keep = mx.ones((vocab_size, 1)).at[mx.array(SPECIAL_IDS)].multiply(0.0)
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * keep
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def kv_llama(**kwargs: Any) -> llama.Model:
    """:func:`tiny_llama` whose answer depends on its KV cache (:data:`ATTENTION_GAIN`)."""
    return tiny_llama(attention_gain=ATTENTION_GAIN, **kwargs)


def tiny_gemma3(
    *, seed: int = 0, vocab_size: int = 256, layers: int = 3, sliding_window: int = 8, dtype: Any = None
) -> gemma3_text.Model:
    """A Gemma 3 text model whose local layers use ``RotatingKVCache(sliding_window)``.

    With ``sliding_window_pattern=3`` and 3 layers, layers 0 and 1 are sliding
    (rotating ring of ``sliding_window`` slots) and layer 2 is full attention.
    """
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=32,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        query_pre_attn_scalar=32,
        sliding_window=sliding_window,
        sliding_window_pattern=3,
    )
    model = gemma3_text.Model(args)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_qwen(kind: str, *, seed: int = 0, vocab_size: int = 256, layers: int = 2) -> Any:
    """A 2-layer fp32 ``qwen2`` (biased q/k/v projections) or ``qwen3`` (q/k norms) model with random weights."""
    from mlx_lm.models import qwen2, qwen3

    mx.random.seed(seed)
    common: dict[str, Any] = {
        "model_type": kind, "hidden_size": 64, "num_hidden_layers": layers, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab_size,
        "tie_word_embeddings": True,
    }
    if kind == "qwen2":
        model: Any = qwen2.Model(qwen2.ModelArgs(**common))
    elif kind == "qwen3":
        model = qwen3.Model(qwen3.ModelArgs(**common, max_position_embeddings=4096, head_dim=16, rope_theta=1e6))
    else:
        raise ValueError(f"not a tiny Qwen: {kind}")
    mx.eval(model.parameters())
    return model


def tiny_mamba(*, seed: int = 0, vocab_size: int = 256, layers: int = 2, dtype: Any = None) -> mamba.Model:
    """A Mamba (selective state space) model: every layer holds recurrent ``ArraysCache`` state."""
    from mlx_lm.models import mamba

    mx.random.seed(seed)
    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=layers,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    model = mamba.Model(args)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_tokenizer() -> Any:
    """A real byte-level BPE tokenizer over printable ASCII + newline (no merges), with
    ``<s>``/``</s>`` and a one-line chat template, wrapped like mlx-lm's own tokenizers.

    Build tiny models with ``vocab_size=len(tok)`` so every sampled id decodes.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> symbol table restricted to printable ASCII (identity) plus newline.
    vocab = {chr(b): i for i, b in enumerate(range(0x21, 0x7F))}
    vocab["Ġ"] = len(vocab)  # space
    vocab["Ċ"] = len(vocab)  # newline
    for special in ("<s>", "</s>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer)
