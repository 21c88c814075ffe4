"""The ``Actor`` base class, its ``Context``, supervision policy and sans-IO cores."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    TypeVar,
    TypeVarTuple,
    Unpack,
    assert_never,
    overload,
)

from messages import Body, Envelope, Request

from ._context import CURRENT
from ._core_trace import traced
from ._ports import Clock, Ids, Rng

if TYPE_CHECKING:
    from ._system import ActorRef, ActorSystem

__all__ = [
    "Actor",
    "Context",
    "CoreActor",
    "Effect",
    "EndStream",
    "Reply",
    "RestartWindow",
    "Supervision",
    "Tell",
]

B = TypeVar("B", bound=Body)
S = TypeVar("S")
R = TypeVar("R")
Ts = TypeVarTuple("Ts")


class Actor:
    """Base class of every actor: override ``receive`` (and the hooks if needed).

    The runtime calls ``receive`` for one message at a time, in mailbox order,
    on the actor's own task; an actor's attributes are therefore its private
    state, touched by no other task. ``receive`` may await (ask another actor,
    wait for engine-thread work); the mailbox is not read meanwhile.
    """

    async def started(self, ctx: Context) -> None:
        """Called once per instance before its first message (and after a restart)."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Handle one message. Raising hands the failure to the supervision policy."""
        raise NotImplementedError

    async def stopped(self, ctx: Context) -> None:
        """Called once when the actor stops normally, after its last message."""


class Context:
    """What an actor may do: send, ask, reply, read its ports.

    One ``Context`` per actor; every id stamped on messages sent through it
    derives from the message being handled (correlation and causation).
    """

    __slots__ = ("_system", "name", "self_ref")

    def __init__(self, system: ActorSystem, self_ref: ActorRef) -> None:
        self._system = system
        self.self_ref = self_ref
        self.name = self_ref.name

    @property
    def system(self) -> ActorSystem:
        """The system running this actor."""
        return self._system

    @property
    def envelope(self) -> Envelope | None:
        """The message being handled right now (``None`` in ``started``/``stopped``)."""
        return CURRENT.get()

    @property
    def clock(self) -> Clock:
        """The injected clock."""
        return self._system.clock

    @property
    def ids(self) -> Ids:
        """The injected id source."""
        return self._system.ids

    @property
    def rng(self) -> Rng:
        """The injected randomness."""
        return self._system.rng

    def traced(self, handle: Callable[[S, Unpack[Ts]], R], state: S, *args: *Ts) -> R:
        """``handle(state, *args)``: a sans-IO core's call, recorded in the live trace if one is on.

        Shells call their core through this (``kvtier serve --record-trace``,
        ``actors/runtime/_core_trace.py``); without a recorder it is the plain call.
        """
        return traced(self.name, handle, state, *args)

    def ref(self, address: str) -> ActorRef:
        """A reference to the actor or inbox at ``address``."""
        return self._system.ref(address)

    async def tell(
        self, to: ActorRef | str, body: Body, *, correlation_id: str | None = None
    ) -> str:
        """Send ``body`` to ``to``, waiting while its mailbox is full (backpressure); its ``msg_id``."""
        return await self._resolve(to).tell(body, correlation_id=correlation_id)

    async def request(
        self, to: ActorRef | str, body: Request, *, correlation_id: str | None = None
    ) -> str:
        """Send ``body`` with THIS actor as its reply slot, without waiting for the answer.

        The answer (or the runtime's ``Failure`` if the handler raises or
        the target stops) arrives later in this actor's mailbox, in its
        reserved room, with ``causation_id`` equal to the returned
        ``msg_id``. For an actor that must keep reading its mailbox while a
        request is outstanding; keep at most ``reserve`` outstanding.
        """
        return await self._resolve(to).tell(
            body.model_copy(update={"reply_to": self.name}), correlation_id=correlation_id
        )

    def try_tell(self, to: ActorRef | str, body: Body) -> bool:
        """Send without waiting; ``False`` when the mailbox is full."""
        return self._resolve(to).try_tell(body)

    @overload
    async def ask(self, to: ActorRef | str, body: Request, *, timeout: float) -> Body: ...

    @overload
    async def ask(
        self, to: ActorRef | str, body: Request, *, timeout: float, expect: type[B]
    ) -> B: ...

    async def ask(
        self,
        to: ActorRef | str,
        body: Request,
        *,
        timeout: float,
        expect: type[Any] = Body,
    ) -> Any:
        """Send a request and wait (at most ``timeout`` s) for its reply."""
        return await self._resolve(to).ask(body, timeout=timeout, expect=expect)

    async def reply(self, request: Envelope, body: Body) -> bool:
        """Answer ``request`` at its reply slot; ``False`` (dead letter) if the slot is gone.

        Waits while the reply slot's inbox is full (a streaming caller's
        backpressure reaches the replying actor).
        """
        return await self._system.reply(request, body)

    def reply_nowait(self, request: Envelope, body: Body) -> bool:
        """Answer without waiting; ``False`` (dead letter) if the slot is gone or full."""
        return self._system.reply_nowait(request, body)

    def end_stream(
        self, address: str, final: Body | None = None, *, correlation_id: str | None = None
    ) -> bool:
        """End the stream to ``address``, ``final`` its last message; whether ``final`` arrived.

        ``final`` uses the room reserved for it, so a full stream still gets
        it. An inbox's reader then sees every message already sent, ``final``
        and the end of the stream; later sends to it become dead letters. An
        actor consumer only receives ``final`` (its mailbox stays open).
        """
        return self._system.end_stream(address, final, correlation_id=correlation_id)

    async def perform(self, effects: Sequence[Effect]) -> None:
        """Carry out the effects returned by a sans-IO core, in order."""
        for effect in effects:
            match effect:
                case Tell():
                    await self.tell(effect.to, effect.body)
                case Reply():
                    await self.reply(effect.request, effect.body)
                case EndStream():
                    self.end_stream(effect.address, effect.final)
                case _:
                    assert_never(effect)

    def _resolve(self, to: ActorRef | str) -> ActorRef:
        return self._system.ref(to) if isinstance(to, str) else to


@dataclass(frozen=True, slots=True)
class Tell:
    """Effect: send ``body`` to the address ``to``."""

    to: str
    body: Body


@dataclass(frozen=True, slots=True)
class Reply:
    """Effect: answer ``request`` with ``body``."""

    request: Envelope
    body: Body


@dataclass(frozen=True, slots=True)
class EndStream:
    """Effect: end the stream to ``address``, ``final`` its last message (see ``Context.end_stream``)."""

    address: str
    final: Body | None = None


Effect = Tell | Reply | EndStream


class CoreActor(Actor, Generic[S]):
    """An actor whose logic is a pure function ``handle(state, envelope)``.

    ``handle`` returns the next state and the effects to perform; the shell
    (this class) keeps the state and performs the effects through the
    ``Context`` (an exhaustive ``match`` over the closed ``Effect`` union).
    Test the core without any runtime; run it in one. The convention every
    actor follows is written down in docs/architecture.md ("Sans-IO
    convention").
    """

    def __init__(self) -> None:
        self.state: S = self.initial_state()

    def initial_state(self) -> S:
        """The state of a fresh instance (also after a restart)."""
        raise NotImplementedError

    def handle(self, state: S, envelope: Envelope) -> tuple[S, Sequence[Effect]]:
        """The sans-IO core: next state and effects for one message."""
        raise NotImplementedError

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Run the core, keep its state, perform its effects."""
        self.state, effects = self.handle(self.state, envelope)
        await ctx.perform(effects)


FailureAction = Literal["restart", "resume", "stop", "escalate"]


@dataclass(frozen=True, slots=True)
class Supervision:
    """One-for-one supervision of a single actor.

    On a handler failure: ``restart`` builds a fresh instance from the
    factory, ``resume`` keeps the same instance (its state survives), both
    only while at most ``max_restarts`` happened within ``within`` seconds
    (Erlang's intensity/period), else the failure escalates; ``stop`` stops
    the actor; ``escalate`` stops the whole system with
    ``SupervisionEscalated``. The failing message is not retried; the rest
    of the mailbox is kept for the next instance (see docs/runtime.md).
    """

    on_failure: FailureAction = "restart"
    max_restarts: int = 3
    within: float = 5.0


class RestartWindow:
    """Sans-IO restart intensity: may this failure at ``now`` restart the actor?"""

    __slots__ = ("_policy", "_times")

    def __init__(self, policy: Supervision) -> None:
        self._policy = policy
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Record a restart at ``now`` and return ``True`` if within intensity."""
        horizon = now - self._policy.within
        while self._times and self._times[0] <= horizon:
            self._times.popleft()
        if len(self._times) >= self._policy.max_restarts:
            return False
        self._times.append(now)
        return True
