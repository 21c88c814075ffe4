"""Fuzz the structured-output front: the schema walk, then the child-process compile.

Every generated JSON schema goes through ``kernels.engine.json_schema_grammar``
(``check_schemas``'s named limits, then llguidance in a compiler child), and
half of them also through ``tool_call_grammar`` as a tool's ``parameters``
(``strict`` or not). Allowed outcomes: a grammar, ``SchemaTooComplex``
(a named limit), ``InvalidGrammar`` (llguidance refused the schema). A
crash is anything else: another exception, this process dying, or a
compiler child dying (``GrammarTooComplex``: contained, but the walk should
have refused the schema first), counted separately and printed.

Schemas come from a Hypothesis strategy built for the compiler's weak
spots: ``$defs`` graphs with ``$ref`` chains, cycles and DAGs, deep inline
nesting, big enums, combinators, patterns, numeric and length bounds,
``const``/``default`` payloads, and a share of random JSON.

    .venv/bin/python tools/fuzz/schema_fuzz.py --engine hypothesis --cases 100000
    .venv/bin/python tools/fuzz/schema_fuzz.py --engine atheris -atheris_runs=50000

``--engine atheris`` (``pip install -e '.[fuzz]'``) feeds atheris's bytes to
the same strategy (``hypothesis``' ``fuzz_one_input``), so coverage of the
walk guides the search. The last line says how many cases ran, how many
compiled, how many were refused by a limit or by llguidance, and the
crashes (0 expected).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.engine import (
    GrammarTooComplex,
    InvalidGrammar,
    SchemaTooComplex,
    json_schema_grammar,
    tool_call_grammar,
)

__all__ = ["run_case", "schemas"]

_CHUNK = 2000

_NAMES = st.sampled_from(["a", "b", "c", "id", "name", "x-y", "n~1", "p/q", "é"])
_DEF_NAMES = st.sampled_from([f"d{i}" for i in range(12)])
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20)
_PATTERNS = st.sampled_from(["^a+$", "[a-z]{1,8}", "(a|b)*c", "\\d{3}-\\d{4}", "(x{1,50}){1,50}",
                             "^((a|b|c)*d){20}$", "[", ".*", "a{1000000}", "(?i)ab"])
_FORMATS = st.sampled_from(["date-time", "date", "time", "email", "uri", "uuid", "ipv4", "nope"])


def _leaf() -> st.SearchStrategy[Any]:
    bound = st.integers(-10**12, 10**12)
    size = st.integers(0, 10**7)
    return st.one_of(
        st.builds(lambda: {"type": "string"}),
        st.fixed_dictionaries({"type": st.just("string")}, optional={
            "minLength": size, "maxLength": size, "pattern": _PATTERNS, "format": _FORMATS}),
        st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
            "minimum": bound, "maximum": bound, "exclusiveMinimum": bound,
            "multipleOf": st.integers(1, 1000)}),
        st.builds(lambda: {"type": "boolean"}),
        st.builds(lambda: {"type": "null"}),
        st.builds(lambda vs: {"enum": vs}, st.lists(_SCALARS, min_size=1, max_size=30)),
        st.builds(lambda n: {"enum": [f"v{i}" for i in range(n)]}, st.integers(1, 12_000)),
        st.builds(lambda v: {"const": v}, _JSON),
        st.builds(lambda d: {"$ref": f"#/$defs/{d}"}, _DEF_NAMES),
        st.builds(lambda: {"$ref": "#"}),
        st.builds(lambda p: {"$ref": p}, st.sampled_from(
            ["#/$defs/missing", "#/properties/a", "http://x/y.json", "#/definitions/d0", "#/%24defs/d1"])),
        _JSON,
    )


def _extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda props, req, extra: {
            "type": "object", "properties": props, "required": [k for k in props if req],
            **({"additionalProperties": extra} if extra is not None else {})},
            st.dictionaries(_NAMES, inner, max_size=5), st.booleans(),
            st.one_of(st.none(), st.booleans(), inner)),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={
            "minItems": st.integers(0, 10**6), "maxItems": st.integers(0, 10**9),
            "uniqueItems": st.booleans()}),
        st.builds(lambda xs: {"prefixItems": xs}, st.lists(inner, max_size=4)),
        st.builds(lambda k, xs: {k: xs}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                  st.lists(inner, min_size=1, max_size=4)),
        st.builds(lambda s: {"not": s}, inner),
        st.builds(lambda c, t, e: {"if": c, "then": t, "else": e}, inner, inner, inner),
    )


def _nested(depth: int, kind: str) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        if kind == "object":
            node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
        elif kind == "array":
            node = {"type": "array", "items": node}
        else:
            node = {"anyOf": [node, {"type": "integer"}]}
    return node


def _chain(length: int, via: str) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    for i in range(length):
        nxt = {"$ref": f"#/{via}/c{i + 1}"}
        defs[f"c{i}"] = nxt if i % 3 else {"type": "object", "properties": {"n": nxt}}
    defs[f"c{length}"] = {"type": "integer"}
    return {via: defs, "$ref": f"#/{via}/c0"}


# NOTE: built once: a strategy made inside the composite is validated again on every draw.
_BODY = st.recursive(_leaf(), _extend, max_leaves=25)
_DEF = st.recursive(_leaf(), _extend, max_leaves=8)
_DEFS = st.dictionaries(_DEF_NAMES, _DEF, max_size=12)


@st.composite
def schemas(draw: st.DrawFn) -> Any:
    """A JSON schema aimed at the compiler's weak spots (or, sometimes, any JSON value)."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(_JSON)
    if kind == 1:
        return _nested(draw(st.integers(1, 200)), draw(st.sampled_from(["object", "array", "anyOf"])))
    if kind == 2:
        return _chain(draw(st.integers(1, 3000)), draw(st.sampled_from(["$defs", "definitions"])))
    body = draw(_BODY)
    if not isinstance(body, dict):
        return body
    if draw(st.booleans()):
        defs = draw(_DEFS)
        body = {**body, draw(st.sampled_from(["$defs", "definitions"])): defs}
    return body


def run_case(schema: Any, tool: bool, strict: bool, outcomes: Counter[str]) -> None:
    """One case: the walk and the child compile; counts the outcome, raises on a crash."""
    try:
        if tool:
            fn: dict[str, Any] = {"name": "f", "parameters": schema}
            if strict:
                fn["strict"] = True
            tool_call_grammar([{"type": "function", "function": fn}],
                              start="<tool_call>", end="</tool_call>")
        else:
            if not isinstance(schema, dict):
                outcomes["not an object"] += 1
                return
            json_schema_grammar(schema)
        outcomes["compiled"] += 1
    except SchemaTooComplex as exc:
        outcomes[f"limit {exc.limit}"] += 1
    except GrammarTooComplex:
        outcomes["CHILD CRASH"] += 1
        raise
    except InvalidGrammar:
        outcomes["refused by llguidance"] += 1


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; exit 1 on the first crash."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["hypothesis", "atheris"], default="hypothesis")
    parser.add_argument("--cases", type=int, default=10_000, help="hypothesis examples")
    parser.add_argument("--seed", type=int, default=0, help="first chunk's Hypothesis seed")
    args, rest = parser.parse_known_args(argv)
    outcomes: Counter[str] = Counter()
    start = time.monotonic()

    def make_target(examples: int, chunk_seed: int) -> Any:
        @seed(chunk_seed)
        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(schemas(), st.booleans(), st.booleans())
        def target(schema: Any, tool: bool, strict: bool) -> None:
            run_case(schema, tool, strict, outcomes)
            ran = sum(outcomes.values())
            if ran % 5000 == 0:
                print(f"... {ran} cases, {time.monotonic() - start:.0f} s, crashes "
                      f"{outcomes['CHILD CRASH']}", flush=True)

        return target

    try:
        if args.engine == "atheris":
            import atheris  # type: ignore[import-untyped,unused-ignore]

            from kernels.engine import _schema_limits, _schema_rewrite

            # NOTE: coverage feedback from the walk and the strict rewrite (the
            # Python this fuzzer aims at); llguidance runs in the child.
            for module in (_schema_limits, _schema_rewrite):
                for value in vars(module).values():
                    if callable(value) and getattr(value, "__module__", "") == module.__name__ \
                            and hasattr(value, "__code__"):
                        atheris.instrument_func(value)
            fuzz_one = make_target(1, args.seed).hypothesis.fuzz_one_input
            atheris.Setup([sys.argv[0], *rest], fuzz_one)
            atheris.Fuzz()
        else:
            # NOTE: runs of CHUNK examples, each from its own seed: one long
            # Hypothesis run keeps every example's choices (gigabytes by 100k).
            done = 0
            while done < args.cases:
                examples = min(_CHUNK, args.cases - done)
                make_target(examples, args.seed + done)()
                done += examples
    finally:
        ran = sum(outcomes.values())
        crashes = outcomes["CHILD CRASH"]
        print(f"cases {ran} in {time.monotonic() - start:.0f} s; "
              + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
              + f"; crashes {crashes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
