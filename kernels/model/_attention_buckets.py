"""Prefill attention at bucketed shapes: queries and keys padded, the padding masked, so cuDNN's graphs repeat.

MLX 0.32's CUDA backend runs a query of two or more positions through
cuDNN's fused attention and builds one cuDNN graph per exact shape (the
query, key and value shapes and strides, the mask's shape). On the H200
(8B shape) a forward at a query length never run before cost 66.8 ms
against 9.4 ms for the same length again, and 21.9 ms with cuDNN's
attention off (``tools/bench/shape_costs.py``): the graph build is most of
a new shape's cost. A served lane rarely repeats a shape (every join has
its own group size, suffix and cached length; every new prompt its own
length), so it paid the build on most prefill steps.

:func:`bucketed_attention` computes the same attention at a shape from a
small set: the queries padded with zeros to :func:`query_bucket` positions,
the keys and values to :func:`key_bucket` positions, and the mask made
explicit at the padded shape (padded keys hidden from every query; padded
queries see the real keys and their outputs are dropped). The softmax of a
real query gives a hidden key a weight of exactly zero, so the result is the
unpadded attention's up to the kernel's summation order. The padding costs
a copy of the keys and values (a few hundred MB a step for a row over 5k
cached tokens at the 8B shape: well under a millisecond on the H200) and
attention over at most one more bucket of positions.

``masked_dispatch`` takes this path with ``KVTIER_CUDA_ATTENTION_BUCKETS=on``
(off by default until a served run says it pays).
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

__all__ = [
    "ATTENTION_BUCKETS_ENV",
    "KEY_BUCKET",
    "Attend",
    "bucketed_attention",
    "buckets_apply",
    "key_bucket",
    "query_bucket",
]

ATTENTION_BUCKETS_ENV = "KVTIER_CUDA_ATTENTION_BUCKETS"
"""Switch (default off): prefill attention at bucketed shapes on CUDA."""

KEY_BUCKET = 256
"""Keys are padded to a multiple of this (mlx-lm's cache buffers grow in steps of 256 too)."""

_SMALL_QUERY = 256
"""Query lengths up to here round to a multiple of 32 (joins' suffixes); longer ones to a multiple of 128."""


class Attend(Protocol):
    """The attention :func:`bucketed_attention` runs at the padded shapes (mlx-lm's, bound to its cache)."""

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any) -> mx.array: ...


def query_bucket(length: int) -> int:
    """The padded query length for ``length`` positions (``>= length``)."""
    step = 32 if length <= _SMALL_QUERY else 128
    return -(-length // step) * step


def key_bucket(keys: int) -> int:
    """The padded key length for ``keys`` positions (``>= keys``)."""
    return -(-keys // KEY_BUCKET) * KEY_BUCKET


def buckets_apply(queries: Any, keys: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether a call is bucketed: two or more query positions, no sinks, not quantized, a mask of None, ``"causal"`` or an array."""
    if sinks is not None or hasattr(cache, "bits"):
        return False
    if queries.shape[2] < 2:
        return False
    return mask is None or isinstance(mask, mx.array) or mask == "causal"


def _explicit_mask(mask: Any, length: int, keys: int) -> mx.array:
    """The call's mask as an array broadcastable to ``(B, H, L, T)`` (boolean where it was not additive)."""
    if mask is None:
        return mx.ones((1, 1, length, keys), dtype=mx.bool_)
    if isinstance(mask, str):
        # NOTE: MLX's "causal" is bottom-right aligned: query i sees keys up to T - L + i.
        rows = mx.arange(length)[:, None] + (keys - length)
        return (mx.arange(keys)[None, :] <= rows)[None, None]
    m: mx.array = mask
    while m.ndim < 4:
        m = m[None]
    return m


def bucketed_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Any,
    attend: Attend,
) -> mx.array:
    """``attend(q, k, v, scale=, mask=)`` at the bucketed shape, sliced back to ``queries``' length.

    ``queries`` ``(B, H, L, D)``, ``keys``/``values`` ``(B, Hkv, T, D)``;
    ``mask`` None, ``"causal"`` or an array broadcastable to ``(B, H, L, T)``
    (boolean: False hides a key; or additive).
    """
    length, t = queries.shape[2], keys.shape[2]
    lp, tp = query_bucket(length), key_bucket(t)
    if lp == length and tp == t:
        return attend(queries, keys, values, scale=scale, mask=mask)
    m = _explicit_mask(mask, length, t)
    hidden: Any = False if m.dtype == mx.bool_ else mx.finfo(m.dtype).min
    if tp > t:
        # NOTE: padded keys are hidden from every query (exact zeros after the softmax).
        m = mx.pad(m, [(0, 0), (0, 0), (0, 0), (0, tp - t)], constant_values=hidden)
        pad_keys = [(0, 0), (0, 0), (0, tp - t), (0, 0)]
        keys = mx.pad(keys, pad_keys)
        values = mx.pad(values, pad_keys)
    if lp > length:
        # NOTE: padded queries see what the last real query sees (never a row
        # with every key hidden); their outputs are dropped below.
        if m.shape[2] != 1:
            last = m[:, :, -1:, :]
            m = mx.concatenate([m, mx.broadcast_to(last, (*last.shape[:2], lp - length, tp))], axis=2)
        queries = mx.pad(queries, [(0, 0), (0, 0), (0, lp - length), (0, 0)])
    out = attend(queries, keys, values, scale=scale, mask=m)
    return out[:, :, :length, :] if lp > length else out
