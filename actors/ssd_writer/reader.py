"""The reader: a thin shell over ``actors.ssd_writer.reader_core``.

It performs the core's effects: opening the file and passing over it on
the tier's worker pool, staging it in the :class:`HostStaging`, answering
the ``Restore`` asker, removing a bad file, reporting to the index. It
holds the one open file of the read in progress and feeds each outcome back
into the core as the next event (it awaits it: the reader's mailbox holds
only further reads, which wait their turn).
"""

from __future__ import annotations

from typing import Any, assert_never

from actors.runtime import Actor, Context
from kernels.cache import CacheFileCorrupt, CacheFileIncompatible, OpenEntry, PassFailed
from messages import Envelope

from . import io
from . import reader_core as core
from .actor import ColdTier
from .ports import StagedEntry
from .shell import feed, warn_file

__all__ = ["Reader"]


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
        self._state = core.ReaderState()
        self._file: OpenEntry | None = None
        self._request: Envelope | None = None
        self._unoffered: str | None = None
        """Staged, but the asker has not been answered yet (dropped if the answer fails)."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Run one read to its end."""
        self._request = envelope
        try:
            await self._feed(core.ReadAsked(envelope, ctx.clock.now()), ctx)
        except BaseException:
            self._state.read = None
            raise
        finally:
            file, self._file, self._request = self._file, None, None
            staged, self._unoffered = self._unoffered, None
            if staged is not None:
                self._tier.staging.discard(staged)
            if file is not None:
                # NOTE: a pass that never ran still ends, waking any landing
                # behind it (a no-op once it ran).
                file.abandon()

    async def _feed(self, event: core.Event, ctx: Context) -> None:
        async def perform(effect: core.Effect) -> core.Event | None:
            return await self._perform(effect, ctx)

        self._state = await feed(ctx, core.handle, self._state, event, perform)

    async def _perform(self, effect: core.Effect, ctx: Context) -> core.Event | None:
        tier, request = self._tier, self._request
        assert request is not None
        match effect:
            case core.Open():
                return await self._open(effect, ctx)
            case core.Stage(staging_id=staging_id):
                file = self._file
                assert file is not None
                # NOTE: the staging owns the open file from here (it closes it
                # when it drops the entry, pushes it out, or lands it; closing
                # it during the pass cancels the pass).
                staged = tier.staging.put(staging_id, StagedEntry(file.path, file))
                self._unoffered = staging_id if staged else None
                return core.Staged(staged, ctx.clock.now())
            case core.Offer(body=body):
                delivered = await ctx.reply(request, body)
                self._unoffered = None
                return core.Delivered(delivered, ctx.clock.now())
            case core.Answer(body=body):
                await ctx.reply(request, body)
            case core.Pass(touch=touch):
                return await self._pass(touch, ctx)
            case core.Discard(staging_id=staging_id):
                tier.staging.discard(staging_id)
            case core.Abandon(reason=reason):
                if self._file is not None:
                    self._file.abandon(reason)
            case core.RemoveBad(path=path):
                removal = await tier.run(io.remove_durably, tier.port, (path,))
                return core.BadRemoved(removal.gone == (path,), ctx.clock.now())
            case core.Report(body=report):
                await ctx.tell(tier.name, report)
            case core.Log(event=name, path=path, error=error, removed=removed):
                warn_file(name, path, error, removed)
            case _:
                assert_never(effect)
        return None

    async def _open(self, effect: core.Open, ctx: Context) -> core.Event:
        tier = self._tier
        try:
            file = await _open_owned(
                tier,
                effect.path,
                fingerprint=tier.config.identity.fingerprint,
                namespace=effect.namespace,
                tokens=effect.tokens,
                verify=tier.config.verify,
                max_header_bytes=tier.config.max_header_bytes,
            )
        except (CacheFileCorrupt, CacheFileIncompatible) as exc:
            return core.OpenFailed("corrupt", ctx.clock.now(), str(exc))
        except FileNotFoundError:
            return core.OpenFailed("gone", ctx.clock.now())
        except OSError as exc:
            return core.OpenFailed("io_error", ctx.clock.now(), str(exc))
        self._file = file
        staging_id = ctx.ids.new_id("restore-")
        return core.Opened(staging_id, len(file.header.tokens), file.nbytes, ctx.clock.now())

    async def _pass(self, touch: bool, ctx: Context) -> core.Event:
        tier, file = self._tier, self._file
        assert file is not None
        try:
            read, touched = await tier.run(io.pass_entry, tier.port, file, touch=touch)
        except (CacheFileCorrupt, CacheFileIncompatible) as exc:
            return core.Passed("corrupt", ctx.clock.now(), error=str(exc))
        except PassFailed:
            return core.Passed("stopped", ctx.clock.now())
        except OSError as exc:
            return core.Passed("io_error", ctx.clock.now(), error=str(exc))
        return core.Passed("ok", ctx.clock.now(), nbytes=read, touched=touched)
