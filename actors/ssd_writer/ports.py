"""Ports of the cold tier: where a store's tensors come from, where a restore's bytes wait.

- :class:`TensorSource`: the store worker reads an entry's tensors back to
  host bytes through it, ONE engine turn per call (design 5.4: background
  work never delays a request by more than one tensor step). The wiring
  provides :class:`EngineTensorSource` over an :class:`EngineTurns` port
  whose ``run_when_idle`` is the gateway's ``RunWhenIdle`` turn
  (``actors.engine.Engine.run_when_idle`` has that shape).
- :class:`HostStaging`: a restore's host buffers wait here under a
  ``staging_id`` until the caller takes them into an engine turn and
  materializes them (``kernels.cache._kv_file.materialize``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from actors.runtime import AskTimeout, get_logger
from kernels.cache import EntryPlan, HostEntry, KvFileHeader, plan_entry, tensor_bytes

__all__ = [
    "CacheSource",
    "EngineTensorSource",
    "EngineTurns",
    "FileIdentity",
    "HostStaging",
    "RearmingTurns",
    "StagedEntry",
    "TensorSource",
    "TimedEngineTurns",
    "cold_fingerprint",
]

T = TypeVar("T")

BytesLike = bytes | bytearray | memoryview
"""Host bytes of one tensor (what ``KvFileWriter.write_tensor`` takes)."""

_log = get_logger("kvtier.ssd_writer")


class TensorSource(Protocol):
    """Reads one cache entry back to host bytes, one engine turn per call.

    The store worker calls :meth:`plan` once, :meth:`tensor` once per planned
    tensor (dropping each buffer after writing it), and :meth:`finish` once
    on every path (success, failure, cancellation), so MLX memory is freed
    on the engine thread.
    """

    async def plan(self, handle: str, *, namespace: str, tokens: tuple[int, ...]) -> EntryPlan:
        """Plan the file for ``handle`` (one engine turn)."""
        ...

    async def tensor(self, plan: EntryPlan, index: int) -> BytesLike:
        """Tensor ``index`` of ``plan`` as host bytes (one engine turn)."""
        ...

    async def finish(self, plan: EntryPlan) -> None:
        """Release everything ``plan`` holds (one engine turn)."""
        ...


class EngineTurns(Protocol):
    """Runs a callable as one background engine turn (granted only while idle)."""

    async def run_when_idle(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the engine thread in one idle turn; its result or exception."""
        ...


class TimedEngineTurns(Protocol):
    """``run_when_idle`` with a deadline on the wait (``actors.engine.Engine`` has this shape)."""

    async def run_when_idle(self, fn: Callable[[], T], *, timeout: float | None = None) -> T:
        """Run ``fn()`` in one idle turn; ``AskTimeout`` when no turn came in time."""
        ...


class RearmingTurns:
    """:class:`EngineTurns` that waits out a busy engine instead of failing (design 5.4).

    Each wait for an idle turn has a deadline (``wait_s``); when it passes
    because requests keep the engine busy, the step is asked for again
    (re-armed) rather than failed: a late tensor read-back is as valid as an
    early one, and background work must never push a request aside.
    ``max_wait_s`` (``None``: no limit) bounds the total wait; the inner
    port's other errors (turns stopped at shutdown) pass through at once.
    """

    def __init__(
        self, inner: TimedEngineTurns, *, wait_s: float = 5.0, max_wait_s: float | None = None
    ) -> None:
        if wait_s <= 0:
            raise ValueError("wait_s must be positive")
        self._inner = inner
        self._wait_s = wait_s
        self._max_wait_s = max_wait_s
        self.rearmed = 0

    async def run_when_idle(self, fn: Callable[[], T]) -> T:
        """See :meth:`EngineTurns.run_when_idle`."""
        waited = 0.0
        while True:
            try:
                return await self._inner.run_when_idle(fn, timeout=self._wait_s)
            except AskTimeout:
                waited += self._wait_s
                if self._max_wait_s is not None and waited >= self._max_wait_s:
                    raise
                self.rearmed += 1
                _log.debug("ssd_cache.turn_rearmed", waited_s=waited)


class CacheSource(Protocol):
    """Where the cache lists behind handles live (``kernels.CacheRegistry.get``)."""

    def get(self, handle: str) -> Any:
        """The entry's per-layer caches (engine thread)."""
        ...


def cold_fingerprint(*, model: str, kv_scheme: str, runtime: str, format_version: int) -> str:
    """The name of the fingerprint directory: a digest of everything that makes KV reusable.

    ``model``: ``kernels.ModelIdentity.fingerprint`` (config, weights digest,
    tokenizer hash, dtype, quantization); ``kv_scheme``: the scheme's
    ``cache_key``; ``runtime``: MLX version and device architecture
    (``actors.backend.runtime_identity``); ``format_version``: the codec's.
    NOTE: the format version is in the name so that files of a future
    format live in their own directory: this version's scan removes files
    it cannot read inside its own directory, and never looks into others.
    """
    parts = "\0".join((model, kv_scheme, runtime, f"kvt{format_version}"))
    return "kvt" + hashlib.blake2b(parts.encode("utf-8"), digest_size=10).hexdigest()


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What every file header records about the model that made it."""

    model_id: str
    fingerprint: str
    tokenizer_hash: str


class EngineTensorSource:
    """:class:`TensorSource` over a registry and an :class:`EngineTurns` port.

    NOTE: ``tensor_bytes`` returns a view that keeps an MLX array alive. The
    source keeps its own reference to the last view of each plan and drops
    it in the NEXT turn (or in :meth:`finish`), on the engine thread; the
    worker drops its reference after writing, so the last reference to an
    MLX buffer is never released on a worker thread or the loop.
    """

    def __init__(self, turns: EngineTurns, caches: CacheSource, identity: FileIdentity) -> None:
        self._turns = turns
        self._caches = caches
        self._identity = identity
        self._last: dict[int, BytesLike] = {}

    async def plan(self, handle: str, *, namespace: str, tokens: tuple[int, ...]) -> EntryPlan:
        """See :meth:`TensorSource.plan`."""
        ident = self._identity

        def step() -> EntryPlan:
            return plan_entry(
                self._caches.get(handle),
                model_id=ident.model_id,
                fingerprint=ident.fingerprint,
                namespace=namespace,
                tokenizer_hash=ident.tokenizer_hash,
                tokens=tokens,
            )

        return await self._turns.run_when_idle(step)

    async def tensor(self, plan: EntryPlan, index: int) -> BytesLike:
        """See :meth:`TensorSource.tensor`."""
        key = id(plan)

        def step() -> BytesLike:
            self._last.pop(key, None)
            view = tensor_bytes(plan, index)
            self._last[key] = view
            return view

        return await self._turns.run_when_idle(step)

    async def finish(self, plan: EntryPlan) -> None:
        """See :meth:`TensorSource.finish`."""
        key = id(plan)

        def step() -> None:
            self._last.pop(key, None)
            plan.release_arrays()

        await self._turns.run_when_idle(step)


@dataclass(frozen=True, slots=True)
class StagedEntry:
    """A restored file's validated header and its tensor bytes in host memory."""

    path: str
    header: KvFileHeader
    host: HostEntry


class HostStaging:
    """Restored entries waiting for their caller, by ``staging_id`` (thread-safe, bounded).

    At most ``max_entries`` wait; a new one pushes out the oldest (its
    caller then finds nothing and treats the restore as a miss). This bounds
    the host memory a caller that never comes back can pin.
    """

    def __init__(self, *, max_entries: int = 4) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._max = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StagedEntry] = OrderedDict()
        self.evicted = 0

    def put(self, staging_id: str, entry: StagedEntry) -> None:
        """Keep ``entry`` under ``staging_id`` (a new id)."""
        with self._lock:
            if staging_id in self._entries:
                raise ValueError(f"staging id {staging_id!r} is in use")
            self._entries[staging_id] = entry
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
                self.evicted += 1

    def take(self, staging_id: str) -> StagedEntry | None:
        """Remove and return the entry (``None`` if unknown, taken or pushed out)."""
        with self._lock:
            return self._entries.pop(staging_id, None)

    def discard(self, staging_id: str) -> None:
        """Drop the entry if it is still here."""
        with self._lock:
            self._entries.pop(staging_id, None)

    @property
    def nbytes(self) -> int:
        """Host bytes held by waiting entries."""
        with self._lock:
            return sum(e.host.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
