"""A JSON codec for what sans-IO cores take and return: states, events, effects.

Every JSON object the codec writes is a tagged value (its first key names
the type), so plain lists, strings, numbers, booleans and ``null`` stand for
themselves and nothing else:

- ``{"$t": [...]}`` tuple, ``{"$d": [[k, v], ...]}`` dict (insertion order,
  any key type; ``"$od"`` an ``OrderedDict``), ``{"$q": [...], "max": n}`` deque, ``{"$s": [...]}`` set and
  ``{"$f": [...]}`` frozenset (elements sorted by their encoding, so the
  text does not depend on string hashing), ``{"$b": "base64"}`` bytes;
- ``{"$e": "module:Qual", "v": value}`` an enum member;
- ``{"$c": "module:Qual", "f": {name: value}}`` a dataclass (every field,
  plus the instance ``__dict__`` of a dataclass without slots, so attributes
  set in ``__post_init__`` survive), a pydantic model (its fields), or a
  plain object of a class of these packages (its attributes);
- ``{"$m": object, "name": "method"}`` a bound public method of such an
  object, ``{"$p": method, "args": [...], "kw": {...}}`` a
  ``functools.partial`` of one (a core's configured estimate, say);
- ``{"$o": "Qual", "n": k}`` an object the codec cannot write (a thread-safe
  port, a callable): a stable placeholder, numbered by first appearance in
  one trace, decoded as an :class:`Opaque` that encodes back to the same tag.

Decoding is for untrusted files: a class is imported only from the
``actors``, ``messages`` and ``kernels`` packages, objects are built with
their attributes set directly (no ``__init__``, no validator and no
``__post_init__`` runs), a callable is only a public method of an object so
built (never a function named by the file), and nesting is bounded.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import functools
import importlib
import inspect
import json
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

__all__ = ["CodecError", "Decoder", "Encoder", "Opaque", "dumps"]

_TRUSTED_PACKAGES = ("actors", "messages", "kernels")
"""Top-level packages whose classes a trace may name."""

MAX_DEPTH = 200
"""Deepest nesting a decoded value may have (a file is untrusted)."""


class CodecError(ValueError):
    """A value could not be decoded (unknown tag, untrusted class, bad shape, too deep)."""


@dataclass(frozen=True, slots=True)
class Opaque:
    """The stand-in of an object a trace could not write: its type name and number."""

    type_name: str
    number: int


def dumps(value: Any) -> str:
    """Compact JSON text of an already encoded value (the form traces store and compare)."""
    # NOTE: ASCII only: a lone surrogate (a broken detokenization) is escaped,
    # never an encoding error in the writer.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _trusted(cls: type) -> bool:
    return cls.__module__.split(".")[0] in _TRUSTED_PACKAGES


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return [name for name in names if name not in ("__dict__", "__weakref__")]


def _own_method(value: object) -> bool:
    """A public method bound to an object of these packages (what a decoder may rebuild)."""
    return (inspect.ismethod(value) and not value.__name__.startswith("_")
            and _trusted(type(value.__self__)))


def _plain(value: object) -> bool:
    """A plain object of our own: its state is its attributes (no exception, no class)."""
    return not isinstance(value, (BaseException, type)) and (
        hasattr(value, "__dict__") or bool(_slot_names(type(value)))
    )


class Encoder:
    """Encodes values to JSON-ready trees; numbers opaque objects by first appearance.

    NOTE: the identity table keeps each opaque object alive while it is in
    use by id: an id freed and reused by a new object would otherwise be
    taken for the old one. Only objects the codec cannot write land here
    (ports and callables, few and long-lived).
    """

    __slots__ = ("_opaque",)

    def __init__(self) -> None:
        self._opaque: dict[int, tuple[object, int]] = {}

    def encode(self, value: Any) -> Any:
        """The JSON-ready tree of ``value``."""
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, enum.Enum):
            return {"$e": _qualname(type(value)), "v": self.encode(value.value)}
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            # NOTE: float subclasses (numpy's float64) are written as floats.
            return float(value)
        if isinstance(value, list):
            return [self.encode(item) for item in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"$t": [self.encode(item) for item in value]}
        if type(value) is dict or type(value) is OrderedDict:
            tag = "$d" if type(value) is dict else "$od"
            return {tag: [[self.encode(k), self.encode(v)] for k, v in value.items()]}
        if isinstance(value, deque):
            return {"$q": [self.encode(item) for item in value], "max": value.maxlen}
        if isinstance(value, (set, frozenset)):
            items = sorted((self.encode(item) for item in value), key=dumps)
            return {"$f" if isinstance(value, frozenset) else "$s": items}
        if isinstance(value, bytes):
            return {"$b": base64.b64encode(value).decode("ascii")}
        if isinstance(value, Opaque):
            return {"$o": value.type_name, "n": value.number}
        if isinstance(value, BaseModel):
            names = type(value).model_fields
            return {"$c": _qualname(type(value)),
                    "f": {name: self.encode(getattr(value, name)) for name in names}}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {"$c": _qualname(type(value)), "f": self._fields(value)}
        if isinstance(value, functools.partial) and _own_method(value.func):
            return {"$p": self.encode(value.func), "args": self.encode(list(value.args)),
                    "kw": self.encode(dict(value.keywords))}
        if _own_method(value):
            return {"$m": self.encode(value.__self__), "name": value.__name__}
        if _trusted(type(value)) and not callable(value) and _plain(value):
            return {"$c": _qualname(type(value)), "f": self._fields(value)}
        return self._placeholder(value)

    def _fields(self, value: Any) -> dict[str, Any]:
        if dataclasses.is_dataclass(value) and not hasattr(value, "__dict__"):
            return {f.name: self.encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        fields = {name: self.encode(item) for name, item in vars(value).items()}
        for name in _slot_names(type(value)):
            if hasattr(value, name):
                fields[name] = self.encode(getattr(value, name))
        return fields

    def _placeholder(self, value: object) -> dict[str, Any]:
        known = self._opaque.get(id(value))
        if known is None or known[0] is not value:
            known = (value, len(self._opaque) + 1)
            self._opaque[id(value)] = known
        return {"$o": type(value).__qualname__, "n": known[1]}


class Decoder:
    """Decodes trees written by :class:`Encoder` (see the module docstring for the bounds)."""

    __slots__ = ("_classes",)

    def __init__(self) -> None:
        self._classes: dict[str, type] = {}

    def decode(self, tree: Any, depth: int = 0) -> Any:
        """The value ``tree`` stands for; raises :class:`CodecError`."""
        if depth > MAX_DEPTH:
            raise CodecError(f"nesting deeper than {MAX_DEPTH}")
        if tree is None or isinstance(tree, (bool, int, float, str)):
            return tree
        if isinstance(tree, list):
            return [self.decode(item, depth + 1) for item in tree]
        if not isinstance(tree, dict) or not tree:
            raise CodecError(f"not an encoded value: {type(tree).__name__}")
        tag = next(iter(tree))
        try:
            return self._tagged(tag, tree, depth + 1)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, CodecError):
                raise
            raise CodecError(f"bad {tag!r} value: {exc}") from exc

    def _tagged(self, tag: str, tree: dict[str, Any], depth: int) -> Any:
        def items() -> list[Any]:
            return [self.decode(i, depth) for i in _list(tree[tag])]
        match tag:
            case "$t":
                return tuple(items())
            case "$d":
                return {self.decode(k, depth): self.decode(v, depth) for k, v in _pairs(tree[tag])}
            case "$od":
                return OrderedDict(
                    (self.decode(k, depth), self.decode(v, depth)) for k, v in _pairs(tree[tag])
                )
            case "$q":
                maxlen = tree.get("max")
                return deque(items(), maxlen=None if maxlen is None else int(maxlen))
            case "$s":
                return set(items())
            case "$f":
                return frozenset(items())
            case "$b":
                return base64.b64decode(str(tree[tag]), validate=True)
            case "$o":
                return Opaque(str(tree[tag]), int(tree["n"]))
            case "$e":
                cls = self._class(str(tree[tag]))
                if not issubclass(cls, enum.Enum):
                    raise CodecError(f"{tree[tag]} is not an enum")
                return cls(self.decode(tree["v"], depth))
            case "$c":
                return self._object(self._class(str(tree[tag])), tree["f"], depth)
            case "$m":
                return self._method(self.decode(tree[tag], depth), str(tree["name"]))
            case "$p":
                function = self.decode(tree[tag], depth)
                if not inspect.ismethod(function):
                    raise CodecError("a partial wraps a method of a decoded object only")
                args = self.decode(tree["args"], depth)
                keywords = self.decode(tree["kw"], depth)
                if not isinstance(args, list) or not isinstance(keywords, dict):
                    raise CodecError("a partial's args are a list and its keywords a dict")
                return functools.partial(function, *args, **keywords)
            case _:
                raise CodecError(f"unknown tag {tag!r}")

    @staticmethod
    def _method(owner: Any, name: str) -> Any:
        # NOTE: only a public method of an object the trace built, so a trace
        # cannot reach a function of its own choosing.
        if not name.isidentifier() or name.startswith("_") or not _trusted(type(owner)):
            raise CodecError(f"{name!r} is not a public method of a decoded object")
        method = getattr(owner, name, None)
        if not inspect.ismethod(method) or method.__self__ is not owner:
            raise CodecError(f"{type(owner).__qualname__}.{name} is not a method")
        return method

    def _object(self, cls: type, fields: Any, depth: int) -> Any:
        if not isinstance(fields, dict):
            raise CodecError(f"fields of {cls.__qualname__} are not an object")
        values = {str(name): self.decode(item, depth) for name, item in fields.items()}
        if issubclass(cls, BaseModel):
            unknown = set(values) - set(cls.model_fields)
            if unknown:
                raise CodecError(f"{cls.__qualname__} has no fields {sorted(unknown)}")
            return cls.model_construct(**values)
        if dataclasses.is_dataclass(cls):
            declared = {f.name for f in dataclasses.fields(cls)}
            slotted = "__slots__" in vars(cls)
            if slotted and set(values) - declared:
                extra = sorted(set(values) - declared)
                raise CodecError(f"{cls.__qualname__} has no fields {extra}")
        obj = object.__new__(cls)
        for name, item in values.items():
            # NOTE: object.__setattr__ also sets the fields of frozen dataclasses.
            object.__setattr__(obj, name, item)
        return obj

    def _class(self, name: str) -> type:
        cls = self._classes.get(name)
        if cls is not None:
            return cls
        module_name, sep, qualname = name.partition(":")
        if not sep or module_name.split(".")[0] not in _TRUSTED_PACKAGES:
            raise CodecError(f"class {name!r} is outside {', '.join(_TRUSTED_PACKAGES)}")
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise CodecError(f"cannot import {module_name!r}: {exc}") from exc
        for part in qualname.split("."):
            target = getattr(target, part, None)
        if not isinstance(target, type):
            raise CodecError(f"{name!r} is not a class")
        if issubclass(target, BaseException) or issubclass(target, type):
            raise CodecError(f"{name!r} is not a class of data")
        self._classes[name] = target
        return target


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise CodecError(f"expected a list, got {type(value).__name__}")
    return value


def _pairs(value: Any) -> list[tuple[Any, Any]]:
    pairs = []
    for pair in _list(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CodecError("a dict entry is not a [key, value] pair")
        pairs.append((pair[0], pair[1]))
    return pairs
