"""The RAM prompt cache actor: a thin shell over ``actors.prompt_cache.core``.

The shell keeps the core's state, runs one message at a time on the event
loop and performs the core's effects: replies (at once, or later for a
``Take`` that waits for the cold tier), disposals through the registry's
thread-safe ``dispose`` (the arrays are dropped on the engine thread), spills
as ``spill_queue.Enqueue`` messages to the cold tier's queue, drain requests
(``RunWhenIdle`` for the standing :data:`DRAIN_STEP`, which the wiring
registered) to the gateway, ``Find``/``Restore`` requests to the SSD index
(answered into this mailbox, so the cache keeps serving while a file is
read), dropping restored bytes nobody will use, and its one alarm (idle
demotions, lookup deadlines). What it could not do (a reply nobody received,
a spill the queue did not take, an ask the index did not take) goes back
into the core as an event. It never touches an MLX array and calls no hook.
See ``docs/prompt-cache.md`` and ``docs/cold-tier.md``.

Addresses and ports come from the wiring at construction
(``actors/engine/wiring.py``): ``spill_to`` (the cold tier's queue; ``None``
disposes instead of spilling), ``turns`` (the gateway; ``None`` asks for no
drain turns), ``cold`` (the SSD index; ``None``: RAM only), ``staging``
(where restored bytes wait), ``durability`` (the write-behind coordinator,
told of every stored put), ``alarm`` (``None``: a loop timer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol, assert_never

from actors.runtime import (
    Actor,
    ActorRef,
    ActorStopped,
    Context,
    MailboxClosed,
    UnknownAddress,
    get_logger,
)
from messages import Body, Envelope, Request
from messages.durability import Schedule
from messages.gateway import RunWhenIdle
from messages.prompt_cache import PromptCacheWake

from . import core
from .ports import Alarm, LoopAlarm, StagedBytes

__all__ = [
    "DRAIN_STEP",
    "PROMPT_CACHE_ADDRESS",
    "HandleDisposer",
    "PromptCache",
]

PROMPT_CACHE_ADDRESS = "prompt_cache"
"""The conventional actor name of the RAM tier."""

DRAIN_STEP = "prompt_cache.drain"
"""The standing background step (registered by the wiring) that drops disposed arrays."""

_log = get_logger("kvtier.prompt_cache")


class HandleDisposer(Protocol):
    """Where disposed handles go: ``kernels.CacheRegistry``.

    The actor calls only the thread-safe ``dispose``; ``drain`` is what the
    wiring registers as the :data:`DRAIN_STEP` background step (engine thread).
    """

    def dispose(self, handle: str) -> None:
        """Forget ``handle``; its arrays are released later on the engine thread."""
        ...

    def drain(self) -> int:
        """Drop the arrays of disposed handles (engine thread); how many."""
        ...


class PromptCache(Actor):
    """Byte-capped LRU of token-prefix entries; answers ``Take``/``Put``/``Release``/stats.

    ``spill_to``: the address of the cold tier's queue, or ``None`` (no cold
    tier: evicted entries are disposed). ``turns``: the gateway's address,
    asked for a :data:`DRAIN_STEP` background turn after disposals, or
    ``None`` (no drain turns). ``cold``: the SSD index asked by ``Take``
    (``None``: RAM only); ``staging``: the cold tier's host staging;
    ``durability``: the coordinator told of every stored put (``None``: none).
    ``state``: a state shared across restarts (the wiring's factory passes
    one, so a restart does not orphan the handles the cache owns).
    ``kv_events``: the KV-event publisher, told what enters and leaves the
    index when the state's ``report_tier`` is set (``None``: nobody).
    """

    def __init__(
        self,
        *,
        cap_bytes: int,
        registry: HandleDisposer,
        spill_to: str | None = None,
        turns: str | None = None,
        cold: str | None = None,
        staging: StagedBytes | None = None,
        alarm: Alarm | None = None,
        durability: str | None = None,
        lease_ttl_s: float = core.DEFAULT_LEASE_TTL_S,
        state: core.CoreState | None = None,
        kv_events: str | None = None,
    ) -> None:
        self._registry = registry
        self._durability = durability
        self._kv_events = kv_events
        self._spill_to = spill_to
        self._turns = turns
        self._cold = cold
        self._staging = staging
        self._alarm = alarm
        self._self: ActorRef | None = None
        self.state = (
            state
            if state is not None
            else core.CoreState(
                cap_bytes=cap_bytes,
                spill_enabled=spill_to is not None,
                drain_step=DRAIN_STEP if turns is not None else None,
                lease_ttl_s=lease_ttl_s,
                cold_lookups=cold is not None,
                notify_puts=durability is not None,
            )
        )

    async def started(self, ctx: Context) -> None:
        """Bind the alarm and set it for whatever the (shared) state has due."""
        self._self = ctx.self_ref
        if self._alarm is None:
            self._alarm = LoopAlarm(ctx.clock)
        await self._feed(core.Started(ctx.clock.now()), None, ctx)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Apply the rules to one message and perform their effects in order."""
        await self._feed(core.Received(envelope, ctx.clock.now()), envelope, ctx)

    async def stopped(self, ctx: Context) -> None:
        """Answer lookups still waiting for the cold tier and dispose every unleased entry."""
        await self._feed(core.Stopping(ctx.clock.now()), None, ctx)

    async def _feed(self, event: core.Event, envelope: Envelope | None, ctx: Context) -> None:
        self.state, effects = ctx.traced(core.handle, self.state, event)
        await self._perform(effects, envelope, ctx)

    async def _perform(
        self, effects: Sequence[core.Effect], envelope: Envelope | None, ctx: Context
    ) -> None:
        pending = deque(effects)
        while pending:
            effect = pending.popleft()
            event: core.Event | None = None
            match effect:
                case core.Reply(body=body, to=to):
                    lease = getattr(body, "lease_id", None)
                    target = envelope if to is None else to
                    if not await self._reply(target, effect, ctx) and isinstance(lease, str):
                        event = core.LeaseUndelivered(lease, ctx.clock.now())
                case core.Dispose(handle=handle):
                    self._dispose(handle)
                case core.Spill(message=message):
                    if not self._send(self._spill_to, message, ctx):
                        event = core.SpillUndelivered(message, ctx.clock.now())
                case core.RequestDrain(step_id=step):
                    if not self._request_drain(step, ctx):
                        # NOTE: taken as a refusal; the next disposal asks again.
                        event = core.DrainUndelivered(step, ctx.clock.now())
                case core.AskCold(take_id=take_id, body=body):
                    event = await self._ask_cold(take_id, body, ctx)
                case core.DiscardStaged(staging_id=staging_id):
                    if self._staging is not None:
                        self._staging.discard(staging_id)
                case core.SetAlarm(at=at):
                    self._set_alarm(at)
                case core.NotifyPut():
                    await self._notify(effect, ctx)
                case core.ReportTier(body=body):
                    await self._report(body, ctx)
                case _:
                    assert_never(effect)
            if event is not None:
                self.state, more = ctx.traced(core.handle, self.state, event)
                pending.extend(more)

    async def _ask_cold(self, take_id: str, body: Request, ctx: Context) -> core.Event:
        """Send a request to the SSD index, answered into this mailbox."""
        if self._cold is None:
            return core.ColdAskUndelivered(take_id, ctx.clock.now())
        try:
            msg_id = await ctx.request(self._cold, body)
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning("prompt_cache.cold_ask_failed", kind=body.kind, error=repr(exc))
            return core.ColdAskUndelivered(take_id, ctx.clock.now())
        return core.ColdAskSent(take_id, msg_id, ctx.clock.now())

    async def _notify(self, effect: core.NotifyPut, ctx: Context) -> None:
        """Tell the durability coordinator about a stored put (waiting while its mailbox is full)."""
        if self._durability is None:
            return
        notice = Schedule(namespace=effect.namespace, tokens=effect.tokens, handle=effect.handle)
        try:
            # NOTE: a waiting tell cannot deadlock: the coordinator never
            # waits on the prompt cache.
            await ctx.tell(self._durability, notice)
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning("prompt_cache.schedule_failed", error=repr(exc))

    async def _report(self, body: Body, ctx: Context) -> None:
        """Tell the KV-event publisher what entered and left the index (waiting while it is full)."""
        if self._kv_events is None:
            return
        try:
            # NOTE: a waiting tell, as for NotifyPut: a dropped report would
            # leave subscribers' block index wrong for good; the publisher
            # never waits on the prompt cache, so this cannot deadlock.
            await ctx.tell(self._kv_events, body)
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning("prompt_cache.kv_events_failed", error=repr(exc))

    def _set_alarm(self, at: float | None) -> None:
        alarm, ref = self._alarm, self._self
        if alarm is None or ref is None:
            return

        def wake() -> None:
            try:
                # NOTE: a full mailbox already holds messages; handling any of
                # them runs what is due just as this wake would.
                ref.try_tell(PromptCacheWake())
            except (ActorStopped, MailboxClosed, UnknownAddress):
                return

        alarm.set(at, wake)

    def _request_drain(self, step_id: str, ctx: Context) -> bool:
        """Ask the gateway for the drain step's turn; ``False`` if the ask was not sent."""
        # NOTE: idle only: every serial turn and batch step drains the
        # registry as it ends (MlxBackend.end_turn, BatchEngine.step), so
        # under load this turn would only cut a step chain for nothing.
        ask = RunWhenIdle(step_id=step_id, label="prompt_cache.drain", reply_to=ctx.name,
                          idle_only=True)
        return self._send(self._turns, ask, ctx)

    async def _reply(self, envelope: Envelope | None, effect: core.Reply, ctx: Context) -> bool:
        """Answer the request; ``False`` when nobody can receive it (a tell, a gone asker)."""
        if envelope is None or not isinstance(envelope.body, Request) or not envelope.body.reply_to:
            return False
        return await ctx.reply(envelope, effect.body)

    def _send(self, to: str | None, body: Request, ctx: Context) -> bool:
        """Tell ``to`` without waiting; ``False`` if it is absent, gone, stopped or full."""
        if to is None:
            return False
        try:
            return ctx.try_tell(to, body)
        except MailboxClosed as exc:  # NOTE: also UnknownAddress and ActorStopped.
            _log.warning("prompt_cache.send_failed", to=to, kind=body.kind, error=repr(exc))
            return False

    def _dispose(self, handle: str) -> None:
        try:
            self._registry.dispose(handle)
        except KeyError:
            _log.warning("prompt_cache.dispose_unknown", handle=handle)

