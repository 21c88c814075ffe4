"""Statistics snapshots of mailboxes and of the whole system."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MailboxStatistics", "SystemStatistics", "WaitSamples", "percentile"]


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank; 0.0 when empty."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[rank]


class WaitSamples:
    """A bounded window of the most recent time-in-mailbox samples (seconds).

    NOTE: bounded so a long-running server's statistics cost O(window), not
    O(messages ever handled); percentiles describe recent traffic.
    """

    __slots__ = ("_samples",)

    def __init__(self, window: int = 1024) -> None:
        self._samples: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        """Record one sample."""
        self._samples.append(seconds)

    def p(self, q: float) -> float:
        """The ``q``-quantile of the window."""
        return percentile(self._samples, q)


@dataclass(frozen=True, slots=True)
class MailboxStatistics:
    """One mailbox at one moment (times in seconds)."""

    address: str
    depth: int
    capacity: int
    waiting_senders: int
    sent: int
    handled: int
    failed: int
    restarts: int
    rejected: int
    time_in_mailbox_p50: float
    time_in_mailbox_p99: float
    state: str

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly dict (for ``/stats``)."""
        return {
            "address": self.address,
            "depth": self.depth,
            "capacity": self.capacity,
            "waiting_senders": self.waiting_senders,
            "sent": self.sent,
            "handled": self.handled,
            "failed": self.failed,
            "restarts": self.restarts,
            "rejected": self.rejected,
            "time_in_mailbox_p50": self.time_in_mailbox_p50,
            "time_in_mailbox_p99": self.time_in_mailbox_p99,
            "state": self.state,
        }


@dataclass(frozen=True, slots=True)
class SystemStatistics:
    """The whole system at one moment."""

    actors: tuple[MailboxStatistics, ...]
    open_inboxes: int
    dead_letters: int
    running: bool

    @property
    def handled(self) -> int:
        """Messages handled by all actors."""
        return sum(a.handled for a in self.actors)

    @property
    def failed(self) -> int:
        """Handler failures across all actors."""
        return sum(a.failed for a in self.actors)

    def actor(self, address: str) -> MailboxStatistics:
        """The statistics of one actor (``KeyError`` if unknown)."""
        for a in self.actors:
            if a.address == address:
                return a
        raise KeyError(address)

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly dict (for ``/stats``)."""
        return {
            "actors": [a.as_dict() for a in self.actors],
            "open_inboxes": self.open_inboxes,
            "dead_letters": self.dead_letters,
            "handled": self.handled,
            "failed": self.failed,
            "running": self.running,
        }
