"""Attention under an array mask as two batched products with the query heads folded per key head.

The batch lane's caches pad rows on the left, so every decode step of a
batch hands attention an array mask (mlx-lm's ``BatchKVCache.make_mask``).
MLX's CUDA backend has no fused kernel for a one-position query under an
array mask (0.32: the vector kernel and the cuDNN decode path both refuse one), so
it runs its generic fallback: the query heads unflattened to
``(B, kv_heads, repeats, L, D)`` against keys broadcast over ``repeats``,
a batched product whose batch axes do not collapse. On the H200 (8B shape)
a decode step of 8 rows over 5.1k cached tokens took ~25 ms against ~7 ms
for one row (tools/bench/join_cost.py ``--burst``).

:func:`masked_attention` computes the same attention with the ``repeats``
query heads of each key head folded into the product's rows:
``(B, kv_heads, repeats * L, D) @ (B, kv_heads, D, T)``, whose batch axes
``(B, kv_heads)`` are one stride of the cache's buffer, so keys and values
are read once, in place. Same operations as MLX's fallback otherwise (the
scale on the queries, a boolean mask as the dtype's lowest value, an
additive one added, a precise softmax), so only the products' summation
order can differ.

:func:`install` rebinds the name ``scaled_dot_product_attention`` in a
loaded model's mlx-lm module to :func:`masked_dispatch`, which takes this
path only where MLX's CUDA backend falls back (a batch cache's array mask,
a one-position query, no sinks, not quantized) and calls mlx-lm's own
function otherwise. On CUDA ``KVTIER_CUDA_MASKED_ATTENTION=off`` leaves the
module alone (the A/B switch of the measurement).

On the CPU it installs where kvtier's native softmax runs
(``kernels.native``, ``KVTIER_NATIVE_SOFTMAX``): MLX's CPU backend on x86
computes a softmax's ``exp`` one element at a time, most of a long
prefill's attention, so every float32 call there runs as these folded
products around the native softmax, and a ``"causal"`` prefill call uses its
causal rows (no mask built or applied).

The same dispatch can fold the prefill calls whose cuDNN graph MLX would
have to build (a shape new to this thread, with few enough scores: see
:mod:`._prefill_route`), with ``KVTIER_CUDA_PREFILL_FOLD=on``. Off by
default: alone, such a call costs 5 ms folded against 65 ms for the build
(H200), but neither a served run nor an in-process join with every shape
new moved with it (docs/benchmarks.md, #20), so the cost a new shape brings
is mostly elsewhere in the step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models import base as _base

from kernels._env import env_switch
from kernels._memory import on_cuda

from ._attention_buckets import ATTENTION_BUCKETS_ENV, bucketed_attention, buckets_apply
from ._prefill_route import causal_mask, prefill_key, shape_memory
from ._suffix_fold import SUFFIX_FOLD_ENV, span_of, suffix_mask, suffix_span

MaskedSoftmax = Callable[[mx.array, mx.array, int, int, int], mx.array]
"""``kernels.native.MaskedSoftmax`` (not imported here: that package loads native code on first use)."""

__all__ = [
    "MASKED_ATTENTION_ENV",
    "MAX_QUERY",
    "PREFILL_FOLD_ENV",
    "bind",
    "folds_prefill",
    "install",
    "masked_attention",
    "masked_dispatch",
    "takes_cpu_path",
    "takes_masked_path",
    "unbind",
]

MASKED_ATTENTION_ENV = "KVTIER_CUDA_MASKED_ATTENTION"
"""Switch: the folded masked attention on CUDA (on unless its value is an off word)."""

MAX_QUERY = 1
"""Longest query :func:`masked_dispatch` diverts.

NOTE: MLX 0.32's CUDA backend sends a masked query of two or more positions
to cuDNN's fused attention, which takes the mask; only the one-position
query (a decode step) has no fused kernel under a mask. Longer queries
stay MLX's (a 56-position prefill chunk was 0.75 x as fast folded).
"""

PREFILL_FOLD_ENV = "KVTIER_CUDA_PREFILL_FOLD"
"""Switch (default off): prefill calls of a shape new to cuDNN run folded."""

_ORIGINAL = _base.scaled_dot_product_attention
"""mlx-lm's dispatcher (quantized caches, then ``mx.fast``)."""

_fold_prefill = False
"""Whether :func:`masked_dispatch` consults :mod:`._prefill_route` (set by :func:`install` / :func:`bind`)."""

_buckets = False
"""Whether :func:`masked_dispatch` runs prefill calls at bucketed shapes (:mod:`._attention_buckets`)."""

_suffix_fold = False
"""Whether :func:`masked_dispatch` folds short prefills over a cached prefix over the cache's buffer (:mod:`._suffix_fold`)."""

_cpu_softmax: Callable[[mx.array], mx.array] | None = None
"""The CPU's native softmax: where set, :func:`masked_dispatch` runs every float32 call as folded products with it."""

_cpu_causal: Callable[[mx.array, int, int], mx.array] | None = None
"""Its causal rows (``(scores, L, T - L)``): a ``"causal"`` prefill call with no mask array built or applied."""

_cpu_masked: MaskedSoftmax | None = None
"""Its masked rows (``kernels.native.MaskedSoftmax``): a boolean mask array applied inside the softmax, no ``where`` pass."""


def takes_cpu_path(queries: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether :func:`masked_dispatch` runs this call with the native softmax: bound on the CPU, float32, no sinks, not quantized, a mask of None, ``"causal"`` or an array."""
    if _cpu_softmax is None or sinks is not None or hasattr(cache, "bits"):
        return False
    if queries.dtype != mx.float32:
        return False
    return mask is None or isinstance(mask, mx.array) or mask == "causal"


def masked_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | None,
    softmax: Callable[[mx.array], mx.array] | None = None,
    masked_softmax: MaskedSoftmax | None = None,
) -> mx.array:
    """Softmax attention of ``queries`` ``(B, H, L, D)`` over ``keys``/``values`` ``(B, Hkv, T, D)`` under ``mask``.

    ``mask`` broadcasts to ``(B, H, L, T)``: boolean (False hides a key) or
    additive; ``None`` hides nothing. ``H`` is a multiple of ``Hkv``
    (grouped-query attention). ``softmax`` replaces MLX's precise softmax
    over the last axis (the CPU's native one); ``masked_softmax`` (its masked
    rows) takes a boolean mask of one head ``(B or 1, 1, L or 1, T)`` into the
    softmax itself: the same bits as ``where`` then ``softmax``.
    """
    b, h, length, d = queries.shape
    hkv = keys.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key heads")
    rep = h // hkv
    t = keys.shape[2]
    # NOTE: (B, H, L, D) -> (B, Hkv, rep, L, D) -> (B, Hkv, rep * L, D): query
    # head j * rep + r reads key head j, as in MLX's fallback.
    q = (queries * mx.array(scale, dtype=queries.dtype)).reshape(b, hkv, rep * length, d)
    scores = q @ keys.swapaxes(-1, -2)
    if mask is None:
        weights = mx.softmax(scores, axis=-1, precise=True) if softmax is None else softmax(scores)
        return (weights @ values).reshape(b, hkv, rep, length, d).reshape(b, h, length, d)
    m = mask
    while m.ndim < 4:
        m = m[None]
    mb, mh, ml = m.shape[0], m.shape[1], m.shape[2]
    if (masked_softmax is not None and m.dtype == mx.bool_ and mh == 1 and mb in (1, b)
            and ml in (1, length) and m.shape[3] == t):
        # NOTE: the folded rows of batch i, head j, repeat r, position p are
        # row ((i * Hkv + j) * rep + r) * L + p: within a batch every L-th row
        # takes the same mask row, so the mask is never broadcast to them.
        weights = masked_softmax(scores, m.reshape(mb * ml, t), hkv * rep * length, mb, ml)
        out = weights @ values
        return out.reshape(b, hkv, rep, length, d).reshape(b, h, length, d)
    if mh != 1 or ml != 1:
        # NOTE: per-head or per-position masks laid out as the folded rows;
        # one mask for every head and position (the decode step's (B, 1, 1,
        # T)) broadcasts against the scores as it is.
        if mh == 1:
            m = mx.broadcast_to(m[:, :, None], (mb, 1, rep, length, t))
        else:
            m = mx.broadcast_to(m, (mb, h, length, t)).reshape(mb, hkv, rep, length, t)
        m = m.reshape(mb, m.shape[1], rep * length, t)
    if m.dtype == mx.bool_:
        scores = mx.where(m, scores, mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype))
    else:
        scores = scores + m.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True) if softmax is None else softmax(scores)
    out = weights @ values
    return out.reshape(b, hkv, rep, length, d).reshape(b, h, length, d)


def takes_masked_path(queries: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether :func:`masked_dispatch` diverts this call: a one-position query under an array mask, no sinks, not quantized."""
    return (
        isinstance(mask, mx.array)
        and sinks is None
        and not hasattr(cache, "bits")
        and queries.shape[2] <= MAX_QUERY
    )


def folds_prefill(queries: Any, keys: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether :func:`masked_dispatch` folds this prefill call: two or more query positions, a causal or array mask, no sinks, not quantized, and a shape :mod:`._prefill_route` folds."""
    if not _fold_prefill or sinks is not None or hasattr(cache, "bits"):
        return False
    if not (isinstance(mask, mx.array) or mask == "causal"):
        return False
    b, h, length, _ = queries.shape
    if length <= MAX_QUERY:
        return False
    scores = b * h * length * keys.shape[2]
    return shape_memory().fold(prefill_key(queries, keys, cache, mask), scores)


def masked_dispatch(
    queries: Any,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
) -> Any:
    """mlx-lm's ``scaled_dot_product_attention``, with one-position masked queries and prefill calls of new shapes folded (:func:`masked_attention`)."""
    cpu_softmax = _cpu_softmax
    if cpu_softmax is not None and takes_cpu_path(queries, cache, mask, sinks):
        softmax = cpu_softmax
        if isinstance(mask, str):
            # NOTE: one query sees every key; longer ones bottom-right causal,
            # in the softmax's own rows where it can (no mask built, no where:
            # a sixth of a long prefill's attention), else as a mask.
            length, t = queries.shape[2], keys.shape[2]
            causal = _cpu_causal
            mask = None
            if length > 1 and causal is not None:

                def softmax(scores: mx.array) -> mx.array:
                    return causal(scores, length, t - length)

            elif length > 1:
                mask = causal_mask(length, t)
        return masked_attention(queries, keys, values, scale=scale, mask=mask, softmax=softmax,
                                masked_softmax=_cpu_masked)
    if takes_masked_path(queries, cache, mask, sinks):
        return masked_attention(queries, keys, values, scale=scale, mask=mask)
    if _suffix_fold and (span := suffix_span(queries, keys, cache, mask, sinks)) is not None:
        # NOTE: the cache's buffer, not the call's keys: one key length per
        # 256-token window, so the products' shapes repeat across turns.
        t = keys.shape[2]
        return masked_attention(
            queries, span_of(cache.keys, t, span), span_of(cache.values, t, span), scale=scale,
            mask=suffix_mask(mask, queries.shape[2], t, span))
    if folds_prefill(queries, keys, cache, mask, sinks):
        if isinstance(mask, str):
            mask = causal_mask(queries.shape[2], keys.shape[2])
        return masked_attention(queries, keys, values, scale=scale, mask=mask)
    if _buckets and buckets_apply(queries, keys, cache, mask, sinks):
        return bucketed_attention(
            queries, keys, values, scale=scale, mask=mask,
            attend=lambda q, k, v, *, scale, mask: _ORIGINAL(q, k, v, cache, scale, mask, sinks),
        )
    return _ORIGINAL(queries, keys, values, cache, scale, mask, sinks)


def install(model: Any) -> bool:
    """Rebind ``scaled_dot_product_attention`` in ``model``'s mlx-lm module to :func:`masked_dispatch`.

    Returns whether it did: only where measured faster, for a module that
    took mlx-lm's own function by that name. On CUDA (switch on): the folded
    masked decode attention. On the CPU, where the native softmax runs
    (``KVTIER_NATIVE_SOFTMAX``, on by default): every float32 attention call
    as folded products with it (MLX's CPU backend on x86 spends most of a
    long prefill's attention in its per-element ``expf``). Idempotent.
    """
    if on_cuda():
        if not env_switch(MASKED_ATTENTION_ENV):
            return False
        return bind(
            model,
            fold_prefill=env_switch(PREFILL_FOLD_ENV, default=False),
            buckets=env_switch(ATTENTION_BUCKETS_ENV, default=False),
            suffix_fold=env_switch(SUFFIX_FOLD_ENV),
        )
    if mx.default_device() != mx.cpu:
        return False
    # NOTE: imported here: kernels.native loads MLX extensions on first use.
    from kernels.native import causal_softmax_op, masked_softmax_op, softmax_op

    op = softmax_op()
    return op is not None and bind(model, cpu_softmax=op, cpu_causal=causal_softmax_op(),
                                   cpu_masked=masked_softmax_op())


def bind(
    model: Any,
    *,
    fold_prefill: bool = False,
    buckets: bool = False,
    suffix_fold: bool = False,
    cpu_softmax: Callable[[mx.array], mx.array] | None = None,
    cpu_causal: Callable[[mx.array, int, int], mx.array] | None = None,
    cpu_masked: MaskedSoftmax | None = None,
) -> bool:
    """Rebind the model module's attention to :func:`masked_dispatch` on any device (benchmarks, tests).

    ``fold_prefill``: whether prefill calls of new shapes fold too;
    ``buckets``: whether the other prefill calls run at bucketed shapes;
    ``suffix_fold``: whether short prefills over a cached prefix fold over
    the cache's buffer (:mod:`._suffix_fold`; before the two above);
    ``cpu_softmax``: every float32 call as folded products with this
    softmax (the CPU's native one); ``cpu_causal``: its causal rows, for
    ``"causal"`` prefill calls; ``cpu_masked``: its masked rows, for boolean
    mask arrays (for every model the dispatch serves in this process).
    """
    global _fold_prefill, _buckets, _suffix_fold, _cpu_softmax, _cpu_causal, _cpu_masked
    _fold_prefill = fold_prefill
    _buckets = buckets
    _suffix_fold = suffix_fold
    _cpu_softmax = cpu_softmax
    _cpu_causal = cpu_causal if cpu_softmax is not None else None
    _cpu_masked = cpu_masked if cpu_softmax is not None else None
    module = sys.modules.get(type(model).__module__)
    if module is None or getattr(module, "scaled_dot_product_attention", None) not in (
        _ORIGINAL, masked_dispatch
    ):
        return False
    # NOTE: a module-global rebinding: every instance of this architecture in
    # the process takes it; masked_dispatch() leaves every other call to mlx-lm.
    module.scaled_dot_product_attention = masked_dispatch  # type: ignore[attr-defined]
    return True


def unbind(model: Any) -> None:
    """Give the model module mlx-lm's own attention back (benchmarks, tests)."""
    global _fold_prefill, _buckets, _suffix_fold, _cpu_softmax, _cpu_causal, _cpu_masked
    _fold_prefill = False
    _buckets = False
    _suffix_fold = False
    _cpu_softmax = None
    _cpu_causal = None
    _cpu_masked = None
    module = sys.modules.get(type(model).__module__)
    if module is not None and getattr(module, "scaled_dot_product_attention", None) is masked_dispatch:
        module.scaled_dot_product_attention = _ORIGINAL  # type: ignore[attr-defined]
