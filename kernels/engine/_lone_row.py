"""The attention mask of a row that prefills alone in the batch lane: the serial lane's ``"causal"``.

mlx-lm's ``BatchKVCache.make_mask`` always builds an array mask (rows may
be left-padded). A row prefilling alone (a batch of one, merged from one
cache: its left padding is 0, and nothing pads a one-row prompt) needs
none: the causal mask of its own keys is exactly what the serial lane's
``KVCache`` asks for with the string ``"causal"``. The difference is the
kernel: on MLX's CUDA backend an array mask takes attention off the fused
path, and the batch lane's prefill of a 4,421-token chat prompt took 354 ms
against the serial lane's 194 ms (H200, 8B shape, docs/benchmarks.md #20).

The mask is swapped per cache instance (an instance attribute shadows the
class's method; ``type(cache) is BatchKVCache`` stays true, which the slot
reuse of ``_greedy`` checks), only for prefill forwards (``N > 1``), and
taken back off before the row's cache joins the decode batch, where rows
are padded and slots are reused. The instance holds its cache weakly: a
strong reference would make a cycle that keeps GBs of keys alive until the
garbage collector's next full pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from mlx_lm.models.cache import BatchKVCache

__all__ = ["lone_row_masks", "plain_masks"]


class _LoneRowMask:
    """``make_mask`` of a one-row batch cache: ``"causal"`` for a prefill chunk, else the cache's own."""

    __slots__ = ("_cache",)

    def __init__(self, cache: BatchKVCache) -> None:
        self._cache = weakref.ref(cache)

    def __call__(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        cache = self._cache()
        assert cache is not None, "a mask asked of a cache that is gone"
        if (
            N > 1
            and not return_array
            and kwargs.get("window_size") is None
            and tuple(cache.left_padding.shape) == (1,)
            and getattr(cache, "_right_padding", None) is None
        ):
            return "causal"
        return BatchKVCache.make_mask(cache, N, return_array=return_array, **kwargs)


def lone_row_masks(caches: Iterable[Any]) -> None:
    """Give each plain batch cache of a row prefilling alone the serial lane's causal mask."""
    for cache in caches:
        if type(cache) is BatchKVCache:
            cache.make_mask = _LoneRowMask(cache)  # type: ignore[method-assign]


def plain_masks(caches: Iterable[Any]) -> None:
    """Take :func:`lone_row_masks` back off (the row's cache joins a batch that pads rows)."""
    for cache in caches:
        if type(cache) is BatchKVCache:
            cache.__dict__.pop("make_mask", None)
