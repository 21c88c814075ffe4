"""Messages of the actor runtime itself, plus the demo conversation's messages.

``Failure`` is what the runtime sends to a request's reply slot when the
handler raised instead of replying, so an ``ask`` fails fast with a typed
error instead of waiting out its deadline. The ``demo.*`` messages drive the
three-actor demo scenario (``actors.runtime.demo``) and the runtime tests.
"""

from __future__ import annotations

from typing import Literal

from ._base import Body, Request

__all__ = [
    "Add",
    "Count",
    "Failure",
    "GetTotal",
    "Ping",
    "Pong",
    "Total",
    "Work",
    "WorkDone",
]


class Failure(Body):
    """The handler of a request raised: ``error`` names the exception type."""

    kind: Literal["runtime.failure"] = "runtime.failure"
    error: str
    message: str = ""
    actor: str = ""
    chain: tuple[str, ...] = ()


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
