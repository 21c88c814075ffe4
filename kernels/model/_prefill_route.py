"""Which prefill attention calls run as folded products instead of cuDNN: the shapes whose graph is not built.

MLX 0.32's CUDA backend runs a query of two or more positions through
cuDNN's fused attention and keeps one cuDNN graph per exact shape (query,
key and value shapes and strides, the mask's shape; an LRU of
``MLX_CUDA_SDPA_CACHE_SIZE`` graphs, 256 by default, per thread). Building
one took 40-65 ms on the H200, once per model step (every layer has the
same shape), where the warm call costs 0.3-3 ms a step for the shapes a
served batch lane makes (``tools/bench/sdpa_shapes.py``). A served lane
rarely repeats a shape: every join has its own group size, suffix length
and cached length, so an agent's turn (one row, 24 new tokens over a cached
5,100) paid ~65 ms of graph build for ~2 ms of attention.

:class:`ShapeMemory` mirrors that cache on the engine thread. A shape seen
before goes to cuDNN (its graph is warm). A new shape with at most
:data:`FOLD_SCORES` attention scores a call runs as folded products
(:func:`kernels.model.masked_attention`; 5-35 ms a step at the measured
shapes against 45-75 ms for a build) and is remembered, so a shape that
comes back builds its graph on its second sighting and is warm from then
on. A new larger shape goes to cuDNN (its build is a smaller share of the
step).

Only the decision lives here; ``_masked_attention.masked_dispatch`` acts on
it when ``KVTIER_CUDA_PREFILL_FOLD=on`` (off by default: served runs and an
in-process join with every shape new did not move with it; a new shape
costs the step more than its attention's graph).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import mlx.core as mx

from kernels._env import env_text

__all__ = [
    "FOLD_SCORES",
    "SDPA_CACHE_ENV",
    "ShapeMemory",
    "causal_mask",
    "prefill_key",
    "shape_memory",
]

FOLD_SCORES = 1 << 27
"""Most attention scores (rows x query heads x queries x keys) a new shape may have and still be folded.

NOTE: on the H200 (8B shape, 32 layers a step), folded products cost
~11 ms per 2^30 scores a step plus ~5 ms; a graph build 40-65 ms. At 2^27
a call (2^32 a step) the folded step costs about what a build does, so a
new shape up to here is cheaper folded, and a larger one is cheaper built.
"""

SDPA_CACHE_ENV = "MLX_CUDA_SDPA_CACHE_SIZE"
"""MLX's variable for its cuDNN graph cache's capacity (read here to mirror it)."""

_DEFAULT_CAPACITY = 256
"""MLX 0.32's default capacity of that cache."""


def _capacity() -> int:
    text = env_text(SDPA_CACHE_ENV)
    if text is None:
        return _DEFAULT_CAPACITY
    try:
        return max(0, int(text))
    except ValueError:
        return _DEFAULT_CAPACITY


class ShapeMemory:
    """The shapes this thread has sent to cuDNN (an LRU as MLX keeps its graphs), and those seen once and folded."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._built: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self._seen: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self.folded = 0
        self.built = 0
        self.warm = 0

    def fold(self, key: tuple[Any, ...], scores: int, *, limit: int = FOLD_SCORES) -> bool:
        """Whether this call runs folded; records what cuDNN will have built otherwise.

        A key built before: cuDNN (warm). A new key with at most ``limit``
        scores seen for the first time: folded, and remembered. Otherwise
        (a second sighting, or too many scores): cuDNN, which builds it.
        """
        if key in self._built:
            self._built.move_to_end(key)
            self.warm += 1
            return False
        if scores <= limit and key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            self.folded += 1
            return True
        self._seen.pop(key, None)
        self._built[key] = None
        if len(self._built) > self.capacity:
            self._built.popitem(last=False)
        self.built += 1
        return False


_local = threading.local()


def shape_memory() -> ShapeMemory:
    """This thread's :class:`ShapeMemory` (MLX keeps its graphs per thread too)."""
    memory: ShapeMemory | None = getattr(_local, "memory", None)
    if memory is None:
        memory = ShapeMemory(_capacity())
        _local.memory = memory
    return memory


def prefill_key(queries: mx.array, keys: mx.array, cache: Any, mask: Any) -> tuple[Any, ...]:
    """What MLX keys a cuDNN graph on, as far as Python sees it.

    NOTE: MLX's key holds the keys' strides, which follow the cache's buffer
    (a slice of it); the buffer's length stands for them where the cache has
    one (mlx-lm's ``KVCache`` and ``BatchKVCache`` keep it as ``keys``).
    """
    buffer = getattr(cache, "keys", None)
    span = buffer.shape[2] if isinstance(buffer, mx.array) and buffer.ndim == 4 else None
    masking: Any = mask if isinstance(mask, str) else (tuple(mask.shape), str(mask.dtype))
    return (tuple(queries.shape), tuple(keys.shape), span, masking, str(queries.dtype))


def causal_mask(length: int, keys: int) -> mx.array:
    """``(L, T)`` boolean: query ``i`` sees keys up to ``T - L + i`` (MLX's bottom-right ``"causal"``)."""
    rows = mx.arange(length)[:, None] + (keys - length)
    return mx.arange(keys)[None, :] <= rows
