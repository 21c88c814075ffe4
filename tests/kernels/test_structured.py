"""Constrained decoding on tiny random-weight models: the output always follows the grammar."""

from __future__ import annotations

import json
from typing import Any, cast

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kernels import Generation, SamplingParams, render_chat, run_generation
from kernels.engine import (
    GrammarProcessor,
    GrammarViolation,
    InvalidGrammar,
    json_schema_grammar,
    make_request_processors,
    parse_tool_call,
    prepare_grammar,
    tool_call_grammar,
    tool_format,
)
from tests.kernels.test_generation import lively_llama
from tests.tool_models import tool_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

WEATHER: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer with a tool template and mlx-lm's json_tools format."""
    return tool_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny random llama (weights scaled so its output varies)."""
    return lively_llama(len(tok._tokenizer))


@pytest.fixture(scope="module")
def prompt(tok: Any) -> list[int]:
    """A chat prompt asking for a person."""
    return render_chat(tok, [{"role": "user", "content": "Describe a person as JSON."}])


def _text(model: Any, tok: Any, prompt: list[int], params: SamplingParams) -> tuple[str, str | None]:
    out = run_generation(Generation(model, tok, prompt, params))
    return "".join(s.text for s in out), out[-1].finish_reason


@pytest.mark.parametrize("seed", [None, 1, 2, 3, 4])
def test_schema_output_parses_and_validates(model: Any, tok: Any, prompt: list[int],
                                            seed: int | None) -> None:
    """Greedy and sampled generations under a JSON schema grammar stop by themselves and validate."""
    grammar = json_schema_grammar(PERSON)
    params = SamplingParams(max_tokens=200, grammar=grammar,
                            temperature=0.0 if seed is None else 1.0, seed=seed)
    text, finish = _text(model, tok, prompt, params)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


def test_unconstrained_output_is_not_json(model: Any, tok: Any, prompt: list[int]) -> None:
    """The same model and prompt without the grammar write no JSON (the grammar does the work)."""
    text, _ = _text(model, tok, prompt, SamplingParams(max_tokens=40))
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_object_grammar_gives_an_object(model: Any, tok: Any, prompt: list[int]) -> None:
    """Without a schema the grammar admits any JSON object, and nothing else."""
    grammar = json_schema_grammar(None)
    params = SamplingParams(max_tokens=400, grammar=grammar)
    text, finish = _text(model, tok, prompt, params)
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_forced_tool_call_parses_with_the_models_parser(model: Any, tok: Any) -> None:
    """A tool-call grammar makes a random model write one valid call, in the format mlx-lm parses."""
    chat = render_chat(tok, [{"role": "user", "content": "Weather in Rome?"}], tools=WEATHER)
    fmt = tool_format(tok)
    assert fmt is not None
    assert fmt.json_in_tags
    grammar = tool_call_grammar(WEATHER, start=fmt.start, end=fmt.end, name="get_weather",
                                multiple=False)
    text, finish = _text(model, tok, chat, SamplingParams(max_tokens=200, grammar=grammar))
    assert finish == "stop"
    assert text.startswith(fmt.start)
    assert text.endswith(fmt.end)
    inner = text[len(fmt.start):-len(fmt.end)]
    [call] = parse_tool_call(fmt, inner, WEATHER)
    assert call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")


def test_required_tool_call_picks_one_of_the_tools(model: Any, tok: Any) -> None:
    """Without a name the grammar allows any listed function, with that function's arguments."""
    chat = render_chat(tok, [{"role": "user", "content": "Time?"}], tools=WEATHER)
    grammar = tool_call_grammar(WEATHER, start="<tool_call>", end="</tool_call>", multiple=False)
    for seed in (1, 2, 3):
        params = SamplingParams(max_tokens=200, grammar=grammar, temperature=1.0, seed=seed)
        text, finish = _text(model, tok, chat, params)
        assert finish == "stop"
        call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        tool = next(t for t in WEATHER if t["function"]["name"] == call["name"])
        jsonschema.validate(call["arguments"], tool["function"]["parameters"])


def test_processor_runs_in_mlx_lms_own_loop(model: Any, tok: Any, prompt: list[int]) -> None:
    """The processor has mlx-lm's (history, logits) shape: mlx_lm's generate_step honours it."""
    grammar = json_schema_grammar(PERSON)
    processor = GrammarProcessor(tok, grammar)
    ids: list[int] = []
    eos = set(tok.eos_token_ids)
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=200,
                                  logits_processors=[processor]):
        if int(token) in eos:
            break
        ids.append(int(token))
    jsonschema.validate(json.loads(tok.decode(ids)), PERSON)


@pytest.mark.parametrize("schema", [{"type": 5}, {"type": "array", "uniqueItems": True},
                                    {"properties": "x"}])
def test_schemas_the_grammar_cannot_enforce_are_refused(schema: dict[str, Any]) -> None:
    """An invalid schema, or a keyword llguidance does not implement, is refused (never ignored)."""
    with pytest.raises(InvalidGrammar):
        json_schema_grammar(schema)


def test_tool_grammar_needs_the_named_function() -> None:
    """Naming a function that is not among the tools is refused."""
    with pytest.raises(InvalidGrammar, match="nope"):
        tool_call_grammar(WEATHER, start="<tool_call>", end="</tool_call>", name="nope")


def test_a_token_outside_the_grammar_is_a_violation(tok: Any) -> None:
    """A history token the mask forbade (the processor was bypassed) fails the request loudly."""
    processor = GrammarProcessor(tok, json_schema_grammar(PERSON))
    vocab = len(tok._tokenizer)
    logits = mx.zeros((1, vocab))
    masked = processor(mx.array([1, 2, 3]), logits)
    row = cast("list[float]", masked[0].tolist())
    allowed = [i for i, v in enumerate(row) if v > -1e9]
    assert [tok.decode([i]) for i in allowed] == ["{"]
    bad = int(tok.encode("x", add_special_tokens=False)[0])
    with pytest.raises(GrammarViolation):
        processor(mx.array([1, 2, 3, bad]), logits)


def test_the_forward_is_started_before_the_previous_token_is_read(
    tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the second call on, the processor hands this step's logits to ``mx.async_eval``
    before it reads the previous token on the host (the device computes the forward meanwhile)."""
    events: list[str] = []
    real_async_eval = mx.async_eval

    def recording_async_eval(*arrays: Any) -> None:
        events.append("async_eval")
        real_async_eval(*arrays)

    class _Last:
        def __init__(self, token: int) -> None:
            self._token = token

        def item(self) -> int:
            events.append("item")
            return self._token

    class _History:
        """A token history whose last token's host read is recorded."""

        def __init__(self, token: int) -> None:
            self._token = token

        def __getitem__(self, index: int) -> _Last:
            assert index == -1
            return _Last(self._token)

    # NOTE: the processor calls mlx.core's own async_eval (the module this test imports as mx).
    monkeypatch.setattr(mx, "async_eval", recording_async_eval)
    processor = GrammarProcessor(tok, json_schema_grammar(PERSON))
    logits = mx.zeros((1, len(tok._tokenizer)))
    processor(mx.array([1, 2, 3]), logits)
    assert events == []
    brace = int(tok.encode("{", add_special_tokens=False)[0])
    processor(cast("Any", _History(brace)), logits)
    assert events == ["async_eval", "item"]


def test_grammar_requests_need_the_tokenizer() -> None:
    """Processors for a constrained request cannot be built without the tokenizer."""
    with pytest.raises(InvalidGrammar):
        make_request_processors(SamplingParams(grammar=json_schema_grammar(None)))


def test_compiled_grammars_are_cached_per_tokenizer(tok: Any) -> None:
    """The second preparation of a grammar returns the cached compiled matcher."""
    grammar = json_schema_grammar(PERSON)
    vocab = len(tok._tokenizer)
    assert prepare_grammar(tok, grammar, vocab) is prepare_grammar(tok, grammar, vocab)
