"""The cold tier's actors: thin shells over ``actors.ssd_writer.core``.

Four actors share one :class:`ColdTier` (state, file port, worker-thread
limiter, host staging); ``actors/engine/wiring.py`` spawns them:

- ``ssd_writer`` (:class:`SsdWriter`): owns the index. Its startup hook
  takes the fingerprint directory's lock and scans the headers; afterwards
  it only decides (``core.handle``) and never waits on a file or an engine
  turn, so ``Find`` answers stay immediate while a store or a restore runs.
- ``ssd_writer.store`` (:class:`StoreWorker`): writes one entry at a time:
  plan (engine turn), reserve room (asks the index), remove the victims
  durably (unlink, directory fsync), temp file, one engine turn + one
  positional write per tensor, commit (fsync, rename, directory fsync), then
  reports (asks the index), removes what the new file superseded durably
  and tells the index which of those are gone.
- ``ssd_writer.read`` (:class:`Reader`): checks a file (one pass through
  a reused buffer, hashes verified) and stages it open for the request's
  engine turn, which lands it straight into MLX memory; answers the
  ``Restore`` asker directly, and reports to the index. Separate from the store worker so a
  restore never waits behind a store that waits for an idle engine turn
  (which a request waiting for its restore would never give it).
- ``ssd_writer.scrub`` (:class:`Scrubber`): while the engine is idle,
  re-verifies one stored file's hashes per round at a bounded rate and
  removes a bad one (design 8b).

All file work runs on worker threads through ``anyio.to_thread`` with one
shared ``CapacityLimiter`` (the bounded pool): never on the loop, never on
the engine thread. ``aiofiles`` has no positional writes, ``fsync`` of
directories, ``O_EXCL|O_NOFOLLOW`` creation or ``flock``; every call here
goes through the injectable ``FilePort`` instead, on the same kind of pool.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, assert_never

import anyio

from actors.checkpoints import (
    CheckpointCounters,
    checkpoint_dir,
    remove_checkpoints,
    write_checkpoint,
)
from actors.runtime import (
    Actor,
    ActorStopped,
    Alarm,
    Context,
    LoopAlarm,
    MailboxClosed,
    RuntimeFailure,
    UnknownAddress,
    get_logger,
)
from kernels.cache import (
    CacheFileCorrupt,
    CacheFileIncompatible,
    CacheFileWriteError,
    EntryPlan,
    FileLock,
    FilePort,
    GenerationCheckpoint,
    KvFileWriter,
    OpenEntry,
    OsFilePort,
    PassFailed,
)
from messages import (
    Body,
    EntryWritten,
    Envelope,
    ReadEntry,
    RemoveCheckpoints,
    ReserveSpace,
    Restore,
    RestoreReport,
    RestoreResult,
    SpaceReserved,
    SpillQueueStats,
    SsdStats,
    Store,
    StoreResult,
    WriteCommitted,
    WriteEntry,
)
from messages.gateway import RunWhenIdle, TurnDone
from messages.ssd_writer import FilesRemoved, ScrubPick, ScrubReport, ScrubTarget, ScrubWake

from . import core, io
from .ports import CheckpointSource, FileIdentity, HostStaging, StagedEntry, TensorSource

__all__ = [
    "SSD_WRITER_ADDRESS",
    "ColdTier",
    "Reader",
    "Scrubber",
    "SsdWriter",
    "SsdWriterConfig",
    "StoreWorker",
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
    (``--ssd-restore always``).
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

    def __post_init__(self) -> None:
        if self.scrub_interval_s < 0 or self.scrub_bytes_per_s <= 0 or self.scrub_idle_wait_s <= 0:
            raise ValueError("scrub_interval_s >= 0, scrub_bytes_per_s > 0, scrub_idle_wait_s > 0")


@dataclass
class ColdTier:
    """What the tier's actors share (built once by :func:`build_cold_tier`, survives restarts).

    ``state`` may be read directly for statistics (``core.stats(tier.state)``);
    ``staging`` is where restored bytes wait for their caller.
    """

    config: SsdWriterConfig
    port: FilePort
    source: TensorSource
    state: core.IndexState
    staging: HostStaging
    name: str = SSD_WRITER_ADDRESS
    lock: FileLock | None = None
    checkpoints: CheckpointCounters = field(default_factory=CheckpointCounters)
    _limiter: anyio.CapacityLimiter | None = field(default=None, repr=False)

    @property
    def store_address(self) -> str:
        """The store worker's address."""
        return f"{self.name}.store"

    @property
    def read_address(self) -> str:
        """The reader's address."""
        return f"{self.name}.read"

    def stats(self) -> SsdStats:
        """The index's statistics, read without asking."""
        return core.stats(self.state)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking ``fn`` on the tier's bounded worker-thread pool."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.config.io_threads)
        call = functools.partial(fn, *args, **kwargs)
        return await anyio.to_thread.run_sync(call, limiter=self._limiter)

    def release_lock(self) -> None:
        """Drop the directory lock (the tier's actors have stopped)."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()


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
    """The index actor: scan at start, then ``core.handle`` for every message."""

    def __init__(self, tier: ColdTier, *, kv_events: str | None = None) -> None:
        self._tier = tier
        self._kv_events = kv_events

    async def started(self, ctx: Context) -> None:
        """Lock the fingerprint directory and scan it (once; a restart keeps the index)."""
        if not self._tier.state.ready:
            await self._load(ctx)

    async def stopped(self, ctx: Context) -> None:
        """Close the files still waiting in the staging (worker thread) and release the lock."""
        try:
            await self._tier.run(self._tier.staging.close)
        finally:
            self._tier.release_lock()

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Apply the rules to one message and perform their effects in order.

        NOTE: the landings the engine thread recorded since the last message
        are applied first (it cannot send messages itself), so a ``Find``
        always sees every landing that finished before it arrived.
        """
        tier = self._tier
        landed: list[core.Effect] = []
        for obs in tier.staging.drain_observations():
            landed += core.landing_report(
                tier.state,
                path=obs.path,
                nbytes=obs.nbytes,
                seconds=obs.seconds,
                ok=obs.ok,
                corrupt=obs.corrupt,
            )
        if landed:
            await self._perform(landed, ctx)
        body = envelope.body
        if (isinstance(body, Store) and body.checkpoint is not None) \
                or isinstance(body, RemoveCheckpoints):
            await self._checkpoint_work(envelope, ctx)
            return
        tier.state, effects = core.handle(tier.state, envelope)
        await self._perform(effects, ctx)

    async def _checkpoint_work(self, envelope: Envelope, ctx: Context) -> None:
        """Hand a checkpoint write or removal to the store worker (outside the index).

        NOTE: checkpoint files are not index entries (no prefix lookup finds
        them); the store worker runs writes and removals in arrival order,
        so a completion's removal never overtakes its key's write.
        """
        tier, body = self._tier, envelope.body
        if tier.state.read_only or not tier.state.ready:
            if isinstance(body, Store):
                tier.checkpoints.write_failed += 1
                await ctx.reply(envelope, StoreResult(handle=body.handle, stored=False,
                                                      reason="read_only"))
            return
        if not _try_tell(ctx, tier.store_address, body, envelope.correlation_id) \
                and isinstance(body, Store):
            tier.checkpoints.write_failed += 1
            await ctx.reply(envelope, StoreResult(handle=body.handle, stored=False,
                                                  reason="writer_unavailable"))

    async def _load(self, ctx: Context) -> None:
        tier, state = self._tier, self._tier.state
        try:
            tier.lock = await tier.run(io.lock_directory, tier.port, state.fingerprint_dir)
        except OSError as exc:
            state.read_only = True
            _log.warning(
                "ssd_cache.unavailable",
                directory=state.fingerprint_dir,
                error=str(exc),
                detail="the SSD cache directory cannot be created or locked; "
                "the cold tier stores nothing in this run",
            )
        else:
            if tier.lock is None:
                state.read_only = True
                _log.warning(
                    "ssd_cache.read_only",
                    directory=state.fingerprint_dir,
                    detail="another kvtier server holds this SSD cache directory; this one "
                    "restores from it but writes and removes nothing",
                )
        try:
            scan = await tier.run(
                io.scan,
                tier.port,
                state.root,
                state.fingerprint,
                tokenizer_hash=tier.config.identity.tokenizer_hash,
                max_header_bytes=tier.config.max_header_bytes,
            )
        except OSError as exc:
            _log.warning("ssd_cache.scan_failed", root=state.root, error=str(exc))
            scan = core.ScanResult(incomplete=True)
        if not state.read_only and scan.directories:
            failed = await tier.run(io.sync_directories, tier.port, scan.directories)
            if failed:
                _log.warning(
                    "ssd_cache.dir_sync_failed",
                    directories=list(failed),
                    detail="an earlier run's unsynced removals there may come back after a crash",
                )
        tier.state, effects = core.load_scan(state, scan)
        await self._perform(effects, ctx)
        _log.info(
            "ssd_cache.ready",
            directory=state.fingerprint_dir,
            entries=len(state.entries),
            bytes=state.indexed_bytes,
            max_bytes=state.max_bytes,
            read_only=state.read_only,
            corrupt_removed=state.corrupt_removed,
            orphans_reaped=state.orphans_reaped,
            foreign_dirs=state.foreign_dirs,
        )

    async def _perform(self, effects: Sequence[core.Effect], ctx: Context) -> None:
        tier = self._tier
        work = list(effects)
        while work:
            effect = work.pop(0)
            if isinstance(effect, core.Answer):
                await ctx.reply(effect.request, effect.body)
            elif isinstance(effect, core.StartWrite):
                body = WriteEntry(
                    job_id=effect.job_id,
                    handle=effect.handle,
                    namespace=effect.namespace,
                    tokens=effect.tokens,
                    path=effect.path,
                )
                # NOTE: never wait on a worker's mailbox: the worker asks this
                # actor (ReserveSpace, EntryWritten), so blocking here could
                # deadlock both until the ask deadline.
                if not _try_tell(ctx, tier.store_address, body, effect.correlation_id):
                    work[:0] = core.abandon_job(tier.state, effect.job_id, "writer_unavailable")
            elif isinstance(effect, core.StartRead):
                request = effect.request
                assert isinstance(request.body, Restore)
                read = ReadEntry(
                    path=effect.path,
                    namespace=effect.namespace,
                    tokens=effect.tokens,
                    ticket=request.body.ticket,
                    reply_to=request.body.reply_to,
                )
                if not _try_tell(ctx, tier.read_address, read, request.correlation_id):
                    unavailable = RestoreResult(
                        ok=False,
                        path=effect.path,
                        reason="reader_unavailable",
                        ticket=request.body.ticket,
                    )
                    await ctx.reply(request, unavailable)
            elif isinstance(effect, core.RemoveFiles):
                removal = await tier.run(io.remove_durably, tier.port, effect.paths)
                core.files_removed(
                    tier.state, FilesRemoved(removed=removal.gone, failed=removal.left)
                )
                _log.info(
                    "ssd_cache.removed",
                    reason=effect.reason,
                    removed=len(removal.gone),
                    failed=len(removal.left),
                )
            elif isinstance(effect, core.Log):
                _log.warning(effect.event, detail=effect.detail)
            else:
                assert_never(effect)
        report = core.tier_report(tier.state)
        if report is not None and self._kv_events is not None:
            try:
                # NOTE: a waiting tell: a dropped report would leave the KV-event
                # subscribers' index wrong; the publisher never waits on this actor.
                await ctx.tell(self._kv_events, report)
            except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
                _log.warning("ssd_cache.kv_events_failed", error=repr(exc))


def _try_tell(ctx: Context, address: str, body: Body, correlation_id: str) -> bool:
    """Send without waiting; ``False`` when the worker is gone or its mailbox is full."""
    try:
        return ctx.ref(address).try_tell(body, correlation_id=correlation_id)
    except (ActorStopped, MailboxClosed, UnknownAddress):
        return False


# --- the store worker -------------------------------------------------------------------


class _SourceFailed(Exception):
    """The tensor source could not plan or read back the entry (a soft store failure)."""


class StoreWorker(Actor):
    """Writes one entry per ``WriteEntry``; always reports back to the index."""

    def __init__(self, tier: ColdTier) -> None:
        self._tier = tier

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Write the job, report it, unlink what it superseded."""
        body = envelope.body
        if isinstance(body, Store):
            await ctx.reply(envelope, await self._write_checkpoint(body))
            return
        if isinstance(body, RemoveCheckpoints):
            await self._remove_checkpoints(body.request_key)
            return
        if not isinstance(body, WriteEntry):
            raise TypeError(f"store worker has no rule for {body.kind!r}")
        tier = self._tier
        try:
            report = await self._write(body, ctx)
        except Exception as exc:  # noqa: BLE001 - NOTE: liveness: a Store must always be answered.
            # An unexpected error is logged with its traceback and counted as a
            # failed store; the spill queue would otherwise wait for ever.
            _log.exception("ssd_cache.store_crashed", job=body.job_id, error=type(exc).__name__)
            report = EntryWritten(job_id=body.job_id, ok=False, reason="internal_error")
        committed = await ctx.ask(
            tier.name, report, timeout=tier.config.ask_timeout, expect=WriteCommitted
        )
        if committed.remove:
            removal = await tier.run(io.remove_durably, tier.port, committed.remove)
            if removal.left:
                _log.warning("ssd_cache.supersede_unlink_failed", paths=list(removal.left))
            # NOTE: the index counts these files until it hears they are gone.
            await ctx.tell(tier.name, FilesRemoved(removed=removal.gone, failed=removal.left))

    def _checkpoint_dir(self) -> str:
        ident = self._tier.config.identity
        return checkpoint_dir(self._tier.config.root, ident.fingerprint)

    async def _write_checkpoint(self, job: Store) -> StoreResult:
        """Write one checkpoint file: plan and host copy in ONE idle engine turn, file work on a worker.

        NOTE: the file is committed under its own name before the key's older
        files go (``actors.checkpoints.write_checkpoint``), so every failure
        leaves the previous checkpoint valid.
        """
        tier = self._tier
        ck = job.checkpoint
        assert ck is not None
        counters = tier.checkpoints
        record = GenerationCheckpoint(ck.request_key, ck.prompt_len, ck.pending_token,
                                      ck.sample_index, ck.rng_key)
        source, port = tier.source, tier.port
        try:
            if not isinstance(source, CheckpointSource):
                raise _SourceFailed("the tensor source cannot copy a checkpoint")
            plan, data = await self._source(source.host_copy(
                job.handle, namespace=job.namespace, tokens=job.tokens, checkpoint=record))
            directory = self._checkpoint_dir()
            await tier.run(port.makedirs, directory)
            path = await tier.run(write_checkpoint, port, directory, plan,
                                  lambda i: memoryview(data[i]))
        except (_SourceFailed, ValueError) as exc:
            counters.write_failed += 1
            _log.warning("checkpoint.write_failed", reason="source_failed", error=str(exc))
            return StoreResult(handle=job.handle, stored=False, reason="source_failed")
        except OSError as exc:
            counters.write_failed += 1
            reason = io.store_failure_reason(exc)
            _log.warning("checkpoint.write_failed", reason=reason, error=str(exc))
            return StoreResult(handle=job.handle, stored=False, reason=reason)
        counters.written += 1
        counters.bytes += plan.file_size
        return StoreResult(handle=job.handle, stored=True, path=path, file_bytes=plan.file_size)

    async def _remove_checkpoints(self, request_key: str) -> None:
        try:
            removed = await self._tier.run(remove_checkpoints, self._tier.port,
                                           self._checkpoint_dir(), request_key)
        except OSError as exc:
            _log.warning("checkpoint.remove_failed", error=str(exc))
            return
        self._tier.checkpoints.removed += removed

    async def _source(self, pending: Awaitable[T]) -> T:
        try:
            return await pending
        except Exception as exc:
            _log.warning("ssd_cache.source_failed", error=type(exc).__name__, detail=str(exc))
            raise _SourceFailed(str(exc)) from exc

    async def _write(self, job: WriteEntry, ctx: Context) -> EntryWritten:
        tier = self._tier
        source, port = tier.source, tier.port
        plan: EntryPlan | None = None
        writer: KvFileWriter | None = None
        unremoved: tuple[str, ...] = ()
        unsynced: tuple[str, ...] = ()
        try:
            plan = await self._source(
                source.plan(job.handle, namespace=job.namespace, tokens=job.tokens)
            )
            reserved = await ctx.ask(
                tier.name,
                ReserveSpace(job_id=job.job_id, file_bytes=plan.file_size),
                timeout=tier.config.ask_timeout,
                expect=SpaceReserved,
            )
            if not reserved.ok:
                return EntryWritten(job_id=job.job_id, ok=False, reason=reserved.reason)
            # NOTE: the victims' removal is durable before the new file
            # exists, so no crash can leave both (with more than the cap).
            removal = await tier.run(io.remove_durably, port, reserved.evict)
            unremoved, unsynced = removal.failed, removal.unsynced
            if removal.left:
                return EntryWritten(
                    job_id=job.job_id,
                    ok=False,
                    reason="evict_failed",
                    unremoved=unremoved,
                    unsynced=unsynced,
                )
            directory = os.path.dirname(job.path)
            await tier.run(port.makedirs, directory)
            writer = KvFileWriter(port, plan)
            await tier.run(writer.begin, directory)
            for i in range(len(plan.tensors)):
                data = await self._source(source.tensor(plan, i))
                await tier.run(writer.write_tensor, i, data)
                # NOTE: drop our reference before the next turn so the source
                # frees the MLX buffer behind it on the engine thread.
                del data
            final = job.path
            await tier.run(writer.commit, final)
            header = plan.header
            return EntryWritten(
                job_id=job.job_id,
                ok=True,
                path=final,
                file_bytes=plan.file_size,
                trimmable=header.trimmable,
                min_reusable_offset=header.min_reusable_offset,
            )
        except _SourceFailed:
            return EntryWritten(job_id=job.job_id, ok=False, reason="source_failed")
        except OSError as exc:
            # NOTE: CacheFileWriteError is an OSError; the writer already
            # discarded its temp file (and the final one after a failed
            # directory fsync). A failed fsync is never retried as success.
            reason = io.store_failure_reason(exc)
            _log.warning("ssd_cache.store_failed", reason=reason, error=str(exc))
            leftover: str | None = None
            if isinstance(exc, CacheFileWriteError) and exc.step == "fsync_dir":
                # NOTE: the rename happened; the final file was unlinked again,
                # but neither is durable: the index counts it until a later
                # directory fsync makes its removal durable.
                leftover = job.path
            return EntryWritten(
                job_id=job.job_id,
                ok=False,
                reason=reason,
                leftover_path=leftover,
                leftover_bytes=plan.file_size if leftover is not None and plan is not None else 0,
            )
        finally:
            with anyio.CancelScope(shield=True):
                if writer is not None:
                    await tier.run(writer.abort)  # NOTE: a no-op once committed.
                if plan is not None:
                    await self._finish(plan)

    async def _finish(self, plan: EntryPlan) -> None:
        try:
            await self._tier.source.finish(plan)
        except Exception as exc:  # noqa: BLE001 - NOTE: the store's outcome is already decided.
            _log.warning("ssd_cache.source_finish_failed", error=type(exc).__name__)


# --- the reader --------------------------------------------------------------------------


async def _open_owned(tier: ColdTier, path: str, **kwargs: Any) -> OpenEntry:
    """``io.open_for_restore`` on the worker pool; its file is closed if the caller never gets it.

    NOTE: the worker thread runs to its end even when the awaiting task is
    cancelled meanwhile; the file it opened is then closed here instead of
    leaking its descriptor.
    """
    produced: list[OpenEntry] = []

    def open_() -> OpenEntry:
        out = io.open_for_restore(tier.port, path, **kwargs)
        produced.append(out)
        return out

    try:
        return await tier.run(open_)
    except BaseException:
        for out in produced:
            out.close()
        raise


class Reader(Actor):
    """Opens one file per ``ReadEntry``, stages it, answers the ``Restore`` asker, then passes over it.

    The answer comes once the header is checked and the file open; the
    pass (every tensor read, hashes checked) runs after it, so the request's
    engine turn can land the entry right behind the pass (a landing waits
    for each tensor the pass has not reached yet). What the pass finds is
    reported to the index: a corrupt file is removed; its landing fails (a
    miss). The pass always ends (done, failed, or abandoned when its worker
    never ran), so a landing waiting on it never hangs.
    """

    def __init__(self, tier: ColdTier) -> None:
        self._tier = tier

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Open, stage, answer the asker, pass over the file, report to the index."""
        body = envelope.body
        if not isinstance(body, ReadEntry):
            raise TypeError(f"reader has no rule for {body.kind!r}")
        tier = self._tier
        state = tier.state
        started = ctx.clock.now()
        try:
            file = await _open_owned(
                tier,
                body.path,
                fingerprint=state.fingerprint,
                namespace=body.namespace,
                tokens=body.tokens,
                verify=tier.config.verify,
                max_header_bytes=tier.config.max_header_bytes,
            )
        except (CacheFileCorrupt, CacheFileIncompatible) as exc:
            await self._bad_file(envelope, ctx, body, exc)
            return
        except FileNotFoundError:
            await ctx.reply(
                envelope, RestoreResult(ok=False, path=body.path, reason="gone", ticket=body.ticket)
            )
            await ctx.tell(tier.name, RestoreReport(path=body.path, ok=False, reason="gone"))
            return
        except OSError as exc:
            await self._io_error(envelope, ctx, body, exc)
            return
        try:
            await self._stage_and_pass(envelope, ctx, body, file, started)
        finally:
            # NOTE: a pass that never ran still ends, waking any landing
            # behind it (a no-op once it ran).
            file.abandon()

    async def _stage_and_pass(
        self, envelope: Envelope, ctx: Context, body: ReadEntry, file: OpenEntry, started: float
    ) -> None:
        tier = self._tier
        staging_id = ctx.ids.new_id("restore-")
        # NOTE: the staging owns the open file from here (it closes it when it
        # drops the entry, pushes it out, or lands it; closing it during the
        # pass cancels the pass).
        if not tier.staging.put(staging_id, StagedEntry(body.path, file)):
            await ctx.reply(
                envelope,
                RestoreResult(ok=False, path=body.path, reason="stopped", ticket=body.ticket),
            )
            await ctx.tell(tier.name, RestoreReport(path=body.path, ok=False, reason="stopped"))
            return
        result = RestoreResult(
            ok=True,
            path=body.path,
            staging_id=staging_id,
            entry_tokens=len(file.header.tokens),
            bytes=file.nbytes,
            read_s=max(0.0, ctx.clock.now() - started),
            ticket=body.ticket,
        )
        try:
            delivered = await ctx.reply(envelope, result)
        except BaseException:
            tier.staging.discard(staging_id)
            raise
        if not delivered:
            tier.staging.discard(staging_id)  # NOTE: the asker left; close the file now.
            file.abandon("the asker left")
            await ctx.tell(tier.name, RestoreReport(path=body.path, ok=False, reason="stopped"))
            return
        try:
            read, touched = await tier.run(
                io.pass_entry, tier.port, file, touch=not tier.state.read_only
            )
        except (CacheFileCorrupt, CacheFileIncompatible) as exc:
            tier.staging.discard(staging_id)
            await self._bad_file(None, ctx, body, exc)
            return
        except PassFailed:
            # NOTE: the entry was closed during its pass (pushed out, dropped,
            # a landing that failed): nothing is known against the file.
            await ctx.tell(tier.name, RestoreReport(path=body.path, ok=False, reason="stopped"))
            return
        except OSError as exc:
            tier.staging.discard(staging_id)
            await self._io_error(None, ctx, body, exc)
            return
        seconds = max(0.0, ctx.clock.now() - started)
        # NOTE: only a pass that read the file teaches the estimator a read
        # speed (``bytes=0`` is ignored there): one that found the file in
        # the page cache read nothing, and its time says nothing of the disk.
        report = RestoreReport(
            path=body.path, ok=True, bytes=read, seconds=seconds, touched=touched
        )
        await ctx.tell(tier.name, report)

    async def _bad_file(
        self, envelope: Envelope | None, ctx: Context, body: ReadEntry, exc: Exception
    ) -> None:
        tier = self._tier
        removed = False
        if not tier.state.read_only:
            removal = await tier.run(io.remove_durably, tier.port, (body.path,))
            removed = removal.gone == (body.path,)
        _log.warning("ssd_cache.corrupt", path=body.path, error=str(exc), removed=removed)
        if envelope is not None:
            await ctx.reply(
                envelope,
                RestoreResult(ok=False, path=body.path, reason="corrupt", ticket=body.ticket),
            )
        report = RestoreReport(path=body.path, ok=False, reason="corrupt", removed=removed)
        await ctx.tell(tier.name, report)

    async def _io_error(
        self, envelope: Envelope | None, ctx: Context, body: ReadEntry, exc: OSError
    ) -> None:
        _log.warning("ssd_cache.read_failed", path=body.path, error=str(exc))
        if envelope is not None:
            await ctx.reply(
                envelope,
                RestoreResult(ok=False, path=body.path, reason="io_error", ticket=body.ticket),
            )
        await ctx.tell(self._tier.name, RestoreReport(path=body.path, ok=False, reason="io_error"))


# --- the scrubber ---------------------------------------------------------------------


class Scrubber(Actor):
    """Re-verifies stored files' hashes while the engine is idle, one file per alarm.

    Each round asks the gateway for one idle engine turn of the standing
    no-op step ``gate_step`` (granted only when no request runs or waits),
    then takes the next file from the index (round robin) and checks every
    tensor's hash on the worker pool, through one reused buffer. A bad file
    is unlinked (not when read-only) and reported; the index drops it. The
    next round comes ``scrub_interval_s`` later, or later still so that the
    bytes read stay under ``scrub_bytes_per_s``. ``gateway`` ``None`` skips
    the idleness check (tests).
    """

    def __init__(
        self,
        tier: ColdTier,
        *,
        gateway: str | None,
        gate_step: str,
        alarm: Alarm | None = None,
    ) -> None:
        self._tier = tier
        self._gateway = gateway
        self._gate_step = gate_step
        self._alarm = alarm

    async def started(self, ctx: Context) -> None:
        """Arm the first round one interval from now."""
        if self._alarm is None:
            self._alarm = LoopAlarm(ctx.clock)
        self._arm(ctx, self._tier.config.scrub_interval_s)

    async def stopped(self, ctx: Context) -> None:
        """Cancel the alarm."""
        if self._alarm is not None:
            self._alarm.set(None, _nothing)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """One round per ``ScrubWake``; then arm the next."""
        body = envelope.body
        if not isinstance(body, ScrubWake):
            raise TypeError(f"scrubber has no rule for {body.kind!r}")
        config = self._tier.config
        checked = await self._round(ctx)
        wait = max(config.scrub_interval_s, checked / config.scrub_bytes_per_s)
        self._arm(ctx, wait)

    def _arm(self, ctx: Context, delay: float) -> None:
        alarm = self._alarm
        if alarm is None or self._tier.config.scrub_interval_s <= 0:
            return
        ref = ctx.self_ref

        def wake() -> None:
            try:
                # NOTE: a full mailbox already holds a wake; nothing is lost.
                ref.try_tell(ScrubWake())
            except (ActorStopped, MailboxClosed, UnknownAddress):
                return

        alarm.set(ctx.clock.now() + delay, wake)

    async def _idle(self, ctx: Context) -> bool:
        """Whether the gateway granted the gate step (the engine was idle)."""
        if self._gateway is None:
            return True
        wait = self._tier.config.scrub_idle_wait_s
        ask = RunWhenIdle(
            step_id=self._gate_step, label="ssd_writer.scrub", deadline=ctx.clock.now() + wait
        )
        try:
            done = await ctx.ask(self._gateway, ask, timeout=wait, expect=TurnDone)
        except RuntimeFailure:
            return False  # NOTE: busy the whole time (or stopping): skip this round.
        return done.ok

    async def _round(self, ctx: Context) -> int:
        """Verify one file; the bytes read (0 when nothing was checked)."""
        tier = self._tier
        state = tier.state
        if state.read_only or not state.ready or not await self._idle(ctx):
            return 0
        try:
            target = await ctx.ask(
                tier.name, ScrubPick(), timeout=tier.config.ask_timeout, expect=ScrubTarget
            )
        except RuntimeFailure:
            return 0  # NOTE: the index is restarting or stopping: try next round.
        path = target.path
        if path is None:
            return 0
        try:
            checked = await tier.run(
                io.verify_entry,
                tier.port,
                path,
                fingerprint=state.fingerprint,
                namespace=target.namespace,
                tokens=target.tokens,
                max_header_bytes=tier.config.max_header_bytes,
            )
        except (CacheFileCorrupt, CacheFileIncompatible) as exc:
            removed = False
            if not state.read_only:
                removal = await tier.run(io.remove_durably, tier.port, (path,))
                removed = removal.gone == (path,)
            _log.warning("ssd_cache.scrub_corrupt", path=path, error=str(exc), removed=removed)
            report = ScrubReport(path=path, ok=False, reason="corrupt", removed=removed)
            checked = target.file_bytes
        except FileNotFoundError:
            report, checked = ScrubReport(path=path, ok=False, reason="gone"), 0
        except OSError as exc:
            _log.warning("ssd_cache.scrub_failed", path=path, error=str(exc))
            report, checked = ScrubReport(path=path, ok=False, reason="io_error"), 0
        else:
            report = ScrubReport(path=path, ok=True, bytes=checked)
        try:
            await ctx.tell(tier.name, report)
        except RuntimeFailure:
            _log.warning("ssd_cache.scrub_report_lost", path=path, reason=report.reason)
        return checked


def _nothing() -> None:
    return None


# --- building -----------------------------------------------------------------------------


def build_cold_tier(
    *,
    config: SsdWriterConfig,
    source: TensorSource,
    port: FilePort | None = None,
    name: str = SSD_WRITER_ADDRESS,
    staging: HostStaging | None = None,
) -> ColdTier:
    """The state the cold tier's actors share (the wiring spawns them over it).

    ``staging``: where restored bytes wait (``None``: a new one of
    ``config.staging_entries``); pass the one the engine's backend takes
    restored entries from.
    """
    state = core.IndexState(
        root=config.root,
        fingerprint=config.identity.fingerprint,
        max_bytes=config.max_bytes,
        min_restore_tokens=config.min_restore_tokens,
        estimator=core.Estimator(always_restore=config.always_restore),
    )
    return ColdTier(
        config=config,
        port=port if port is not None else OsFilePort(),
        source=source,
        state=state,
        staging=staging if staging is not None else HostStaging(max_entries=config.staging_entries),
        name=name,
    )
