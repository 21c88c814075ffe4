"""Ports of the cold tier: where a store's tensors come from, where a restore's bytes wait.

- :class:`TensorSource`: the store worker reads an entry's tensors back to
  host bytes through it, at most one engine turn per call (design 5.4:
  background work never delays a request by more than one short step;
  :class:`EngineTensorSource` takes the views of up to
  :data:`VIEW_GROUP_BYTES` of tensors in one turn); a generation
  checkpoint is planned in one turn that hands out views, no copies
  (:class:`CheckpointSource`). The wiring
  provides :class:`EngineTensorSource` over an :class:`EngineTurns` port
  whose ``run_when_idle`` is the gateway's ``RunWhenIdle`` turn
  (``actors.engine.Engine.run_when_idle`` has that shape).
- :class:`HostStaging`: a restore's checked, open file waits here under a
  ``staging_id`` until the caller takes it into an engine turn and lands
  it: its bytes read straight into MLX memory
  (``kernels.cache.land_entry``).
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from actors.runtime import AskTimeout, get_logger
from kernels import env_text
from kernels.cache import (
    LANDING_THREADS_ENV,
    CacheFileCorrupt,
    EntryPlan,
    GenerationCheckpoint,
    HostRead,
    KvFileHeader,
    LandingPool,
    OpenEntry,
    PassFailed,
    land_entry,
    landing_thread_count,
    plan_entry,
    read_fits,
    release_host_copies,
    tail_starts,
    tensors_bytes,
    usable_cpus,
)

__all__ = [
    "VIEW_GROUP_BYTES",
    "CacheSource",
    "CheckpointSource",
    "EngineTensorSource",
    "EngineTurns",
    "FileIdentity",
    "HostStaging",
    "LandingObservation",
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

VIEW_GROUP_BYTES = 64 * 1024 * 1024
"""Tensor bytes whose host views one engine turn of a prompt spill takes (at least one tensor).

NOTE: one turn per tensor was 64 turns per 8B-shape entry; under load each
background turn cuts the batch's step chain (a trip through the event loop
and back), and at 32 streams on the H200 the chain cuts, not the copies,
took the engine's time (the engine thread idle ~46 % of a guidellm run).
The group bounds what one turn holds: on CUDA each view is of a
device-side copy, so up to two groups' copies (the one being written and
the previous, released in the next turn) are alive per spill.
"""


class TensorSource(Protocol):
    """Reads one cache entry back to host bytes, one engine turn per call.

    The store worker calls :meth:`plan` once, :meth:`tensor` once per planned
    tensor (dropping each buffer after writing it), and :meth:`finish` once
    on every path (success, failure, cancellation), so MLX memory is freed
    on the engine thread.
    """

    async def plan(self, handle: str, *, namespace: str, tokens: tuple[int, ...]) -> EntryPlan:
        """Plan the file for ``handle`` (one engine turn; it may take the first tensors' views too)."""
        ...

    async def tensor(self, plan: EntryPlan, index: int) -> BytesLike:
        """Tensor ``index`` of ``plan`` as host bytes (one engine turn)."""
        ...

    async def finish(self, plan: EntryPlan) -> None:
        """Release everything ``plan`` holds, on the engine thread (no turn of its own needed)."""
        ...


@runtime_checkable
class CheckpointSource(Protocol):
    """A :class:`TensorSource` that can also plan a generation checkpoint in one engine turn."""

    async def checkpoint_views(
        self,
        handle: str,
        *,
        namespace: str,
        tokens: tuple[int, ...],
        checkpoint: GenerationCheckpoint,
        base: KvFileHeader | None = None,
    ) -> tuple[EntryPlan, list[BytesLike]]:
        """The checkpoint file's plan and a host view of every tensor (one engine turn, no copy).

        With ``base`` (the previous file of the same answer), the view of
        each tensor ``kernels.cache.tail_starts(plan.header, base)`` lists
        holds only the tokens after that file's. The views stay valid until
        :meth:`TensorSource.finish` of the plan, which the caller calls on
        every path after dropping its references.
        """
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
    """Where the cache lists behind handles live (``kernels.CacheRegistry``)."""

    def get(self, handle: str) -> Any:
        """The entry's per-layer caches (engine thread)."""
        ...

    def release_later(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread at the next drain (any thread may call this)."""
        ...

    def take_read(self, handle: str) -> object | None:
        """The entry's host bytes read ahead (``kernels.cache.HostRead``), taken from it (engine thread)."""
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


class _Claim:
    """Whether the asker of one engine turn still takes what the turn holds (thread-safe).

    The turn runs on the engine thread; the asker's await may end (a
    cancellation, a timeout) while it runs or right after, and then no one
    would call :meth:`EngineTensorSource.finish` for what the turn returned.
    The turn :meth:`take`s its plan; an asker that stopped waiting
    :meth:`abandon`s the claim and gets the plan back if the turn already took
    it (it is then released in the source's next turn), or makes the turn
    release it itself.
    """

    __slots__ = ("_abandoned", "_lock", "_plan")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plan: EntryPlan | None = None
        self._abandoned = False

    def take(self, plan: EntryPlan) -> bool:
        """Engine thread: record ``plan`` as the asker's; ``False`` if the asker stopped waiting."""
        with self._lock:
            if self._abandoned:
                return False
            self._plan = plan
            return True

    def abandon(self) -> EntryPlan | None:
        """Asker: stop waiting; the plan the turn already took, if any."""
        with self._lock:
            self._abandoned = True
            plan, self._plan = self._plan, None
            return plan


def _view_group(plan: EntryPlan, first: int) -> list[int]:
    """The tensor indices from ``first`` whose bytes fit :data:`VIEW_GROUP_BYTES` together (at least ``first``)."""
    indices = [first]
    total = plan.tensors[first].nbytes
    for i in range(first + 1, len(plan.tensors)):
        total += plan.tensors[i].nbytes
        if total > VIEW_GROUP_BYTES:
            break
        indices.append(i)
    return indices


class EngineTensorSource:
    """:class:`TensorSource` over a registry and an :class:`EngineTurns` port.

    NOTE: ``tensors_bytes`` returns views that keep MLX arrays alive. The
    source keeps its own reference to every view it hands out and drops it
    on the engine thread: a prompt entry's group of views in its NEXT turn
    (or once finished), a checkpoint's views once finished. The worker
    drops its references first (after writing), so the last reference to an
    MLX buffer is never released on a worker thread or the loop. A finished
    plan, and one whose asker stopped waiting after its turn ran, is
    released at the registry's next drain (every batch step, request turn
    and registry operation drains) or in this source's next turn, whichever
    comes first: :meth:`finish` takes no engine turn of its own.
    """

    def __init__(self, turns: EngineTurns, caches: CacheSource, identity: FileIdentity) -> None:
        self._turns = turns
        self._caches = caches
        self._identity = identity
        self._last: dict[int, dict[int, BytesLike]] = {}
        self._held: dict[int, list[BytesLike]] = {}
        self._orphans_lock = threading.Lock()
        self._orphans: list[EntryPlan] = []
        # NOTE: checkpoints whose views came from a read-ahead, and those that
        # had one that did not fit (another base): engine thread, read anywhere.
        self.read_ahead_used = 0
        self.read_ahead_missed = 0

    def _release_orphans(self) -> None:
        """Engine thread: release the plans whose askers stopped waiting (see :class:`_Claim`)."""
        with self._orphans_lock:
            orphans, self._orphans = self._orphans, []
        dropped = False
        for plan in orphans:
            dropped |= self._drop(id(plan))
            plan.release_arrays()
        if dropped:
            release_host_copies()

    def _drop(self, key: int) -> bool:
        """Engine thread: drop this source's references to plan ``key``'s views; whether it held any.

        NOTE: the caller then calls :func:`release_host_copies` (after every
        drop of the turn): on CUDA, where switched on, it empties MLX's
        buffer cache of the views' managed buffers.
        """
        group = self._last.pop(key, None)
        held = self._held.pop(key, None)
        return bool(group) or bool(held)

    async def _claimed(self, claim: _Claim, step: Callable[[], T]) -> T:
        """Run ``step`` in one idle turn; the plan it took in ``claim`` is orphaned if the await fails.

        NOTE: ``step`` is a named closure (not a partial): the engine's slow-step
        log names it.
        """
        try:
            return await self._turns.run_when_idle(step)
        except BaseException:
            plan = claim.abandon()
            if plan is not None:
                with self._orphans_lock:
                    self._orphans.append(plan)
            raise

    async def plan(self, handle: str, *, namespace: str, tokens: tuple[int, ...]) -> EntryPlan:
        """See :meth:`TensorSource.plan`."""
        ident = self._identity
        claim = _Claim()

        def plan_step() -> EntryPlan:
            self._release_orphans()
            plan = plan_entry(
                self._caches.get(handle),
                model_id=ident.model_id,
                fingerprint=ident.fingerprint,
                namespace=namespace,
                tokenizer_hash=ident.tokenizer_hash,
                tokens=tokens,
            )
            if not claim.take(plan):
                plan.release_arrays()
                return plan
            if plan.tensors:
                # NOTE: the first group's views in the plan's own turn: one
                # background turn (one cut of a step chain) fewer per spill.
                indices = _view_group(plan, 0)
                views: dict[int, BytesLike] = dict(
                    zip(indices, tensors_bytes(plan, indices), strict=True)
                )
                self._last[id(plan)] = views
            return plan

        return await self._claimed(claim, plan_step)

    async def tensor(self, plan: EntryPlan, index: int) -> BytesLike:
        """See :meth:`TensorSource.tensor`; a turn takes the views of the tensors from ``index`` up to :data:`VIEW_GROUP_BYTES`."""
        key = id(plan)
        group = self._last.get(key)
        if group is not None and index in group:
            # NOTE: taken by an earlier turn; the source keeps its own reference
            # until the plan's next turn or finish (both on the engine thread).
            return group[index]

        def step() -> BytesLike:
            self._release_orphans()
            # NOTE: the previous group's views are dropped here, on the engine
            # thread, and their memory freed before this group's copies are made.
            if self._last.pop(key, None):
                release_host_copies()
            indices = _view_group(plan, index)
            views: dict[int, BytesLike] = dict(zip(indices, tensors_bytes(plan, indices), strict=True))
            self._last[key] = views
            return views[index]

        return await self._turns.run_when_idle(step)

    async def checkpoint_views(
        self,
        handle: str,
        *,
        namespace: str,
        tokens: tuple[int, ...],
        checkpoint: GenerationCheckpoint,
        base: KvFileHeader | None = None,
    ) -> tuple[EntryPlan, list[BytesLike]]:
        """Plan a checkpoint file and take a host view of every tensor, in ONE idle engine turn.

        NOTE: a checkpoint is written while its answer is still decoding,
        when idle turns are rare (the background share); one turn per tensor
        would leave it undurable for hundreds of tokens. The turn copies
        nothing: each view shares the (evaluated, contiguous) array's memory,
        and the store worker reads it on a worker thread while it hashes and
        writes the file. A host copy inside the turn stalled every decoding
        row for its length (83-116 ms for an 8B-shape snapshot on CUDA,
        where reading device memory on the host migrates its pages). The
        views are held here until :meth:`finish`, which releases them and
        the plan's arrays on the engine thread.
        """
        ident = self._identity
        claim = _Claim()

        def checkpoint_step() -> tuple[EntryPlan, list[BytesLike]]:
            self._release_orphans()
            plan = plan_entry(
                self._caches.get(handle),
                model_id=ident.model_id,
                fingerprint=ident.fingerprint,
                namespace=namespace,
                tokenizer_hash=ident.tokenizer_hash,
                tokens=tokens,
                checkpoint=checkpoint,
            )
            tails = tail_starts(plan.header, base) if base is not None else None
            ahead = self._caches.take_read(handle)
            try:
                views: list[BytesLike]
                if isinstance(ahead, HostRead) and read_fits(plan, ahead, tails):
                    # NOTE: read with the other checkpoints of its batch step in one
                    # read-back (kernels.cache.read_ahead): this turn reads nothing.
                    views = list(ahead.views)
                    self.read_ahead_used += 1
                else:
                    views = list(tensors_bytes(plan, range(len(plan.tensors)), tails))
                    self.read_ahead_missed += ahead is not None
            except BaseException:
                plan.release_arrays()
                raise
            if not claim.take(plan):
                views.clear()
                plan.release_arrays()
                return plan, []
            self._held[id(plan)] = views
            return plan, list(views)

        return await self._claimed(claim, checkpoint_step)

    async def finish(self, plan: EntryPlan) -> None:
        """See :meth:`TensorSource.finish`: queued, released without a turn of its own (class note).

        NOTE: a turn of its own was one more background turn per written
        file and per checkpoint, each granted from the background share
        under load and each ending the batch lane's step chain.
        """
        with self._orphans_lock:
            self._orphans.append(plan)
        self._caches.release_later(self._release_orphans)


@dataclass(eq=False, slots=True)
class StagedEntry:
    """A restored file waiting for its request's engine turn: header checked, held open.

    The reader's pass over its tensors (hashes checked, page cache warmed)
    may still run; a landing goes right behind it.

    Its holder closes it on every path (:meth:`close` is idempotent): the
    staging when it drops or pushes it out, :meth:`HostStaging.land` once
    landed or failed, the taker when it decides not to land it.
    """

    path: str
    file: OpenEntry

    @property
    def header(self) -> KvFileHeader:
        """The file's validated header."""
        return self.file.header

    @property
    def nbytes(self) -> int:
        """Tensor bytes a landing will read into MLX memory."""
        return self.file.nbytes

    def close(self) -> None:
        """Close the file (idempotent)."""
        self.file.close()


@dataclass(frozen=True, slots=True)
class LandingObservation:
    """One landing, for the restore-or-recompute estimator.

    ``nbytes`` landed in ``seconds`` (engine-thread time, allocation and
    the second hash pass included) when ``ok``; otherwise the file at
    ``path`` failed its second check (``corrupt``) and should be removed.
    """

    path: str
    nbytes: int
    seconds: float
    ok: bool
    corrupt: bool = False


class HostStaging:
    """Restored entries waiting for their caller, by ``staging_id`` (a thread-safe port, bounded).

    The one object several parties share in the cold tier, so every method
    takes its lock: the reader puts entries (event loop), the prompt cache
    discards ones nobody will use (event loop), the backend takes and lands
    them (engine thread), and the index closes it at shutdown (a worker
    thread). It holds no decision of the index: what a landing teaches the
    index leaves as a message (:meth:`bind_reports`).

    An entry is an open, already checked file (:class:`StagedEntry`), not
    host bytes: the request's engine turn reads it straight into MLX memory
    (:meth:`land`). At most ``max_entries`` wait; a new one pushes out the
    oldest (its file is closed and its caller finds nothing: a miss). The
    bound caps the descriptors held open and the bytes the waiting landings
    will allocate (at most ``max_entries`` times the largest file); nothing
    of a waiting entry sits in host memory except the kernel's page cache,
    which the kernel may reclaim.

    NOTE: files are closed on the landing threads (:meth:`release`,
    pushed-out and discarded entries, the end of a landing), never on the
    event loop or the engine thread, which make no file calls. :meth:`land`
    hands each landing's size and time, and each file that failed the
    landing's checks, to the report sink the index bound
    (:meth:`bind_reports`), which posts them to the index as
    ``LandingReport`` messages. :meth:`close` (on a worker thread, at
    shutdown) closes every waiting file and stops the landing threads.
    ``landing_threads`` (default: ``kernels.cache.landing_thread_count`` of
    the usable CPUs, ``KVTIER_LANDING_THREADS`` overriding) read and hash
    the landings.
    """

    def __init__(
        self,
        *,
        max_entries: int = 4,
        landing_threads: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        if landing_threads is None:
            # NOTE: read at construction, so a test or an operator can set it.
            landing_threads = landing_thread_count(
                usable_cpus(), env_text(LANDING_THREADS_ENV)
            )
        if landing_threads < 1:
            raise ValueError("landing_threads must be >= 1")
        self._max = max_entries
        self._threads = landing_threads
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StagedEntry] = OrderedDict()
        self._reports: Callable[[LandingObservation], object] | None = None
        self._pool: LandingPool | None = None
        self._closed = False
        self.evicted = 0
        self.landed = 0
        self.land_failures = 0

    def put(self, staging_id: str, entry: StagedEntry) -> bool:
        """Keep ``entry`` under ``staging_id`` (a new id); the staging owns its file from now on.

        ``False`` (the file released at once) when the staging is closed.
        """
        pushed: list[StagedEntry] = []
        with self._lock:
            duplicate = staging_id in self._entries
            if self._closed or duplicate:
                pushed.append(entry)
            else:
                self._entries[staging_id] = entry
                while len(self._entries) > self._max:
                    pushed.append(self._entries.popitem(last=False)[1])
                    self.evicted += 1
        for e in pushed:
            self.release(e)
        if duplicate:
            raise ValueError(f"staging id {staging_id!r} is in use")
        return entry not in pushed

    def take(self, staging_id: str) -> StagedEntry | None:
        """Remove and return the entry (``None`` if unknown, taken or pushed out).

        The taker owns its file: :meth:`land` it or :meth:`release` it.
        """
        with self._lock:
            return self._entries.pop(staging_id, None)

    def discard(self, staging_id: str) -> None:
        """Drop the entry if it is still here, releasing its file."""
        with self._lock:
            entry = self._entries.pop(staging_id, None)
        if entry is not None:
            self.release(entry)

    def release(self, entry: StagedEntry) -> None:
        """Close ``entry``'s file on a landing thread (at once, here, once the staging is closed)."""
        with self._lock:
            pool = None if self._closed else self._landing_pool_locked()
        if pool is None:
            _close(entry)
        else:
            pool.post(functools.partial(_close, entry))

    def land(self, entry: StagedEntry, *, step: int = 256) -> list[Any]:
        """Read a taken entry straight into MLX arrays and build its caches (engine thread).

        See :func:`kernels.cache.land_entry`; the file calls and hashes run
        on this staging's landing threads, right behind the reader's pass
        when it still runs. The file is released on every path. Raises what
        the landing raises (:class:`CacheFileCorrupt` when the file changed
        or a hash disagrees: recorded for the index; ``PassFailed`` when the
        reader's pass failed or was cancelled: the reader reports it).
        """
        started = self._clock()
        passed_at: list[float] = []
        # NOTE: a landing that starts while the reader's pass still runs
        # goes right behind it; its cost is the time it adds after the pass
        # ended (the read line already holds the pass), so restore = read +
        # landing stays what a request waits.
        entry.file.when_passed(lambda: passed_at.append(self._clock()))
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("staging is closed")
                pool = self._landing_pool_locked()
            caches = land_entry(entry.file, step=step, pool=pool)
        except PassFailed:
            # NOTE: the reader reports what its pass found; nothing to
            # record against the landing or the file here.
            raise
        except CacheFileCorrupt:
            self._observe(LandingObservation(entry.path, entry.nbytes, 0.0, ok=False, corrupt=True))
            raise
        except BaseException:
            self._observe(LandingObservation(entry.path, entry.nbytes, 0.0, ok=False))
            raise
        finally:
            self.release(entry)
        seconds = max(0.0, self._clock() - max([started, *passed_at]))
        self._observe(LandingObservation(entry.path, entry.nbytes, seconds, ok=True))
        return caches

    def _landing_pool_locked(self) -> LandingPool:
        if self._pool is None:
            self._pool = LandingPool(self._threads)
        return self._pool

    def bind_reports(
        self,
        sink: Callable[[LandingObservation], object] | None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """Where each landing's observation goes from now on (``None``: nowhere).

        ``sink`` is called on the thread that landed (the engine thread),
        outside the lock; it must not block (the index binds one that posts a
        message through the event loop). ``clock``: what times the landings
        from now on (the index passes its actor system's clock, so a
        simulated run's reports carry simulated times and replay exactly).
        """
        with self._lock:
            self._reports = sink
            if clock is not None:
                self._clock = clock

    def _observe(self, obs: LandingObservation) -> None:
        with self._lock:
            sink = self._reports
            if obs.ok:
                self.landed += 1
            else:
                self.land_failures += 1
        if sink is not None:
            sink(obs)

    def close(self) -> None:
        """Close every waiting file and stop the landing threads (a worker thread; idempotent).

        Files already posted for closing are closed before the threads stop.
        """
        with self._lock:
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            pool, self._pool = self._pool, None
        for e in entries:
            _close(e)
        if pool is not None:
            pool.close()

    @property
    def landing_threads(self) -> int:
        """The landing threads this staging reads and hashes with (started on first use)."""
        return self._threads

    @property
    def nbytes(self) -> int:
        """Bytes the waiting entries' landings will allocate (their tensor bytes)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


def _close(entry: StagedEntry) -> None:
    """Close a staged file; a failing ``close`` of a read-only file loses nothing, so it is logged."""
    try:
        entry.close()
    except OSError as exc:
        _log.warning("ssd_cache.close_failed", path=entry.path, error=str(exc))
