"""The durability coordinator actor: a thin shell over ``actors.durability.core``.

The shell reads the clock, hands each message to the core and performs the
effects. It never awaits another actor's work: every request goes out with
``try_tell`` (this actor as ``reply_to``, the core's ref as correlation id)
and its answer arrives later as an ordinary message, so flush and stats
asks are answered while writes run. A send that a full mailbox refuses, or
that finds its target gone, goes back to the core as :class:`core.Undelivered`.

Clone steps: for :class:`core.RunClone` the shell registers a
:class:`CloneSlot` step with the turn runner's registry and asks the gateway
for a turn; when the ``TurnDone`` arrives it takes the slot's outcome and
hands it to the core with the message.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from actors.runtime import (
    Actor,
    ActorRef,
    ActorStopped,
    Context,
    MailboxClosed,
    UnknownAddress,
    get_logger,
)
from messages import Envelope, Request
from messages.durability import Wake
from messages.gateway import RunWhenIdle, TurnDone

from . import core
from .ports import Alarm, Cloner, CloneSlot, LoopAlarm, StepRegistry

__all__ = [
    "DURABILITY_ADDRESS",
    "DurabilityCoordinator",
    "DurabilityTargets",
]

DURABILITY_ADDRESS = "durability"
"""The conventional actor name of the durability coordinator."""

_log = get_logger("kvtier.durability")


@dataclass(frozen=True, slots=True)
class DurabilityTargets:
    """The addresses the coordinator talks to."""

    ssd_writer: str = "ssd_writer"
    spill_queue: str = "spill_queue"
    gateway: str = "gateway"
    prompt_cache: str = "prompt_cache"


class DurabilityCoordinator(Actor):
    """Turns puts into dirty records, writes them behind, and flushes them to a durable boundary."""

    def __init__(
        self,
        *,
        state: core.DurabilityState,
        cloner: Cloner,
        steps: StepRegistry,
        alarm: Alarm | None = None,
        targets: DurabilityTargets | None = None,
    ) -> None:
        self.state = state
        self._cloner = cloner
        self._steps = steps
        self._alarm = alarm
        self._targets = targets or DurabilityTargets()
        self._slots: dict[str, CloneSlot] = {}
        self._self: ActorRef | None = None

    async def started(self, ctx: Context) -> None:
        """Bind the alarm to the system's clock (unless one was injected)."""
        self._self = ctx.self_ref
        if self._alarm is None:
            self._alarm = LoopAlarm(ctx.clock)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Hand one message (with a clone step's outcome) to the core; perform the effects."""
        clone: core.CloneOutcome | None = None
        body = envelope.body
        if isinstance(body, TurnDone):
            slot = self._slots.pop(body.step_id, None)
            if slot is not None:
                clone = slot.take()
            self._steps.discard(body.step_id)
        event = core.Received(envelope, clone)
        self.state, effects = ctx.traced(core.handle, self.state, event, ctx.clock.now())
        await self._perform(effects, ctx)

    async def stopped(self, ctx: Context) -> None:
        """Answer flush askers (not durable), give up waiting clone steps, cancel the alarm."""
        self.state, effects = ctx.traced(core.stop, self.state, ctx.clock.now())
        await self._perform(effects, ctx)
        for step_id in list(self._slots):
            self._drop_step(step_id)

    async def _perform(self, effects: Sequence[core.Effect], ctx: Context) -> None:
        work = collections.deque(effects)
        while work:
            effect = work.popleft()
            failed: core.Undelivered | None = None
            match effect:
                case core.Send():
                    failed = self._send(effect.ref, self._address(effect.to), effect.body, ctx)
                case core.RunClone():
                    failed = self._run_clone(effect, ctx)
                case core.DropStep():
                    self._drop_step(effect.step_id)
                case core.DisposeClone():
                    self._dispose(effect.handle)
                case core.Answer():
                    await ctx.reply(effect.request, effect.body)
                case core.SetAlarm():
                    assert self._alarm is not None
                    self._alarm.set(effect.at, self._wake)
                case core.Log():
                    _log.warning(effect.event, **dict(effect.fields))
                case _:
                    assert_never(effect)
            if failed is not None:
                self.state, more = ctx.traced(core.handle, self.state, failed, ctx.clock.now())
                work.extend(more)

    def _address(self, target: core.Target) -> str:
        if target == "ssd_writer":
            return self._targets.ssd_writer
        if target == "prompt_cache":
            return self._targets.prompt_cache
        return self._targets.spill_queue

    def _send(self, ref: str, to: str, body: Request, ctx: Context) -> core.Undelivered | None:
        request = body.model_copy(update={"reply_to": ctx.name})
        try:
            sent = ctx.ref(to).try_tell(request, correlation_id=ref)
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning("durability.target_gone", to=to, error=type(exc).__name__)
            return core.Undelivered(ref, "gone")
        return None if sent else core.Undelivered(ref, "full")

    def _run_clone(self, effect: core.RunClone, ctx: Context) -> core.Undelivered | None:
        slot = CloneSlot(self._cloner, effect.handle)
        self._slots[effect.step_id] = slot
        self._steps.add(effect.step_id, slot.run)
        ask = RunWhenIdle(
            step_id=effect.step_id, label="durability.clone", deadline=effect.deadline
        )
        failed = self._send(effect.ref, self._targets.gateway, ask, ctx)
        if failed is not None:
            self._drop_step(effect.step_id)
        return failed

    def _drop_step(self, step_id: str) -> None:
        self._steps.discard(step_id)
        slot = self._slots.pop(step_id, None)
        if slot is not None:
            slot.abandon()

    def _dispose(self, handle: str) -> None:
        try:
            self._cloner.dispose(handle)
        except KeyError:
            # NOTE: the registry raises UnknownCacheHandle (a KeyError) for a
            # handle it no longer knows; there is nothing left to free.
            _log.warning("durability.dispose_unknown", handle=handle)

    def _wake(self) -> None:
        ref = self._self
        if ref is None:
            return
        try:
            # NOTE: a full mailbox means messages are waiting; handling any of
            # them brings time forward just as this Wake would.
            ref.try_tell(Wake())
        except (ActorStopped, MailboxClosed, UnknownAddress):
            return
