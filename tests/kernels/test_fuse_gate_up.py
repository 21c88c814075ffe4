"""gate|up as one product at every row count (the CUDA load transform), checked on the CPU."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.nn.layers.linear import Linear
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from kernels.model import FusedLinear, fuse_gate_up, transform_for_device
from tests.tiny_models import tiny_gemma3, tiny_llama


def _pair(seed: int = 3) -> tuple[Any, Any]:
    plain = tiny_llama(seed=seed, dtype=mx.float32)
    fused = tiny_llama(seed=seed, dtype=mx.float32)
    report = fuse_gate_up(fused)
    assert report.groups == len(fused.layers)
    return plain, fused


def test_every_mlp_gets_one_gate_up_product_and_attention_stays() -> None:
    """gate and up become members of one always-fused group; q, k, v stay nn.Linear; no weight views."""
    _, fused = _pair()
    for layer in fused.layers:
        gate, up = layer.mlp.gate_proj, layer.mlp.up_proj
        assert isinstance(gate, FusedLinear)
        assert isinstance(up, FusedLinear)
        assert gate._group is up._group
        assert gate._group.always
        assert gate._group.views == []
        assert type(layer.self_attn.q_proj) is Linear
    again = fuse_gate_up(fused)
    assert again.groups == 0, "already fused layers are left as they are"


def test_outputs_stay_within_rounding_at_every_row_count() -> None:
    """Prefill (1x9 and 4x20 positions) and batched decode (1-20 rows) logits: the plain model's within 1e-4."""
    plain, fused = _pair()
    for rows, length in ((1, 9), (4, 20)):
        toks = mx.random.randint(0, 256, (rows, length), key=mx.random.key(rows))
        la = plain(toks, cache=make_prompt_cache(plain))
        lb = fused(toks, cache=make_prompt_cache(fused))
        assert mx.allclose(la, lb, rtol=1e-4, atol=1e-4).item()
    for rows in (1, 3, 8, 17, 20):
        ca = [BatchKVCache([0] * rows) for _ in plain.layers]
        cb = [BatchKVCache([0] * rows) for _ in fused.layers]
        toks = mx.random.randint(0, 256, (rows, 5), key=mx.random.key(50 + rows))
        plain(toks, cache=ca)
        fused(toks, cache=cb)
        step = mx.random.randint(0, 256, (rows, 1), key=mx.random.key(90 + rows))
        assert mx.allclose(plain(step, cache=ca), fused(step, cache=cb), rtol=1e-4, atol=1e-4).item()


def test_model_types_outside_the_list_are_left_unchanged() -> None:
    """A Gemma 3 model keeps its MLP; the report says why."""
    model = tiny_gemma3(seed=0)
    report = fuse_gate_up(model)
    assert report.groups == 0
    assert "gemma3" in report.skipped
    assert type(model.layers[0].mlp.gate_proj) is Linear


def test_the_cpu_device_gets_the_bitwise_fusion_not_this_one() -> None:
    """On the CPU, transform_for_device applies fuse_projections (q|k|v too), never the always-fused gate|up."""
    model = tiny_llama(seed=1, dtype=mx.float32)
    report = transform_for_device(model, few_row=False)
    assert report is not None
    assert report.groups == 2 * len(model.layers)
    assert not model.layers[0].mlp.gate_proj._group.always
    assert isinstance(model.layers[0].self_attn.q_proj, FusedLinear)
