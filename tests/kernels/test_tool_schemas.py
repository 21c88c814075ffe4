"""Forced tool calls with nested (pydantic) parameter schemas: $defs resolve, strict refuses extras, limits apply."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from kernels.engine import (
    InvalidGrammar,
    SchemaTooComplex,
    prepare_grammar,
    strict_schema,
    tool_call_grammar,
)
from tests.kernels.test_schema_limits import Person, ref_chain
from tests.tool_models import tool_tokenizer

START, END = "<tool_call>", "</tool_call>"


class Point(BaseModel):
    """A second nested model, so two tools each carry their own $defs."""

    x: int
    y: int


class Segment(BaseModel):
    """Refs Point twice."""

    a: Point
    b: Point


def _tools(strict: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, model in (("save_person", Person), ("draw", Segment)):
        fn: dict[str, Any] = {"name": name, "parameters": model.model_json_schema()}
        if strict:
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer with a tool template."""
    return tool_tokenizer()


def _accepts(tok: Any, grammar: str, text: str) -> bool:
    """True when the grammar takes ``text`` whole (token by token, then accepting)."""
    matcher = prepare_grammar(tok, grammar, len(tok._tokenizer)).deep_copy()
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(int(token)):
            return False
    return bool(matcher.is_accepting())


def _call(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"{START}\n{body}\n{END}"


PERSON_ARGS = {"name": "Ada", "home": {"street": "Main", "country": {"code": "UK"}},
               "work": None, "friends": ["Bob"]}
SEGMENT_ARGS = {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}}


@pytest.mark.parametrize("name", [None, "save_person", "draw"])
def test_nested_pydantic_parameters_compile_on_every_tool_choice(tok: Any, name: str | None) -> None:
    """required (None) and each named function: $refs into each tool's own $defs resolve."""
    grammar = tool_call_grammar(_tools(), start=START, end=END, name=name, multiple=False)
    if name in (None, "save_person"):
        assert _accepts(tok, grammar, _call("save_person", PERSON_ARGS))
    if name in (None, "draw"):
        assert _accepts(tok, grammar, _call("draw", SEGMENT_ARGS))
    if name == "draw":
        assert not _accepts(tok, grammar, _call("save_person", PERSON_ARGS))


def test_the_nested_model_is_enforced(tok: Any) -> None:
    """A call whose nested object misses a required field (country.code) is outside the grammar."""
    grammar = tool_call_grammar(_tools(), start=START, end=END, name="save_person")
    bad = {**PERSON_ARGS, "home": {"street": "Main", "country": {}}}
    assert not _accepts(tok, grammar, _call("save_person", bad))
    assert not _accepts(tok, grammar, _call("draw", {"a": {"x": 1, "y": 2}, "b": {"x": "3", "y": 4}}))


def test_several_calls_follow_each_other_with_no_text_between(tok: Any) -> None:
    """Multiple calls: one right after another; text between them (a newline) is outside the grammar."""
    grammar = tool_call_grammar(_tools(), start=START, end=END)
    first, second = _call("draw", SEGMENT_ARGS), _call("save_person", PERSON_ARGS)
    assert _accepts(tok, grammar, first + second)
    assert not _accepts(tok, grammar, first + "\n" + second)
    assert not _accepts(tok, grammar, "")
    single = tool_call_grammar(_tools(), start=START, end=END, multiple=False)
    assert not _accepts(tok, single, first + second)


def test_strict_refuses_undeclared_properties(tok: Any) -> None:
    """strict: true → an extra key (top level or nested) is outside the grammar; without strict it is allowed."""
    extra_top = {**SEGMENT_ARGS, "colour": "red"}
    extra_nested = {"a": {"x": 1, "y": 2, "z": 0}, "b": {"x": 3, "y": 4}}
    loose = tool_call_grammar(_tools(), start=START, end=END, name="draw")
    strict = tool_call_grammar(_tools(strict=True), start=START, end=END, name="draw")
    for args in (extra_top, extra_nested):
        assert _accepts(tok, loose, _call("draw", args))
        assert not _accepts(tok, strict, _call("draw", args))
    assert _accepts(tok, strict, _call("draw", SEGMENT_ARGS))


def test_strict_keeps_what_the_client_wrote() -> None:
    """An explicit additionalProperties stays; every other object (in $defs too) gets false."""
    schema = {"type": "object", "properties": {"m": {"type": "object", "additionalProperties": True}},
              "$defs": {"D": {"properties": {"q": {"type": "integer"}}}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["m"]["additionalProperties"] is True
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # NOTE: the client's schema is not changed


def test_tool_parameters_go_through_the_limits() -> None:
    """A 1,500-hop chain as a tool's parameters is refused by a named limit, naming the tool's field."""
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "bad", "parameters": ref_chain(1500)}}]
    with pytest.raises(SchemaTooComplex) as info:
        tool_call_grammar(tools, start=START, end=END)
    assert info.value.where == "tools.1.function.parameters"
    with pytest.raises(InvalidGrammar, match="Pointer"):
        tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}],
            start=START, end=END)
