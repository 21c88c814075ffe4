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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList

from messages import EntryMeta

from ._adapters import (
    adapter_for,
    cache_arrays,
    caches_min_reusable_offset,
    caches_offset,
    caches_trimmable,
    clone_caches,
)

__all__ = ["CacheRegistry", "RegisteredCache", "RegistryStats", "UnknownCacheHandle"]


class UnknownCacheHandle(KeyError):
    """A handle that was never registered here, or was already disposed."""


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
    registered: int
    disposed: int
    materialized: int


@dataclass
class _Slot:
    caches: list[Any]
    meta: EntryMeta


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
    """

    def __init__(self, *, prefix: str = "kv") -> None:
        self._prefix = prefix
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._pending: list[_Slot] = []
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

        ``offset`` (tokens covered) is needed only for models whose every
        layer is recurrent; otherwise it comes from the attention layers.
        """
        self.drain()
        owned = list(caches)
        _compact_recurrent(owned)
        meta = self._measure(owned, offset, retained=None)
        return self._insert(owned, meta)

    def snapshot(self, caches: Sequence[Any], *, offset: int | None = None) -> RegisteredCache:
        """Register zero-copy views of a live cache that the caller keeps using.

        The live cache's next write copies its buffer (MLX never writes a
        shared buffer in place), so the snapshot keeps the current buffers;
        ``meta.nbytes`` bills those whole buffers, not the view lengths.
        """
        self.drain()
        live = list(caches)
        covered = offset if offset is not None else caches_offset(live)
        mx.eval(*cache_arrays(live))
        # NOTE: the live list is never stamped or trimmed; every layer is cloned
        # whole at its own offset, and recurrent layers are compacted copies.
        views = clone_caches(live)
        _compact_recurrent(views)
        retained = 0
        for live_layer, view_layer in zip(live, views, strict=True):
            source = view_layer if _is_recurrent(view_layer) else live_layer
            retained += sum(self._retained_bytes(a) for a in adapter_for(source).arrays(source))
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
        """Drop the arrays of disposed entries (engine thread); returns how many."""
        with self._lock:
            pending, self._pending = self._pending, []
        count = len(pending)
        for slot in pending:
            slot.caches.clear()
        self._issued = {k: v for k, v in self._issued.items() if v[0]() is not None}
        return count

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
        """Entries, retained bytes, queued disposals and lifetime counters."""
        with self._lock:
            return RegistryStats(
                entries=len(self._slots),
                nbytes=sum(s.meta.nbytes for s in self._slots.values()),
                pending_dispose=len(self._pending),
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

    def _measure(self, caches: list[Any], offset: int | None, *, retained: int | None) -> EntryMeta:
        covered = offset if offset is not None else caches_offset(caches)
        _stamp_recurrent_offset(caches, covered)
        arrays = cache_arrays(caches)
        mx.eval(*arrays)
        nbytes = retained if retained is not None else sum(self._retained_bytes(a) for a in arrays)
        return EntryMeta(
            offset=covered,
            nbytes=nbytes,
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
