"""OpenAI's ``strict: true`` for a function's parameters, as a schema rewrite.

With ``strict``, OpenAI constrains a call's arguments to the declared
properties: an object schema takes no property it does not declare. JSON
schema's default is the opposite (undeclared properties are allowed), so
:func:`strict_schema` adds ``"additionalProperties": false`` to every object
schema that does not set ``additionalProperties`` itself (what the client
wrote explicitly is kept).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["strict_schema"]

_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
        "contains", "propertyNames", "not", "if", "then", "else", "additionalItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def _is_object(node: Mapping[str, Any]) -> bool:
    kind = node.get("type")
    return ("properties" in node or kind == "object"
            or (isinstance(kind, list) and "object" in kind))


def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` whose object schemas refuse undeclared properties.

    NOTE: recursive; call it on a schema that passed ``check_schemas``
    (its JSON nesting is bounded far below Python's recursion limit).
    """
    out: dict[str, Any] = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), Mapping):
            out[key] = strict_schema(out[key])
    items = out.get("items")
    if isinstance(items, list):
        out["items"] = [strict_schema(v) if isinstance(v, Mapping) else v for v in items]
    for key in _MAP:
        sub = out.get(key)
        if isinstance(sub, Mapping):
            out[key] = {k: strict_schema(v) if isinstance(v, Mapping) else v
                        for k, v in sub.items()}
    for key in _LIST:
        sub = out.get(key)
        if isinstance(sub, list):
            out[key] = [strict_schema(v) if isinstance(v, Mapping) else v for v in sub]
    if _is_object(out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
