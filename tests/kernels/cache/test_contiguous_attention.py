"""Quantized attention with contiguous operands equals mlx-lm's, and is routed in on CUDA only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from kernels.cache import (
    KvScheme,
    LayerQuant,
    convert_caches,
    install_contiguous_quantized_attention,
    uninstall_contiguous_quantized_attention,
)
from kernels.cache._contiguous_attention import contiguous_quantized_sdpa

ORIGINAL = mlx_base.quantized_scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _restore_mlx_lm() -> Iterator[None]:
    yield
    uninstall_contiguous_quantized_attention()
    assert mlx_base.quantized_scaled_dot_product_attention is ORIGINAL


def _cache_slices(tokens: int, kv_heads: int, bits: int, seed: int) -> tuple[Any, Any]:
    """Keys and values as mlx-lm hands them to attention: a step-sized buffer sliced to the offset."""
    mx.random.seed(seed)
    cache = QuantizedKVCache(group_size=32, bits=bits)
    keys, values = cache.update_and_fetch(
        mx.random.normal((1, kv_heads, tokens, 64)), mx.random.normal((1, kv_heads, tokens, 64))
    )
    buffer: Any = cache.keys
    assert buffer[0].shape[-2] > tokens, "the slice must be a strided view of a larger buffer"
    return keys, values


@pytest.mark.parametrize(
    ("q_len", "q_heads", "mask"), [(1, 4, None), (1, 8, None), (5, 8, "causal")]
)
def test_contiguous_operands_give_mlx_lms_result(
    q_len: int, q_heads: int, mask: str | None
) -> None:
    """mlx-lm's quantized attention on copied-contiguous keys and values equals it on the strided slices (fp32)."""
    keys, values = _cache_slices(37, 4, 4, seed=q_len + q_heads)
    queries = mx.random.normal((1, q_heads, q_len, 64))
    # NOTE: mlx-lm scales its queries in place (``queries *= scale``): a copy each call.
    m: Any = mask
    want = ORIGINAL(mx.array(queries), keys, values, 0.125, m, 32, 4)
    got = contiguous_quantized_sdpa(ORIGINAL, mx.array(queries), keys, values, 0.125, m, 32, 4)
    assert got.shape == want.shape
    assert mx.array_equal(got, want).item()


def test_install_is_a_no_op_off_cuda() -> None:
    """Without CUDA (Metal, the CPU) mlx-lm's own quantized attention stays in place."""
    assert install_contiguous_quantized_attention(on_cuda=lambda: False) is False
    assert mlx_base.quantized_scaled_dot_product_attention is ORIGINAL


def test_installed_wrapper_serves_mlx_lms_dispatch_with_the_same_result() -> None:
    """On CUDA the wrapper replaces mlx-lm's quantized attention (idempotently) and mlx-lm's SDPA reaches it."""
    assert install_contiguous_quantized_attention(on_cuda=lambda: True) is True
    wrapper = mlx_base.quantized_scaled_dot_product_attention
    assert install_contiguous_quantized_attention(on_cuda=lambda: True) is True
    assert mlx_base.quantized_scaled_dot_product_attention is wrapper is not ORIGINAL
    keys, values = _cache_slices(21, 2, 8, seed=3)
    cache = QuantizedKVCache(group_size=32, bits=8)
    queries = mx.random.normal((1, 4, 1, 64))
    want = ORIGINAL(mx.array(queries), keys, values, 0.125, None, 32, 8)
    got = mlx_base.scaled_dot_product_attention(
        mx.array(queries), keys, values, cache=cache, scale=0.125, mask=None
    )
    assert mx.array_equal(got, want).item()


def test_a_quantizing_scheme_installs_it_when_caches_convert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """convert_caches under a quantizing scheme installs the wrapper (a no-op here, off CUDA)."""
    calls: list[bool] = []

    def install() -> bool:
        calls.append(True)
        return False

    monkeypatch.setattr("kernels.cache._kv_scheme.install_contiguous_quantized_attention", install)
    scheme = KvScheme(kind="affine-uniform", uniform=LayerQuant(bits=4, group_size=32))
    convert_caches([], scheme)
    assert calls == [True]
