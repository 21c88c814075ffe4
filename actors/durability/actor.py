"""The durability coordinator actor: a thin shell over ``actors.durability.core``.

The shell reads the clock, hands each message to the core and performs the
effects. It never awaits another actor's work (``actors.runtime.try_request``,
the shape it shares with the memory actor): a request's answer arrives
later as an ordinary message, so flush and stats asks are answered while
writes run. A send that a full mailbox refuses, or that finds its target
gone, goes back to the core as :class:`core.Undelivered`.

Clone steps: for :class:`core.RunClone` the shell registers a
:class:`CloneSlot` step with the turn runner's registry and asks the gateway
for a turn; when the ``TurnDone`` arrives it takes the slot's outcome and
hands it to the core with the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from actors.runtime import Actor, Context, WakeAlarm, get_logger, perform_all, try_request
from messages import Envelope, Request
from messages.durability import Wake
from messages.gateway import RunWhenIdle, TurnDone

from . import core
from .ports import Alarm, Cloner, CloneSlot, StepRegistry

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
        self._alarm = WakeAlarm(Wake, alarm)
        self._targets = targets or DurabilityTargets()
        self._slots: dict[str, CloneSlot] = {}

    async def started(self, ctx: Context) -> None:
        """Bind the alarm to the system's clock (unless one was injected)."""
        self._alarm.bind(ctx)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Hand one message (with a clone step's outcome) to the core; perform the effects."""
        clone: core.CloneOutcome | None = None
        body = envelope.body
        if isinstance(body, TurnDone):
            slot = self._slots.pop(body.step_id, None)
            if slot is not None:
                clone = slot.take()
            self._steps.discard(body.step_id)
        await self._perform(self._step(core.Received(envelope, ctx.clock.now(), clone), ctx), ctx)

    async def stopped(self, ctx: Context) -> None:
        """Answer flush askers (not durable), give up waiting clone steps, cancel the alarm."""
        await self._perform(self._step(core.Stopping(ctx.clock.now()), ctx), ctx)
        for step_id in list(self._slots):
            self._drop_step(step_id)

    def _step(self, event: core.Event, ctx: Context) -> Sequence[core.Effect]:
        self.state, effects = ctx.traced(core.handle, self.state, event)
        return effects

    async def _perform(self, effects: Sequence[core.Effect], ctx: Context) -> None:
        async def perform(effect: core.Effect) -> Sequence[core.Effect]:
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
                    self._alarm.set(effect.at)
                case core.Log():
                    _log.warning(effect.event, **dict(effect.fields))
                case _:
                    assert_never(effect)
            return () if failed is None else self._step(failed, ctx)

        await perform_all(effects, perform)

    def _address(self, target: core.Target) -> str:
        if target == "ssd_writer":
            return self._targets.ssd_writer
        if target == "prompt_cache":
            return self._targets.prompt_cache
        return self._targets.spill_queue

    def _send(self, ref: str, to: str, body: Request, ctx: Context) -> core.Undelivered | None:
        failed = try_request(ctx, to, body, ref, log_as="durability")
        return None if failed is None else core.Undelivered(ref, failed, ctx.clock.now())

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
