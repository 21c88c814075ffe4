"""Schemas that would crash or stall the grammar compiler get a fast 400 naming the limit, and the server serves on.

Through the HTTP app over a REAL Engine (tiny random llama whose tokenizer
has a tool template). Also: forced calls of tools whose parameters are
nested pydantic models (``$defs`` + ``$ref``) on every ``tool_choice``.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from actors.engine import Engine
from actors.http import HttpSettings, create_app
from kernels.engine import GrammarCompiler
from kernels.engine import _grammar_compiler as compiler_module
from tests.kernels.test_generation import lively_llama
from tests.kernels.test_schema_limits import nested, ref_chain
from tests.tool_models import tool_tokenizer

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Answer in JSON."}]
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}
_UNIQUE = itertools.count()


def _format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The app over an Engine on a tiny tool-capable llama."""
    tok = tool_tokenizer()
    model = lively_llama(len(tok._tokenizer))
    async with Engine.from_loaded(model, tok, model_id="tiny") as engine:
        app = create_app(engine, HttpSettings())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            yield c


async def _serves(client: httpx.AsyncClient) -> None:
    """The next structured request is answered (200, valid JSON under SMALL)."""
    # NOTE: a fresh schema each time, so the compiler child really runs.
    schema = {**SMALL, "title": f"t{next(_UNIQUE)}"}
    r = await client.post(CHAT, json={"messages": ASK, "max_tokens": 40,
                                      "response_format": _format(schema)})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SMALL)


@pytest.mark.parametrize(("schema", "limits"), [
    (ref_chain(1500), ("(definitions)", "(ref_hops)")),
    (ref_chain(3000), ("(definitions)", "(ref_hops)")),
    (nested(60), ("(json_depth)",)),
], ids=["ref-chain-1500", "ref-chain-3000", "nesting-60"])
async def test_compiler_crashers_get_a_fast_400_naming_the_limit(
        client: httpx.AsyncClient, schema: dict[str, Any], limits: tuple[str, ...]) -> None:
    """$ref chains that crashed llguidance 1.9.1, deep nesting: 400 schema_too_complex within 1 s; then 200s."""
    start = time.monotonic()
    r = await client.post(CHAT, json={"messages": ASK, "response_format": _format(schema)})
    elapsed = time.monotonic() - start
    assert r.status_code == 400, r.text
    assert elapsed < 1.0
    error = r.json()["error"]
    assert error["code"] == "schema_too_complex"
    assert error["param"] == "response_format.json_schema.schema"
    assert any(name in error["message"] for name in limits), error["message"]
    await _serves(client)


async def test_a_400_deep_nesting_is_refused_by_the_body_parser(client: httpx.AsyncClient) -> None:
    """400 levels (800 JSON levels) pass no parser: 400 naming the nesting limit within 1 s; then 200s."""
    start = time.monotonic()
    r = await client.post(CHAT, json={"messages": ASK, "response_format": _format(nested(400))})
    assert time.monotonic() - start < 1.0
    assert r.status_code == 400, r.text
    assert "nests too deeply" in r.json()["error"]["message"]
    await _serves(client)


async def test_a_10000_value_enum_is_answered_within_5_s(client: httpx.AsyncClient) -> None:
    """A 10,000-value enum: 200 (its limit is 10,000) with one of the values, within 5 s; then the server serves."""
    values = [f"value-{i}" for i in range(10_000)]
    start = time.monotonic()
    r = await client.post(CHAT, json={"messages": ASK, "max_tokens": 16,
                                      "response_format": _format({"enum": values})})
    assert time.monotonic() - start < 5.0
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert json.loads(choice["message"]["content"]) in values
    over = await client.post(CHAT, json={"messages": ASK, "response_format": _format(
        {"enum": [*values, "one-more"]})})
    assert over.status_code == 400
    assert "(enum)" in over.json()["error"]["message"]
    await _serves(client)


async def test_tool_parameters_over_a_limit_name_the_tool(client: httpx.AsyncClient) -> None:
    """A forced tool whose parameters are a 1,500-hop chain: 400 naming tools.0.function.parameters."""
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(1500)}}
    r = await client.post(CHAT, json={"messages": ASK, "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "schema_too_complex"
    assert r.json()["error"]["param"] == "tools.0.function.parameters"
    await _serves(client)


@pytest.fixture
def small_stack_compiler() -> Iterator[GrammarCompiler]:
    """The process's compiler replaced by one whose child has a 96 KiB stack (restored after)."""
    saved = compiler_module._DEFAULT
    pool = GrammarCompiler(workers=1, stack_bytes=96 << 10)
    compiler_module._DEFAULT = pool
    yield pool
    compiler_module._DEFAULT = saved
    pool.close()


async def test_a_compiler_child_killed_by_a_signal_is_a_400_and_the_server_serves(
        client: httpx.AsyncClient, small_stack_compiler: GrammarCompiler) -> None:
    """A 31-hop chain (within every limit) overflows a 96 KiB child stack: SIGSEGV there, 400 here, then 200s."""
    schema = {**ref_chain(31), "title": f"t{next(_UNIQUE)}"}
    r = await client.post(CHAT, json={"messages": ASK, "response_format": _format(schema)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "schema_too_complex"
    assert "signal 11" in error["message"]
    assert error["param"] == "response_format.json_schema.schema"
    assert small_stack_compiler.crashes == 1
    # NOTE: the same pool replaced its child: a small schema compiles there.
    await _serves(client)
    assert small_stack_compiler.crashes == 1


class Country(BaseModel):
    """A leaf model (short values, so a random model finishes the call in a few tokens)."""

    code: Literal["UK", "FR"]


class Address(BaseModel):
    """A nested model."""

    street: str = Field(max_length=6)
    country: Country


class Person(BaseModel):
    """Nested twice, with an optional: pydantic writes $defs and $ref."""

    name: str = Field(max_length=6)
    home: Address
    work: Address | None = None


def _person_tool(strict: bool = False) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": "save_person", "description": "Store a person.",
                          "parameters": Person.model_json_schema()}
    if strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


FORCINGS = pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "save_person"}}],
    ids=["required", "named"])
OTHER = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}


def _forced(choice: Any, strict: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Save Ada."}],
            "tools": [OTHER, _person_tool(strict)], "tool_choice": choice,
            "parallel_tool_calls": False, "max_tokens": 300, "seed": 3, "temperature": 0.7}


@FORCINGS
async def test_forced_strict_calls_with_nested_pydantic_parameters(
        client: httpx.AsyncClient, choice: Any) -> None:
    """strict $defs/$ref parameters (pydantic) forced: one call, content null, arguments load into the model."""
    r = await client.post(CHAT, json=_forced(choice, strict=True))
    assert r.status_code == 200, r.text
    choice_body = r.json()["choices"][0]
    assert choice_body["finish_reason"] == "tool_calls"
    message = choice_body["message"]
    assert message["content"] is None
    [call] = message["tool_calls"]
    if isinstance(choice, dict):
        assert call["function"]["name"] == "save_person"
    if call["function"]["name"] == "save_person":
        person = Person.model_validate_json(call["function"]["arguments"])
        assert person.home.country.code in ("UK", "FR")
        args = json.loads(call["function"]["arguments"])
        assert set(args) <= set(Person.model_fields)
        assert set(args["home"]) <= set(Address.model_fields)


@FORCINGS
async def test_loose_nested_parameters_compile_on_every_tool_choice(
        client: httpx.AsyncClient, choice: Any) -> None:
    """Without strict the same $defs/$ref schema is forced too (it was 400 "Pointer '/$defs/...' does not exist")."""
    r = await client.post(CHAT, json={**_forced(choice, strict=False), "max_tokens": 60})
    assert r.status_code == 200, r.text
    # NOTE: loose objects take any extra key, so a random model's call is
    # cut by max_tokens (returned as text); its start shows the grammar ran.
    content = r.json()["choices"][0]["message"]["content"]
    name = "save_person" if isinstance(choice, dict) else ""
    assert content.startswith(f'<tool_call>\n{{"name": "{name}')
    if content.startswith('<tool_call>\n{"name": "save_person"'):
        assert content.startswith('<tool_call>\n{"name": "save_person", "arguments": {"')
