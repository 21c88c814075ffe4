"""The memory actor: a thin shell over ``actors.memory.core``.

The shell stamps each message with the clock and the engine thread's
memory gauges (:class:`~actors.memory.ports.GaugePort`), hands it to the
core in ONE place (:meth:`MemoryActor._feed`) and performs the effects. It
never awaits another actor's work (``actors.runtime.try_request``, the
shape it shares with the durability coordinator): an ask's answer arrives
later as an ordinary message, so requests that fit are answered while a
relief runs. A send that a full mailbox refuses, or that finds its target
gone, goes back to the core as :class:`core.Undelivered`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from actors.runtime import Actor, Context, WakeAlarm, get_logger, perform_all, try_request
from messages import Envelope
from messages.memory import MemoryWake

from . import core
from .ports import Alarm, GaugePort

__all__ = ["MEMORY_ADDRESS", "MemoryActor", "MemoryTargets"]

MEMORY_ADDRESS = "memory"
"""The conventional actor name of the memory actor."""

_log = get_logger("kvtier.memory")


@dataclass(frozen=True, slots=True)
class MemoryTargets:
    """The addresses the memory actor asks."""

    gateway: str = "gateway"
    prompt_cache: str = "prompt_cache"
    spill_queue: str = "spill_queue"


class MemoryActor(Actor):
    """Admission relief and demotion: answers ``AdmitMemory``, ``Relieve`` and statistics."""

    def __init__(
        self,
        *,
        state: core.MemoryState,
        gauges: GaugePort,
        alarm: Alarm | None = None,
        targets: MemoryTargets | None = None,
    ) -> None:
        self.state = state
        self._gauges = gauges
        self._alarm = WakeAlarm(MemoryWake, alarm)
        self._targets = targets or MemoryTargets()

    async def started(self, ctx: Context) -> None:
        """Bind the alarm to the system's clock (unless one was injected)."""
        self._alarm.bind(ctx)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Hand one message to the core; perform the effects."""
        await self._feed(core.Received(envelope, ctx.clock.now(), self._gauges.read()), ctx)

    async def stopped(self, ctx: Context) -> None:
        """Answer every waiting asker (refused / not relieved) and cancel the alarm."""
        await self._feed(core.Stopping(ctx.clock.now(), self._gauges.read()), ctx)

    async def _feed(self, event: core.Event, ctx: Context) -> None:
        def step(event: core.Event) -> Sequence[core.Effect]:
            self.state, effects = ctx.traced(core.handle, self.state, event)
            return effects

        async def perform(effect: core.Effect) -> Sequence[core.Effect]:
            match effect:
                case core.Answer(request=request, body=body):
                    await ctx.reply(request, body)
                case core.Ask(ref=ref, to=to, body=body):
                    if try_request(ctx, self._address(to), body, ref, log_as="memory"):
                        return step(core.Undelivered(ref, ctx.clock.now(), self._gauges.read()))
                case core.SetAlarm(at=at):
                    self._alarm.set(at)
                case core.Log(event=name, level=level, fields=fields):
                    if level == "info":
                        _log.info(name, **dict(fields))
                    else:
                        _log.warning(name, **dict(fields))
                case _:
                    assert_never(effect)
            return ()

        await perform_all(step(event), perform)

    def _address(self, target: core.Target) -> str:
        if target == "gateway":
            return self._targets.gateway
        if target == "prompt_cache":
            return self._targets.prompt_cache
        return self._targets.spill_queue
