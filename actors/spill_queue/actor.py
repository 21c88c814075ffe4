"""The spill queue actor: a thin shell over ``actors.spill_queue.core``.

The shell keeps the core's state, handles one message at a time and
performs the core's effects: ``Store`` tells to the SSD writer (answered to
this actor's own address, so the queue keeps accepting and dropping while a
store runs), handle disposals through the registry's thread-safe
``dispose``, ``RunWhenIdle`` for the registry's drain step to the gateway
(``turns``; the ``TurnDone`` comes back here), and replies. It never awaits
the writer's work.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Protocol, assert_never

from actors.runtime import (
    Actor,
    ActorStopped,
    Context,
    MailboxClosed,
    UnknownAddress,
    get_logger,
)
from messages import Envelope, RemoveCheckpoints, Store
from messages.gateway import RunWhenIdle

from . import core

__all__ = [
    "SPILL_QUEUE_ADDRESS",
    "HandleReleaser",
    "SpillQueue",
]

SPILL_QUEUE_ADDRESS = "spill_queue"
"""The conventional actor name of the spill queue."""

_SSD_WRITER_ADDRESS = "ssd_writer"

_log = get_logger("kvtier.spill_queue")


class HandleReleaser(Protocol):
    """Where released handles go: ``kernels.CacheRegistry`` (thread-safe ``dispose``)."""

    def dispose(self, handle: str) -> None:
        """Forget ``handle``; its arrays are dropped later on the engine thread."""
        ...


class SpillQueue(Actor):
    """One serial, byte-capped queue of entries waiting to be written to SSD."""

    def __init__(
        self,
        *,
        state: core.QueueState,
        releaser: HandleReleaser,
        writer: str = _SSD_WRITER_ADDRESS,
        turns: str | None = None,
    ) -> None:
        self.state = state
        self._releaser = releaser
        self._writer = writer
        self._turns = turns

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Apply the rules to one message and perform their effects in order."""
        self.state, effects = ctx.traced(core.handle, self.state, envelope)
        await self._perform(effects, ctx)

    async def stopped(self, ctx: Context) -> None:
        """Release every handle still owned (queued and in flight)."""
        self.state, effects = ctx.traced(core.handle, self.state, core.Stopping())
        await self._perform(effects, ctx)

    async def _perform(self, effects: Sequence[core.Effect], ctx: Context) -> None:
        work = collections.deque(effects)
        while work:
            effect = work.popleft()
            match effect:
                case core.SendStore(item=item):
                    work.extend(await self._send_store(item, ctx))
                case core.ReleaseHandle(handle=handle):
                    self._release(handle)
                case core.RequestDrain(step_id=step_id):
                    if not self._request_drain(step_id, ctx):
                        undelivered = core.DrainUndelivered()
                        self.state, more = ctx.traced(core.handle, self.state, undelivered)
                        work.extend(more)
                case core.Answer(request=request, body=body):
                    await ctx.reply(request, body)
                case core.SendRemoveCheckpoints(request_key=request_key):
                    await self._send_remove(request_key, ctx)
                case _:
                    assert_never(effect)

    async def _send_store(self, item: core.Item, ctx: Context) -> list[core.Effect]:
        body = Store(
            handle=item.handle,
            namespace=item.namespace,
            tokens=item.tokens,
            meta=item.meta,
            source=item.source,
            reply_to=ctx.name,
            checkpoint=item.checkpoint,
        )
        try:
            await ctx.ref(self._writer).tell(body, correlation_id=item.correlation_id)
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning(
                "spill_queue.writer_unavailable", handle=item.handle, error=type(exc).__name__
            )
            unavailable = core.StoreUnavailable(item.handle, "writer_unavailable")
            self.state, more = ctx.traced(core.handle, self.state, unavailable)
            return more
        return []

    async def _send_remove(self, request_key: str, ctx: Context) -> None:
        # NOTE: the same mailbox as the Stores, so the removal runs after any
        # write of the key already handed over; a lost one leaves files that
        # the next identical request finds and resumes (never a wrong answer).
        try:
            await ctx.ref(self._writer).tell(RemoveCheckpoints(request_key=request_key))
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning("spill_queue.remove_checkpoints_unsent", error=type(exc).__name__)

    def _request_drain(self, step_id: str, ctx: Context) -> bool:
        """Ask the gateway for the drain turn; ``False`` if the ask was not sent."""
        if self._turns is None:
            return False
        # NOTE: idle only: every serial turn and batch step drains the
        # registry as it ends, so under load this turn would only cut a
        # step chain (one per spilled entry) for nothing.
        ask = RunWhenIdle(step_id=step_id, label="spill_queue.drain", reply_to=ctx.name,
                          idle_only=True)
        try:
            return ctx.try_tell(self._turns, ask)
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning("spill_queue.drain_unsent", error=type(exc).__name__)
            return False

    def _release(self, handle: str) -> None:
        try:
            self._releaser.dispose(handle)
        except KeyError:
            # NOTE: the registry raises UnknownCacheHandle (a KeyError) for a
            # handle it no longer knows; there is nothing left to free.
            _log.warning("spill_queue.release_unknown", handle=handle)
