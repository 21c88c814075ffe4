"""End to end on the default model with the official ``openai`` client: logprobs and structured output."""

from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema

from .server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.model]

ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Give me the name and age of a famous scientist."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(default_model_server: ServerProcess) -> ServerProcess:
    """kvtier serve on the default model (the session's shared one)."""
    return default_model_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The official client, retries off."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_greedy_logprobs_are_consistent(client: openai.OpenAI) -> None:
    """Each chosen token's logprob is the max of its top_logprobs at temperature 0; the tokens spell the text."""
    r = client.chat.completions.create(model="default", messages=ASK, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=5)
    choice = r.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 12
    assert b"".join(bytes(e.bytes or []) for e in entries).decode() == choice.message.content
    for e in entries:
        assert len(e.top_logprobs) == 5
        assert e.logprob == max(t.logprob for t in e.top_logprobs)
        assert e.top_logprobs[0].token == e.token
        assert math.fsum(math.exp(t.logprob) for t in e.top_logprobs) <= 1.0 + 1e-4


def test_streamed_logprobs_equal_the_non_streamed(client: openai.OpenAI) -> None:
    """The streamed chunks' logprobs, joined, are the non-streamed list."""
    whole = client.chat.completions.create(model="default", messages=ASK, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=2)
    stream = client.chat.completions.create(model="default", messages=ASK, max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True)
    joined = [(e.token, round(e.logprob, 4)) for c in stream if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content or []]
    assert whole.choices[0].logprobs is not None
    assert joined == [(e.token, round(e.logprob, 4)) for e in whole.choices[0].logprobs.content or []]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    """/v1/completions with logprobs=3: the legacy lists, one entry per token, greedy first."""
    r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=5,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert lp.tokens is not None
    assert lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob == max(top.values())
        assert top[token] == logprob


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer_validates(client: openai.OpenAI, stream: bool) -> None:
    """response_format json_schema: the answer parses and validates, streamed or not."""
    fmt: ResponseFormatJSONSchema = {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    if stream:
        chunks = client.chat.completions.create(model="default", messages=ASK, max_tokens=80,
                                                temperature=0, response_format=fmt, stream=True)
        parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason)
                 for c in chunks if c.choices]
        text = "".join(p for p, _ in parts)
        finish = parts[-1][1]
    else:
        r = client.chat.completions.create(model="default", messages=ASK, max_tokens=80,
                                           temperature=0, response_format=fmt)
        text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_answer_parses(client: openai.OpenAI) -> None:
    """response_format json_object: the answer is one JSON object."""
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": (
            'Return a JSON object with one key, "answer", holding the capital of France.')}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_tools_on_the_default_model_are_refused(client: openai.OpenAI) -> None:
    """SmolLM2's template has no tool-call format: tools are a 400 naming 'tools'."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=ASK, tools=[{
            "type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert "tools" in str(err.value)


def test_every_sampled_choice_follows_the_schema(client: openai.OpenAI) -> None:
    """n=3 sampled with json_schema: every choice is its own constrained answer and validates."""
    fmt: ResponseFormatJSONSchema = {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="default", messages=ASK, max_tokens=80, n=3,
                                       temperature=0.9, seed=3, response_format=fmt)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_n_of_zero_is_refused(client: openai.OpenAI) -> None:
    """n=0 is a clear 400 naming n."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=ASK, n=0)
    assert "'n'" in str(err.value)
