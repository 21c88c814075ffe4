"""What a shell that asks other actors without waiting does, written once (the memory actor,
the durability coordinator).

Such a shell never awaits another actor's work: a request goes out with
``try_tell`` (this actor as ``reply_to``, the core's ref as correlation id)
and its answer arrives later as an ordinary message, so the actor keeps
answering while the work it asked for runs. A send that a full mailbox
refuses, or that finds its target gone, goes back to the core as an event.
The core asks for ONE alarm, which wakes the actor with a message to itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

from messages import Body, Request

from ._actor import Context
from ._alarm import Alarm, LoopAlarm
from ._errors import ActorStopped, MailboxClosed, UnknownAddress
from ._system import ActorRef
from ._tracing import get_logger

__all__ = ["NotSent", "WakeAlarm", "perform_all", "send_while_room", "try_request"]

F = TypeVar("F")

NotSent = Literal["full", "gone"]
"""Why :func:`try_request` did not send: the target's mailbox was full, or the target is gone."""


async def perform_all(effects: Sequence[F], perform: Callable[[F], Awaitable[Sequence[F]]]) -> None:
    """Perform a core's ``effects`` in order, and those its answers to their outcomes add.

    ``perform`` carries out one effect; when the core must hear how it went
    (a send that did not go out) it hands the core that event through the
    shell's traced core call (``ctx.traced(core.handle, ...)``, which keeps
    the state) and returns the effects of the answer, else none. Those are
    performed after the ones already queued, so every effect runs in the
    order the core returned it.
    """
    work: deque[F] = deque(effects)
    while work:
        work.extend(await perform(work.popleft()))


def try_request(
    ctx: Context, to: str, body: Request, correlation_id: str, *, log_as: str
) -> NotSent | None:
    """Send ``body`` to ``to`` without waiting, this actor as its reply slot; ``None`` once sent.

    A target that is gone is logged as ``<log_as>.target_gone`` on the
    ``kvtier.<log_as>`` logger; a full mailbox is the core's to handle.
    """
    request = body.model_copy(update={"reply_to": ctx.name})
    try:
        sent = ctx.ref(to).try_tell(request, correlation_id=correlation_id)
    except (ActorStopped, MailboxClosed, UnknownAddress) as exc:
        get_logger(f"kvtier.{log_as}").warning(
            f"{log_as}.target_gone", to=to, error=type(exc).__name__
        )
        return "gone"
    return None if sent else "full"


def send_while_room(ctx: Context, to: str, bodies: Sequence[Body],
                    correlation_id: str) -> tuple[int, bool]:
    """Send ``bodies`` in order without waiting until ``to``'s mailbox refuses one.

    Returns how many went, and whether ``to`` is gone (closed or unknown):
    a reader's full stream keeps the rest for a later try.
    """
    sent = 0
    try:
        ref = ctx.ref(to)
        for body in bodies:
            if not ref.try_tell(body, correlation_id=correlation_id):
                break
            sent += 1
    except (MailboxClosed, UnknownAddress):
        return sent, True
    return sent, False


class WakeAlarm:
    """A shell's ONE alarm: at the time the core set, the actor gets ``wake()`` from itself.

    ``alarm`` ``None``: a :class:`LoopAlarm` on the system's clock, bound in
    the actor's ``started`` (:meth:`bind`); a simulated run injects its own.
    ``again_s``: when the actor's mailbox is full as the alarm fires, fire
    again that much later (``None``: not; for a core whose every message
    brings time forward, a full mailbox already does).
    """

    def __init__(self, wake: Callable[[], Body], alarm: Alarm | None = None, *,
                 again_s: float | None = None) -> None:
        self._wake = wake
        self._alarm = alarm
        self._again_s = again_s
        self._clock: Callable[[], float] | None = None
        self._self: ActorRef | None = None

    def bind(self, ctx: Context) -> None:
        """Know the actor to wake, and the clock (unless an alarm was injected); call in ``started``."""
        self._self = ctx.self_ref
        self._clock = ctx.clock.now
        if self._alarm is None:
            self._alarm = LoopAlarm(ctx.clock)

    def set(self, at: float | None) -> None:
        """Wake the actor at clock time ``at`` (``None``: cancel); replaces any earlier setting."""
        assert self._alarm is not None, "WakeAlarm.set before bind"
        self._alarm.set(at, self._fire)

    def _fire(self) -> None:
        ref = self._self
        if ref is None:
            return
        try:
            # NOTE: a full mailbox means messages are waiting; handling any of
            # them brings time forward just as this wake-up would (unless the
            # actor asked to be woken again: ``again_s``).
            sent = ref.try_tell(self._wake())
        except (ActorStopped, MailboxClosed, UnknownAddress):
            return
        if not sent and self._again_s is not None and self._clock is not None:
            self.set(self._clock() + self._again_s)
