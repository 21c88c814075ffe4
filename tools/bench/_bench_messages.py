"""The runtime benchmark's own message bodies (``bench.*``).

Registered into the message union at import (``messages.register_messages``),
like the runtime tests' ``demo.*`` bodies: the product's ``messages`` package
holds only the protocols its actors speak.
"""

from __future__ import annotations

from typing import Literal

from messages import Body, Request, register_messages

__all__ = ["Count", "Ping", "Pong"]


class Ping(Request):
    """Ask for a ``Pong`` echoing ``n``."""

    kind: Literal["bench.ping"] = "bench.ping"
    n: int = 0


class Pong(Body):
    """The reply to ``Ping``."""

    kind: Literal["bench.pong"] = "bench.pong"
    n: int = 0


class Count(Body):
    """A numbered one-way event (what the tell benchmark sends)."""

    kind: Literal["bench.count"] = "bench.count"
    n: int


register_messages(__name__)
