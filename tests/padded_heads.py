"""A copy of a Llama-architecture model whose attention heads are zero-padded: the same function, more heads.

SmolLM2-135M has 9 query and 3 KV heads, which do not split over 2 ranks.
Padding each group to a multiple of the rank count (here: 12 query heads, 4
KV heads, 3 query heads per KV head as before) with all-zero projections
keeps every output: a padded KV head's values are zero, so the padded query
heads attend to zeros, and the output projection's columns for them are zero.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx

__all__ = ["pad_attention_heads"]


def pad_attention_heads(src: Path, dst: Path, *, kv_heads: int) -> Path:
    """Write ``src`` (an mlx-lm Llama directory) to ``dst`` with ``kv_heads`` KV heads (zero-padded)."""
    config = json.loads((src / "config.json").read_text())
    q0, kv0 = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    group = q0 // kv0
    head_dim = int(config.get("head_dim") or config["hidden_size"] // q0)
    if kv_heads < kv0:
        raise ValueError("padding only adds heads")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    weights: Any = mx.load(str(src / "model.safetensors"))
    q_rows, kv_rows = (kv_heads * group - q0) * head_dim, (kv_heads - kv0) * head_dim
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        if name.endswith("self_attn.q_proj.weight"):
            w = mx.concatenate([w, mx.zeros((q_rows, w.shape[1]), w.dtype)], axis=0)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            w = mx.concatenate([w, mx.zeros((kv_rows, w.shape[1]), w.dtype)], axis=0)
        elif name.endswith("self_attn.o_proj.weight"):
            w = mx.concatenate([w, mx.zeros((w.shape[0], q_rows), w.dtype)], axis=1)
        out[name] = w
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "mlx"})
    config.update(num_attention_heads=kv_heads * group, num_key_value_heads=kv_heads,
                  head_dim=head_dim)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
