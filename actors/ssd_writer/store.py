"""The store worker: a thin shell over ``actors.ssd_writer.store_core``.

It performs the core's effects: the tensor source's engine turns (plan,
one tensor per turn, release; a generation checkpoint's plan and views in
one turn), the asks to the index (``ReserveSpace``, ``EntryWritten``), the
file work on the tier's low-priority background thread
(``ColdTier.run_background``: victims' removal, temp file,
positional writes, commit, removals), generation checkpoint writes and
removals, and the replies. It holds the plan and the
open writer of the write in progress and feeds each outcome back into the
core as the next event (it awaits it: its mailbox holds only further jobs,
which wait their turn).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar, assert_never

import anyio

from actors.checkpoints import DeltaBase, checkpoint_dir, remove_checkpoints, write_checkpoint
from actors.runtime import Actor, Context, RuntimeFailure, get_logger
from kernels.cache import (
    CacheFileCorrupt,
    CacheFileIncompatible,
    CacheFileWriteError,
    EntryPlan,
    GenerationCheckpoint,
    KvFileHeader,
    KvFileWriter,
    delta_enabled,
    read_header,
    tail_starts,
)
from messages import (
    EntryWritten,
    Envelope,
    ReserveSpace,
    SpaceReserved,
    Store,
    WriteCommitted,
)

from . import io
from . import store_core as core
from .actor import ColdTier
from .ports import BytesLike, CheckpointSource, TensorSource
from .shell import feed

__all__ = ["StoreWorker"]

T = TypeVar("T")

_log = get_logger("kvtier.ssd_writer")


class _SourceFailed(Exception):
    """The tensor source could not plan or read back the entry (a soft store failure)."""


class StoreWorker(Actor):
    """Writes one entry per ``WriteEntry``; always reports back to the index.

    Also writes and removes generation checkpoints (``Store`` with a
    checkpoint record, ``RemoveCheckpoints``: the index hands them over, in
    arrival order) and removes the files the index asks it to
    (``RemoveEntries``).
    """

    def __init__(self, tier: ColdTier, source: TensorSource) -> None:
        self._tier = tier
        # NOTE: the tensor source is the store worker's alone (the other
        # cold-tier actors get the tier without it): it keeps the last view
        # of each plan until the next engine turn.
        self._source_port = source
        self._state = core.StoreState()
        self._request: Envelope | None = None
        self._plan: EntryPlan | None = None
        self._writer: KvFileWriter | None = None
        # NOTE: a checkpoint's tensor views (they share the MLX arrays'
        # memory); the list is emptied before the source's finish turn.
        self._views: list[BytesLike] = []
        # NOTE: the previous file a checkpoint delta builds on (set with its plan).
        self._base: DeltaBase | None = None

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Run one message to its end (a write: report it, remove what it superseded)."""
        self._request = envelope
        try:
            try:
                await self._feed(core.Asked(envelope, ctx.clock.now()), ctx)
            except Exception as exc:
                if self._state.request is None:
                    raise
                # An unexpected error is logged with its traceback; the core
                # reports the job failed, or the spill queue would wait for ever.
                _log.exception("ssd_cache.store_crashed", error=type(exc).__name__)
                await self._feed(core.Crashed(type(exc).__name__, ctx.clock.now()), ctx)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()
            self._request = None
            # NOTE: a message that ended by an exception leaves nothing in progress.
            state = self._state
            state.job, state.request, state.removing = None, None, ""

    async def _feed(self, event: core.Event, ctx: Context) -> None:
        async def perform(effect: core.Effect) -> core.Event | None:
            return await self._perform(effect, ctx)

        self._state = await feed(ctx, core.handle, self._state, event, perform)

    async def _perform(self, effect: core.Effect, ctx: Context) -> core.Event | None:
        tier, request = self._tier, self._request
        assert request is not None
        match effect:
            case core.Plan(handle=handle, namespace=namespace, tokens=tokens):
                return await self._planned(handle, namespace, tokens, ctx)
            case core.Reserve(job_id=job_id, file_bytes=nbytes):
                try:
                    reserved: SpaceReserved | None = await ctx.ask(
                        tier.name, ReserveSpace(job_id=job_id, file_bytes=nbytes),
                        timeout=tier.config.ask_timeout, expect=SpaceReserved,
                    )  # fmt: skip
                except RuntimeFailure as exc:
                    _log.warning("ssd_cache.reserve_unanswered", error=repr(exc))
                    reserved = None
                return core.Reserved(reserved, ctx.clock.now())
            case core.Evict(paths=paths):
                removal = await tier.run_background(io.remove_durably, tier.port, paths)
                return core.Evicted(removal.failed, removal.unsynced, ctx.clock.now())
            case core.Begin(directory=directory):
                return await self._file_step(self._begin(directory), ctx)
            case core.WriteTensor(index=index):
                return await self._write_tensor(index, ctx)
            case core.Commit(path=path):
                writer = self._writer
                assert writer is not None
                return await self._file_step(tier.run_background(writer.commit, path), ctx)
            case core.Release():
                await self._release()
            case core.Report(body=written):
                return core.Settled(await self._report(written, ctx), ctx.clock.now())
            case core.Remove(paths=paths):
                removal = await tier.run_background(io.remove_durably, tier.port, paths)
                return core.Removed(removal.gone, removal.left, ctx.clock.now())
            case core.TellRemoved(body=body):
                await ctx.tell(tier.name, body)
            case core.PlanCheckpoint(body=body, base=base):
                return await self._plan_checkpoint(body, base, ctx)
            case core.WriteCheckpoint():
                return await self._write_checkpoint(ctx)
            case core.RemoveCheckpointFiles(request_key=key):
                try:
                    removed = await tier.run_background(
                        remove_checkpoints, tier.port, self._checkpoint_dir(), key
                    )
                except OSError as exc:
                    return core.CheckpointsRemoved(0, ctx.clock.now(), error=str(exc))
                return core.CheckpointsRemoved(len(removed), ctx.clock.now(), paths=removed)
            case core.Answer(body=body):
                await ctx.reply(request, body)
            case core.Count(what=what, n=n, nbytes=nbytes, reused=reused):
                counters = tier.checkpoints
                if what == "written":
                    counters.written += n
                    counters.bytes += nbytes
                    if reused:
                        counters.deltas += n
                        counters.delta_reused_bytes += reused
                elif what == "failed":
                    counters.write_failed += n
                elif what == "refused":
                    counters.refuse(effect.reason)
                else:
                    counters.removed += n
            case core.Log(event=name, fields=fields, level=level):
                if level == "info":
                    _log.info(name, **dict(fields))
                else:
                    _log.warning(name, **dict(fields))
            case _:
                assert_never(effect)
        return None

    # --- the write's steps -----------------------------------------------------------------

    async def _source(self, pending: Awaitable[T]) -> T:
        try:
            return await pending
        except Exception as exc:
            _log.warning("ssd_cache.source_failed", error=type(exc).__name__, detail=str(exc))
            raise _SourceFailed(str(exc)) from exc

    async def _planned(
        self, handle: str, namespace: str, tokens: tuple[int, ...], ctx: Context
    ) -> core.Event:
        try:
            plan = await self._source(
                self._source_port.plan(handle, namespace=namespace, tokens=tokens)
            )
        except _SourceFailed:
            return core.SourceFailed(ctx.clock.now())
        self._plan = plan
        header = plan.header
        return core.Planned(plan.file_size, len(plan.tensors), header.trimmable,
                            header.min_reusable_offset, ctx.clock.now())  # fmt: skip

    async def _begin(self, directory: str) -> core.Event | None:
        tier, plan = self._tier, self._plan
        assert plan is not None
        await tier.run_background(tier.port.makedirs, directory)
        self._writer = KvFileWriter(tier.port, plan)
        await tier.run_background(self._writer.begin, directory)
        return None

    async def _file_step(self, step: Awaitable[object], ctx: Context) -> core.Event:
        """Run one file step; what it makes for the rules (``Begun`` or ``Committed`` when ok)."""
        began = self._writer is None
        try:
            await step
        except OSError as exc:
            # NOTE: CacheFileWriteError is an OSError; the writer already
            # discarded its temp file (and the final one after a failed
            # directory fsync). A failed fsync is never retried as success.
            fsync_dir = isinstance(exc, CacheFileWriteError) and exc.step == "fsync_dir"
            reason = io.store_failure_reason(exc)
            return core.WriteFailed(reason, str(exc), ctx.clock.now(), fsync_dir=fsync_dir)
        return core.Begun(ctx.clock.now()) if began else core.Committed(ctx.clock.now())

    async def _write_tensor(self, index: int, ctx: Context) -> core.Event:
        tier, plan, writer = self._tier, self._plan, self._writer
        assert plan is not None
        assert writer is not None
        try:
            data = await self._source(self._source_port.tensor(plan, index))
        except _SourceFailed:
            return core.SourceFailed(ctx.clock.now())
        # NOTE: the view is lent to the worker thread in a list that is
        # emptied here once the write returned, so neither we nor the worker
        # thread (anyio drops a call's arguments only after it reported the
        # result) hold it when the source frees the MLX buffer on the engine
        # thread.
        lent = [data]
        del data
        try:
            await tier.run_background(_write_lent, writer, index, lent)
        except OSError as exc:
            return core.WriteFailed(io.store_failure_reason(exc), str(exc), ctx.clock.now())
        finally:
            lent.clear()
        return core.TensorWritten(index, ctx.clock.now())

    async def _release(self) -> None:
        """Drop the temp file unless committed, release the plan (idempotent, never raises)."""
        writer, self._writer = self._writer, None
        plan, self._plan = self._plan, None
        self._base = None
        # NOTE: emptied in place: the checkpoint write's reader holds this
        # list, not the views; the source's finish below drops the last ones.
        self._views.clear()
        if writer is not None:
            await self._tier.run_background(writer.abort)  # NOTE: a no-op once committed.
        if plan is not None:
            try:
                await self._source_port.finish(plan)
            except Exception as exc:  # noqa: BLE001 - NOTE: the store's outcome is already decided.
                _log.warning("ssd_cache.source_finish_failed", error=type(exc).__name__)

    async def _report(self, written: EntryWritten, ctx: Context) -> WriteCommitted | None:
        tier = self._tier
        try:
            return await ctx.ask(
                tier.name, written, timeout=tier.config.ask_timeout, expect=WriteCommitted
            )
        except RuntimeFailure as exc:
            _log.warning("ssd_cache.report_unanswered", job=written.job_id, error=repr(exc))
            return None

    # --- generation checkpoints --------------------------------------------------------------

    def _checkpoint_dir(self) -> str:
        ident = self._tier.config.identity
        return checkpoint_dir(self._tier.config.root, ident.fingerprint)

    async def _base_header(self, path: str | None) -> KvFileHeader | None:
        """The validated header of a delta's previous file (``None``: no delta this time)."""
        if path is None or not delta_enabled():
            return None
        tier = self._tier
        try:
            return await tier.run_background(read_header, tier.port, path,
                                             expected_fingerprint=tier.config.identity.fingerprint)
        except (CacheFileCorrupt, CacheFileIncompatible, OSError):
            # NOTE: gone or damaged: this checkpoint is read back whole.
            return None

    async def _plan_checkpoint(self, job: Store, base_path: str | None, ctx: Context) -> core.Event:
        """Plan the checkpoint file and take its tensors' views in ONE idle engine turn (no copy).

        With ``base_path`` (the previous file of the same answer) and deltas
        on, the views of the attention tensors hold only the tokens after
        that file's (``kernels.cache._kv_delta``).
        """
        ck = job.checkpoint
        assert ck is not None
        record = GenerationCheckpoint(ck.request_key, ck.prompt_len, ck.pending_token,
                                      ck.sample_index, ck.rng_key)
        source = self._source_port
        base = await self._base_header(base_path)
        try:
            if not isinstance(source, CheckpointSource):
                raise _SourceFailed("the tensor source cannot plan a checkpoint")
            plan, views = await self._source(source.checkpoint_views(
                job.handle, namespace=job.namespace, tokens=job.tokens, checkpoint=record,
                base=base))
        except _SourceFailed:
            return core.SourceFailed(ctx.clock.now())
        # NOTE: from here ``_release`` ends the plan with the source's finish
        # (engine thread), on every path.
        self._plan, self._views = plan, views
        if base is not None and base_path is not None:
            # NOTE: the same pure function the engine turn applied to the same headers.
            starts = tail_starts(plan.header, base)
            self._base = DeltaBase(base_path, base, starts) if starts else None
        return core.CheckpointPlanned(plan.file_size, ctx.clock.now())

    async def _write_checkpoint(self, ctx: Context) -> core.Event:
        """Write the planned checkpoint file (its room is reserved), on a worker thread.

        The worker thread reads the tensors' bytes from the views while it
        hashes and writes them: the device-to-host reads happen here, never
        in an engine turn. NOTE: the file is committed under its own name
        before the key's older files go (``actors.checkpoints.write_checkpoint``),
        so every failure leaves the previous checkpoint valid.
        """
        tier, plan, views, base = self._tier, self._plan, self._views, self._base
        assert plan is not None
        port = tier.port
        try:
            directory = self._checkpoint_dir()
            await tier.run_background(port.makedirs, directory)
            path = await tier.run_background(write_checkpoint, port, directory, plan,
                                             lambda i: memoryview(views[i]), base)
        except (CacheFileCorrupt, CacheFileIncompatible) as exc:
            # NOTE: the delta's previous file failed its checks: this restart point is lost
            # (the next checkpoint is read back whole), never a wrong one.
            return core.CheckpointWritten(False, ctx.clock.now(), reason="delta_base_failed",
                                          error=str(exc))
        except ValueError as exc:
            return core.CheckpointWritten(False, ctx.clock.now(), reason="source_failed",
                                          error=str(exc))
        except OSError as exc:
            return core.CheckpointWritten(False, ctx.clock.now(),
                                          reason=io.store_failure_reason(exc), error=str(exc))
        reused = 0 if base is None else sum(
            plan.tensors[i].nbytes // plan.tensors[i].shape[-2] * n
            for i, n in base.starts.items() if plan.tensors[i].shape[-2])
        return core.CheckpointWritten(True, ctx.clock.now(), path=path,
                                      file_bytes=plan.file_size, reused_bytes=reused)  # fmt: skip


def _write_lent(writer: KvFileWriter, index: int, lent: list[BytesLike]) -> None:
    """Write tensor ``index`` from the one view in ``lent`` (a worker thread)."""
    writer.write_tensor(index, lent[0])
