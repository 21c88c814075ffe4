"""Base classes every message body derives from.

A message body is plain data: frozen, no unknown fields, JSON round-trip
exact. Tensors never appear here, only opaque handle ids (strings) into the
registry the engine thread owns.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    """A message body; subclasses pin ``kind`` to a ``Literal`` discriminator."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str


class Request(Body):
    """A body that expects a reply: the reply slot travels inside the request.

    ``reply_to`` is an opaque slot id filled in by the runtime's ``ask``; an
    actor answers by replying to that slot, never by holding a future.
    """

    reply_to: str = ""
