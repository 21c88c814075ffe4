"""Mailbox endpoints: where messages for one address wait to be received.

Three real kinds: an actor's mailbox and a non-actor ``Inbox`` (both bounded
FIFO buffers) and a one-shot reply slot for ``ask`` (an event and one value).
The simulated runtime supplies its own endpoints with the same interface.

Every mailbox holds ``capacity`` messages for ordinary sends plus ``reserve``
more that only *reserved* sends may use: replies (an answer must not be lost
or wait behind the traffic it answers), an actor's notes to itself, and the
final message of a stream. NOTE: the reserve is what makes "a reply always
arrives" true with bounded mailboxes: an actor that keeps at most
``reserve`` requests (replying to itself) outstanding always finds room for
their answers, however many ordinary messages fill its mailbox.
"""

from __future__ import annotations

from collections import deque

import anyio
from anyio.lowlevel import checkpoint

from messages import Envelope

from ._errors import ActorStopped, MailboxClosed

__all__ = ["Endpoint", "SlotEndpoint", "StreamEndpoint"]


class Endpoint:
    """The receiving side of one address (actor mailbox, inbox or reply slot)."""

    __slots__ = ("address", "capacity", "is_actor", "reserve")

    def __init__(self, address: str, capacity: int, *, is_actor: bool, reserve: int = 0) -> None:
        if capacity < 1:
            raise ValueError("a mailbox holds at least one message")
        if reserve < 0:
            raise ValueError("a mailbox's reserve cannot be negative")
        self.address = address
        self.capacity = capacity
        self.is_actor = is_actor
        self.reserve = reserve

    def limit(self, reserved: bool) -> int:
        """How many messages the buffer may hold when a send of this kind is accepted."""
        return self.capacity + self.reserve if reserved else self.capacity

    def closed_error(self) -> MailboxClosed:
        """The error a sender gets once this endpoint is closed."""
        return ActorStopped(self.address) if self.is_actor else MailboxClosed(self.address)

    async def put(self, envelope: Envelope, *, reserved: bool = False) -> None:
        """Accept ``envelope``, waiting while full; raises ``MailboxClosed`` once closed.

        ``reserved`` sends may also use the ``reserve`` room (replies, notes
        to self, a stream's final message).
        """
        raise NotImplementedError

    def put_nowait(self, envelope: Envelope, *, reserved: bool = False) -> bool:
        """Accept without waiting; ``False`` when full; raises ``MailboxClosed`` once closed."""
        raise NotImplementedError

    async def get(self) -> Envelope | None:
        """The next accepted message, waiting for one; ``None`` once closed and drained."""
        raise NotImplementedError

    def get_nowait(self) -> Envelope | None:
        """The next accepted message if one is ready, else ``None``."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop accepting; already accepted messages stay receivable."""
        raise NotImplementedError

    def discard(self) -> None:
        """Close both sides (the reader is gone); later sends fail as closed."""
        self.close()

    @property
    def closed(self) -> bool:
        """Whether the endpoint stopped accepting messages."""
        raise NotImplementedError

    def depth(self) -> int:
        """Accepted messages not yet received."""
        raise NotImplementedError

    def waiting_senders(self) -> int:
        """Senders blocked because the endpoint is full."""
        raise NotImplementedError


class _BlockedSend:
    """A sender waiting for room; ``accepted`` once its envelope moved into the buffer."""

    __slots__ = ("accepted", "envelope", "event")

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope
        self.event = anyio.Event()
        self.accepted = False


class StreamEndpoint(Endpoint):
    """A bounded FIFO buffer (actor mailboxes and inboxes) with reserved room.

    Senders blocked on a full buffer wait in FIFO order; a receive moves the
    first of them into the buffer at once (reserved senders first), so a new
    send never overtakes a blocked one. NOTE: closing withdraws senders still
    blocked (they get ``MailboxClosed``/``ActorStopped``): "accepted" means
    "in the buffer".
    """

    __slots__ = ("_blocked", "_blocked_reserved", "_buffer", "_closed", "_readers")

    def __init__(self, address: str, capacity: int, *, is_actor: bool, reserve: int = 0) -> None:
        super().__init__(address, capacity, is_actor=is_actor, reserve=reserve)
        self._buffer: deque[Envelope] = deque()
        self._blocked: deque[_BlockedSend] = deque()
        self._blocked_reserved: deque[_BlockedSend] = deque()
        self._readers: deque[anyio.Event] = deque()
        self._closed = False

    async def put(self, envelope: Envelope, *, reserved: bool = False) -> None:
        # NOTE: a checkpoint on every send (as anyio's memory streams do) keeps
        # a sender that never blocks from starving the other tasks.
        await checkpoint()
        if self.put_nowait(envelope, reserved=reserved):
            return
        blocked = _BlockedSend(envelope)
        queue = self._blocked_reserved if reserved else self._blocked
        queue.append(blocked)
        try:
            await blocked.event.wait()
        except BaseException:
            if not blocked.accepted:
                queue.remove(blocked)
            raise
        if not blocked.accepted:
            raise self.closed_error()

    def put_nowait(self, envelope: Envelope, *, reserved: bool = False) -> bool:
        if self._closed:
            raise self.closed_error()
        # NOTE: blocked senders exist only while the buffer is at their
        # limit, so this check also keeps FIFO order with them.
        if len(self._buffer) >= self.limit(reserved):
            return False
        self._buffer.append(envelope)
        if self._readers:
            self._readers.popleft().set()
        return True

    async def get(self) -> Envelope | None:
        await checkpoint()
        while True:
            envelope = self.get_nowait()
            if envelope is not None:
                return envelope
            if self._closed:
                return None
            event = anyio.Event()
            self._readers.append(event)
            try:
                await event.wait()
            finally:
                if not event.is_set():
                    self._readers.remove(event)

    def get_nowait(self) -> Envelope | None:
        if not self._buffer:
            return None
        envelope = self._buffer.popleft()
        self._admit_blocked()
        return envelope

    def _admit_blocked(self) -> None:
        buffer = self._buffer
        for queue, limit in (
            (self._blocked_reserved, self.limit(True)),
            (self._blocked, self.limit(False)),
        ):
            while queue and len(buffer) < limit:
                blocked = queue.popleft()
                buffer.append(blocked.envelope)
                blocked.accepted = True
                blocked.event.set()

    def close(self) -> None:
        self._closed = True
        for queue in (self._blocked_reserved, self._blocked):
            while queue:
                queue.popleft().event.set()
        while self._readers:
            self._readers.popleft().set()

    def discard(self) -> None:
        self.close()
        self._buffer.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> int:
        return len(self._buffer)

    def waiting_senders(self) -> int:
        return len(self._blocked) + len(self._blocked_reserved)


class SlotEndpoint(Endpoint):
    """The one-shot reply slot of an ``ask``: holds at most one envelope."""

    __slots__ = ("_closed", "_event", "_value")

    def __init__(self, address: str) -> None:
        super().__init__(address, 1, is_actor=False)
        self._event = anyio.Event()
        self._value: Envelope | None = None
        self._closed = False

    async def put(self, envelope: Envelope, *, reserved: bool = False) -> None:
        if not self.put_nowait(envelope):
            # NOTE: a second reply to one ask is a bug in the replier, not
            # backpressure: fail like a closed slot so it becomes a dead letter.
            raise MailboxClosed(self.address)

    def put_nowait(self, envelope: Envelope, *, reserved: bool = False) -> bool:
        if self._closed:
            raise MailboxClosed(self.address)
        if self._value is not None:
            return False
        self._value = envelope
        self._event.set()
        return True

    async def get(self) -> Envelope | None:
        await self._event.wait()
        return self._value

    def get_nowait(self) -> Envelope | None:
        return self._value

    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> int:
        return 0 if self._value is None else 1

    def waiting_senders(self) -> int:
        return 0
