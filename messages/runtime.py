"""Messages of the actor runtime itself.

``Failure`` is what the runtime sends to a request's reply slot when the
handler raised instead of replying, so an ``ask`` fails fast with a typed
error instead of waiting out its deadline. The ``demo.*`` messages drive the
three-actor demo scenario (``actors.runtime.demo``) and the runtime tests.
"""

from __future__ import annotations

from typing import Literal

from ._base import Body

__all__ = ["Failure"]


class Failure(Body):
    """The handler of a request raised: ``error`` names the exception type."""

    kind: Literal["runtime.failure"] = "runtime.failure"
    error: str
    message: str = ""
    actor: str = ""
    chain: tuple[str, ...] = ()
