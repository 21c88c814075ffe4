"""``ActorSystem``, ``ActorRef`` and ``Inbox``: running actors on the caller's loop."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Self, TypeVar, overload

import anyio
import structlog
from anyio.abc import TaskGroup

from messages import EXTERNAL, Body, Envelope, Failure, Request

from . import _trace_events as events
from ._actor import Actor, Context, RestartWindow, Supervision
from ._context import CORRELATION, CURRENT
from ._endpoints import Endpoint, SlotEndpoint, StreamEndpoint
from ._errors import (
    ActorStopped,
    AskCycle,
    AskTimeout,
    HandlerFailed,
    MailboxClosed,
    MailboxFull,
    ReceiveTimeout,
    RuntimeFailure,
    SupervisionEscalated,
    UnexpectedReply,
    UnknownAddress,
)
from ._ports import Clock, Ids, Rng, SystemClock, SystemIds, SystemRng
from ._stats import MailboxStatistics, SystemStatistics, WaitSamples
from ._tracing import TRACE

__all__ = ["ActorRef", "ActorSystem", "DeadLetter", "Inbox"]

B = TypeVar("B", bound=Body)

MAX_STREAK = 16
"""Messages an actor handles in a row, when they are already waiting, before it yields.

NOTE: every ``get`` and every ``put`` of a mailbox yields to the other
tasks first (anyio's rule for memory streams). An actor that forwards
what it receives (the gateway handing a burst of ``Arriving`` and
``Generate`` to the batch lane) then needs two trips round the event loop
per message, and in a burst a trip is every other ready task's step: with
32 requests arriving together a ``Generate`` waited 59 ms p50 in the
gateway's mailbox while the gateway's handlers took ~0.4 ms each (CPU
stand-in, docs/benchmarks.md 2026-12-06 22:00; admission 0.45 × since,
2026-12-07 00:45). So an actor takes up to
this many waiting messages without yielding, and a send from inside a
handler (or a task it started, which inherits its context) yields only
when it must wait for room (``ActorSystem._put``): the actor's loop
yields at least once every ``MAX_STREAK`` messages, and a sender that
never waits is still bounded by its receiver's capacity.
"""

_log = structlog.get_logger("kvtier.runtime")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that could not be delivered, and why."""

    envelope: Envelope
    reason: str


class ActorRef:
    """The address of an actor or inbox, with the ways to send to it."""

    __slots__ = ("_endpoint", "_system", "name")

    def __init__(self, system: ActorSystem, endpoint: Endpoint) -> None:
        self._system = system
        self._endpoint = endpoint
        self.name = endpoint.address

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r})"

    async def tell(self, body: Body, *, correlation_id: str | None = None) -> str:
        """Send ``body``; waits while the mailbox is full (backpressure); returns its ``msg_id``.

        Raises ``ActorStopped``/``MailboxClosed`` (and records a dead letter)
        once the target no longer accepts messages. A reply to a request sent
        this way names the returned ``msg_id`` as its ``causation_id``.
        """
        system = self._system
        envelope = system._envelope(self.name, body, correlation_id, ())
        await system._put(self._endpoint, envelope)
        return envelope.msg_id

    def try_tell(self, body: Body, *, correlation_id: str | None = None) -> bool:
        """Send without waiting; ``False`` when the mailbox is full (nothing sent)."""
        system = self._system
        envelope = system._envelope(self.name, body, correlation_id, ())
        return system._put_nowait(self._endpoint, envelope)

    def tell_nowait(self, body: Body, *, correlation_id: str | None = None) -> None:
        """Send without waiting; raises ``MailboxFull`` when the mailbox is full."""
        if not self.try_tell(body, correlation_id=correlation_id):
            raise MailboxFull(self.name, self._endpoint.capacity)

    def post(self, body: Body, *, correlation_id: str | None = None) -> bool:
        """Send without waiting into the mailbox's reserved room; ``False`` if even that is full.

        For an actor's notes to itself (e.g. "an engine job ended", posted
        from a loop callback): ordinary traffic cannot crowd them out. Keep
        at most ``reserve`` such notes and replies outstanding.
        """
        system = self._system
        envelope = system._envelope(self.name, body, correlation_id, ())
        return system._put_nowait(self._endpoint, envelope, reserved=True)

    @overload
    async def ask(
        self, body: Request, *, timeout: float, correlation_id: str | None = None
    ) -> Body: ...

    @overload
    async def ask(
        self,
        body: Request,
        *,
        timeout: float,
        expect: type[B],
        correlation_id: str | None = None,
    ) -> B: ...

    async def ask(
        self,
        body: Request,
        *,
        timeout: float,
        expect: type[Any] = Body,
        correlation_id: str | None = None,
    ) -> Any:
        """Send a request and wait for its reply body, at most ``timeout`` seconds.

        The deadline covers waiting for mailbox space too. Raises
        ``AskTimeout``, ``AskCycle`` (the target is already waiting on this
        call chain), ``HandlerFailed`` (the handler raised), ``ActorStopped``,
        or ``UnexpectedReply`` (the reply is not an ``expect``).
        """
        return await self._system._ask(self, body, timeout, expect, correlation_id)

    def statistics(self) -> MailboxStatistics:
        """The target mailbox's statistics now."""
        return self._system._statistics_of(self._endpoint)


class Inbox:
    """A bounded mailbox read by plain async code (HTTP handlers, the Engine API).

    Actors send to ``inbox.address`` (e.g. as a request's ``reply_to``) like
    to any actor; the owner iterates it. The stream ends when an actor calls
    ``ctx.end_stream(address, final)`` (``final`` uses the room reserved for
    it, so it arrives even when the inbox is full) or the owner closes the
    inbox.
    """

    __slots__ = ("_endpoint", "_system", "address")

    def __init__(self, system: ActorSystem, endpoint: Endpoint) -> None:
        self._system = system
        self._endpoint = endpoint
        self.address = endpoint.address

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __aiter__(self) -> AsyncIterator[Envelope]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Envelope]:
        while (envelope := await self._endpoint.get()) is not None:
            yield envelope

    async def receive(self, *, timeout: float | None = None) -> Envelope:
        """The next message; ``ReceiveTimeout`` past ``timeout``; ``MailboxClosed`` at the end."""
        if timeout is None:
            envelope = await self._endpoint.get()
        else:
            with anyio.move_on_after(timeout):
                envelope = await self._endpoint.get()
                if envelope is None:
                    raise MailboxClosed(self.address)
                return envelope
            raise ReceiveTimeout(self.address, timeout)
        if envelope is None:
            raise MailboxClosed(self.address)
        return envelope

    def close(self) -> None:
        """Stop receiving: unregister the address; later sends become dead letters."""
        self._system._unregister(self.address, self._endpoint)

    def statistics(self) -> MailboxStatistics:
        """Depth, capacity and counters of this inbox."""
        return self._system._statistics_of(self._endpoint)


class _Counters:
    """Per-endpoint counters (``sent``/``rejected`` counted by senders)."""

    __slots__ = ("failed", "handled", "rejected", "restarts", "samples", "sent", "state")

    def __init__(self) -> None:
        self.sent = 0
        self.rejected = 0
        self.handled = 0
        self.failed = 0
        self.restarts = 0
        self.samples = WaitSamples()
        self.state = "open"


class _Cell:
    """One spawned actor: its mailbox, factory, supervision and counters."""

    __slots__ = ("counters", "done", "endpoint", "factory", "name", "ref", "supervision", "window")

    def __init__(
        self,
        ref: ActorRef,
        endpoint: Endpoint,
        factory: Callable[[], Actor],
        supervision: Supervision,
        counters: _Counters,
    ) -> None:
        self.name = endpoint.address
        self.ref = ref
        self.endpoint = endpoint
        self.factory = factory
        self.supervision = supervision
        self.window = RestartWindow(supervision)
        self.counters = counters
        self.done = anyio.Event()


class ActorSystem:
    """Runs actors as tasks of one task group on the caller's event loop.

    Use as ``async with ActorSystem() as system:``; leaving the block stops
    every actor in reverse spawn order after each handled every message its
    mailbox had accepted. Time, ids and randomness come from the injected
    ports, so a simulated system can replay a run exactly.
    """

    _max_streak: ClassVar[int] = MAX_STREAK
    """Waiting messages an actor takes in a row before it yields (1: a yield before each)."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        ids: Ids | None = None,
        rng: Rng | None = None,
        stop_timeout: float = 30.0,
        dead_letter_window: int = 1000,
    ) -> None:
        self.clock: Clock = clock or SystemClock()
        self.ids: Ids = ids or SystemIds()
        self.rng: Rng = rng or SystemRng()
        self.stop_timeout = stop_timeout
        self._endpoints: dict[str, Endpoint] = {}
        self._counters: dict[str, _Counters] = {}
        self._cells: dict[str, _Cell] = {}
        self._dead: deque[DeadLetter] = deque(maxlen=dead_letter_window)
        self._dead_total = 0
        self._tg: TaskGroup | None = None
        self._stopping = False
        self._stopped = anyio.Event()

    # -- lifecycle ---------------------------------------------------------

    async def __aenter__(self) -> Self:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg = self._tg
        assert tg is not None, "ActorSystem was not entered"
        try:
            if exc_type is None:
                await self.stop()
            else:
                # NOTE: the block failed (or was cancelled by an escalation):
                # tear down at once instead of draining mailboxes.
                tg.cancel_scope.cancel()
        except BaseException:
            tg.cancel_scope.cancel()
            raise
        finally:
            try:
                result = await tg.__aexit__(exc_type, exc, tb)
            except BaseExceptionGroup as group:
                escalated = _first(group, SupervisionEscalated)
                if escalated is not None:
                    raise escalated from None
                if exc is not None and _only(group, exc):
                    # NOTE: the block's own exception propagates unwrapped.
                    return False
                raise
            finally:
                self._stopping = True
                self._stopped.set()
                # NOTE: release every stream still open (inboxes the caller
                # forgot, mailboxes of cancelled actors) so none leaks.
                for endpoint in list(self._endpoints.values()):
                    endpoint.discard()
        return result

    def spawn(
        self,
        name: str,
        factory: Callable[[], Actor],
        *,
        capacity: int = 64,
        reserve: int = 8,
        supervision: Supervision | None = None,
    ) -> ActorRef:
        """Start an actor named ``name`` with a mailbox of ``capacity`` messages.

        ``reserve`` more messages fit for replies and the actor's notes to
        itself (``ActorRef.post``) only, so an answer is never dropped or
        held up by a mailbox that ordinary traffic filled. ``factory``
        builds the instance (called again on each restart). Messages can be
        told to the returned ref at once; they wait in the mailbox until the
        actor's ``started`` hook has run.
        """
        if self._tg is None:
            raise RuntimeError("spawn inside `async with ActorSystem()`")
        if self._stopping:
            raise ActorStopped(name)
        if name in self._endpoints:
            raise ValueError(f"address {name!r} is already in use")
        endpoint = self._new_mailbox(name, capacity, is_actor=True, reserve=reserve)
        ref = ActorRef(self, endpoint)
        counters = _Counters()
        counters.state = "running"
        cell = _Cell(ref, endpoint, factory, supervision or Supervision(), counters)
        self._endpoints[name] = endpoint
        self._counters[name] = counters
        self._cells[name] = cell
        self._start_task(self._run_cell, cell)
        return ref

    async def stop(self, order: Sequence[str] | None = None, *, timeout: float | None = None) -> None:
        """Stop every actor, one at a time, each after it handled its accepted messages.

        The default order is reverse spawn order (actors spawned later, which
        usually depend on earlier ones, stop first); ``order`` names actors to
        stop first, the rest follow in reverse spawn order. Past ``timeout``
        (default ``stop_timeout``) the remaining actors are cancelled.
        """
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        first = list(order or ())
        names = first + [n for n in reversed(list(self._cells)) if n not in first]
        try:
            with anyio.move_on_after(self.stop_timeout if timeout is None else timeout) as scope:
                for name in names:
                    cell = self._cells[name]
                    cell.counters.state = "stopping"
                    cell.endpoint.close()
                    await self._wait_stopped(cell)
            if scope.cancelled_caught and self._tg is not None:
                _log.warning("runtime.stop_timeout", remaining=[n for n in names if not self._cells[n].done.is_set()])
                self._tg.cancel_scope.cancel()
        finally:
            self._stopped.set()

    async def _wait_stopped(self, cell: _Cell) -> None:
        await cell.done.wait()

    # -- addressing --------------------------------------------------------

    def ref(self, address: str) -> ActorRef:
        """A reference to the actor or inbox at ``address`` (``UnknownAddress`` if none)."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            raise UnknownAddress(address)
        cell = self._cells.get(address)
        return cell.ref if cell is not None else ActorRef(self, endpoint)

    def actors(self) -> tuple[str, ...]:
        """Names of all spawned actors, in spawn order."""
        return tuple(self._cells)

    def open_inbox(self, capacity: int = 64, *, prefix: str = "inbox-", reserve: int = 1) -> Inbox:
        """A new bounded inbox for non-actor code; close it (or ``async with`` it) when done.

        ``reserve`` more messages fit for replies and a stream's final
        message (``end_stream(address, final)``).
        """
        address = self.ids.new_id(prefix)
        endpoint = self._new_mailbox(address, capacity, is_actor=False, reserve=reserve)
        self._endpoints[address] = endpoint
        self._counters[address] = _Counters()
        return Inbox(self, endpoint)

    async def tell(
        self, to: str, body: Body, *, correlation_id: str | None = None
    ) -> str:
        """``ref(to).tell(body)`` (its ``msg_id``); a message to an unknown address is a dead letter."""
        return await self._ref_or_dead(to, body, correlation_id).tell(body, correlation_id=correlation_id)

    def try_tell(self, to: str, body: Body, *, correlation_id: str | None = None) -> bool:
        """``ref(to).try_tell(body)``."""
        return self._ref_or_dead(to, body, correlation_id).try_tell(body, correlation_id=correlation_id)

    @overload
    async def ask(
        self, to: str, body: Request, *, timeout: float, correlation_id: str | None = None
    ) -> Body: ...

    @overload
    async def ask(
        self,
        to: str,
        body: Request,
        *,
        timeout: float,
        expect: type[B],
        correlation_id: str | None = None,
    ) -> B: ...

    async def ask(
        self,
        to: str,
        body: Request,
        *,
        timeout: float,
        expect: type[Any] = Body,
        correlation_id: str | None = None,
    ) -> Any:
        """``ref(to).ask(...)``."""
        ref = self._ref_or_dead(to, body, correlation_id)
        return await self._ask(ref, body, timeout, expect, correlation_id)

    async def reply(self, request: Envelope, body: Body) -> bool:
        """Send ``body`` to ``request``'s reply slot; ``False`` (dead letter) if it is gone.

        A reply uses the slot's reserved room (an actor mailbox's
        ``reserve``), so it waits only when even that is full.
        """
        envelope = self._reply_envelope(request, body)
        endpoint = self._endpoints.get(envelope.receiver)
        if endpoint is None:
            self._dead_letter(envelope, "no such address")
            return False
        try:
            await self._put(endpoint, envelope, reserved=True)
        except MailboxClosed:
            return False
        return True

    def reply_nowait(self, request: Envelope, body: Body) -> bool:
        """Like ``reply`` without waiting; a slot whose reserved room is full makes a dead letter."""
        envelope = self._reply_envelope(request, body)
        endpoint = self._endpoints.get(envelope.receiver)
        if endpoint is None:
            self._dead_letter(envelope, "no such address")
            return False
        try:
            if self._put_nowait(endpoint, envelope, reserved=True):
                return True
        except MailboxClosed:
            return False
        self._dead_letter(envelope, "reply slot full")
        return False

    def end_stream(
        self, address: str, final: Body | None = None, *, correlation_id: str | None = None
    ) -> bool:
        """End the stream to ``address`` with ``final`` as its last message.

        ``final`` goes into the reserved room, so it is delivered even when
        the stream's buffer is full (a slow reader still learns how its
        stream ended). An inbox then closes: its reader sees every message
        already sent, then the end; later sends are dead letters. An actor
        consumer (its mailbox) only receives ``final``. Returns whether
        ``final`` was delivered (``True`` when there is none); to a gone or
        closed stream it is a dead letter.
        """
        endpoint = self._endpoints.get(address)
        delivered = True
        if final is not None:
            envelope = self._envelope(address, final, correlation_id, ())
            if endpoint is None:
                self._dead_letter(envelope, "no such address")
                return False
            try:
                delivered = self._put_nowait(endpoint, envelope, reserved=True)
            except MailboxClosed:
                delivered = False
            else:
                if not delivered:
                    self._dead_letter(envelope, "stream reserve full")
        if endpoint is not None and not endpoint.is_actor:
            endpoint.close()
        return delivered

    def is_open(self, address: str) -> bool:
        """Whether ``address`` exists and still accepts messages (e.g. an ask's reply slot)."""
        endpoint = self._endpoints.get(address)
        return endpoint is not None and not endpoint.closed

    # -- observation -------------------------------------------------------

    def statistics(self) -> SystemStatistics:
        """Every actor's mailbox statistics plus system-wide counts."""
        return SystemStatistics(
            actors=tuple(self._statistics_of(c.endpoint) for c in self._cells.values()),
            open_inboxes=len(self._endpoints) - len(
                [a for a in self._endpoints if a in self._cells]
            ),
            dead_letters=self._dead_total,
            running=self._tg is not None and not self._stopped.is_set(),
        )

    def dead_letters(self) -> tuple[DeadLetter, ...]:
        """The most recent undeliverable messages (a bounded window)."""
        return tuple(self._dead)

    # -- internals (also the simulated runtime's hooks) ----------------------

    def _new_mailbox(
        self, address: str, capacity: int, *, is_actor: bool, reserve: int = 0
    ) -> Endpoint:
        return StreamEndpoint(address, capacity, is_actor=is_actor, reserve=reserve)

    def _new_slot(self, address: str) -> Endpoint:
        return SlotEndpoint(address)

    def _start_task(self, fn: Callable[[_Cell], Any], cell: _Cell) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, cell, name=f"actor:{cell.name}")

    def _envelope(
        self,
        receiver: str,
        body: Body,
        correlation_id: str | None,
        chain: tuple[str, ...],
    ) -> Envelope:
        current = CURRENT.get()
        if current is None:
            return Envelope(
                self.ids.new_id("m-"),
                correlation_id or CORRELATION.get() or self.ids.new_id("c-"),
                None,
                EXTERNAL,
                receiver,
                self.clock.now(),
                body,
                chain,
            )
        return Envelope(
            self.ids.new_id("m-"),
            correlation_id or current.correlation_id,
            current.msg_id,
            current.receiver,
            receiver,
            self.clock.now(),
            body,
            chain,
        )

    def _reply_envelope(self, request: Envelope, body: Body) -> Envelope:
        request_body = request.body
        reply_to = request_body.reply_to if isinstance(request_body, Request) else ""
        if not reply_to:
            raise ValueError(f"{request_body.kind!r} carries no reply slot")
        return Envelope(
            self.ids.new_id("m-"),
            request.correlation_id,
            request.msg_id,
            request.receiver,
            reply_to,
            self.clock.now(),
            body,
            (),
        )

    async def _put(self, endpoint: Endpoint, envelope: Envelope, *, reserved: bool = False) -> None:
        try:
            # NOTE: inside a handler a send with room does not yield: the
            # actor's loop does, at least every MAX_STREAK messages.
            if CURRENT.get() is None or not endpoint.put_nowait(envelope, reserved=reserved):
                await endpoint.put(envelope, reserved=reserved)
        except MailboxClosed as exc:
            self._dead_letter(envelope, type(exc).__name__)
            raise
        counters = self._counters.get(endpoint.address)
        if counters is not None:
            counters.sent += 1
        if TRACE.on:
            events.sent(envelope, endpoint.depth())

    def _put_nowait(self, endpoint: Endpoint, envelope: Envelope, *, reserved: bool = False) -> bool:
        try:
            accepted = endpoint.put_nowait(envelope, reserved=reserved)
        except MailboxClosed as exc:
            self._dead_letter(envelope, type(exc).__name__)
            raise
        counters = self._counters.get(endpoint.address)
        if not accepted:
            if counters is not None:
                counters.rejected += 1
            return False
        if counters is not None:
            counters.sent += 1
        if TRACE.on:
            events.sent(envelope, endpoint.depth())
        return True

    def _ref_or_dead(self, to: str, body: Body, correlation_id: str | None) -> ActorRef:
        endpoint = self._endpoints.get(to)
        if endpoint is None:
            self._dead_letter(self._envelope(to, body, correlation_id, ()), "no such address")
            raise UnknownAddress(to)
        return self.ref(to)

    def _dead_letter(self, envelope: Envelope, reason: str) -> None:
        self._dead.append(DeadLetter(envelope, reason))
        self._dead_total += 1
        if TRACE.on:
            events.dead_letter(envelope, reason)

    def _unregister(self, address: str, endpoint: Endpoint) -> None:
        endpoint.discard()
        if self._endpoints.get(address) is endpoint:
            del self._endpoints[address]
            self._counters.pop(address, None)

    async def _ask(
        self,
        ref: ActorRef,
        body: Request,
        timeout: float,
        expect: type[Any],
        correlation_id: str | None,
    ) -> Any:
        current = CURRENT.get()
        chain: tuple[str, ...] = ()
        if current is not None:
            chain = (*current.call_chain, current.receiver)
            if ref.name in chain:
                raise AskCycle((*chain, ref.name))
        address = self.ids.new_id("ask-")
        slot = self._new_slot(address)
        self._endpoints[address] = slot
        try:
            request = body.model_copy(update={"reply_to": address})
            envelope = self._envelope(ref.name, request, correlation_id, chain)
            with anyio.move_on_after(timeout):
                await self._put(ref._endpoint, envelope)
                reply = await slot.get()
                assert reply is not None
                return _reply_body(reply, expect)
            raise AskTimeout(ref.name, body.kind, timeout)
        finally:
            self._unregister(address, slot)

    def _statistics_of(self, endpoint: Endpoint) -> MailboxStatistics:
        c = self._counters.get(endpoint.address) or _Counters()
        return MailboxStatistics(
            address=endpoint.address,
            depth=endpoint.depth(),
            capacity=endpoint.capacity,
            waiting_senders=endpoint.waiting_senders(),
            sent=c.sent,
            handled=c.handled,
            failed=c.failed,
            restarts=c.restarts,
            rejected=c.rejected,
            time_in_mailbox_p50=c.samples.p(0.5),
            time_in_mailbox_p99=c.samples.p(0.99),
            state=c.state if endpoint.is_actor else ("closed" if endpoint.closed else "open"),
        )

    # -- the actor loop ----------------------------------------------------

    async def _run_cell(self, cell: _Cell) -> None:
        ctx = Context(self, cell.ref)
        counters = cell.counters
        endpoint = cell.endpoint
        clock = self.clock
        samples = counters.samples
        structlog.contextvars.bind_contextvars(actor=cell.name)
        bound: str | None = None
        try:
            actor = await self._start_actor(cell, ctx, None)
            streak = 0
            while actor is not None:
                envelope = endpoint.get_nowait() if 0 < streak < self._max_streak else None
                if envelope is None:
                    streak = 0
                    envelope = await endpoint.get()
                    if envelope is None:
                        break
                streak += 1
                waited = clock.now() - envelope.sent_at
                samples.add(waited)
                if TRACE.on:
                    events.received(envelope, endpoint.depth(), waited)
                if envelope.correlation_id != bound:
                    bound = envelope.correlation_id
                    structlog.contextvars.bind_contextvars(correlation_id=bound)
                token = CURRENT.set(envelope)
                began = clock.now()
                try:
                    await actor.receive(envelope, ctx)
                except Exception as exc:  # noqa: BLE001 - handed to the supervision policy
                    counters.failed += 1
                    actor = await self._on_failure(cell, ctx, actor, envelope, waited, exc)
                else:
                    counters.handled += 1
                    if TRACE.on:
                        events.handled(envelope, endpoint.depth(), waited, clock.now() - began)
                finally:
                    CURRENT.reset(token)
            if actor is not None:
                try:
                    await actor.stopped(ctx)
                except Exception as exc:  # noqa: BLE001 - a stop hook must not block shutdown
                    _log.warning("actor.stop_hook_failed", actor=cell.name, error=repr(exc))
                counters.state = "stopped"
        finally:
            if counters.state in ("running", "stopping"):
                counters.state = "stopped"
            endpoint.discard()
            cell.done.set()

    async def _start_actor(self, cell: _Cell, ctx: Context, previous: Actor | None) -> Actor | None:
        """Build (unless resuming ``previous``) and start an instance, under supervision."""
        while True:
            actor = previous if previous is not None else cell.factory()
            try:
                await actor.started(ctx)
            except Exception as exc:  # noqa: BLE001 - handed to the supervision policy
                cell.counters.failed += 1
                _log.warning("actor.start_failed", actor=cell.name, error=repr(exc))
                if not self._may_restart(cell, exc):
                    return None
                previous = None
                continue
            return actor

    def _may_restart(self, cell: _Cell, exc: BaseException) -> bool:
        """Apply the policy: ``True`` to go on, ``False`` to stop; raises to escalate."""
        policy = cell.supervision
        if policy.on_failure == "stop":
            self._stop_after_failure(cell)
            return False
        if policy.on_failure == "escalate" or not cell.window.allow(self.clock.now()):
            cell.counters.state = "escalated"
            self._stop_after_failure(cell)
            raise SupervisionEscalated(cell.name, policy.max_restarts, policy.within) from exc
        cell.counters.restarts += 1
        return True

    async def _on_failure(
        self,
        cell: _Cell,
        ctx: Context,
        actor: Actor,
        envelope: Envelope,
        waited: float,
        exc: Exception,
    ) -> Actor | None:
        policy = cell.supervision
        events.failed(envelope, cell.endpoint.depth(), waited, exc, policy.on_failure)
        self._fail_request(envelope, exc)
        if not self._may_restart(cell, exc):
            return None
        if policy.on_failure == "resume":
            return actor
        return await self._start_actor(cell, ctx, None)

    def _fail_request(self, envelope: Envelope, exc: BaseException) -> None:
        """Tell an asker at once that its request failed (instead of a silent timeout)."""
        body = envelope.body
        if isinstance(body, Request) and body.reply_to:
            chain = exc.chain if isinstance(exc, AskCycle) else ()
            failure = Failure(
                error=type(exc).__name__, message=str(exc), actor=envelope.receiver, chain=chain
            )
            self.reply_nowait(envelope, failure)

    def _stop_after_failure(self, cell: _Cell) -> None:
        """The actor stops for good: refuse new messages, dead-letter the accepted ones."""
        cell.counters.state = "failed" if cell.counters.state != "escalated" else "escalated"
        endpoint = cell.endpoint
        endpoint.close()
        stopped = ActorStopped(cell.name)
        while True:
            envelope = _drain_one(endpoint)
            if envelope is None:
                break
            self._dead_letter(envelope, "actor stopped after failure")
            self._fail_request(envelope, stopped)


def _drain_one(endpoint: Endpoint) -> Envelope | None:
    """Take one accepted message without waiting (``None`` when empty)."""
    return endpoint.get_nowait()


def _reply_body(reply: Envelope, expect: type[Any]) -> Any:
    body = reply.body
    if isinstance(body, Failure) and expect is not Failure:
        if body.error == "AskCycle":
            raise AskCycle(body.chain)
        if body.error == "ActorStopped":
            raise ActorStopped(body.actor)
        raise HandlerFailed(body.actor, body.error, body.message)
    if not isinstance(body, expect):
        raise UnexpectedReply(expect.__name__, body.kind)
    return body


def _first(group: BaseExceptionGroup[Any], kind: type[RuntimeFailure]) -> RuntimeFailure | None:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _first(exc, kind)
            if found is not None:
                return found
        elif isinstance(exc, kind):
            return exc
    return None


def _only(group: BaseExceptionGroup[Any], exc: BaseException) -> bool:
    """Whether every leaf of ``group`` is ``exc`` itself."""
    for leaf in group.exceptions:
        if isinstance(leaf, BaseExceptionGroup):
            if not _only(leaf, exc):
                return False
        elif leaf is not exc:
            return False
    return True
