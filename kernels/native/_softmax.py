"""The native softmax as an MLX operation: availability, the switch, the check.

:func:`softmax_op` returns a callable ``x -> softmax(x, axis=-1)`` for
float32 arrays on the CPU stream (``src/softmax.c``: an 8-lane exp where
MLX's CPU backend on x86 calls ``expf`` per element), or ``None`` where it is
switched off or cannot run here (:func:`softmax_status` says why). The
first call loads the extension the few-row product lives in (built on demand,
``_build.py``) and checks the operation against MLX's softmax on random rows
before trusting it, and that a row's result does not change with leading
hidden elements nor with the threads its rows are split across (as many as
the few-row product uses, :func:`few_row_threads`). Every failure becomes a status and ``None``, so attention
keeps MLX's softmax. The outcome is kept for the life of the process.
Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx

from kernels._env import env_switch

from ._build import NativeUnavailable, cpu_supports_kernel, load_extension
from ._few_row import few_row_threads

__all__ = [
    "NATIVE_SOFTMAX_ENV",
    "MaskedSoftmax",
    "causal_softmax_op",
    "masked_softmax_op",
    "native_softmax_enabled",
    "softmax_op",
    "softmax_status",
]

NATIVE_SOFTMAX_ENV = "KVTIER_NATIVE_SOFTMAX"
"""Environment switch: ``0`` keeps MLX's softmax in attention on the CPU."""

_state: dict[str, Any] = {}


def native_softmax_enabled(env: Mapping[str, str] | None = None) -> bool:
    """False when ``KVTIER_NATIVE_SOFTMAX`` is ``0``/``false``/``off``/``no`` (default: enabled)."""
    return env_switch(NATIVE_SOFTMAX_ENV, env)


def _check(fn: Callable[[mx.array], mx.array]) -> None:
    """The op against MLX's softmax, and leading hidden elements changing nothing; raises NativeUnavailable."""
    x = mx.random.normal((5, 3, 77), key=mx.random.key(11)) * 4.0
    hidden = mx.full((5, 3, 13), mx.finfo(mx.float32).min)
    try:
        got = fn(x)
        ref = mx.softmax(x, axis=-1, precise=True)
        padded = fn(mx.concatenate([hidden, x], axis=-1))
        mx.eval(got, ref, padded)
        agrees = got.shape == ref.shape and mx.allclose(got, ref, rtol=1e-5, atol=1e-7).item()
        same = agrees and mx.array_equal(padded[..., 13:], got).item() and not mx.any(padded[..., :13]).item()
    except (RuntimeError, TypeError, ValueError) as exc:
        raise NativeUnavailable(f"the native softmax failed its check: {exc}") from exc
    if not agrees:
        raise NativeUnavailable("the native softmax disagrees with MLX's")
    if not same:
        raise NativeUnavailable("the native softmax's rows change with leading hidden elements")


def _check_split(split: mx.array, whole: mx.array) -> None:
    """The same rows computed split across threads and on one: the same bits; raises NativeUnavailable."""
    try:
        same = mx.array_equal(split, whole).item()
    except (RuntimeError, TypeError, ValueError) as exc:
        raise NativeUnavailable(f"the native softmax failed its check: {exc}") from exc
    if not same:
        raise NativeUnavailable("the native softmax's rows change with the threads they run on")


SPLIT_CHECK_SHAPE = (3, 40, 1100)
"""A check input large enough to be split across threads (the kernel splits from 2^15 elements a thread)."""


def _check_causal(fn: Callable[[mx.array, int, int], mx.array]) -> None:
    """The causal rows against MLX's softmax under the same bottom-right mask; raises NativeUnavailable."""
    period, offset, n = 5, 9, 14
    x = mx.random.normal((2, 3 * period, n), key=mx.random.key(12)) * 4.0
    query = mx.arange(3 * period)[:, None] % period
    seen = mx.arange(n)[None, :] <= query + offset
    try:
        got = fn(x, period, offset)
        ref = mx.softmax(mx.where(seen, x, mx.finfo(mx.float32).min), axis=-1, precise=True)
        mx.eval(got, ref)
        agrees = mx.allclose(got, ref, rtol=1e-5, atol=1e-7).item() and not mx.any(mx.where(seen, 0.0, got)).item()
    except (RuntimeError, TypeError, ValueError) as exc:
        raise NativeUnavailable(f"the native causal softmax failed its check: {exc}") from exc
    if not agrees:
        raise NativeUnavailable("the native causal softmax disagrees with MLX's")


def _raw(name: str) -> Callable[..., mx.array]:
    """The extension's function ``name``; raises NativeUnavailable where the module lacks it."""
    raw = getattr(load_extension(), name, None)
    if not callable(raw):
        raise NativeUnavailable(f"the extension has no {name} function")
    fn: Callable[..., mx.array] = raw
    return fn


def causal_softmax_op() -> Callable[[mx.array, int, int], mx.array] | None:
    """``(x, period, offset) -> softmax`` where row ``r`` sees its first ``offset + r % period + 1`` elements, or ``None``.

    Available when :func:`softmax_op` is (same extension, same switch) and
    its own check passes.
    """
    if "causal" in _state:
        op: Callable[[mx.array, int, int], mx.array] | None = _state["causal"]
        return op
    _state["causal"] = None
    if softmax_op() is None:
        return None
    try:
        raw = _raw("softmax_causal")
        threads = few_row_threads()

        def fn(x: mx.array, period: int, offset: int) -> mx.array:
            out: mx.array = raw(x, period, offset, threads)
            return out

        with mx.stream(mx.cpu):  # NOTE: the extension's device, whatever the default (_few_row).
            _check_causal(fn)
            big = mx.random.normal(SPLIT_CHECK_SHAPE, key=mx.random.key(13)) * 4.0
            _check_split(fn(big, 7, 900), raw(big, 7, 900, 1))
    except (NativeUnavailable, OSError) as exc:
        _state["status"] = f"on (causal rows unavailable: {exc})"
        return None
    _state["causal"] = fn
    return fn


MaskedSoftmax = Callable[[mx.array, mx.array, int, int, int], mx.array]
"""``(x, mask, per_batch, mask_batches, period) -> weights``: x row ``g`` under mask row
``((g // per_batch) % mask_batches) * period + (g % per_batch) % period`` (False hides)."""


def _check_masked(fn: MaskedSoftmax, plain: Callable[[mx.array], mx.array]) -> None:
    """The masked rows against ``where`` then the plain rows, bit for bit; raises NativeUnavailable."""
    b, heads, length, n = 2, 3, 5, 14
    x = mx.random.normal((b, heads * length, n), key=mx.random.key(14)) * 4.0
    pad = mx.array([0, 4])[:, None, None]
    k = mx.arange(n)[None, None, :]
    mask = (k >= pad) & (k <= mx.arange(length)[None, :, None] + n - length)
    rows = mx.broadcast_to(mask[:, None], (b, heads, length, n)).reshape(b, heads * length, n)
    try:
        got = fn(x, mask, heads * length, b, length)
        ref = plain(mx.where(rows, x, mx.finfo(mx.float32).min))
        same = mx.array_equal(got, ref).item()
    except (RuntimeError, TypeError, ValueError) as exc:
        raise NativeUnavailable(f"the native masked softmax failed its check: {exc}") from exc
    if not same:
        raise NativeUnavailable("the native masked softmax disagrees with where and the plain rows")


def masked_softmax_op() -> MaskedSoftmax | None:
    """The masked rows (:data:`MaskedSoftmax`: ``where(mask, x, lowest)`` and the softmax in one pass), or ``None``.

    Available when :func:`softmax_op` is (same extension, same switch) and
    its own check passes: the same bits as ``where`` then the plain rows.
    """
    if "masked" in _state:
        op: MaskedSoftmax | None = _state["masked"]
        return op
    _state["masked"] = None
    plain = softmax_op()
    if plain is None:
        return None
    try:
        raw = _raw("softmax_masked")
        threads = few_row_threads()

        def fn(x: mx.array, mask: mx.array, per_batch: int, mask_batches: int, period: int) -> mx.array:
            out: mx.array = raw(x, mask, per_batch, mask_batches, period, threads)
            return out

        with mx.stream(mx.cpu):  # NOTE: the extension's device, whatever the default (_few_row).
            _check_masked(fn, plain)
            big = mx.random.normal(SPLIT_CHECK_SHAPE, key=mx.random.key(15)) * 4.0
            rows, n = SPLIT_CHECK_SHAPE[1], SPLIT_CHECK_SHAPE[2]
            mask = mx.random.uniform(shape=(SPLIT_CHECK_SHAPE[0] * rows, n), key=mx.random.key(16)) > 0.2
            _check_split(fn(big, mask, rows, SPLIT_CHECK_SHAPE[0], rows),
                         raw(big, mask, rows, SPLIT_CHECK_SHAPE[0], rows, 1))
    except (NativeUnavailable, OSError) as exc:
        _state["status"] = f"{_state.get('status', 'on')} (masked rows unavailable: {exc})"
        return None
    _state["masked"] = fn
    return fn


def softmax_op() -> Callable[[mx.array], mx.array] | None:
    """``x -> softmax(x, axis=-1)`` for float32 through the extension, or ``None`` (switched off, or unavailable here)."""
    if "op" in _state:
        op: Callable[[mx.array], mx.array] | None = _state["op"]
        return op
    if not native_softmax_enabled():
        _state["op"], _state["status"] = None, f"off ({NATIVE_SOFTMAX_ENV}=0)"
        return None
    if not cpu_supports_kernel():
        _state["op"], _state["status"] = None, "unavailable: this CPU lacks AVX2 and FMA"
        return None
    try:
        raw = _raw("softmax")
        threads = few_row_threads()

        def fn(x: mx.array) -> mx.array:
            out: mx.array = raw(x, threads)
            return out

        with mx.stream(mx.cpu):  # NOTE: the extension's device, whatever the default (_few_row).
            _check(fn)
            big = mx.random.normal(SPLIT_CHECK_SHAPE, key=mx.random.key(13)) * 4.0
            _check_split(fn(big), raw(big, 1))
    except (NativeUnavailable, OSError) as exc:
        _state["op"], _state["status"] = None, f"unavailable: {exc}"
        return None
    _state["op"], _state["status"] = fn, f"on ({threads} threads)"
    return fn


def softmax_status() -> str:
    """What :func:`softmax_op` decided (``"not tried"`` before its first call)."""
    return str(_state.get("status", "not tried"))
