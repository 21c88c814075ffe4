"""Adapters over mlx-lm's per-layer cache classes: signature, trim, bytes, clone.

Every cache that can reach the prompt cache, the scheduler or the file codec
goes through :func:`adapter_for`, which dispatches on the *exact* class: an
unknown class (or a subclass nobody declared) raises
:class:`UnsupportedCacheKind` where it enters, never routes silently.

Signatures (stable storage identity):

| class | signature | trimmable |
|---|---|---|
| ``KVCache`` | ``kv:plain`` | yes |
| ``QuantizedKVCache`` | ``kv:quant:<bits>:<group>`` | yes |
| ``RotatingKVCache`` | ``kv:rotating-plain`` | only before it wraps |
| ``ArraysCache`` (Mamba / linear-attention state) | ``ssm`` | never |
| ``CacheList`` | ``list(<sig>,<sig>,...)`` | when every member is |

mlx-lm 0.32 has no quantized rotating cache, so ``kv:rotating-quant`` never
arises; rotating layers keep their plain dtype under a KV scheme.

All functions here touch MLX arrays and run on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

__all__ = [
    "CacheAdapter",
    "CacheNotTrimmable",
    "UnsupportedCacheKind",
    "adapter_for",
    "cache_arrays",
    "cache_signature",
    "caches_min_reusable_offset",
    "caches_nbytes",
    "caches_offset",
    "caches_trimmable",
    "clone_caches",
    "declare_min_reusable_offset",
    "declared_min_reusable_offset",
    "snapshot_cuttable",
    "trim_caches",
]

# NOTE: an attribute, not a subclass, so mlx-lm's own classes can carry an
# irreversible-transition bound and clones inherit it (see "Minimum reusable
# offsets" in the residency spec).
_MIN_OFFSET_ATTR = "_kvtier_min_reusable_offset"


class UnsupportedCacheKind(TypeError):
    """A cache object of a class kvtier has no adapter for (never routed silently)."""

    def __init__(self, cache: object) -> None:
        cls = type(cache)
        super().__init__(f"no cache adapter for {cls.__module__}.{cls.__qualname__}")
        self.cache_class = cls


class CacheNotTrimmable(ValueError):
    """A trim was asked of a cache that cannot drop tokens (wrapped ring, recurrent state)."""


def _slice_tokens(x: mx.array, n: int) -> mx.array:
    # NOTE: basic slicing yields a new array object sharing the buffer (no copy);
    # MLX copies a shared buffer on the first in-place update, so writes to
    # the result never reach the donor.
    return x[..., :n, :]


@dataclass(frozen=True)
class CacheAdapter:
    """The capabilities of one cache class, as plain functions over an instance."""

    cache_type: type
    signature: Callable[[Any], str]
    offset: Callable[[Any], int]
    is_trimmable: Callable[[Any], bool]
    trim: Callable[[Any, int], int]
    arrays: Callable[[Any], list[mx.array]]
    bytes_per_token: Callable[[Any], int]
    clone: Callable[[Any, int], Any]
    """``clone(cache, n)``: a new cache of zero-copy views covering the first ``n`` tokens."""
    natural_min_offset: Callable[[Any], int]

    def nbytes(self, cache: Any) -> int:
        """Bytes of the arrays the cache references (a view counts its view size)."""
        return sum(a.nbytes for a in self.arrays(cache))

    def minimum_reusable_offset(self, cache: Any) -> int:
        """The shortest prefix this cache may be trimmed to and still be valid."""
        return max(declared_min_reusable_offset(cache), self.natural_min_offset(cache))


def _copy_min_offset(src: Any, dst: Any) -> Any:
    if hasattr(src, _MIN_OFFSET_ATTR):
        setattr(dst, _MIN_OFFSET_ATTR, getattr(src, _MIN_OFFSET_ATTR))
    return dst


def declared_min_reusable_offset(cache: object) -> int:
    """The bound an irreversible transition declared on ``cache`` (0 when none did)."""
    return int(getattr(cache, _MIN_OFFSET_ATTR, 0))


def declare_min_reusable_offset(cache: object, offset: int) -> None:
    """Raise ``cache``'s minimum reusable offset to at least ``offset`` (never lowers it).

    For irreversible transitions (a delayed KV conversion): a prefix shorter
    than ``offset`` no longer has the representation a fresh run would give it.
    """
    setattr(cache, _MIN_OFFSET_ATTR, max(declared_min_reusable_offset(cache), offset))


def _plain_trim(cache: Any, n: int) -> int:
    return int(cache.trim(n))


# --- KVCache ---------------------------------------------------------------


def _kv_arrays(c: Any) -> list[mx.array]:
    return [] if c.keys is None else [c.keys, c.values]


def _kv_bpt(c: Any) -> int:
    if c.keys is None:
        return 0
    per_k = c.keys.nbytes // (c.keys.shape[0] * c.keys.shape[2])
    per_v = c.values.nbytes // (c.values.shape[0] * c.values.shape[2])
    return int(per_k + per_v)


def _kv_clone(c: Any, n: int) -> Any:
    out: Any = KVCache()  # type: ignore[no-untyped-call]
    if c.keys is not None:
        out.keys = _slice_tokens(c.keys, n)
        out.values = _slice_tokens(c.values, n)
    out.offset = n
    return _copy_min_offset(c, out)


# --- QuantizedKVCache ------------------------------------------------------


def _q_arrays(c: Any) -> list[mx.array]:
    return [] if c.keys is None else [*c.keys, *c.values]


def _q_bpt(c: Any) -> int:
    if c.keys is None:
        return 0
    total = 0
    for a in (*c.keys, *c.values):
        total += a.nbytes // (a.shape[0] * a.shape[-2])
    return int(total)


def _q_clone(c: Any, n: int) -> Any:
    out: Any = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
    if c.keys is not None:
        # NOTE: groups run along head_dim, never the token axis, so slicing
        # tokens is byte-safe for the packed data, scales and biases alike.
        out.keys = tuple(_slice_tokens(a, n) for a in c.keys)
        out.values = tuple(_slice_tokens(a, n) for a in c.values)
    out.offset = n
    return _copy_min_offset(c, out)


# --- RotatingKVCache -------------------------------------------------------


def _rot_trimmable(c: Any) -> bool:
    return bool(c.offset < c.max_size)


def _rot_trim(c: Any, n: int) -> int:
    if n > 0 and not _rot_trimmable(c):
        raise CacheNotTrimmable("a rotating cache cannot trim after it wrapped")
    return int(c.trim(n))


def _rot_clone(c: Any, n: int) -> Any:
    if n != c.offset and not _rot_trimmable(c):
        raise CacheNotTrimmable("a wrapped rotating cache can only be cloned whole")
    out: Any = RotatingKVCache(max_size=c.max_size, keep=c.keep)  # type: ignore[no-untyped-call]
    if c.keys is not None:
        if n == c.offset:
            # NOTE: keep the whole ring (its slot layout is indexed by _idx).
            out.keys = c.keys[...]
            out.values = c.values[...]
            out._idx = c._idx
        else:
            # Pre-wrap the ring is in temporal order from slot 0.
            out.keys = _slice_tokens(c.keys, n)
            out.values = _slice_tokens(c.values, n)
            out._idx = n
    out.offset = n
    return _copy_min_offset(c, out)


def _rot_min(c: Any) -> int:
    # A wrapped ring lost the tokens before the window: only its full length is valid.
    return 0 if _rot_trimmable(c) else int(c.offset)


# --- ArraysCache (recurrent state) ------------------------------------------


def _ssm_arrays(c: Any) -> list[mx.array]:
    return [a for a in c.cache if a is not None]


def _ssm_offset(c: Any) -> int:
    # NOTE: recurrent state has no token axis; the registry records the
    # offset from the attention layers (or the caller). 0 here means "unknown".
    return int(getattr(c, "_kvtier_offset", 0))


def _ssm_trim(c: Any, n: int) -> int:
    if n > 0:
        raise CacheNotTrimmable("recurrent state cannot drop tokens")
    return 0


def _ssm_clone(c: Any, n: int) -> Any:
    if n != _ssm_offset(c) and _ssm_offset(c) != 0:
        raise CacheNotTrimmable("recurrent state can only be cloned at its own offset")
    out: Any = ArraysCache(len(c.cache))
    out.cache = [None if a is None else a[...] for a in c.cache]
    if hasattr(c, "_kvtier_offset"):
        out._kvtier_offset = c._kvtier_offset
    return _copy_min_offset(c, out)


# --- CacheList -------------------------------------------------------------


def _list_sig(c: Any) -> str:
    return "list(" + ",".join(cache_signature(x) for x in c.caches) + ")"


def _list_offset(c: Any) -> int:
    return max((adapter_for(x).offset(x) for x in c.caches), default=0)


def _list_trim(c: Any, n: int) -> int:
    return min((adapter_for(x).trim(x, n) for x in c.caches), default=0)


def _list_arrays(c: Any) -> list[mx.array]:
    return [a for x in c.caches for a in adapter_for(x).arrays(x)]


def _list_clone(c: Any, n: int) -> Any:
    out: Any = CacheList(*(adapter_for(x).clone(x, n) for x in c.caches))  # type: ignore[no-untyped-call]
    return _copy_min_offset(c, out)


_ADAPTERS: dict[type, CacheAdapter] = {
    KVCache: CacheAdapter(
        cache_type=KVCache,
        signature=lambda c: "kv:plain",
        offset=lambda c: int(c.offset),
        is_trimmable=lambda c: True,
        trim=_plain_trim,
        arrays=_kv_arrays,
        bytes_per_token=_kv_bpt,
        clone=_kv_clone,
        natural_min_offset=lambda c: 0,
    ),
    QuantizedKVCache: CacheAdapter(
        cache_type=QuantizedKVCache,
        signature=lambda c: f"kv:quant:{c.bits}:{c.group_size}",
        offset=lambda c: int(c.offset),
        is_trimmable=lambda c: True,
        trim=_plain_trim,
        arrays=_q_arrays,
        bytes_per_token=_q_bpt,
        clone=_q_clone,
        natural_min_offset=lambda c: 0,
    ),
    RotatingKVCache: CacheAdapter(
        cache_type=RotatingKVCache,
        signature=lambda c: "kv:rotating-plain",
        offset=lambda c: int(c.offset),
        is_trimmable=_rot_trimmable,
        trim=_rot_trim,
        arrays=_kv_arrays,
        bytes_per_token=_kv_bpt,
        clone=_rot_clone,
        natural_min_offset=_rot_min,
    ),
    ArraysCache: CacheAdapter(
        cache_type=ArraysCache,
        signature=lambda c: "ssm",
        offset=_ssm_offset,
        is_trimmable=lambda c: False,
        trim=_ssm_trim,
        arrays=_ssm_arrays,
        bytes_per_token=lambda c: 0,
        clone=_ssm_clone,
        natural_min_offset=_ssm_offset,
    ),
    CacheList: CacheAdapter(
        cache_type=CacheList,
        signature=_list_sig,
        offset=_list_offset,
        is_trimmable=lambda c: all(adapter_for(x).is_trimmable(x) for x in c.caches),
        trim=_list_trim,
        arrays=_list_arrays,
        bytes_per_token=lambda c: sum(adapter_for(x).bytes_per_token(x) for x in c.caches),
        clone=_list_clone,
        natural_min_offset=lambda c: max(
            (adapter_for(x).minimum_reusable_offset(x) for x in c.caches), default=0
        ),
    ),
}


def adapter_for(cache: object) -> CacheAdapter:
    """The adapter of ``cache``'s exact class; :class:`UnsupportedCacheKind` otherwise."""
    adapter = _ADAPTERS.get(type(cache))
    if adapter is None:
        raise UnsupportedCacheKind(cache)
    return adapter


def cache_signature(cache: object) -> str:
    """The stable storage identity of one layer's cache (``kv:plain``, ``ssm``, ...)."""
    return adapter_for(cache).signature(cache)


def cache_arrays(caches: Sequence[object]) -> list[mx.array]:
    """Every array the per-layer caches reference, in layer order."""
    return [a for c in caches for a in adapter_for(c).arrays(c)]


def caches_offset(caches: Sequence[object]) -> int:
    """Tokens the cache list covers: the largest layer offset (recurrent layers report 0)."""
    return max((adapter_for(c).offset(c) for c in caches), default=0)


def caches_trimmable(caches: Sequence[object]) -> bool:
    """Whether every layer can drop trailing tokens."""
    return all(adapter_for(c).is_trimmable(c) for c in caches)


def snapshot_cuttable(caches: Sequence[object]) -> bool:
    """Whether a prefix of ``caches`` can be cut off after a forward ran past it.

    True when every layer is a plain or quantized KV cache with no declared
    minimum offset: trimming such a layer to ``n`` tokens leaves exactly the
    KV its forwards computed for those ``n`` (causal: later tokens never
    change earlier ones), so a prompt-boundary snapshot need not end a
    prefill chunk (which costs a second forward over the whole prefix).
    Rotating rings (which may wrap inside the chunk), recurrent state (no
    token axis) and layers converted during the prefill are not.
    """
    return all(
        type(c) in (KVCache, QuantizedKVCache) and declared_min_reusable_offset(c) == 0
        for c in caches
    )


def caches_min_reusable_offset(caches: Sequence[object]) -> int:
    """The shortest prefix every layer can be trimmed to (max over layers)."""
    return max((adapter_for(c).minimum_reusable_offset(c) for c in caches), default=0)


def caches_nbytes(caches: Sequence[object]) -> int:
    """Bytes of all arrays the cache list references (views at their view size)."""
    return sum(adapter_for(c).nbytes(c) for c in caches)


def trim_caches(caches: Sequence[object], n: int) -> int:
    """Drop the last ``n`` tokens of every layer; :class:`CacheNotTrimmable` if one cannot."""
    if n <= 0:
        return 0
    if not caches_trimmable(caches):
        raise CacheNotTrimmable(f"cannot trim {n} tokens: a layer is not trimmable")
    return min(adapter_for(c).trim(c, n) for c in caches)


def clone_caches(caches: Sequence[object], n: int | None = None) -> list[Any]:
    """Zero-copy views of ``caches`` covering their first ``n`` tokens (default: all).

    The donor is never changed, and later writes to the clone never reach it.
    Shortening requires every layer to be trimmable and ``n`` to be at least
    each layer's minimum reusable offset.
    """
    if n is None:
        return [adapter_for(c).clone(c, adapter_for(c).offset(c)) for c in caches]
    full = caches_offset(caches)
    target = n
    if target > full or target < 0:
        raise ValueError(f"cannot clone {target} tokens of a {full}-token cache")
    if target < full:
        if not caches_trimmable(caches):
            raise CacheNotTrimmable("cannot shorten a clone: a layer is not trimmable")
        if target < caches_min_reusable_offset(caches):
            raise CacheNotTrimmable("clone shorter than the minimum reusable offset")
    out: list[Any] = []
    for c in caches:
        adapter = adapter_for(c)
        # NOTE: recurrent layers have no token axis; they clone whole.
        layer_n = adapter.offset(c) if adapter.offset(c) == 0 else target
        out.append(adapter.clone(c, layer_n))
    return out
