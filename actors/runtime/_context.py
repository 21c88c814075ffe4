"""Context variables that carry the message being handled and a caller's correlation id."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import structlog

from messages import Envelope

__all__ = ["CURRENT", "current_envelope", "use_correlation"]

CURRENT: ContextVar[Envelope | None] = ContextVar("kvtier_current_envelope", default=None)
"""The envelope whose handler is running in this task (``None`` outside actors).

NOTE: ids propagate through this variable rather than through ``Context`` so
a helper function called from a handler that tells an ``ActorRef`` directly
still stamps the right correlation and causation ids; the ask call chain
travels inside the envelope (``Envelope.call_chain``) because contextvars do
not cross mailboxes.
"""

CORRELATION: ContextVar[str | None] = ContextVar("kvtier_correlation", default=None)
"""A correlation id chosen by non-actor code (one per HTTP request)."""


def current_envelope() -> Envelope | None:
    """The envelope being handled by the calling task, if it is an actor."""
    return CURRENT.get()


@contextmanager
def use_correlation(correlation_id: str) -> Iterator[str]:
    """Stamp ``correlation_id`` on every message this non-actor code sends.

    Also binds it into ``structlog.contextvars`` so the caller's own log lines
    (an HTTP handler's) carry the same id as the actors' events.
    """
    token = CORRELATION.set(correlation_id)
    tokens = structlog.contextvars.bind_contextvars(correlation_id=correlation_id)
    try:
        yield correlation_id
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
        CORRELATION.reset(token)
