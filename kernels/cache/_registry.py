"""The engine-thread-owned registry of cache entries, addressed by opaque handles.

Tensors never travel in messages: the prompt cache, the gateway and (later)
the cold tier pass handle ids, and the arrays live here. Every method that
touches arrays runs on the engine thread; :meth:`CacheRegistry.dispose` is
the one thread-safe exception (it only queues, :meth:`CacheRegistry.drain`
drops the arrays on the engine thread).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from messages import EntryMeta

from ._adapters import (
    adapter_for,
    cache_arrays,
    caches_min_reusable_offset,
    caches_offset,
    caches_trimmable,
    clone_caches,
)

__all__ = [
    "CacheOffsetMismatch",
    "CacheRegistry",
    "RegisteredCache",
    "RegistryStats",
    "UnknownCacheHandle",
]


class UnknownCacheHandle(KeyError):
    """A handle that was never registered here, or was already disposed."""


class CacheOffsetMismatch(ValueError):
    """A layer holds a different number of tokens than the caller says the cache covers.

    NOTE: indexing such an entry under the caller's tokens would serve KV of
    other tokens; the registry refuses it instead (the entry is a future miss).
    """


@dataclass(frozen=True)
class RegisteredCache:
    """A handle into the registry plus the facts the prompt cache's rules need."""

    handle: str
    meta: EntryMeta


@dataclass(frozen=True)
class RegistryStats:
    """Gauges and counters of a :class:`CacheRegistry`."""

    entries: int
    nbytes: int
    pending_dispose: int
    pending_bytes: int
    registered: int
    disposed: int
    materialized: int


@dataclass
class _Slot:
    caches: list[Any]
    meta: EntryMeta
    # NOTE: host bytes of the entry read ahead of its file's write
    # (``kernels.cache.read_ahead``); dropped with the arrays.
    ahead: Any = None


def _compact_recurrent(caches: Sequence[Any]) -> None:
    # NOTE: models slice recurrent state out of larger activations (Mamba's
    # conv state is the tail of the padded input), so a stored state array
    # may pin a buffer many times its size. The state is small and constant:
    # copying it makes the retained bytes equal its nbytes.
    for c in caches:
        if type(c) is ArraysCache:
            c.cache = [None if a is None else mx.array(a) for a in c.cache]
        elif type(c) is CacheList:
            _compact_recurrent(c.caches)


def _is_recurrent(cache: Any) -> bool:
    return type(cache) is ArraysCache


def _token_layers(caches: Sequence[Any]) -> list[Any]:
    """Every layer with a token axis (recurrent state has none), CacheList members included."""
    return [c for c in _all_layers(caches) if not _is_recurrent(c)]


def _all_layers(caches: Sequence[Any]) -> list[Any]:
    """Every layer, ``CacheList`` members in place of their list."""
    out: list[Any] = []
    for c in caches:
        out += _all_layers(c.caches) if type(c) is CacheList else [c]
    return out


def _check_offsets(caches: Sequence[Any], offset: int) -> None:
    for index, layer in enumerate(_token_layers(caches)):
        held = adapter_for(layer).offset(layer)
        if held != offset:
            raise CacheOffsetMismatch(
                f"cache layer {index} holds {held} tokens but the entry is said to cover {offset}"
            )


# NOTE: a layer is copied out to its real length when its buffers waste more
# than this fraction of the bytes its tokens use (mlx-lm grows KV in 256-token
# slabs, so short entries are mostly slack; long ones waste < 1/8 and are kept
# as they are, sparing the copy).
_SLACK_DIVISOR = 8


def _copy(a: mx.array) -> mx.array:
    # NOTE: mx.array(view) materializes a new buffer of the view's own size
    # (measured: a 9-token slice of a 1024-token buffer retains 9 tokens).
    return mx.array(a)


def _compact_layer(c: Any) -> bool:
    """Copy a KV layer's arrays out to its real length, in place; whether it applies.

    Plain and quantized KV layers, and rotating rings before they wrap (their
    slots are then in temporal order from 0); a wrapped ring has no slack.
    """
    kind = type(c)
    if c.keys is None:
        return False
    n = int(c.offset)
    if kind is KVCache:
        c.keys, c.values = _copy(c.keys[..., :n, :]), _copy(c.values[..., :n, :])
    elif kind is QuantizedKVCache:
        c.keys = tuple(_copy(a[..., :n, :]) for a in c.keys)
        c.values = tuple(_copy(a[..., :n, :]) for a in c.values)
    elif kind is RotatingKVCache and n < c.max_size and c._idx == n:
        c.keys, c.values = _copy(c.keys[..., :n, :]), _copy(c.values[..., :n, :])
    else:
        return False
    return True


def _used_bytes(c: Any) -> int:
    """Bytes of a token-axis layer's first ``offset`` tokens (what compaction keeps)."""
    n = int(c.offset)
    total = 0
    for a in adapter_for(c).arrays(c):
        slots = int(a.shape[-2])
        total += a.nbytes * min(n, slots) // max(slots, 1)
    return total


def _stamp_recurrent_offset(caches: Sequence[Any], offset: int) -> None:
    # NOTE: recurrent state has no token axis; the offset stamped here lets
    # the adapters report it, so the rules treat such a layer as exact-only.
    for c in caches:
        if type(c) is ArraysCache:
            vars(c)["_kvtier_offset"] = offset
        elif type(c) is CacheList:
            _stamp_recurrent_offset(c.caches, offset)


class CacheRegistry:
    """Owns per-layer cache lists on the engine thread and names them by handle.

    ``register`` takes a cache list over (the caller stops using it);
    ``snapshot`` registers zero-copy views of a live cache that keeps running;
    ``materialize`` lends zero-copy views of an entry trimmed to a prefix.

    A thread-safe port, shared by the actors that own handles (the prompt
    cache, the spill queue, the turn runner, the batch lane): its handle
    table is under one lock, :meth:`dispose` only queues, and every method
    that touches arrays runs on the engine thread.
    """

    def __init__(self, *, prefix: str = "kv") -> None:
        self._prefix = prefix
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._pending: list[_Slot] = []
        self._later: list[Callable[[], None]] = []
        # id(view) -> (weak ref to a view issued by materialize/snapshot, bytes of
        # the buffer behind it): a view that comes back in ``register`` unchanged
        # is billed at the buffer it keeps alive, not at its view size.
        self._issued: dict[int, tuple[weakref.ref[mx.array], int]] = {}
        self._registered = 0
        self._disposed = 0
        self._materialized = 0

    # -- engine thread --------------------------------------------------------

    def register(self, caches: Sequence[Any], *, offset: int | None = None) -> RegisteredCache:
        """Take ``caches`` over and return its handle and :class:`EntryMeta`.

        ``offset`` (tokens covered) is needed for models whose every layer is
        recurrent; when given, every layer with a token axis must hold exactly
        that many tokens (:class:`CacheOffsetMismatch` otherwise). A layer
        whose buffers are mostly slack is copied out to its real length.
        """
        self.drain()
        owned = list(caches)
        if offset is not None:
            _check_offsets(owned, offset)
        _compact_recurrent(owned)
        retained = self._compact(owned, always=False)
        meta = self._measure(owned, offset, retained=retained)
        return self._insert(owned, meta)

    def snapshot(
        self, caches: Sequence[Any], *, offset: int | None = None, tokens: int | None = None
    ) -> RegisteredCache:
        """Register a copy of a live cache that the caller keeps using.

        KV layers are copied out to their real length (compact; the live
        cache then keeps writing its own buffer in place). A wrapped rotating
        ring stays a zero-copy view: the live ring's next write copies away
        from it (MLX never writes a shared buffer in place), and
        ``meta.nbytes`` bills the whole ring it keeps. ``tokens`` (fewer
        than the live cache holds) registers only that prefix: a
        prompt-boundary snapshot cut from a forward that ran past its point
        (every layer trimmable, :class:`CacheNotTrimmable` otherwise).
        """
        self.drain()
        live = list(caches)
        if offset is not None:
            _check_offsets(live, offset)
        covered = offset if offset is not None else caches_offset(live)
        if tokens is not None and not 0 < tokens <= covered:
            raise ValueError(f"cannot snapshot {tokens} tokens of a {covered}-token cache")
        mx.eval(*cache_arrays(live))
        # NOTE: the live list is never stamped or trimmed; every layer is cloned
        # at its own offset (or cut to ``tokens``), and recurrent layers are
        # compacted copies.
        donor_bytes = {id(a): self._retained_bytes(a) for a in cache_arrays(live)}
        if tokens is not None and tokens < covered:
            views = clone_caches(live, tokens)
            covered = tokens
        else:
            views = clone_caches(live)
        self._remember_views(views, live, donor_bytes)
        _compact_recurrent(views)
        retained = self._compact(views, always=True)
        meta = self._measure(views, covered, retained=retained)
        return self._insert(views, meta)

    def materialize(self, handle: str, tokens: int) -> list[Any]:
        """Zero-copy views of entry ``handle`` covering its first ``tokens`` tokens.

        Writes to the returned caches never reach the entry. Shortening needs
        a trimmable entry and ``tokens >= meta.min_reusable_offset``.
        """
        self.drain()
        with self._lock:
            slot = self._slots.get(handle)
        if slot is None:
            raise UnknownCacheHandle(handle)
        donor_bytes = {id(a): self._retained_bytes(a) for a in cache_arrays(slot.caches)}
        views = clone_caches(slot.caches, tokens)
        self._remember_views(views, slot.caches, donor_bytes)
        self._materialized += 1
        return views

    def get(self, handle: str) -> Sequence[Any]:
        """The entry's caches, read-only (for the cold tier's read-back)."""
        with self._lock:
            slot = self._slots.get(handle)
        if slot is None:
            raise UnknownCacheHandle(handle)
        return tuple(slot.caches)

    def drain(self) -> int:
        """Drop the arrays of disposed entries and run the queued releases (engine thread).

        Returns how many entries it dropped.
        """
        with self._lock:
            pending, self._pending = self._pending, []
            later, self._later = self._later, []
        count = len(pending)
        for slot in pending:
            slot.caches.clear()
            slot.ahead = None
        for fn in later:
            fn()
        self._issued = {k: v for k, v in self._issued.items() if v[0]() is not None}
        return count

    def attach_read(self, handle: str, read: object) -> None:
        """Keep ``read`` (host bytes of the entry read ahead, ``kernels.cache.HostRead``) with ``handle`` (engine thread).

        It goes with the entry's arrays (the drain after :meth:`dispose`) unless
        :meth:`take_read` takes it first.
        """
        with self._lock:
            slot = self._slots.get(handle)
        if slot is None:
            raise UnknownCacheHandle(handle)
        slot.ahead = read

    def take_read(self, handle: str) -> object | None:
        """The read kept with ``handle``, removed from it (``None``: none, or no such entry; engine thread)."""
        with self._lock:
            slot = self._slots.get(handle)
        if slot is None:
            return None
        read: object | None = slot.ahead
        slot.ahead = None
        return read

    # -- any thread -------------------------------------------------------------

    def dispose(self, handle: str) -> None:
        """Forget ``handle``; its arrays are dropped by the next :meth:`drain`.

        Thread-safe and non-blocking (the prompt cache calls it from the loop).
        """
        with self._lock:
            slot = self._slots.pop(handle, None)
            if slot is None:
                raise UnknownCacheHandle(handle)
            self._pending.append(slot)
            self._disposed += 1

    def release_later(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread at the next :meth:`drain` (thread-safe, non-blocking).

        For releases that must happen on the engine thread (the last reference
        to an MLX buffer) but need no engine turn of their own: every batch
        step, request turn and registry operation drains.
        """
        with self._lock:
            self._later.append(fn)

    def meta(self, handle: str) -> EntryMeta:
        """The :class:`EntryMeta` recorded when ``handle`` was registered."""
        with self._lock:
            slot = self._slots.get(handle)
        if slot is None:
            raise UnknownCacheHandle(handle)
        return slot.meta

    def entries(self) -> dict[str, EntryMeta]:
        """Every live handle and its :class:`EntryMeta` (a copy; any thread)."""
        with self._lock:
            return {handle: slot.meta for handle, slot in self._slots.items()}

    def __contains__(self, handle: object) -> bool:
        with self._lock:
            return handle in self._slots

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def statistics(self) -> RegistryStats:
        """Entries, retained bytes, disposals whose arrays the next drain drops, lifetime counters."""
        with self._lock:
            return RegistryStats(
                entries=len(self._slots),
                nbytes=sum(s.meta.nbytes for s in self._slots.values()),
                pending_dispose=len(self._pending),
                pending_bytes=sum(s.meta.nbytes for s in self._pending),
                registered=self._registered,
                disposed=self._disposed,
                materialized=self._materialized,
            )

    # -- internals ------------------------------------------------------------------

    def _insert(self, caches: list[Any], meta: EntryMeta) -> RegisteredCache:
        handle = f"{self._prefix}-{next(self._ids)}"
        with self._lock:
            self._slots[handle] = _Slot(caches=caches, meta=meta)
            self._registered += 1
        return RegisteredCache(handle=handle, meta=meta)

    def _compact(self, caches: list[Any], *, always: bool) -> int:
        """Copy out slack-heavy KV layers (every one with slack if ``always``); retained bytes.

        The returned figure is what the entry keeps alive: a copied layer its
        own arrays, any other layer the whole buffers behind its arrays
        (a view issued by :meth:`materialize` or :meth:`snapshot` is billed at
        its donor's buffer).
        """
        retained = 0
        for layer in _all_layers(caches):
            adapter = adapter_for(layer)
            held = sum(self._retained_bytes(a) for a in adapter.arrays(layer))
            if not _is_recurrent(layer):
                used = _used_bytes(layer)
                wasteful = held > used if always else held - used > used // _SLACK_DIVISOR
                if wasteful and _compact_layer(layer):
                    held = sum(a.nbytes for a in adapter.arrays(layer))
            retained += held
        return retained

    def _measure(self, caches: list[Any], offset: int | None, *, retained: int) -> EntryMeta:
        covered = offset if offset is not None else caches_offset(caches)
        _stamp_recurrent_offset(caches, covered)
        mx.eval(*cache_arrays(caches))
        return EntryMeta(
            offset=covered,
            nbytes=retained,
            trimmable=caches_trimmable(caches),
            min_reusable_offset=min(caches_min_reusable_offset(caches), covered),
            signatures=tuple(adapter_for(c).signature(c) for c in caches),
        )

    def _retained_bytes(self, a: mx.array) -> int:
        issued = self._issued.get(id(a))
        if issued is not None and issued[0]() is a:
            return issued[1]
        return int(a.nbytes)

    def _remember_views(
        self, views: list[Any], donors: list[Any], donor_bytes: dict[int, int]
    ) -> None:
        for view, donor in zip(cache_arrays(views), cache_arrays(donors), strict=True):
            self._issued[id(view)] = (weakref.ref(view), donor_bytes[id(donor)])
