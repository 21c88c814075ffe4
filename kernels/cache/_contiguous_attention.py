"""Attention over a quantized KV cache on MLX's CUDA backend: contiguous operands.

mlx-lm attends a quantized cache (``QuantizedKVCache``, kvtier's converted
rows) with two ``mx.quantized_matmul`` calls whose keys and values are the
cache's buffers sliced to its offset (``x[..., :offset, :]``). The buffers
grow in steps of 256 tokens, so the slice is row-contiguous only when the
offset is a multiple of the step. MLX 0.32.4's CUDA kernels for
``quantized_matmul`` (``qmv``, the Hopper ``qmm``) require row-contiguous
operands and the dispatcher has nothing else for a short query, so a decode
step against a 4-bit cache of 32,769 tokens failed with "No implementation
for problem shape: 1x32769x128x32" while 2,048-token prefill chunks (ending
on step multiples) ran (docs/benchmarks/gpu.md). So ``--kv-quant`` could
prefill a long context but not decode from it.

:func:`install_contiguous_quantized_attention` puts a thin wrapper in front
of mlx-lm's ``quantized_scaled_dot_product_attention`` on CUDA only: it
hands mlx-lm's function row-contiguous keys and values (``mx.contiguous``:
no copy when the slice already is, else a copy of the valid part). Metal
and the CPU have kernels for strided operands and keep mlx-lm's path
untouched. The arithmetic is mlx-lm's own; only the memory layout changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as _mlx_base

from kernels._memory import on_cuda

__all__ = [
    "contiguous_quantized_sdpa",
    "install_contiguous_quantized_attention",
    "uninstall_contiguous_quantized_attention",
]

_original: Callable[..., Any] | None = None


def contiguous_quantized_sdpa(
    attend: Callable[..., Any],
    queries: Any,
    q_keys: tuple[Any, Any, Any],
    q_values: tuple[Any, Any, Any],
    scale: float,
    mask: Any,
    group_size: int = 64,
    bits: int = 8,
) -> Any:
    """``attend`` (mlx-lm's quantized attention) with row-contiguous quantized keys and values."""
    keys = tuple(mx.contiguous(t) for t in q_keys)
    values = tuple(mx.contiguous(t) for t in q_values)
    return attend(queries, keys, values, scale, mask, group_size, bits)


def install_contiguous_quantized_attention(*, on_cuda: Callable[[], bool] = on_cuda) -> bool:
    """Route mlx-lm's quantized attention through :func:`contiguous_quantized_sdpa` on CUDA.

    Idempotent; returns whether the wrapper is installed. ``on_cuda`` is the
    device check (a port, so tests can exercise the wrapper on the CPU).
    NOTE: mlx-lm's ``scaled_dot_product_attention`` looks the quantized
    function up in its module at each call, so every model file picks the
    wrapper up without being touched.
    """
    global _original
    if _original is not None:
        return True
    if not on_cuda():
        return False
    original = _mlx_base.quantized_scaled_dot_product_attention
    wrapper = functools.partial(contiguous_quantized_sdpa, original)
    _original = original
    _mlx_base.quantized_scaled_dot_product_attention = wrapper
    return True


def uninstall_contiguous_quantized_attention() -> None:
    """Put mlx-lm's own quantized attention back (tests)."""
    global _original
    if _original is not None:
        _mlx_base.quantized_scaled_dot_product_attention = _original
        _original = None
