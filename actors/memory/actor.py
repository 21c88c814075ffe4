"""The memory actor: a thin shell over ``actors.memory.core``.

The shell stamps each message with the clock and the engine thread's
memory gauges (:class:`~actors.memory.ports.GaugePort`), hands it to the
core in ONE place (:meth:`MemoryActor._feed`) and performs the effects. It
never awaits another actor's work: an ask goes out with ``try_tell`` (this
actor as ``reply_to``, the core's ref as correlation id) and its answer
arrives later as an ordinary message, so requests that fit are answered
while a relief runs. A send that a full mailbox refuses, or that finds its
target gone, goes back to the core as :class:`core.Undelivered`.
"""

from __future__ import annotations

from collections import deque
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
from messages.memory import MemoryWake

from . import core
from .ports import Alarm, GaugePort, LoopAlarm

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
        self._alarm = alarm
        self._targets = targets or MemoryTargets()
        self._self: ActorRef | None = None

    async def started(self, ctx: Context) -> None:
        """Bind the alarm to the system's clock (unless one was injected)."""
        self._self = ctx.self_ref
        if self._alarm is None:
            self._alarm = LoopAlarm(ctx.clock)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Hand one message to the core; perform the effects."""
        await self._feed(core.Received(envelope, ctx.clock.now(), self._gauges.read()), ctx)

    async def stopped(self, ctx: Context) -> None:
        """Answer every waiting asker (refused / not relieved) and cancel the alarm."""
        await self._feed(core.Stopping(ctx.clock.now(), self._gauges.read()), ctx)

    async def _feed(self, event: core.Event, ctx: Context) -> None:
        events: deque[core.Event] = deque([event])
        while events:
            self.state, effects = ctx.traced(core.handle, self.state, events.popleft())
            for effect in effects:
                match effect:
                    case core.Answer(request=request, body=body):
                        await ctx.reply(request, body)
                    case core.Ask(ref=ref, to=to, body=body):
                        if not self._send(ref, self._address(to), body, ctx):
                            events.append(core.Undelivered(ref, ctx.clock.now(),
                                                           self._gauges.read()))
                    case core.SetAlarm(at=at):
                        assert self._alarm is not None
                        self._alarm.set(at, self._wake)
                    case core.Log(event=name, level=level, fields=fields):
                        if level == "info":
                            _log.info(name, **dict(fields))
                        else:
                            _log.warning(name, **dict(fields))
                    case _:
                        assert_never(effect)

    def _address(self, target: core.Target) -> str:
        if target == "gateway":
            return self._targets.gateway
        if target == "prompt_cache":
            return self._targets.prompt_cache
        return self._targets.spill_queue

    def _send(self, ref: str, to: str, body: Request, ctx: Context) -> bool:
        request = body.model_copy(update={"reply_to": ctx.name})
        try:
            return ctx.ref(to).try_tell(request, correlation_id=ref)
        except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
            _log.warning("memory.target_gone", to=to, error=type(exc).__name__)
            return False

    def _wake(self) -> None:
        ref = self._self
        if ref is None:
            return
        try:
            # NOTE: a full mailbox means messages are waiting; handling any of
            # them brings time forward just as this wake would.
            ref.try_tell(MemoryWake())
        except (ActorStopped, MailboxClosed, UnknownAddress):
            return
