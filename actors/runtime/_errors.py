"""Typed failures of the actor runtime, each named after the state it reports."""

from __future__ import annotations

__all__ = [
    "ActorStopped",
    "AskCycle",
    "AskTimeout",
    "DeadlineExceeded",
    "HandlerFailed",
    "MailboxClosed",
    "MailboxFull",
    "ReceiveTimeout",
    "ReplayDiverged",
    "RuntimeFailure",
    "SupervisionEscalated",
    "UnexpectedReply",
    "UnknownAddress",
]


class RuntimeFailure(Exception):
    """Base of every error the actor runtime raises."""


class MailboxClosed(RuntimeFailure):
    """The target mailbox (actor or inbox) no longer accepts messages."""

    def __init__(self, address: str) -> None:
        super().__init__(f"mailbox {address!r} is closed")
        self.address = address


class ActorStopped(MailboxClosed):
    """The target actor has stopped (or is stopping) and accepts no new messages."""

    def __init__(self, address: str) -> None:
        RuntimeFailure.__init__(self, f"actor {address!r} has stopped")
        self.address = address


class UnknownAddress(MailboxClosed):
    """No actor or inbox is registered under this address."""

    def __init__(self, address: str) -> None:
        RuntimeFailure.__init__(self, f"no mailbox at address {address!r}")
        self.address = address


class MailboxFull(RuntimeFailure):
    """A non-waiting send found the bounded mailbox at capacity (admission control)."""

    def __init__(self, address: str, capacity: int) -> None:
        super().__init__(f"mailbox {address!r} is full ({capacity} messages)")
        self.address = address
        self.capacity = capacity


class DeadlineExceeded(RuntimeFailure):
    """A wait ran past its deadline."""


class AskTimeout(DeadlineExceeded):
    """No reply to an ``ask`` arrived before its deadline."""

    def __init__(self, address: str, kind: str, timeout: float) -> None:
        super().__init__(f"ask {kind!r} to {address!r} got no reply within {timeout:g} s")
        self.address = address
        self.kind = kind
        self.timeout = timeout


class ReceiveTimeout(DeadlineExceeded):
    """An inbox received nothing before the deadline."""

    def __init__(self, address: str, timeout: float) -> None:
        super().__init__(f"inbox {address!r} received nothing within {timeout:g} s")
        self.address = address
        self.timeout = timeout


class AskCycle(RuntimeFailure):
    """An ``ask`` would wait on an actor that is itself waiting on this call chain."""

    def __init__(self, chain: tuple[str, ...]) -> None:
        super().__init__("ask cycle: " + " -> ".join(chain))
        self.chain = chain


class HandlerFailed(RuntimeFailure):
    """The asked actor's handler raised instead of replying (``error`` names the type)."""

    def __init__(self, actor: str, error: str, message: str) -> None:
        super().__init__(f"actor {actor!r} failed: {error}: {message}")
        self.actor = actor
        self.error = error
        self.message = message


class UnexpectedReply(RuntimeFailure):
    """An ``ask`` got a reply of another type than the one expected."""

    def __init__(self, expected: str, got: str) -> None:
        super().__init__(f"expected a {expected} reply, got {got!r}")
        self.expected = expected
        self.got = got


class SupervisionEscalated(RuntimeFailure):
    """An actor failed more often than its restart intensity allows; the system stops."""

    def __init__(self, actor: str, restarts: int, within: float) -> None:
        super().__init__(
            f"actor {actor!r} exceeded {restarts} restarts within {within:g} s; escalating"
        )
        self.actor = actor
        self.restarts = restarts
        self.within = within


class ReplayDiverged(RuntimeFailure):
    """A replay produced a delivery different from the recorded one."""

    def __init__(self, line: int, expected: str, actual: str) -> None:
        super().__init__(f"replay diverged at line {line}:\n- {expected}\n+ {actual}")
        self.line = line
        self.expected = expected
        self.actual = actual
