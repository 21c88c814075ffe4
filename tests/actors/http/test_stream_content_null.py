"""A streamed answer that holds only tool calls adds up to ``content`` null in the real ``openai`` client."""

from __future__ import annotations

from typing import Any

import httpx2
import openai
import pytest

from actors.http import HttpSettings, HttpState, create_app

from .fake_engine import FakeEngine, Script

pytestmark = pytest.mark.anyio

ASK: Any = [{"role": "user", "content": "Weather in Paris and Rome?"}]
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
FORCE: Any = {"type": "function", "function": {"name": "get_weather"}}


def _call(city: str) -> tuple[str, ...]:
    # NOTE: markers cut across tokens, as real tokenizers cut them.
    return ("<tool", "_call>\n", '{"name": "get_weather", ',
            '"arguments": {"city": "' + city + '"}}', "\n</tool_", "call>")


def _client(engine: FakeEngine) -> openai.AsyncOpenAI:
    state = HttpState(clock=lambda: 1_700_000_000.0, new_id=lambda: "abc")
    app = create_app(engine, HttpSettings(), state=state)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t")
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http,
                              max_retries=0)


async def _accumulated(engine: FakeEngine, **extra: Any) -> Any:
    """The message the openai client adds up from the stream (its ChatCompletionStreamState)."""
    async with _client(engine) as client, client.chat.completions.stream(
            model="fake-model", messages=ASK, tools=[WEATHER], **extra) as stream:
        final = await stream.get_final_completion()
    return final.choices[0]


async def test_forced_call_streamed_adds_up_to_null_content() -> None:
    """tool_choice forcing a call: the role chunk carries no content, so the accumulated content is None."""
    engine = FakeEngine(scripts=[Script(tokens=_call("Paris"), eos=True)])
    choice = await _accumulated(engine, tool_choice=FORCE)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')


async def test_auto_newlines_between_and_after_calls_are_not_content() -> None:
    """tool_choice auto: the newline a model writes between and after calls sends no text delta."""
    tokens = ("\n", *_call("Paris"), "\n", " \n", *_call("Rome"), "\n")
    engine = FakeEngine(scripts=[Script(tokens=tokens, eos=True), Script(tokens=tokens, eos=True)])
    async with _client(engine) as client:
        stream = await client.chat.completions.create(
            model="fake-model", messages=ASK, tools=[WEATHER], stream=True)
        texts = [c.choices[0].delta.content async for c in stream
                 if c.choices and c.choices[0].delta.content]
        whole = await client.chat.completions.create(model="fake-model", messages=ASK,
                                                     tools=[WEATHER])
    assert texts == []
    assert whole.choices[0].message.content is None
    calls = whole.choices[0].message.tool_calls or []
    assert [c.function.arguments for c in calls if c.type == "function"] == [
        '{"city": "Paris"}', '{"city": "Rome"}']


async def test_auto_whitespace_before_text_is_kept() -> None:
    """Held whitespace goes out with the text that follows it; an answer without calls keeps its end."""
    tokens = ("Hi", " ", "\n", "there", "\n\n")
    engine = FakeEngine(scripts=[Script(tokens=tokens, eos=True),
                                 Script(tokens=("Hi ", *_call("Paris"), "\n", "ok"), eos=True)])
    first = await _accumulated(engine)
    assert first.message.content == "Hi \nthere\n\n"
    second = await _accumulated(engine)
    assert second.message.content == "Hi \nok"
    assert len(second.message.tool_calls) == 1


async def test_auto_calls_only_streamed_adds_up_to_null_content() -> None:
    """tool_choice auto: an answer of calls only adds up to content None; a text answer to its text."""
    engine = FakeEngine(scripts=[Script(tokens=_call("Paris"), eos=True),
                                 Script(tokens=("Sunny", " today"), eos=True)])
    calls = await _accumulated(engine)
    assert calls.message.content is None
    assert [c.function.name for c in calls.message.tool_calls] == ["get_weather"]
    text = await _accumulated(engine)
    assert text.message.content == "Sunny today"
