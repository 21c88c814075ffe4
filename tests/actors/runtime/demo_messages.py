"""The demo conversation's messages (``demo.*``), used by the runtime's tests only.

Registered into the message union at import (``messages.register_messages``),
so traces that contain them parse like any other.
"""

from __future__ import annotations

from typing import Literal

from messages import Body, Request, register_messages

__all__ = ["Add", "Count", "GetTotal", "Ping", "Pong", "Total", "Work", "WorkDone"]


class Ping(Request):
    """Ask for a ``Pong`` echoing ``n``."""

    kind: Literal["demo.ping"] = "demo.ping"
    n: int = 0


class Pong(Body):
    """The reply to ``Ping``."""

    kind: Literal["demo.pong"] = "demo.pong"
    n: int = 0


class Add(Body):
    """Add ``amount`` to a counter (fire and forget)."""

    kind: Literal["demo.add"] = "demo.add"
    amount: int


class GetTotal(Request):
    """Ask a counter for its total."""

    kind: Literal["demo.get_total"] = "demo.get_total"


class Total(Body):
    """A counter's total and how many ``Add`` messages it handled."""

    kind: Literal["demo.total"] = "demo.total"
    total: int
    count: int


class Work(Request):
    """A unit of work split by a coordinator into ``Add`` messages."""

    kind: Literal["demo.work"] = "demo.work"
    job: str
    amounts: tuple[int, ...] = ()


class WorkDone(Body):
    """A worker finished ``job``; ``total`` is the counter's total afterwards."""

    kind: Literal["demo.work_done"] = "demo.work_done"
    job: str
    total: int


class Count(Body):
    """A generic numbered event (used to stream to inboxes in tests/benchmarks)."""

    kind: Literal["demo.count"] = "demo.count"
    n: int


register_messages(__name__)
