"""The SSD index actor (a thin shell over ``actors.ssd_writer.core``) and what the tier is built over.

:class:`ColdTier` is immutable configuration and ports; four actors are
built over it by ``actors/engine/wiring.py``, each a sans-IO core and a
thin shell:

- ``ssd_writer`` (:class:`SsdWriter`, here): owns the index (its state and
  directory lock in an :class:`IndexKeep` no other actor sees). Its start
  hook takes the fingerprint directory's lock, scans the headers and
  performs the scan's removals; afterwards it only decides
  (``core.handle``) and never waits on a file or an engine turn, so
  ``Find`` answers stay immediate while a store or a restore runs.
  Removals it decides later go to the store worker (``RemoveEntries``).
- ``ssd_writer.store`` (``StoreWorker``, ``store.py``): writes one entry at
  a time (plan, reserve, victims removed durably, temp file, one engine
  turn and one positional write per tensor, commit, report, superseded
  files removed durably), generation checkpoints, and the index's removals.
- ``ssd_writer.read`` (``Reader``, ``reader.py``): checks a file and stages
  it open for the request's engine turn; answers the ``Restore`` asker
  directly and reports to the index. Separate from the store worker so a
  restore never waits behind a store that waits for an idle engine turn
  (which a request waiting for its restore would never give it).
- ``ssd_writer.scrub`` (``Scrubber``, ``scrubber.py``): while the engine is
  idle, re-verifies one stored file's hashes per round at a bounded rate
  and removes a bad one (design 8b).

All file work runs on worker threads through the tier's :class:`IoRunner`
(``ThreadPool``: ``anyio.to_thread`` with one ``CapacityLimiter``, the
bounded pool): never on the loop, never on the engine thread. The store
worker's (background durability work) runs on ``ColdTier.background``
instead: its own thread at the lowest CPU priority
(``background.BackgroundThreads``), so it takes no core from decode. ``aiofiles``
has no positional writes, ``fsync`` of directories, ``O_EXCL|O_NOFOLLOW``
creation or ``flock``; every call here goes through the injectable
``FilePort`` instead, on the same kind of pool.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, assert_never

import anyio

from actors.checkpoints import CheckpointCounters
from actors.runtime import (
    Actor,
    ActorStopped,
    Context,
    MailboxClosed,
    UnknownAddress,
    get_logger,
)
from kernels.cache import FileLock, FilePort, OsFilePort
from messages import (
    Body,
    Envelope,
    ReadEntry,
    Restore,
    SpillQueueStats,
    SsdStats,
    Store,
    StoreResult,
    WriteEntry,
)
from messages.ssd_writer import LandingReport, RemoveEntries

from . import core, io
from .background import BackgroundThreads
from .ports import FileIdentity, HostStaging, LandingObservation
from .shell import feed

__all__ = [
    "SSD_WRITER_ADDRESS",
    "ColdTier",
    "IndexKeep",
    "IoRunner",
    "SsdWriter",
    "SsdWriterConfig",
    "ThreadPool",
    "build_cold_tier",
    "cold_tier_stats",
]

SSD_WRITER_ADDRESS = "ssd_writer"
"""The conventional actor name of the cold tier's index (the one addressed from outside)."""

T = TypeVar("T")

_log = get_logger("kvtier.ssd_writer")


@dataclass(frozen=True)
class SsdWriterConfig:
    """Settings of the cold tier.

    ``root``: the cache directory (``--ssd-cache DIR``); files live under
    ``<root>/<identity.fingerprint>/<namespace digest>/``. ``max_bytes``:
    the byte cap (``--ssd-cache-max``), temp files included; 0: no cap
    (a full disk ends stores with ``disk_full``). ``verify``:
    check every tensor's hash on restore (``--ssd-cache-verify``).
    ``io_threads``: the worker-thread pool shared by the tier's file work.
    ``ask_timeout``: deadline of the store worker's asks to the index.
    ``max_header_bytes``: the largest header a reader accepts (``None``: the
    codec's default). ``staging_entries``: restored entries (open, checked
    files) that may wait for their turn at once. ``verify`` covers both
    hash passes (the reader's and the landing's). The idle scrubber
    re-verifies one file every ``scrub_interval_s`` seconds (0, the default here: no scrubber; the
    engine's wiring sets 60), reading at most
    ``scrub_bytes_per_s`` on average, and skips a round when no idle engine
    turn came within ``scrub_idle_wait_s``. ``min_restore_tokens``: ``Find``
    offers no file that adds fewer tokens than this to what RAM serves
    (``core.MIN_RESTORE_TOKENS``). ``always_restore``: read every usable
    file instead of asking the restore-or-recompute estimator
    (``--ssd-restore always``). ``wall_clock_ns``: the wall clock the
    startup scan ages generation checkpoint files against
    (``core.CHECKPOINT_MAX_AGE_NS``; a simulated file system brings its own).
    """

    root: str
    identity: FileIdentity
    max_bytes: int
    verify: bool = True
    io_threads: int = 2
    max_header_bytes: int | None = None
    ask_timeout: float = 30.0
    staging_entries: int = 2
    scrub_interval_s: float = 0.0
    scrub_bytes_per_s: float = 32.0 * 1024 * 1024
    scrub_idle_wait_s: float = 5.0
    min_restore_tokens: int = core.MIN_RESTORE_TOKENS
    always_restore: bool = False
    wall_clock_ns: Callable[[], int] = time.time_ns

    def __post_init__(self) -> None:
        if self.scrub_interval_s < 0 or self.scrub_bytes_per_s <= 0 or self.scrub_idle_wait_s <= 0:
            raise ValueError("scrub_interval_s >= 0, scrub_bytes_per_s > 0, scrub_idle_wait_s > 0")


class IoRunner(Protocol):
    """Runs blocking file work off the event loop (the tier's bounded worker-thread pool)."""

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a worker thread; its result or exception."""
        ...


class ThreadPool:
    """:class:`IoRunner` over ``anyio.to_thread`` with one ``CapacityLimiter`` of ``threads``.

    A loop-only port the tier's actors share: it holds nothing but the
    limiter, which every actor uses from the event loop (anyio's limiter is
    made for that).
    NOTE: the limiter is made on first use, inside the running loop.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._threads = threads
        self._limiter: anyio.CapacityLimiter | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """See :meth:`IoRunner.run`."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._threads)
        call = functools.partial(fn, *args, **kwargs)
        return await anyio.to_thread.run_sync(call, limiter=self._limiter)


@dataclass(frozen=True)
class ColdTier:
    """The cold tier's configuration and ports, built once by :func:`build_cold_tier`.

    Immutable: what the actors know of each other is their addresses;
    everything they decide on travels in their messages. The fields that are
    objects are ports every cold-tier actor may share: ``port`` (the file
    port, thread-safe), ``staging`` (:class:`HostStaging`, thread-safe),
    ``io`` (the bounded worker-thread pool, loop-only), ``background`` (the
    store worker's low-priority threads, loop-only; ``None``: ``io``),
    ``checkpoints`` (the generation-checkpoint counters, loop-only). What one actor alone uses is
    not here: the wiring gives the index its own :class:`IndexKeep` and the
    store worker its own tensor source.
    """

    config: SsdWriterConfig
    port: FilePort
    staging: HostStaging
    io: IoRunner
    name: str = SSD_WRITER_ADDRESS
    checkpoints: CheckpointCounters = field(default_factory=CheckpointCounters)
    background: IoRunner | None = None

    @property
    def store_address(self) -> str:
        """The store worker's address."""
        return f"{self.name}.store"

    @property
    def read_address(self) -> str:
        """The reader's address."""
        return f"{self.name}.read"

    @property
    def scrub_address(self) -> str:
        """The scrubber's address."""
        return f"{self.name}.scrub"

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking ``fn`` on the tier's bounded worker-thread pool."""
        return await self.io.run(fn, *args, **kwargs)

    async def run_background(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking background durability work ``fn`` (the store worker's) at low CPU priority."""
        runner = self.background if self.background is not None else self.io
        return await runner.run(fn, *args, **kwargs)


@dataclass
class IndexKeep:
    """What the index actor keeps across its restarts: the core's state and the directory lock.

    Given to the index's factory only (never to another actor): a restart
    after a failing message goes on with the same index instead of
    scanning again, and the lock stays held until the actor stops.
    """

    state: core.IndexState
    lock: FileLock | None = None

    @classmethod
    def fresh(cls, config: SsdWriterConfig, *, report_tier: bool = False) -> IndexKeep:
        """An empty index for ``config`` (``report_tier``: KV events of disk entries are on)."""
        return cls(
            core.new_state(
                root=config.root,
                fingerprint=config.identity.fingerprint,
                max_bytes=config.max_bytes,
                min_restore_tokens=config.min_restore_tokens,
                always_restore=config.always_restore,
                report_tier=report_tier,
            )
        )


def cold_tier_stats(ssd: SsdStats, queue: SpillQueueStats) -> dict[str, Any]:
    """The ``/stats`` ``ssd_cache`` section: the index's figures plus the spill queue's."""
    out: dict[str, Any] = ssd.model_dump(exclude={"kind"})
    out.update(
        pending_spills=queue.pending,
        pending_spill_bytes=queue.pending_bytes,
        dropped_spills=queue.dropped,
        failed_spills=queue.failed,
        spill_queue_cap_bytes=queue.cap_bytes,
    )
    return out


# --- the index ----------------------------------------------------------------------


class SsdWriter(Actor):
    """The index actor: scan at start, then ``core.handle`` for every event; performs its effects.

    ``keep``: the index's state and lock, kept across restarts (the wiring
    makes one per tier; ``None``: a fresh one for this instance).
    ``kv_events``: the KV-event publisher told what enters and leaves the
    index (``None``: nobody).
    """

    def __init__(
        self, tier: ColdTier, *, keep: IndexKeep | None = None, kv_events: str | None = None
    ) -> None:
        self._tier = tier
        self._keep = keep if keep is not None else IndexKeep.fresh(tier.config)
        self._kv_events = kv_events

    async def started(self, ctx: Context) -> None:
        """Bind the staging's landing reports; lock and scan the directory (once: a restart keeps it)."""
        self._tier.staging.bind_reports(_landing_poster(ctx), clock=ctx.clock.now)
        if not self._keep.state.ready:
            await self._load(ctx)

    async def stopped(self, ctx: Context) -> None:
        """Close the files still waiting in the staging (worker thread) and release the lock."""
        tier = self._tier
        tier.staging.bind_reports(None)
        try:
            await tier.run(tier.staging.close)
        finally:
            lock, self._keep.lock = self._keep.lock, None
            if lock is not None:
                lock.release()

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Feed the message to the rules and perform their effects in order."""
        await self._feed(core.Received(envelope, ctx.clock.now()), ctx)

    async def _load(self, ctx: Context) -> None:
        """The start hook's file work: lock, scan, directory fsyncs; the rules decide the rest."""
        tier, keep = self._tier, self._keep
        fingerprint_dir = keep.state.fingerprint_dir
        try:
            keep.lock = await tier.run(io.lock_directory, tier.port, fingerprint_dir)
        except OSError as exc:
            _log.warning(
                "ssd_cache.unavailable",
                directory=fingerprint_dir,
                error=str(exc),
                detail="the SSD cache directory cannot be created or locked; "
                "the cold tier stores nothing in this run",
            )
        else:
            if keep.lock is None:
                _log.warning(
                    "ssd_cache.read_only",
                    directory=fingerprint_dir,
                    detail="another kvtier server holds this SSD cache directory; this one "
                    "restores from it but writes and removes nothing",
                )
        locked = keep.lock is not None
        try:
            scan = await tier.run(
                io.scan,
                tier.port,
                tier.config.root,
                tier.config.identity.fingerprint,
                tokenizer_hash=tier.config.identity.tokenizer_hash,
                max_header_bytes=tier.config.max_header_bytes,
                now_ns=tier.config.wall_clock_ns(),
            )
        except OSError as exc:
            _log.warning("ssd_cache.scan_failed", root=tier.config.root, error=str(exc))
            scan = core.ScanResult(incomplete=True)
        if locked and scan.directories:
            failed = await tier.run(io.sync_directories, tier.port, scan.directories)
            if failed:
                _log.warning(
                    "ssd_cache.dir_sync_failed",
                    directories=list(failed),
                    detail="an earlier run's unsynced removals there may come back after a crash",
                )
        await self._feed(core.ScanLoaded(scan, locked, ctx.clock.now()), ctx)
        ready = core.stats(keep.state)
        _log.info(
            "ssd_cache.ready",
            directory=fingerprint_dir,
            entries=ready.entries,
            bytes=ready.bytes,
            max_bytes=ready.max_bytes,
            read_only=ready.read_only,
            corrupt_removed=ready.corrupt_removed,
            orphans_reaped=ready.orphans_reaped,
            foreign_dirs=ready.foreign_dirs,
        )

    async def _feed(self, event: core.Event, ctx: Context) -> None:
        async def perform(effect: core.Effect) -> core.Event | None:
            return await self._perform(effect, ctx)

        keep = self._keep
        keep.state = await feed(ctx, core.handle, keep.state, event, perform)

    async def _perform(self, effect: core.Effect, ctx: Context) -> core.Event | None:
        """Carry out one effect; the event its outcome makes for the rules, if any."""
        tier = self._tier
        match effect:
            case core.Answer(request=request, body=body):
                await ctx.reply(request, body)
            case core.StartWrite():
                write = WriteEntry(
                    job_id=effect.job_id,
                    handle=effect.handle,
                    namespace=effect.namespace,
                    tokens=effect.tokens,
                    path=effect.path,
                )
                # NOTE: never wait on a worker's mailbox: the worker asks this
                # actor (ReserveSpace, EntryWritten), so blocking here could
                # deadlock both until the ask deadline.
                if not _try_tell(ctx, tier.store_address, write, effect.correlation_id):
                    return core.WorkerGone(effect.job_id, "writer_unavailable", ctx.clock.now())
            case core.StartRead(request=request):
                assert isinstance(request.body, Restore)
                read = ReadEntry(
                    path=effect.path,
                    namespace=effect.namespace,
                    tokens=effect.tokens,
                    ticket=request.body.ticket,
                    reply_to=request.body.reply_to,
                    read_only=effect.read_only,
                )
                if not _try_tell(ctx, tier.read_address, read, request.correlation_id):
                    return core.ReaderGone(request, effect.path, ctx.clock.now())
            case core.RemoveFiles(paths=paths, reason=reason):
                remove = RemoveEntries(paths=paths, reason=reason)
                if not _try_tell(ctx, tier.store_address, remove, None):
                    _log.warning("ssd_cache.remove_deferred", paths=list(paths), reason=reason)
                    return core.Removed((), paths, ctx.clock.now())
            case core.RemoveNow(paths=paths, reason=reason):
                removal = await tier.run(io.remove_durably, tier.port, paths)
                _log.info(
                    "ssd_cache.removed",
                    reason=reason,
                    removed=len(removal.gone),
                    failed=len(removal.left),
                )
                return core.Removed(removal.gone, removal.left, ctx.clock.now())
            case core.ForwardCheckpoint(request=request, job_id=job_id):
                body = request.body
                if not _try_tell(ctx, tier.store_address, body, request.correlation_id) \
                        and isinstance(body, Store):
                    return core.WorkerGone(job_id, "writer_unavailable", ctx.clock.now())
            case core.RefuseCheckpoint(request=request, reason=reason):
                await self._refuse_checkpoint(request, reason, ctx)
            case core.ReportTier(body=report):
                await self._report(report, ctx)
            case core.Log(event=name, detail=detail):
                _log.warning(name, detail=detail)
            case _:
                assert_never(effect)
        return None

    async def _refuse_checkpoint(self, request: Envelope, reason: str, ctx: Context) -> None:
        body = request.body
        assert isinstance(body, Store)
        self._tier.checkpoints.write_failed += 1
        await ctx.reply(request, StoreResult(handle=body.handle, stored=False, reason=reason))

    async def _report(self, report: Body, ctx: Context) -> None:
        if self._kv_events is None:
            return
        try:
            # NOTE: a waiting tell: a dropped report would leave the KV-event
            # subscribers' index wrong; the publisher never waits on this actor.
            await ctx.tell(self._kv_events, report)
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning("ssd_cache.kv_events_failed", error=repr(exc))


def _landing_poster(ctx: Context) -> Callable[[LandingObservation], None]:
    """A landing-report sink for :meth:`HostStaging.bind_reports`: posts ``LandingReport`` to ``ctx``.

    NOTE: called on the engine thread, which makes no actor calls: it hands
    the observation to the event loop, which sends it (into the reserved
    room when the mailbox is full, so a busy index still learns of a
    corrupt file). A report lost all the same loses a timing sample, or the
    removal of a corrupt file, which its next landing reports again.
    """
    loop = asyncio.get_running_loop()
    ref = ctx.self_ref

    def send(obs: LandingObservation) -> None:
        report = LandingReport(
            path=obs.path, nbytes=obs.nbytes, seconds=obs.seconds, ok=obs.ok, corrupt=obs.corrupt
        )
        try:
            if not ref.try_tell(report) and not ref.post(report):
                _log.warning("ssd_cache.landing_report_lost", path=obs.path, ok=obs.ok)
        except (ActorStopped, MailboxClosed, UnknownAddress):
            return

    def sink(obs: LandingObservation) -> None:
        try:
            loop.call_soon_threadsafe(send, obs)
        except RuntimeError:
            return  # NOTE: the loop is closed; nobody is left to tell.

    return sink


def _try_tell(ctx: Context, address: str, body: Body, correlation_id: str | None) -> bool:
    """Send without waiting; ``False`` when the worker is gone or its mailbox is full."""
    try:
        return ctx.ref(address).try_tell(body, correlation_id=correlation_id)
    except (ActorStopped, MailboxClosed, UnknownAddress):
        return False


# --- building -----------------------------------------------------------------------------


def build_cold_tier(
    *,
    config: SsdWriterConfig,
    port: FilePort | None = None,
    name: str = SSD_WRITER_ADDRESS,
    staging: HostStaging | None = None,
    io_runner: IoRunner | None = None,
) -> ColdTier:
    """The configuration and ports the cold tier's actors are built over (the wiring spawns them).

    ``staging``: where restored files wait (``None``: a new one of
    ``config.staging_entries``); pass the one the engine's backend takes
    restored entries from. ``io_runner``: where file work runs (``None``: a
    :class:`ThreadPool` of ``config.io_threads``); the store worker's runs
    on one :class:`BackgroundThreads` thread unless ``io_runner`` is given
    (a simulation's runner then runs all of it).
    """
    return ColdTier(
        config=config,
        port=port if port is not None else OsFilePort(),
        staging=staging if staging is not None else HostStaging(max_entries=config.staging_entries),
        io=io_runner if io_runner is not None else ThreadPool(config.io_threads),
        name=name,
        # NOTE: one thread: the store worker runs one file call at a time.
        background=BackgroundThreads(1) if io_runner is None else None,
    )
