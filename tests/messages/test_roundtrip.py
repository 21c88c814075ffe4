"""Every registered message survives the JSON round trip exactly (Hypothesis-generated)."""

from __future__ import annotations

import types
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from messages import (
    Body,
    Envelope,
    body_classes,
    envelope_from_json,
    envelope_to_json,
    parse_body,
)
from tests.actors.runtime.demo_messages import Ping

_TEXT = st.text(max_size=12)
_FLOAT = st.floats(allow_nan=False, allow_infinity=False, width=64)


def _strategy(annotation: Any) -> st.SearchStrategy[Any]:
    """A strategy for one field annotation of a message model."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _strategy(args[0])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_strategy(a) for a in args])
    if origin in (tuple,):
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy(args[0]), max_size=4).map(tuple)
        return st.tuples(*[_strategy(a) for a in args])
    if origin in (list,):
        return st.lists(_strategy(args[0]), max_size=4)
    if origin in (dict,):
        return st.dictionaries(_strategy(args[0]), _strategy(args[1]), max_size=3)
    if annotation is type(None):
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(min_value=0, max_value=2**40) | st.integers(min_value=-5, max_value=5)
    if annotation is float:
        return _FLOAT
    if annotation is str:
        return _TEXT
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model(annotation)
    return st.from_type(annotation)


def _model(cls: type[BaseModel]) -> st.SearchStrategy[Any]:
    """Instances of ``cls`` with every field drawn (invalid combinations discarded)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {name: _strategy(hints[name]) for name in cls.model_fields}

    def build(values: dict[str, Any]) -> Any:
        try:
            return cls(**values)
        except ValidationError:
            return None

    return st.fixed_dictionaries(fields).map(build).filter(lambda m: m is not None)


_BODIES = st.one_of([_model(cls) for cls in body_classes()])


def test_every_registered_module_contributes_bodies() -> None:
    """The union holds the runtime's messages, registered test messages, and each kind once."""
    kinds = [cls.model_fields["kind"].default for cls in body_classes()]
    assert "runtime.failure" in kinds
    assert "demo.ping" in kinds
    assert len(kinds) == len(set(kinds))


@settings(max_examples=300, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(_BODIES)
def test_body_json_round_trip_is_exact(body: Body) -> None:
    """``model_dump_json`` → ``parse_body`` reproduces the same body and type."""
    again = parse_body(body.model_dump_json())
    assert type(again) is type(body)
    assert again == body


@settings(max_examples=100, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(
    body=_BODIES,
    ids=st.tuples(_TEXT, _TEXT, st.none() | _TEXT, _TEXT, _TEXT),
    sent_at=_FLOAT,
    chain=st.lists(_TEXT, max_size=3).map(tuple),
)
def test_envelope_json_round_trip_is_exact(
    body: Body, ids: tuple[str, str, str | None, str, str], sent_at: float, chain: tuple[str, ...]
) -> None:
    """An envelope serialized with ``envelope_to_json`` parses back equal."""
    envelope = Envelope(*ids, sent_at, body, chain)
    assert envelope_from_json(envelope_to_json(envelope)) == envelope


def test_messages_are_frozen_and_reject_unknown_fields() -> None:
    """Bodies cannot be mutated and unknown fields fail validation."""
    ping = Ping(n=1)
    with pytest.raises(ValidationError):
        ping.n = 2  # type: ignore[misc]
    with pytest.raises(ValidationError):
        parse_body('{"kind":"demo.ping","n":1,"surprise":true}')
    with pytest.raises(ValidationError):
        parse_body('{"kind":"no.such.kind"}')
