"""The KV-event publisher actor: a thin shell over ``actors.kv_events.core``.

It feeds the core the tiers' ``TierChanged`` messages, replay requests and
statistics asks, stamped with the wall-clock time (vLLM's batch ``ts``),
and performs its effects on the :class:`~actors.kv_events.ports.EventSockets`:
batches on the PUB socket, replay answers on the ROUTER socket, replies.
A task reads the ROUTER socket and posts each request into this mailbox
(so the replay buffer is read only by the core). See ``docs/scale-out.md``.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from typing import assert_never

from actors.runtime import Actor, ActorStopped, Context, MailboxClosed, UnknownAddress, get_logger
from messages import Envelope, Request
from messages.kv_events import KvEventsReplay

from . import core
from .ports import EventSockets

__all__ = ["KV_EVENTS_ADDRESS", "KvEvents"]

KV_EVENTS_ADDRESS = "kv_events"
"""The conventional actor name of the publisher."""

_log = get_logger("kvtier.kv_events")


class KvEvents(Actor):
    """Publishes vLLM-format KV events for the RAM and SSD tiers.

    ``state`` is shared by every instance (the wiring keeps one), so the
    stream's sequence numbers and block counts survive a restart;
    ``sockets`` are bound by the caller and closed when this actor stops.
    ``wall``: the wall clock stamped on batches (``time.time``).
    """

    def __init__(self, *, state: core.CoreState, sockets: EventSockets,
                 wall: Callable[[], float] = time.time) -> None:
        self.state = state
        self._sockets = sockets
        self._wall = wall
        self._reader: asyncio.Task[None] | None = None

    async def started(self, ctx: Context) -> None:
        """Start reading replay requests; publish ``AllBlocksCleared`` on the first start."""
        ref = ctx.self_ref

        def ask(client: bytes, start_seq: int) -> None:
            try:
                if not ref.try_tell(KvEventsReplay(client=client.hex(), start_seq=start_seq)):
                    _log.warning("kv_events.replay_dropped", reason="mailbox full")
            except (ActorStopped, MailboxClosed, UnknownAddress):
                return

        # NOTE: a fresh context, so the posted requests are not stamped with
        # the envelope being handled when the task started.
        self._reader = asyncio.get_running_loop().create_task(
            self._sockets.serve_replays(ask), context=contextvars.Context()
        )
        await self._feed(core.Started(self._wall()), None, ctx)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Apply the rules to one message and perform their effects in order."""
        await self._feed(core.Received(envelope.body, self._wall()), envelope, ctx)

    async def stopped(self, ctx: Context) -> None:
        """Stop reading replay requests and close the sockets."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        self._sockets.close()

    async def _feed(self, event: core.Event, envelope: Envelope | None, ctx: Context) -> None:
        self.state, effects = ctx.traced(core.handle, self.state, event)
        for effect in effects:
            match effect:
                case core.Publish(seq=seq, frames=frames):
                    if not await self._sockets.publish(frames):
                        self.state, _ = ctx.traced(core.handle, self.state, core.SendFailed(seq))
                case core.SendReplay(frames=frames):
                    lost = await self._sockets.send_replay(frames)
                    if lost:
                        _log.warning("kv_events.replay_incomplete", lost=lost)
                case core.Reply(body=body):
                    if (envelope is not None and isinstance(envelope.body, Request)
                            and envelope.body.reply_to):
                        await ctx.reply(envelope, body)
                case _:
                    assert_never(effect)
