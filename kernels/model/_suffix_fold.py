"""A short prefill over a cached prefix as folded products over the cache's buffer: the same shapes turn after turn.

An agent's turn prefills a short suffix (tens of tokens) over a long cached
conversation, and every turn's query and key lengths are new. On MLX 0.32's
CUDA backend a new shape costs the step twice: cuDNN builds an attention
graph for it (43.5 ms new against 0.27 ms warm on an H100, 8B shape,
``tools/bench/shape_costs.py --parts``), and with cuDNN's attention off the
fallback's products meet a key length they have not run, and MLX's CUDA
graphs cost the new length more (a new join forward 39 ms against 25 warm;
28.5 with the graphs off too, in one process each: docs/benchmarks.md,
2026-12-07 16:56).

:func:`suffix_span` picks the calls this path takes (2 to
:data:`SUFFIX_MAX` query positions over a cached prefix in mlx-lm's
``KVCache`` or ``BatchKVCache``) and their span, the key length rounded up
to :data:`KEY_STEP`; :func:`span_of` reads that many positions of the
cache's buffers (zeros after the keys where a buffer is shorter) and
:func:`suffix_mask` is the call's mask over them. The attention runs as
:func:`kernels.model.masked_attention` at that span, so its products and
mask take one key length for every call inside a 256-token window (a
conversation's next turns, every conversation of about the same length),
and no cuDNN graph is built. With ``KVTIER_BATCH_PREFILL_BUCKET=32`` the
query length repeats too.

``masked_dispatch`` takes this path on CUDA unless ``KVTIER_CUDA_SUFFIX_FOLD``
says off. Served, it pays: the agent line's turns 2+ TTFT p50 fell to
0.72 x with it and the warm-row bucket of 32 (232 against 323 ms, 7 runs
each, every run with it below every run without; H100, 8B shape,
``gpu_serving.sh agentmx``: docs/benchmarks.md, 2026-12-07 21:10), though
a warm shape costs more than cuDNN's (24.5 against 13.9 ms a forward over
a cached 5,100): served, a join's shapes are almost never warm.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

__all__ = ["KEY_STEP", "SUFFIX_FOLD_ENV", "SUFFIX_MAX", "span_of", "suffix_mask", "suffix_span"]

SUFFIX_FOLD_ENV = "KVTIER_CUDA_SUFFIX_FOLD"
"""Switch (default on): short prefills over a cached prefix folded over the cache's buffer on CUDA."""

SUFFIX_MAX = 256
"""Most query positions a call may have and take this path (a turn's suffix, not a prompt's chunk)."""

KEY_STEP = 256
"""Key lengths round up to a multiple of this (a conversation's turns share a span until it passes one)."""


def suffix_span(queries: Any, keys: Any, cache: Any, mask: Any, sinks: Any) -> int | None:
    """The key length to fold this call over, or None where the path does not apply.

    It applies to 2 to :data:`SUFFIX_MAX` query positions over more keys
    than queries (a cached prefix), no sinks, a cache of mlx-lm's
    ``KVCache`` or ``BatchKVCache`` exactly (whose ``keys`` are the first
    ``T`` positions of its buffers ``cache.keys`` / ``cache.values``), and a mask of
    None, ``"causal"`` or an array over the ``T`` keys. The span is ``T``
    rounded up to :data:`KEY_STEP` (:func:`span_of` reads it).
    """
    # NOTE: these two only: their update returns the buffer's first T
    # positions. A rotating (sliding-window) cache's buffer is not in order,
    # and a quantized or transitioning one holds packed planes.
    if sinks is not None or type(cache) not in (KVCache, BatchKVCache):
        return None
    length, t = queries.shape[2], keys.shape[2]
    if not 2 <= length <= SUFFIX_MAX or t <= length:
        return None
    if not (mask is None or isinstance(mask, mx.array) or mask == "causal"):
        return None
    if isinstance(mask, mx.array) and mask.shape[-1] != t:
        return None  # NOTE: a mask broadcast over the keys is not padded here.
    kbuf, vbuf = getattr(cache, "keys", None), getattr(cache, "values", None)
    if not (isinstance(kbuf, mx.array) and isinstance(vbuf, mx.array) and kbuf.ndim == 4):
        return None
    if kbuf.shape[:2] != keys.shape[:2] or kbuf.shape[3] != keys.shape[3] or kbuf.shape[2] < t:
        return None
    span: int = -(-t // KEY_STEP) * KEY_STEP
    return span


def span_of(buffer: mx.array, t: int, span: int) -> mx.array:
    """The first ``span`` positions of a cache buffer whose first ``t`` are the call's: a view where
    the buffer is that long, else its first ``t`` with zeros after them.

    NOTE: mlx-lm's buffers grow by 256 positions from wherever they were, so
    their lengths are not multiples of 256: the zeros keep the span one
    length for every call in a window, whatever the buffer's.
    """
    if buffer.shape[2] >= span:
        return buffer[..., :span, :]
    return mx.pad(buffer[..., :t, :], [(0, 0), (0, 0), (0, span - t), (0, 0)])


def suffix_mask(mask: Any, length: int, keys: int, span: int) -> mx.array:
    """``mask`` (None, ``"causal"`` or an array over ``keys`` positions) over ``span >= keys`` positions.

    Positions ``keys`` to ``span - 1`` are hidden from every query: they
    hold :func:`span_of`'s zeros, or what the buffer held there (zeros or
    an earlier row's finite keys and values), which a hidden score's weight
    (exactly zero after the softmax) never reads into the output. Boolean where the mask was None, causal or
    boolean; additive (the dtype's lowest value hides) where it was additive.
    """
    cols = mx.arange(span)[None, :]
    if mask is None:
        return (cols < keys)[None, None]
    if isinstance(mask, str):
        # NOTE: MLX's "causal" is bottom-right aligned: query i sees keys up to
        # keys - length + i, which also hides every position past ``keys``.
        rows = mx.arange(length)[:, None] + (keys - length)
        return (cols <= rows)[None, None]
    m: mx.array = mask
    while m.ndim < 4:
        m = m[None]
    if span == keys:
        return m
    hidden: Any = False if m.dtype == mx.bool_ else mx.finfo(m.dtype).min
    return mx.pad(m, [(0, 0), (0, 0), (0, 0), (0, span - keys)], constant_values=hidden)
