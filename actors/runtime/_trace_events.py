"""The per-message structlog events (called only when ``TRACE.on``)."""

from __future__ import annotations

import structlog

from messages import Envelope

__all__ = ["dead_letter", "failed", "handled", "received", "sent"]

_log = structlog.get_logger("kvtier.mailbox")


def sent(envelope: Envelope, depth: int) -> None:
    """``mailbox.sent``: the receiver's mailbox accepted ``envelope``."""
    _log.debug(
        "mailbox.sent",
        actor=envelope.receiver,
        kind=envelope.body.kind,
        msg_id=envelope.msg_id,
        correlation_id=envelope.correlation_id,
        causation_id=envelope.causation_id,
        sender=envelope.sender,
        depth=depth,
    )


def received(envelope: Envelope, depth: int, waited: float) -> None:
    """``mailbox.received``: the actor took ``envelope`` out of its mailbox."""
    _log.debug(
        "mailbox.received",
        actor=envelope.receiver,
        kind=envelope.body.kind,
        msg_id=envelope.msg_id,
        correlation_id=envelope.correlation_id,
        causation_id=envelope.causation_id,
        sender=envelope.sender,
        depth=depth,
        time_in_mailbox=waited,
    )


def handled(envelope: Envelope, depth: int, waited: float, took: float) -> None:
    """``mailbox.handled``: the handler returned normally."""
    _log.debug(
        "mailbox.handled",
        actor=envelope.receiver,
        kind=envelope.body.kind,
        msg_id=envelope.msg_id,
        correlation_id=envelope.correlation_id,
        causation_id=envelope.causation_id,
        depth=depth,
        time_in_mailbox=waited,
        duration=took,
    )


def failed(envelope: Envelope, depth: int, waited: float, error: BaseException, action: str) -> None:
    """``mailbox.failed`` (warning level, always emitted): the handler raised."""
    _log.warning(
        "mailbox.failed",
        actor=envelope.receiver,
        kind=envelope.body.kind,
        msg_id=envelope.msg_id,
        correlation_id=envelope.correlation_id,
        causation_id=envelope.causation_id,
        depth=depth,
        time_in_mailbox=waited,
        error=type(error).__name__,
        message=str(error),
        action=action,
    )


def dead_letter(envelope: Envelope, reason: str) -> None:
    """``mailbox.dead_letter``: ``envelope`` could not be delivered."""
    _log.debug(
        "mailbox.dead_letter",
        actor=envelope.receiver,
        kind=envelope.body.kind,
        msg_id=envelope.msg_id,
        correlation_id=envelope.correlation_id,
        causation_id=envelope.causation_id,
        sender=envelope.sender,
        reason=reason,
    )
