"""Host bytes to caches (engine thread): :func:`materialize` builds MLX arrays
and mlx-lm cache objects from a :class:`HostEntry`, plain KV with step-rounded
slack so the next decode step writes in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from ._kv_format import (
    _DTYPES,
    _MAMBA_CLS,
    _MIN_OFFSET_ATTR,
    _STAMP_ATTR,
    HostEntry,
    KvFileHeader,
    LayerRecord,
    TensorRecord,
    _mlc,
)

__all__ = [
    "materialize",
]


# --- restore (engine thread) -------------------------------------------------------


def _array(rec: TensorRecord, buf: bytearray) -> Any:
    dt = _DTYPES[rec.dtype]
    if rec.nbytes == 0:
        return mx.zeros(rec.shape, dtype=dt)
    # NOTE: mx.array copies the buffer at construction, so the result never
    # aliases host memory the caller may reuse or free.
    src: Any = memoryview(buf)
    return mx.array(src).view(dt).reshape(rec.shape)


def _with_slack(a: Any, capacity: int) -> Any:
    pad = capacity - a.shape[2]
    if pad <= 0:
        return a
    shape = (*a.shape[:2], pad, *a.shape[3:])
    return mx.concatenate([a, mx.zeros(shape, dtype=a.dtype)], axis=2)


def _padded(a: Any, capacity: int) -> Any:
    """``a`` with slack up to ``capacity`` on its token axis, evaluated now.

    NOTE: evaluated here so the unpadded copy is dropped before the next
    tensor is copied (one tensor's worth of extra memory at a time).
    """
    out = _with_slack(a, capacity)
    mx.eval(out)
    return out


def materialize(
    header: KvFileHeader, host: HostEntry, *, step: int = 256, consume: bool = False
) -> list[Any]:
    """Build the cache objects from host bytes (engine thread).

    Plain and quantized KV buffers get capacity ``ceil((offset + 1) / step) *
    step`` so the next decode step writes in place; rotating buffers are
    restored exactly. All arrays are evaluated before returning and none
    references ``host``.

    Tensors are copied one at a time, each evaluated (slack included) before
    the next is read. With ``consume`` each host buffer is emptied as soon
    as its copy exists, so peak memory is the restored entry plus about one
    tensor instead of the whole entry twice; ``host`` is unusable afterwards.
    """
    if host.header_hash != header.header_hash or len(host.buffers) != len(header.tensors):
        raise ValueError("host entry does not belong to this header")
    if any(len(b) != t.nbytes for t, b in zip(header.tensors, host.buffers, strict=True)):
        raise ValueError("host entry was already consumed")
    if step < 1:
        raise ValueError("step must be positive")
    arrays = _copies(header, host, consume=consume)
    caches = [_build(layer, arrays, step) for layer in header.layers]
    mx.eval(*[a for c in caches for a in _cache_arrays(c)])
    return caches


def _copies(header: KvFileHeader, host: HostEntry, *, consume: bool) -> Iterator[Any]:
    """Each tensor as an evaluated MLX array, in file order (lazily, one at a time)."""
    for rec, buf in zip(header.tensors, host.buffers, strict=True):
        a = _array(rec, buf)
        mx.eval(a)
        if consume:
            # NOTE: the array owns a copy now (mx.array copies at
            # construction) and no view of the buffer is left, so it can
            # be freed before the next tensor is copied.
            buf.clear()
        yield a


def _build(layer: LayerRecord, arrays: Iterator[Any], step: int) -> Any:
    kind = layer.kind
    out: Any
    capacity = -(-(layer.offset + 1) // step) * step
    if kind == "kv":
        out = _mlc.KVCache()
        if layer.tensors:
            out.keys = _padded(next(arrays), capacity)
            out.values = _padded(next(arrays), capacity)
            out.offset = layer.offset
    elif kind == "quantized":
        assert layer.bits is not None
        assert layer.group_size is not None
        out = _mlc.QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
        if layer.tensors:
            n = len(layer.tensors) // 2
            parts = [_padded(next(arrays), capacity) for _ in range(2 * n)]
            out.keys, out.values = tuple(parts[:n]), tuple(parts[n:])
            out.offset = layer.offset
    elif kind == "rotating":
        out = _mlc.RotatingKVCache(max_size=layer.max_size, keep=layer.keep)
        if layer.tensors:
            out.keys = next(arrays)
            out.values = next(arrays)
        out.offset = layer.offset
        out._idx = layer.idx
    elif kind in ("arrays", "mamba"):
        assert layer.slots is not None
        cls = _MAMBA_CLS if kind == "mamba" and _MAMBA_CLS is not None else _mlc.ArraysCache
        out = cls.__new__(cls)
        _mlc.ArraysCache.__init__(out, layer.slots)
        for t in layer.tensors:
            a = next(arrays)
            if t.name == "left_padding":
                out.left_padding = a
            elif t.name == "lengths":
                out.lengths = a
            else:
                out.cache[int(t.name[len("state.") :])] = a
        if layer.offset:
            setattr(out, _STAMP_ATTR, layer.offset)
    else:
        out = _mlc.CacheList(*(_build(c, arrays, step) for c in layer.children))
    if layer.min_reusable_offset is not None:
        setattr(out, _MIN_OFFSET_ATTR, layer.min_reusable_offset)
    return out


def _cache_arrays(c: Any) -> list[Any]:
    if type(c) is _mlc.CacheList:
        return [a for x in c.caches for a in _cache_arrays(x)]
    if isinstance(c, _mlc.ArraysCache):
        extra = [getattr(c, "left_padding", None), getattr(c, "lengths", None)]
        return [a for a in (*c.cache, *extra) if a is not None]
    keys, values = c.keys, c.values
    if keys is None:
        return []
    if isinstance(keys, tuple):
        return [*keys, *values]
    return [keys, values]
