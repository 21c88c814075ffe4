"""Bounds on a JSON schema before it reaches the grammar compiler.

llguidance compiles a schema by recursion: every nesting level and every
``$ref`` hop is a native stack frame, and its JSON reader stops only at 128
levels of *inline* nesting. A ``$defs`` chain of ``$ref``s is not inline,
so a chain of a few thousand definitions (about 4 KB of stack a hop) overflows an 8 MiB
stack and the process dies (SIGSEGV, nothing logged). :func:`check_schemas`
walks every schema of a request first (``response_format`` and each tool's
``parameters``), iteratively (no Python recursion, whatever the input), and
refuses one over a limit with :class:`SchemaTooComplex` naming the limit.

What is measured (:class:`SchemaLimits` has the bounds):

- ``bytes``: the schemas' size as JSON (approximate: string lengths plus a
  few bytes per value), summed over the request's schemas;
- ``json_depth``: nesting of the JSON value itself (any keyword: ``const``
  and ``default`` values count too);
- ``depth``: schema nesting along any path *with each ``$ref`` followed*
  (a hop counts as a level), the depth the compiler recurses to. A ``$ref``
  back into a definition that is still open on the path is recursion (a
  tree type), which the compiler keeps as a rule: the walk stops there;
- ``ref_hops``: ``$ref`` hops along any path (the chain length);
- ``definitions``: entries of ``$defs`` / ``definitions``, summed;
- ``nodes``: subschemas, summed; ``enum``: values of one ``enum``;
  ``enum_total``: values of every ``enum``, summed.

NOTE: the walk is the first line; it cannot see every way a compiler may
recurse (the order in which llguidance visits definitions is its own), so
the compile itself also runs in a bounded child process with a smaller
stack than the parent's compile thread (``_grammar_compiler``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ._grammar_errors import SchemaTooComplex

__all__ = [
    "SchemaLimits",
    "SchemaStats",
    "check_schemas",
]


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """The bounds :func:`check_schemas` enforces (every one a positive count)."""

    bytes: int = 512 * 1024
    json_depth: int = 100
    depth: int = 64
    ref_hops: int = 32
    definitions: int = 1024
    nodes: int = 20_000
    enum: int = 10_000
    enum_total: int = 20_000


DEFAULT_LIMITS = SchemaLimits()

_LIMIT_TEXT = {
    "bytes": "schema size (bytes of JSON, all schemas of the request)",
    "json_depth": "JSON nesting depth",
    "depth": "schema nesting depth (levels plus $ref hops along a path)",
    "ref_hops": "$ref chain length ($ref hops along a path)",
    "definitions": "number of $defs/definitions (all schemas of the request)",
    "nodes": "number of subschemas (all schemas of the request)",
    "enum": "values in one enum",
    "enum_total": "enum values (all schemas of the request)",
}


def _too_complex(limit: str, value: int, bound: int, where: str) -> SchemaTooComplex:
    return SchemaTooComplex(limit, _LIMIT_TEXT[limit], value, bound, where)


@dataclass(frozen=True, slots=True)
class SchemaStats:
    """What :func:`check_schemas` measured (the largest depths, the summed counts)."""

    bytes: int
    json_depth: int
    depth: int
    ref_hops: int
    definitions: int
    nodes: int
    enum_total: int


# Keywords whose value is one subschema / a map of subschemas / a list of subschemas.
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
        "contains", "propertyNames", "not", "if", "then", "else",
        "additionalItems", "contentSchema")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_DEFS = ("$defs", "definitions")


def _scalar_size(value: Any) -> int:
    return len(value) + 2 if isinstance(value, str) else 8


def _json_shape(value: Any, where: str, limits: SchemaLimits) -> tuple[int, int]:
    """(approximate JSON bytes, nesting depth) of ``value``; iterative; refuses early."""
    size = 0
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limits.json_depth:
            raise _too_complex("json_depth", depth, limits.json_depth, where)
        deepest = max(deepest, depth)
        if isinstance(item, Mapping):
            size += 2 + 4 * len(item) + sum(len(str(k)) for k in item)
            values: Any = item.values()
        elif isinstance(item, list | tuple):
            size += 2 + len(item)
            values = item
        else:
            size += _scalar_size(item)
            values = ()
        for v in values:
            # NOTE: scalars are sized here, only containers go on the stack.
            if isinstance(v, Mapping | list | tuple):
                stack.append((v, depth + 1))
            else:
                size += _scalar_size(v)
        if size > limits.bytes:
            raise _too_complex("bytes", size, limits.bytes, where)
    return size, deepest


def _pointer(root: Any, ref: str) -> Any:
    """The value a local ``$ref`` (``#`` or ``#/a/b``) names in ``root``, or ``None``."""
    if not ref.startswith("#"):
        return None
    node = root
    path = unquote(ref[1:])
    if not path:
        return node
    if not path.startswith("/"):
        return None
    for raw in path[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(node: Mapping[str, Any]) -> list[Any]:
    """Every subschema directly inside ``node`` (definitions included)."""
    out: list[Any] = [node[key] for key in _ONE if isinstance(node.get(key), Mapping)]
    for key in _MAP:
        sub = node.get(key)
        if isinstance(sub, Mapping):
            out.extend(v for v in sub.values() if isinstance(v, Mapping))
    for key in (*_LIST, "items"):  # NOTE: "items" as a list: draft-04 tuples
        sub = node.get(key)
        if isinstance(sub, list):
            out.extend(v for v in sub if isinstance(v, Mapping))
    deps = node.get("dependencies")
    if isinstance(deps, Mapping):
        out.extend(v for v in deps.values() if isinstance(v, Mapping))
    return out


@dataclass
class _Totals:
    bytes: int = 0
    definitions: int = 0
    nodes: int = 0
    enum_total: int = 0


@dataclass(slots=True)
class _Frame:
    node: Mapping[str, Any]
    kids: list[tuple[Any, int]]
    path_hops: int
    depth: int = 1
    hops: int = 0
    entering_hop: int = 0


def _walk(schema: Any, where: str, limits: SchemaLimits, totals: _Totals) -> tuple[int, int]:
    """(depth, ref hops) of one schema, following ``$ref``s; counts into ``totals``.

    Depth-first with a memo: the (depth, hops) below each subschema is
    computed once, so a DAG of definitions costs its size, not its number
    of paths. A ``$ref`` to a subschema still open on the path is recursion
    (a tree type): it adds no depth, the compiler keeps it as a rule
    reference. Depth and hops along the current path are checked as the
    path grows, so a long chain is refused before the walk goes further.
    """
    if not isinstance(schema, Mapping):
        return 0, 0
    memo: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()
    seen: set[int] = set()
    stack: list[_Frame] = []

    def count(node: Mapping[str, Any]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        totals.nodes += 1
        if totals.nodes > limits.nodes:
            raise _too_complex("nodes", totals.nodes, limits.nodes, where)
        enum = node.get("enum")
        if isinstance(enum, list):
            if len(enum) > limits.enum:
                raise _too_complex("enum", len(enum), limits.enum, where)
            totals.enum_total += len(enum)
            if totals.enum_total > limits.enum_total:
                raise _too_complex("enum_total", totals.enum_total, limits.enum_total, where)
        for key in _DEFS:
            defs = node.get(key)
            if isinstance(defs, Mapping):
                totals.definitions += len(defs)
                if totals.definitions > limits.definitions:
                    raise _too_complex("definitions", totals.definitions,
                                           limits.definitions, where)

    def enter(node: Mapping[str, Any], path_hops: int) -> None:
        if len(stack) + 1 > limits.depth:
            raise _too_complex("depth", len(stack) + 1, limits.depth, where)
        if path_hops > limits.ref_hops:
            raise _too_complex("ref_hops", path_hops, limits.ref_hops, where)
        count(node)
        kids: list[tuple[Any, int]] = [(c, 0) for c in _children(node)]
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _pointer(schema, ref)
            if isinstance(target, Mapping):
                kids.append((target, 1))
        open_.add(id(node))
        stack.append(_Frame(node, kids, path_hops))

    enter(schema, 0)
    result = (1, 0)
    while stack:
        frame = stack[-1]
        if frame.kids:
            child, hop = frame.kids.pop()
            if id(child) in open_:
                continue
            known = memo.get(id(child))
            if known is None:
                frame.entering_hop = hop
                enter(child, frame.path_hops + hop)
                continue
            d, h = known
            if len(stack) + d > limits.depth:
                raise _too_complex("depth", len(stack) + d, limits.depth, where)
            if frame.path_hops + hop + h > limits.ref_hops:
                raise _too_complex("ref_hops", frame.path_hops + hop + h,
                                       limits.ref_hops, where)
            frame.depth = max(frame.depth, d + 1)
            frame.hops = max(frame.hops, h + hop)
            continue
        stack.pop()
        open_.discard(id(frame.node))
        result = (frame.depth, frame.hops)
        memo[id(frame.node)] = result
        if stack:
            parent = stack[-1]
            parent.depth = max(parent.depth, result[0] + 1)
            parent.hops = max(parent.hops, result[1] + parent.entering_hop)
    return result


def check_schemas(schemas: Sequence[tuple[str, Any]],
                  limits: SchemaLimits = DEFAULT_LIMITS) -> SchemaStats:
    """Refuse (:class:`SchemaTooComplex`) a request's schemas over ``limits``.

    ``schemas`` are (where, schema) pairs; ``where`` names the field in the
    error (``response_format.json_schema.schema``, ``tools.0.function.parameters``).
    Sizes, definitions, subschemas and enum values are summed over all of
    them; depths are per schema. Pure, iterative, no compiler involved.
    """
    totals = _Totals()
    json_depth = depth = hops = 0
    for where, schema in schemas:
        size, jd = _json_shape(schema, where, limits)
        totals.bytes += size
        if totals.bytes > limits.bytes:
            raise _too_complex("bytes", totals.bytes, limits.bytes, where)
        d, h = _walk(schema, where, limits, totals)
        json_depth, depth, hops = max(json_depth, jd), max(depth, d), max(hops, h)
    return SchemaStats(bytes=totals.bytes, json_depth=json_depth, depth=depth, ref_hops=hops,
                       definitions=totals.definitions, nodes=totals.nodes,
                       enum_total=totals.enum_total)
