"""The envelope around every delivered message, and its exact JSON form.

The runtime builds millions of envelopes, so ``Envelope`` is a frozen, slotted
dataclass (cheap to construct); its JSON form goes through a pydantic model
whose ``body`` is the registered discriminated union, so
``envelope_from_json(envelope_to_json(e)) == e`` for every registered body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, SerializeAsAny, TypeAdapter, field_validator

from ._base import Body
from ._union import body_adapter

__all__ = ["EXTERNAL", "Envelope", "EnvelopeRecord", "envelope_from_json", "envelope_to_json"]

EXTERNAL = "external"
"""The ``sender`` of a message told by code that is not an actor (HTTP handler, tests)."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message in flight: ids, addresses, the send time and the body.

    ``correlation_id`` names the outside request this message serves (it
    propagates from the message being handled to every message it causes);
    ``causation_id`` is the ``msg_id`` of that message (``None`` at the edge);
    ``sent_at`` comes from the system's injected clock (seconds);
    ``call_chain`` lists the actors blocked in ``ask`` on this causal path,
    which is how ask cycles are detected instead of deadlocking.
    """

    msg_id: str
    correlation_id: str
    causation_id: str | None
    sender: str
    receiver: str
    sent_at: float
    body: Body
    call_chain: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """The body's ``kind`` discriminator."""
        return self.body.kind


class EnvelopeRecord(BaseModel):
    """The serialized form of an ``Envelope`` (``body`` validated by ``kind``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    msg_id: str
    correlation_id: str
    causation_id: str | None
    sender: str
    receiver: str
    sent_at: float
    body: SerializeAsAny[Body]
    call_chain: tuple[str, ...] = ()

    @field_validator("body", mode="before")
    @classmethod
    def _by_kind(cls, value: Any) -> Any:
        # NOTE: validated through the union as it is NOW (register_messages may
        # have added bodies after this class was built), keyed by ``kind``.
        return value if isinstance(value, Body) else body_adapter().validate_python(value)

    @classmethod
    def of(cls, envelope: Envelope) -> EnvelopeRecord:
        """The record of ``envelope`` (no validation: the body is already a model)."""
        return cls.model_construct(**{name: getattr(envelope, name) for name in _FIELDS})

    def to_envelope(self) -> Envelope:
        """The runtime envelope this record describes."""
        return Envelope(**{name: getattr(self, name) for name in _FIELDS})


# NOTE: the record and the envelope have the same fields, in the same order
# (checked at import), so conversion copies them by name.
_FIELDS = tuple(Envelope.__dataclass_fields__)
if tuple(EnvelopeRecord.model_fields) != _FIELDS:
    raise TypeError("Envelope and EnvelopeRecord must have the same fields")


_RECORD = TypeAdapter(EnvelopeRecord)


def envelope_to_json(envelope: Envelope) -> str:
    """Serialize ``envelope`` to one line of JSON (the body keyed by ``kind``)."""
    return EnvelopeRecord.of(envelope).model_dump_json()


def envelope_from_json(data: str | bytes) -> Envelope:
    """Parse ``envelope_to_json`` output back into an equal ``Envelope``."""
    record: Any = _RECORD.validate_json(data)
    assert isinstance(record, EnvelopeRecord)
    return record.to_envelope()
