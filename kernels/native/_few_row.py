"""The few-row product as an MLX operation: availability, the switch, the thread count.

:func:`few_row_op` returns a callable ``(x, w) -> x @ w.T`` for float32
arrays on the CPU stream whose every output row is computed alone (the same
bits whatever other rows share the call), or ``None`` where it is switched
off or cannot run here (:func:`few_row_status` says why). The first call
builds or loads the extension (``_build.py``) and checks it against MLX's
own product on random data before trusting it. Every failure of that
(build, import, a missing symbol, an error or a wrong answer from the check,
an untrusted cache directory) becomes :class:`NativeUnavailable`, so the
model loads with MLX's product and the status says why; a module that fails
its check is discarded (``discard_build``). The outcome is kept for the
life of the process. Engine thread only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx

from kernels._env import env_switch, env_text

from ._build import NativeUnavailable, discard_build, load_extension

__all__ = [
    "FEW_ROW_ENV",
    "FEW_ROW_THREADS_ENV",
    "few_row_enabled",
    "few_row_op",
    "few_row_status",
    "few_row_threads",
]

FEW_ROW_ENV = "KVTIER_FEW_ROW"
"""Environment switch: ``0`` keeps MLX's product for one-token steps on the CPU."""

FEW_ROW_THREADS_ENV = "KVTIER_FEW_ROW_THREADS"
"""Threads of one product (default: the usable CPUs, at most 8)."""

_state: dict[str, Any] = {}


def few_row_enabled(env: Mapping[str, str] | None = None) -> bool:
    """False when ``KVTIER_FEW_ROW`` is ``0``/``false``/``off``/``no`` (default: enabled)."""
    return env_switch(FEW_ROW_ENV, env)


def few_row_threads(env: Mapping[str, str] | None = None) -> int:
    """Threads per product: ``KVTIER_FEW_ROW_THREADS`` (1-16), else the usable CPUs clamped to 1-8."""
    raw = env_text(FEW_ROW_THREADS_ENV, env)
    if raw is not None:
        try:
            value = int(raw)
        except ValueError as exc:
            raise ValueError(f"{FEW_ROW_THREADS_ENV} must be an integer, got {raw!r}") from exc
        if not 1 <= value <= 16:
            raise ValueError(f"{FEW_ROW_THREADS_ENV} must be 1-16, got {value}")
        return value
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def _check(fn: Callable[[mx.array, mx.array], mx.array]) -> None:
    """The product against MLX's on random data, and row independence; raises NativeUnavailable."""
    key = mx.random.key(7)
    kx, kw = mx.random.split(key)
    x = mx.random.normal((6, 200), key=kx)
    w = mx.random.normal((70, 200), key=kw)
    try:
        got = fn(x, w)
        ref = x @ w.T
        alone = fn(x[4:5], w)
        mx.eval(got, ref, alone)
        agrees = got.shape == ref.shape and mx.allclose(got, ref, rtol=1e-4, atol=1e-3).item()
        alone_equal = agrees and mx.array_equal(alone[0], got[4]).item()
    except (RuntimeError, TypeError, ValueError) as exc:
        # NOTE: what MLX and nanobind raise for a module built against
        # another ABI or a kernel that refuses its inputs.
        raise NativeUnavailable(f"the few-row extension failed its check: {exc}") from exc
    if not agrees:
        raise NativeUnavailable("the few-row extension disagrees with MLX's product")
    if not alone_equal:
        raise NativeUnavailable("the few-row extension's rows depend on each other")


def few_row_op() -> Callable[[mx.array, mx.array], mx.array] | None:
    """``(x, w) -> x @ w.T`` through the extension, or ``None`` (switched off, or unavailable here)."""
    if "op" in _state:
        op: Callable[[mx.array, mx.array], mx.array] | None = _state["op"]
        return op
    if not few_row_enabled():
        _state["op"], _state["status"] = None, f"off ({FEW_ROW_ENV}=0)"
        return None
    try:
        threads = few_row_threads()
    except ValueError as exc:
        _state["op"], _state["status"] = None, f"unavailable: {exc}"
        return None
    try:
        fn = _checked_product(threads)
    except (NativeUnavailable, OSError) as exc:
        _state["op"], _state["status"] = None, f"unavailable: {exc}"
        return None
    _state["op"], _state["status"] = fn, f"on ({threads} threads)"
    return fn


def _checked_product(threads: int) -> Callable[[mx.array, mx.array], mx.array]:
    """Load the module, wrap its product, check it; a module failing the check is discarded."""
    module = load_extension()
    raw = getattr(module, "few_row", None)
    if not callable(raw):
        reason = "the few-row extension has no few_row function"
        discard_build(reason)
        raise NativeUnavailable(reason)

    def fn(x: mx.array, w: mx.array) -> mx.array:
        out: mx.array = raw(x, w, threads)
        return out

    try:
        # NOTE: against MLX's product ON THE CPU (the extension's device): on a
        # GPU host MLX's default device is the GPU, whose TF32 products the CPU
        # kernel cannot match to 1e-4, even where the replicas run on the CPU.
        with mx.stream(mx.cpu):
            _check(fn)
    except NativeUnavailable as exc:
        discard_build(str(exc))
        raise
    return fn


def few_row_status() -> str:
    """What :func:`few_row_op` decided (``"not tried"`` before its first call)."""
    return str(_state.get("status", "not tried"))
