"""The discriminated union of every registered message body (``AnyBody``).

Registering a message module is ONE line in ``_MODULES`` below. Every public
(``__all__``) subclass of ``Body`` in a registered module whose ``kind`` is a
``Literal`` joins the union; two classes claiming one ``kind`` fail at import.

NOTE: the union is built at import time from the registered modules so that
adding a module never edits a long hand-written ``Union[...]``; for the type
checker ``AnyBody`` is simply ``Body`` (handlers narrow with ``isinstance``).
"""

from __future__ import annotations

import importlib
import typing
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import Field, TypeAdapter

from ._base import Body

__all__ = ["AnyBody", "body_adapter", "body_classes", "parse_body", "register_messages"]

# One line per message module (keep others' lines when adding yours).
_MODULES: tuple[str, ...] = (
    "messages.runtime",
    "messages.gateway",
    "messages.prompt_cache",
    "messages.spill_queue",
    "messages.ssd_writer",
    "messages.durability",
    "messages.batch_scheduler",
    "messages.kv_events",
    "messages.memory",
)


def _literal_kind(cls: type[Body]) -> str | None:
    field = cls.model_fields.get("kind")
    if field is None or typing.get_origin(field.annotation) is not typing.Literal:
        return None
    args = typing.get_args(field.annotation)
    return str(args[0]) if len(args) == 1 else None


def _collect() -> tuple[type[Body], ...]:
    seen: dict[str, type[Body]] = {}
    for name in _MODULES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if not (isinstance(obj, type) and issubclass(obj, Body)):
                continue
            kind = _literal_kind(obj)
            if kind is None:
                continue
            other = seen.get(kind)
            if other is not None and other is not obj:
                raise TypeError(f"message kind {kind!r} claimed by {other!r} and {obj!r}")
            seen[kind] = obj
    return tuple(seen.values())


_CLASSES = _collect()

if TYPE_CHECKING:
    AnyBody = Body
else:
    AnyBody = Annotated[Union[_CLASSES], Field(discriminator="kind")]  # noqa: UP007


def register_messages(*module_names: str) -> None:
    """Add message modules outside ``messages/`` (tests, plugins) to the union.

    NOTE: for code that defines its own bodies without editing ``_MODULES``
    (the runtime's demo messages live under tests/). Idempotent; a ``kind``
    claimed twice still fails loudly.
    """
    global _MODULES, _CLASSES
    new = tuple(m for m in module_names if m not in _MODULES)
    if not new:
        return
    _MODULES = (*_MODULES, *new)
    _CLASSES = _collect()
    body_adapter.cache_clear()


def body_classes() -> tuple[type[Body], ...]:
    """Every registered body class, in registration order."""
    return _CLASSES


@cache
def body_adapter() -> TypeAdapter[Any]:
    """The (cached) pydantic adapter validating any registered body by ``kind``."""
    if len(_CLASSES) == 0:
        raise TypeError("no message bodies are registered")
    union: Any = Annotated[Union[_CLASSES], Field(discriminator="kind")]  # noqa: UP007
    return TypeAdapter(union)


def parse_body(data: str | bytes) -> Body:
    """Validate one body from its JSON text (``Body.model_dump_json`` output)."""
    body = body_adapter().validate_json(data)
    assert isinstance(body, Body)
    return body
