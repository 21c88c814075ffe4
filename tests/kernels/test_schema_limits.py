"""The schema walk: every limit is named, real schemas pass, and no input makes the walk itself fail."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel

from kernels.engine import SchemaLimits, SchemaTooComplex, check_schemas
from tools.fuzz.schema_fuzz import schemas


def ref_chain(n: int) -> dict[str, Any]:
    """``$defs`` d0 → d1 → ... → dn, each a bare ``$ref`` (the chain that crashed llguidance)."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested(n: int) -> dict[str, Any]:
    """An object nested ``n`` levels deep."""
    node: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


class Country(BaseModel):
    """A leaf model."""

    code: str


class Address(BaseModel):
    """A nested model."""

    street: str
    country: Country


class Person(BaseModel):
    """Two nested levels, an optional and a list: pydantic emits $defs + $ref."""

    name: str
    home: Address
    work: Address | None = None
    friends: list[str] = []


def _refused(schema: Any, limits: SchemaLimits | None = None) -> SchemaTooComplex:
    with pytest.raises(SchemaTooComplex) as info:
        check_schemas([("response_format.json_schema.schema", schema)], limits or SchemaLimits())
    return info.value


@pytest.mark.parametrize("n", [1500, 3000])
def test_long_ref_chains_are_refused_fast(n: int) -> None:
    """1,500 and 3,000-hop $ref chains are refused by a named limit in well under a second."""
    start = time.monotonic()
    err = _refused(ref_chain(n))
    assert time.monotonic() - start < 0.5
    assert err.limit in ("definitions", "ref_hops")
    assert err.where == "response_format.json_schema.schema"
    assert f"({err.limit})" in str(err)


def test_a_chain_within_the_definitions_limit_is_refused_by_ref_hops() -> None:
    """40 definitions fit the count limit; 40 hops along one path pass ref_hops (32)."""
    err = _refused(ref_chain(40))
    assert err.limit == "ref_hops"
    assert (err.value, err.bound) == (33, 32)


def test_deep_nesting_is_refused() -> None:
    """A 400-deep object is refused (its JSON nesting is over the limit)."""
    err = _refused(nested(400))
    assert err.limit == "json_depth"


def _three_level_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"a": {
        "type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_schema_depth_counts_ref_hops_as_levels() -> None:
    """Defs of 3 levels each, chained: depth is 3n + 2 (root, leaf); 21 defs pass 64 with 21 hops."""
    stats = check_schemas([("s", _three_level_chain(20))])
    assert (stats.depth, stats.ref_hops) == (62, 21)
    err = _refused(_three_level_chain(21))
    assert err.limit == "depth"
    assert err.value == 65


def test_enum_limits() -> None:
    """One enum of 10,001 values is over `enum`; two of 10,000 over `enum_total`; 10,000 passes."""
    assert check_schemas([("s", {"enum": list(range(10_000))})]).enum_total == 10_000
    assert _refused({"enum": list(range(10_001))}).limit == "enum"
    two = {"anyOf": [{"enum": list(range(10_000))}, {"enum": list(range(10_000, 20_001))}]}
    assert _refused(two, SchemaLimits(enum=20_000)).limit == "enum_total"


def test_sizes_and_counts_sum_over_the_request() -> None:
    """Bytes, definitions and nodes are summed over the schemas of one request."""
    one = {"$defs": {f"x{i}": {"type": "integer"} for i in range(600)}}
    check_schemas([("tools.0.function.parameters", one)])
    with pytest.raises(SchemaTooComplex) as info:
        check_schemas([("tools.0.function.parameters", one), ("tools.1.function.parameters", one)])
    assert info.value.limit == "definitions"
    assert info.value.where == "tools.1.function.parameters"
    big = {"description": "x" * 300_000}
    check_schemas([("a", big)])
    with pytest.raises(SchemaTooComplex) as info:
        check_schemas([("a", big), ("b", big)])
    assert info.value.limit == "bytes"


def test_pydantic_and_recursive_schemas_pass() -> None:
    """A pydantic nested model and a recursive tree type pass with their real depths."""
    stats = check_schemas([("p", Person.model_json_schema())])
    assert stats.ref_hops == 2  # Person → Address → Country
    assert stats.definitions == 2
    tree = {"$defs": {"T": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}}}}, "$ref": "#/$defs/T"}
    assert check_schemas([("t", tree)]).ref_hops == 1


def test_a_wide_dag_of_definitions_costs_its_size_not_its_paths() -> None:
    """Each of 30 defs refs the next one twice (2^30 paths): walked once each, in milliseconds."""
    defs: dict[str, Any] = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"},
                                                 {"$ref": f"#/$defs/d{i + 1}"}]}
                            for i in range(30)}
    defs["d30"] = {"type": "null"}
    start = time.monotonic()
    stats = check_schemas([("s", {"$defs": defs, "$ref": "#/$defs/d0"})])
    assert time.monotonic() - start < 0.5
    assert stats.ref_hops == 31


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schemas())
def test_the_walk_accepts_or_names_a_limit_for_any_input(schema: Any) -> None:
    """Generated schemas (chains, deep nesting, DAGs, random JSON): stats or a named limit, nothing else."""
    limit: str | None = None
    try:
        stats = check_schemas([("s", schema)])
    except SchemaTooComplex as exc:
        limit = exc.limit
    if limit is not None:
        assert limit in SchemaLimits.__dataclass_fields__
        return
    limits = SchemaLimits()
    assert stats.json_depth <= limits.json_depth
    assert stats.depth <= limits.depth
    assert stats.ref_hops <= limits.ref_hops
