"""Fused q|k|v and gate|up projections (``kernels.model.fuse_projections``): the unfused model's bits, fewer products."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedLinear, quantize
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from kernels.model import (
    FUSE_MAX_ROWS,
    FusedLinear,
    fuse_projections,
    fused_projections_enabled,
    load_model,
)
from tests.tiny_models import tiny_gemma3, tiny_llama


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


def _pair(seed: int = 3) -> tuple[Any, Any]:
    plain = tiny_llama(seed=seed, dtype=mx.float32)
    fused = tiny_llama(seed=seed, dtype=mx.float32)
    report = fuse_projections(fused)
    assert report.groups == 2 * len(fused.layers)
    return plain, fused


def _caches_equal(a: list[Any], b: list[Any]) -> bool:
    return all(
        _same(x.keys, y.keys) and _same(x.values, y.values) for x, y in zip(a, b, strict=True)
    )


def _prefill_mismatches(plain: Any, fused: Any, lengths: list[int]) -> list[int]:
    bad = []
    for n in lengths:
        toks = mx.random.randint(0, 256, (1, n), key=mx.random.key(n))
        ca, cb = make_prompt_cache(plain), make_prompt_cache(fused)
        la, lb = plain(toks, cache=ca), fused(toks, cache=cb)
        mx.eval(la, lb)
        if not (_same(la, lb) and _caches_equal(ca, cb)):
            bad.append(n)
    return bad


def _decode_mismatches(
    plain: Any, fused: Any, rows: range | list[int], vocab: int, *, steps: int = 3
) -> list[int]:
    bad = []
    for b in rows:
        ca = [BatchKVCache([0] * b) for _ in plain.layers]
        cb = [BatchKVCache([0] * b) for _ in fused.layers]
        toks = mx.random.randint(0, vocab, (b, 5), key=mx.random.key(b))
        plain(toks, cache=ca)
        fused(toks, cache=cb)
        for step in range(steps):
            t = mx.random.randint(0, vocab, (b, 1), key=mx.random.key(100 * b + step))
            la, lb = plain(t, cache=ca), fused(t, cache=cb)
            mx.eval(la, lb)
            if not (_same(la, lb) and _caches_equal(ca, cb)):
                bad.append(b)
                break
    return bad


def test_fused_prefill_gives_the_unfused_logits_and_kv_bit_for_bit() -> None:
    """Prompts of 1 to 100 tokens (fused and separate row counts alike): same logits and KV, every bit."""
    plain, fused = _pair()
    lengths = [*range(1, 10), 31, FUSE_MAX_ROWS, FUSE_MAX_ROWS + 1, 100]
    assert _prefill_mismatches(plain, fused, lengths) == []


def test_fused_batched_decode_gives_the_unfused_logits_and_kv_bit_for_bit() -> None:
    """Decode steps of 1 to 8 rows in a BatchKVCache: same logits and KV, every bit."""
    plain, fused = _pair()
    assert _decode_mismatches(plain, fused, range(1, 9), 256) == []


def test_the_separate_path_through_weight_views_is_the_unfused_arithmetic() -> None:
    """With every row count forced onto the separate path (views of the fused weight), outputs still match."""
    plain, fused = _pair()
    for layer in fused.layers:
        for member in (layer.self_attn.q_proj, layer.mlp.gate_proj):
            member._group.split_rows = frozenset(range(1, FUSE_MAX_ROWS + 1))
    assert _prefill_mismatches(plain, fused, [1, 2, 5, 17]) == []
    assert _decode_mismatches(plain, fused, range(1, 5), 256) == []


def test_fusion_replaces_the_projections_and_keeps_the_weight_once() -> None:
    """Each group's members become FusedLinear; the fused weight is a parameter of the first member only."""
    plain, fused = _pair()
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    for member in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        assert type(member) is FusedLinear
    p_attn = plain.layers[0].self_attn
    rows = sum(p.weight.shape[0] for p in (p_attn.q_proj, p_attn.k_proj, p_attn.v_proj))
    assert attn.q_proj.weight.shape == (rows, p_attn.q_proj.weight.shape[1])
    assert "weight" not in attn.k_proj
    assert "weight" not in mlp.up_proj
    assert type(fused.layers[0].self_attn.o_proj) is Linear
    assert type(fused.layers[0].mlp.down_proj) is Linear


def test_a_member_called_on_its_own_computes_its_own_output() -> None:
    """A member asked first, twice, or on a new input gives the unfused layer's output for that input."""
    plain, fused = _pair()
    p, f = plain.layers[0].self_attn, fused.layers[0].self_attn
    x1 = mx.random.normal((2, 3, 64), key=mx.random.key(1))
    x2 = mx.random.normal((2, 3, 64), key=mx.random.key(2))
    assert _same(f.k_proj(x1), p.k_proj(x1))
    assert _same(f.k_proj(x1), p.k_proj(x1))
    assert _same(f.q_proj(x2), p.q_proj(x2))
    assert _same(f.v_proj(x1), p.v_proj(x1))
    assert _same(f.v_proj(x2), p.v_proj(x2))


def test_model_types_outside_the_list_are_left_unchanged() -> None:
    """A Gemma 3 model is not fused: the report says why and its layers stay nn.Linear."""
    model = tiny_gemma3(seed=0)
    report = fuse_projections(model)
    assert report.groups == 0
    assert "gemma3" in report.skipped
    assert type(model.layers[0].self_attn.q_proj) is Linear


def test_quantized_projections_are_left_unchanged() -> None:
    """QuantizedLinear layers are not plain nn.Linear: nothing is fused."""
    model = tiny_llama(seed=0, dtype=mx.float32)
    quantize(model, group_size=32, bits=4)
    assert fuse_projections(model).groups == 0
    assert type(model.layers[0].self_attn.q_proj) is QuantizedLinear


def test_the_environment_switch() -> None:
    """KVTIER_FUSED_PROJECTIONS=0 (or false/off/no) turns fusion off; unset or 1 leaves it on."""
    assert fused_projections_enabled({})
    assert fused_projections_enabled({"KVTIER_FUSED_PROJECTIONS": "1"})
    for off in ("0", "false", "OFF", "no"):
        assert not fused_projections_enabled({"KVTIER_FUSED_PROJECTIONS": off})


# NOTE: slow (13 s): the tiny-model tests above prove the same bit-for-bit
# prefill and batched decode in the default suite.
@pytest.mark.slow
@pytest.mark.model
def test_default_model_fused_is_bitwise_the_unfused_model(default_model_path: Any) -> None:
    """The real default model (fp32): prefills and 1-8-row decode steps give the unfused logits and KV exactly."""
    plain = load_model(default_model_path, fuse=False)
    fused = load_model(default_model_path, fuse=True)
    assert fused.fusion is not None
    assert fused.fusion.groups == 2 * len(fused.model.layers)
    lengths = [1, 2, 5, 17, 40]
    assert _prefill_mismatches(plain.model, fused.model, lengths) == []
    vocab = int(plain.config["vocab_size"])
    assert _decode_mismatches(plain.model, fused.model, [1, 2, 4, 8], vocab, steps=1) == []
