"""Mailbox endpoints: where messages for one address wait to be received.

Three real kinds: an actor's mailbox and a non-actor ``Inbox`` (both bounded
anyio memory object streams) and a one-shot reply slot for ``ask`` (an event
and one value; cheaper than a stream). The simulated runtime supplies its own
endpoints with the same interface.
"""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from messages import Envelope

from ._errors import ActorStopped, MailboxClosed

__all__ = ["Endpoint", "SlotEndpoint", "StreamEndpoint"]


class Endpoint:
    """The receiving side of one address (actor mailbox, inbox or reply slot)."""

    __slots__ = ("address", "capacity", "is_actor")

    def __init__(self, address: str, capacity: int, *, is_actor: bool) -> None:
        if capacity < 1:
            raise ValueError("a mailbox holds at least one message")
        self.address = address
        self.capacity = capacity
        self.is_actor = is_actor

    def closed_error(self) -> MailboxClosed:
        """The error a sender gets once this endpoint is closed."""
        return ActorStopped(self.address) if self.is_actor else MailboxClosed(self.address)

    async def put(self, envelope: Envelope) -> None:
        """Accept ``envelope``, waiting while full; raises ``MailboxClosed`` once closed."""
        raise NotImplementedError

    def put_nowait(self, envelope: Envelope) -> bool:
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


class StreamEndpoint(Endpoint):
    """A bounded anyio memory object stream (actor mailboxes and inboxes).

    NOTE: closing withdraws senders still blocked on a full stream (they get
    ``MailboxClosed``/``ActorStopped``): "accepted" means "in the buffer".
    """

    __slots__ = ("_closed", "_recv", "_send")

    def __init__(self, address: str, capacity: int, *, is_actor: bool) -> None:
        super().__init__(address, capacity, is_actor=is_actor)
        send, recv = anyio.create_memory_object_stream[Envelope](capacity)
        self._send: MemoryObjectSendStream[Envelope] = send
        self._recv: MemoryObjectReceiveStream[Envelope] = recv
        self._closed = False

    async def put(self, envelope: Envelope) -> None:
        try:
            await self._send.send(envelope)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise self.closed_error() from None

    def put_nowait(self, envelope: Envelope) -> bool:
        try:
            self._send.send_nowait(envelope)
        except anyio.WouldBlock:
            return False
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise self.closed_error() from None
        return True

    async def get(self) -> Envelope | None:
        try:
            return await self._recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return None

    def get_nowait(self) -> Envelope | None:
        try:
            return self._recv.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return None

    def close(self) -> None:
        self._closed = True
        self._send.close()

    def discard(self) -> None:
        self.close()
        self._recv.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> int:
        return self._send.statistics().current_buffer_used

    def waiting_senders(self) -> int:
        return self._send.statistics().tasks_waiting_send


class SlotEndpoint(Endpoint):
    """The one-shot reply slot of an ``ask``: holds at most one envelope."""

    __slots__ = ("_closed", "_event", "_value")

    def __init__(self, address: str) -> None:
        super().__init__(address, 1, is_actor=False)
        self._event = anyio.Event()
        self._value: Envelope | None = None
        self._closed = False

    async def put(self, envelope: Envelope) -> None:
        if not self.put_nowait(envelope):
            # NOTE: a second reply to one ask is a bug in the replier, not
            # backpressure: fail like a closed slot so it becomes a dead letter.
            raise MailboxClosed(self.address)

    def put_nowait(self, envelope: Envelope) -> bool:
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
