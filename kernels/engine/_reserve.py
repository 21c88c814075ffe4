"""Room in a batch cache's buffers for the prefill still to come, made once.

mlx-lm's ``BatchKVCache`` grows its key and value buffers when a forward
would pass their end: a new buffer rounded up to 256 tokens past the
forward's tokens, the old contents copied in. Merged from lent prefixes, a
group's buffers are exactly as long as the longest prefix, so the group's
first prefill chunk copies the whole merged cache again; a cold row's
prefill grows by one chunk at a time, copying everything cached so far at
every chunk (a 5,100-token prompt in 256-token chunks copies about ten times
its final size). On the CPU those copies are memory bandwidth the forward
needs: seven rows over a lent 5,100-token prefix of the default model
(235 MB of KV a row) joined in 2.6 s, of which the merge took 0.7-0.9 s and
the growth most of the rest of the copying.

:func:`merge_with_room` merges with the room already there;
:func:`reserve` grows once to what the rest of the prefill needs. Neither
changes what attention reads (``keys[..., :_idx]``), only when the buffers
are allocated and how often they are copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

__all__ = ["merge_with_room", "reserve"]


def _capacity(tokens: int, step: int) -> int:
    return -(-tokens // step) * step


def merge_with_room(caches: Sequence[Any], room: int) -> Any:
    """mlx-lm's ``BatchKVCache.merge`` of plain ``KVCache`` layers, its buffers with ``room`` more tokens.

    The capacity is rounded up to the cache's step. Falls back to the first
    layer's own merge (mlx-lm's way) where there is no room to make, nothing
    cached yet (no buffer to take the heads and widths from) or a layer of
    another class.
    """
    if room <= 0 or any(type(c) is not KVCache for c in caches):
        return caches[0].merge(list(caches))
    lengths = [c.size() for c in caches]
    longest = max(lengths, default=0)
    if longest == 0:
        return caches[0].merge(list(caches))
    held = [c for c in caches if c.keys is not None]
    heads = max(c.keys.shape[1] for c in held)
    key_width = max(c.keys.shape[3] for c in held)
    value_width = max(c.values.shape[3] for c in held)
    dtype = held[0].keys.dtype
    padding = [longest - n for n in lengths]
    capacity = _capacity(longest + room, BatchKVCache.step)
    keys = mx.zeros((len(caches), heads, capacity, key_width), dtype=dtype)
    values = mx.zeros((len(caches), heads, capacity, value_width), dtype=dtype)
    for i, (pad, c) in enumerate(zip(padding, caches, strict=True)):
        if c.keys is None:
            continue
        keys[i : i + 1, :, pad : pad + c.offset] = c.keys[..., : c.offset, :]
        values[i : i + 1, :, pad : pad + c.offset] = c.values[..., : c.offset, :]
    # NOTE: Any: mlx-lm types the fresh cache's buffers as None.
    merged: Any = BatchKVCache(padding)
    merged.keys = keys
    merged.values = values
    # NOTE: as mlx-lm's merge: each row's offset is its length (-padding + longest).
    merged.offset += longest
    merged._idx = longest
    return merged


def reserve(caches: Sequence[Any], tokens: int) -> int:
    """Grow each ``BatchKVCache`` layer once to hold ``tokens`` more; the layers grown.

    A layer that already has the room, holds nothing yet, or is of another
    class is left as it is (its own growth applies).
    """
    grown = 0
    if tokens <= 0:
        return grown
    for layer in caches:
        if type(layer) is not BatchKVCache:
            continue
        c: Any = layer
        if c.keys is None:
            continue
        used = c._idx
        if used + tokens <= c.keys.shape[2]:
            continue
        b, h, _, dk = c.keys.shape
        extra = _capacity(used + tokens, c.step) - used
        # NOTE: one concatenation, as mlx-lm's own growth writes it.
        c.keys = mx.concatenate(
            [c.keys[..., :used, :], mx.zeros((b, h, extra, dk), dtype=c.keys.dtype)], axis=2)
        c.values = mx.concatenate(
            [c.values[..., :used, :],
             mx.zeros((b, h, extra, c.values.shape[3]), dtype=c.values.dtype)], axis=2)
        grown += 1
    return grown
