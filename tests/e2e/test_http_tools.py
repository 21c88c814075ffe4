"""End to end: a tool-calling round trip with the official ``openai`` client against a real ``kvtier serve``.

The default model's template has no tool-call format, so the server runs a
tiny random-weight model directory made here, whose Hermes-style template
renders tools (mlx-lm infers its ``json_tools`` parser). Random weights do
not decide to call a tool: the first turn names the function in
``tool_choice``, which kvtier enforces by constrained decoding; the call is
then read back by mlx-lm's parser like any model's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.tool_models import tool_model_dir

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e]

TOOLS: list[ChatCompletionToolParam] = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}]
ASK: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Paris?"}]
FORCE: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """kvtier serve on the tiny tool-capable model (prompt cache on)."""
    model = tool_model_dir(tmp_path_factory.mktemp("tool-model"))
    srv = ServerProcess(tmp_path_factory.mktemp("serve-tools"), "--model", str(model),
                        "--max-tokens", "16", "--prompt-cache", "0.1")
    yield srv
    assert srv.stop() == 0, srv.logs()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The official client, retries off."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _finish_round_trip(client: openai.OpenAI, call_id: str, name: str, arguments: str,
                       first_prompt: int) -> None:
    """Send the tool result back; the model answers in text, reusing the cached turn."""
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"celsius": 18})},
    ]
    final = client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                           max_tokens=6, temperature=0)
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)
    assert final.usage is not None
    assert final.usage.prompt_tokens > first_prompt
    details = final.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens is not None
    # NOTE: the tool-call turn fed the prompt cache like any other turn.
    assert details.cached_tokens >= first_prompt - 1


def test_tool_round_trip(client: openai.OpenAI) -> None:
    """Call → tool result → final answer, non-streamed."""
    first = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                           tool_choice=FORCE, max_tokens=120)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert first.usage is not None
    _finish_round_trip(client, call.id, call.function.name, call.function.arguments,
                       first.usage.prompt_tokens)


def test_tool_round_trip_streamed(client: openai.OpenAI) -> None:
    """The same round trip with stream=True: the call arrives as delta.tool_calls, then the answer streams."""
    stream = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                            tool_choice=FORCE, max_tokens=120, stream=True,
                                            stream_options={"include_usage": True})
    calls: dict[int, dict[str, str]] = {}
    finish = None
    prompt_tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            if tc.function is not None:
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0]
    call = calls[0]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    text = client.chat.completions.create(
        model="default", messages=[*ASK, {"role": "assistant", "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["id"], "content": "18 C"}],
        tools=TOOLS, max_tokens=6, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in text if c.choices]
    assert isinstance("".join(pieces), str)
    _finish_round_trip(client, call["id"], call["name"], call["arguments"], prompt_tokens)


def test_required_without_a_forceable_format_is_a_clear_400(client: openai.OpenAI) -> None:
    """A bad tool request is the client's BadRequestError naming the parameter."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in str(err.value)
