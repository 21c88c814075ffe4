"""openai-agents and pydantic-ai drive a forced tool call with a nested pydantic argument against ``kvtier serve``.

The server runs the tiny tool-capable model of ``test_http_tools`` (a
Hermes-style template over random weights): random weights never choose
to call a tool, so each agent forces the call (``tool_choice``), which
kvtier enforces by constrained decoding over the tool's schema — pydantic's
schema for a model with a nested model (``$defs``/``$ref``, ``strict``).
The nested fields are enums and booleans, so a forced call is short (about
130 tokens of the test tokenizer, nearly one a character).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx2
import openai
import pytest
from pydantic import BaseModel

from tests.tool_models import tool_model_dir

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Place(BaseModel):
    """Where to look."""

    city: Literal["Paris", "Rome"]
    coastal: bool


class WeatherQuery(BaseModel):
    """A weather question about one place."""

    place: Place
    metric: bool


def _recording_client(url: str, sent: list[dict[str, Any]]) -> openai.AsyncOpenAI:
    """The official async client; each request body it sends is appended to ``sent``."""

    async def record(request: httpx2.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx2.AsyncClient(event_hooks={"request": [record]}, timeout=120)
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                              http_client=http)


def _nested(tool: dict[str, Any]) -> bool:
    """The tool's parameters refer into their own $defs (pydantic's nested-model shape)."""
    text = json.dumps(tool["function"]["parameters"])
    return "$defs" in text and "$ref" in text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """kvtier serve on the tiny tool-capable model."""
    model = tool_model_dir(tmp_path_factory.mktemp("tool-model"))
    srv = ServerProcess(tmp_path_factory.mktemp("serve-agents"), "--model", str(model),
                        "--max-tokens", "400")
    yield srv
    assert srv.stop() == 0, srv.logs()


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_openai_agents_forced_nested_tool_completes_the_loop(server: ServerProcess) -> None:
    """openai-agents: the forced call reaches the tool as a validated WeatherQuery; the loop ends in text."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[WeatherQuery] = []

    @function_tool  # type: ignore[untyped-decorator,unused-ignore]
    def get_weather(query: WeatherQuery) -> str:
        """The weather for a query."""
        seen.append(query)
        return f"18 C in {query.place.city}"

    sent: list[dict[str, Any]] = []
    async with _recording_client(server.url, sent) as client:
        agent = Agent(
            name="weather", instructions="Answer weather questions with the tool.",
            tools=[get_weather],
            model=OpenAIChatCompletionsModel(model="default", openai_client=client),
            model_settings=ModelSettings(tool_choice="get_weather", max_tokens=400,
                                         temperature=0.0))
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(seen) == 1, repr(result.final_output)[-300:]
    assert seen[0].place.city in ("Paris", "Rome")
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    assert sent[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert _nested(sent[0]["tools"][0])
    assert sent[0]["tools"][0]["function"]["strict"] is True


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_pydantic_ai_forced_nested_output_tool_completes(server: ServerProcess) -> None:
    """pydantic-ai: a nested model as output is a forced tool call ('required'); the run returns it validated."""
    from pydantic_ai import Agent, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    sent: list[dict[str, Any]] = []
    async with _recording_client(server.url, sent) as client:
        model = OpenAIChatModel("default", provider=OpenAIProvider(openai_client=client))
        agent = Agent(model, output_type=ToolOutput(WeatherQuery, name="weather_query"),
                      instructions="Turn the question into a weather query.")
        result = await agent.run("Is it warm in Rome?",
                                 model_settings={"max_tokens": 400, "temperature": 0.0})
    assert isinstance(result.output, WeatherQuery)
    assert result.output.place.city in ("Paris", "Rome")
    calls = [p for m in result.all_messages() for p in getattr(m, "parts", ())
             if getattr(p, "part_kind", "") == "tool-call"]
    assert [c.tool_name for c in calls] == ["weather_query"]
    assert [body["tool_choice"] for body in sent] == ["required"]
    assert _nested(sent[0]["tools"][0])
