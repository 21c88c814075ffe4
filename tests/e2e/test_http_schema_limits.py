"""End to end: schemas that crashed the server (llguidance stack overflow) are 400s, and the server serves on."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.kernels.test_schema_limits import nested, ref_chain

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.model]

ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say yes or no in JSON."}]
SMALL = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"],
         "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_model_server: ServerProcess) -> ServerProcess:
    """kvtier serve on the default model (the session's shared one)."""
    return default_model_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The official client, retries off."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, schema: dict[str, Any]) -> Any:
    return client.chat.completions.create(
        model="default", messages=ASK, max_tokens=12, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


@pytest.mark.parametrize("schema", [ref_chain(1500), ref_chain(3000), nested(400)],
                         ids=["ref-chain-1500", "ref-chain-3000", "nesting-400"])
def test_a_crashing_schema_is_a_400_and_the_server_lives(
        server: ServerProcess, client: openai.OpenAI, schema: dict[str, Any]) -> None:
    """Each schema that killed kvtier serve (SIGSEGV) is a 400 within 1 s; the next request is answered."""
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, schema)
    assert time.monotonic() - start < 1.0
    assert info.value.status_code == 400
    assert server.proc.poll() is None, server.logs()
    r = _ask(client, SMALL)
    assert r.choices[0].message.content is not None
    assert r.choices[0].message.content.startswith('{"yes": ')
