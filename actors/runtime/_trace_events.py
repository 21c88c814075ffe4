"""The per-message structlog events (called only when ``TRACE.on``)."""

from __future__ import annotations

from typing import Any

import structlog

from messages import Envelope

__all__ = ["dead_letter", "failed", "handled", "received", "sent"]

_log = structlog.get_logger("kvtier.mailbox")


def _ids(envelope: Envelope) -> dict[str, Any]:
    """The fields every mailbox event carries: receiver, kind, the three ids, sender."""
    return {
        "actor": envelope.receiver,
        "kind": envelope.body.kind,
        "msg_id": envelope.msg_id,
        "correlation_id": envelope.correlation_id,
        "causation_id": envelope.causation_id,
        "sender": envelope.sender,
    }


def sent(envelope: Envelope, depth: int) -> None:
    """``mailbox.sent``: the receiver's mailbox accepted ``envelope``."""
    _log.debug("mailbox.sent", **_ids(envelope), depth=depth)


def received(envelope: Envelope, depth: int, waited: float) -> None:
    """``mailbox.received``: the actor took ``envelope`` out of its mailbox."""
    _log.debug("mailbox.received", **_ids(envelope), depth=depth, time_in_mailbox=waited)


def handled(envelope: Envelope, depth: int, waited: float, took: float) -> None:
    """``mailbox.handled``: the handler returned normally."""
    _log.debug(
        "mailbox.handled", **_ids(envelope), depth=depth, time_in_mailbox=waited, duration=took
    )


def failed(envelope: Envelope, depth: int, waited: float, error: BaseException, action: str) -> None:
    """``mailbox.failed`` (warning level, always emitted): the handler raised."""
    _log.warning(
        "mailbox.failed",
        **_ids(envelope),
        depth=depth,
        time_in_mailbox=waited,
        error=type(error).__name__,
        message=str(error),
        action=action,
    )


def dead_letter(envelope: Envelope, reason: str) -> None:
    """``mailbox.dead_letter``: ``envelope`` could not be delivered."""
    _log.debug("mailbox.dead_letter", **_ids(envelope), reason=reason)
