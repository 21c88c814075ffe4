"""Options the serial lane served first, with the batch lane on: ``Engine(max_batch=4)`` on a
tiny fp32 Llama.

A request with a grammar (constrained decoding) and a ``top_logprobs`` request join the
running plain requests as batch rows; every answer equals its serial-only run; a grammar
that fails in a row fails that row alone.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import jsonschema
import pytest

from actors.engine import DoneEvent, Engine, GenerationFailed, GenerationParams, TokenEvent
from kernels import render_chat
from kernels.engine import json_schema_grammar
from tests.kernels.test_generation import lively_llama
from tests.tool_models import tool_tokenizer

pytestmark = pytest.mark.anyio

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "integer"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
PLAIN = GenerationParams(max_tokens=160)
TOP = GenerationParams(max_tokens=12, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer with a chat template (llguidance can compile grammars for it)."""
    return tool_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny fp32 Llama whose greedy output varies."""
    return lively_llama(len(tok._tokenizer))


def _engine(model: Any, tok: Any, max_batch: int) -> Engine:
    return Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0,
                              max_batch=max_batch)


def _prompt(tok: Any, text: str) -> list[int]:
    return list(render_chat(tok, [{"role": "user", "content": text}]))


async def _run(
    engine: Engine, prompt: list[int], params: GenerationParams
) -> tuple[list[TokenEvent], DoneEvent]:
    events: list[TokenEvent] = []
    async with engine.generate(prompt, params) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                events.append(event)
            else:
                return events, event
    raise AssertionError("the stream ended without a DoneEvent")


def _answers(events: list[TokenEvent]) -> tuple[list[int], list[Any]]:
    return [e.token_id for e in events], [(e.logprob, e.top_logprobs) for e in events]


async def test_grammar_and_top_logprobs_requests_join_running_batch_rows(
    model: Any, tok: Any
) -> None:
    """With max_batch=4, a grammar request joins three running plain batch rows as a row (none
    refused by the batch lane), then a top_logprobs request; each gives its serial-only answer,
    the grammar one the same tokens (valid JSON of the schema), the top_logprobs one the same
    alternatives (values within float32 rounding)."""
    grammar = GenerationParams(max_tokens=60, grammar=json_schema_grammar(SCHEMA))
    structured = _prompt(tok, "Weather as JSON, please.")
    ranked = _prompt(tok, "Rank your next words.")
    plains = [_prompt(tok, f"Plain request number {i}, tell me a story.") for i in range(3)]
    async with _engine(model, tok, 1) as serial:
        want_json, _ = await _run(serial, structured, grammar)
        want_top, _ = await _run(serial, ranked, TOP)
        want_plain = [(await _run(serial, p, PLAIN))[0] for p in plains]

    async with _engine(model, tok, 4) as engine:
        rows_joined = anyio.Event()
        plain_out: list[Any] = [None] * len(plains)
        first_tokens = [anyio.Event() for _ in plains]
        during: dict[str, Any] = {}

        async def plain(i: int) -> None:
            events: list[TokenEvent] = []
            async with engine.generate(plains[i], PLAIN) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        events.append(event)
                        first_tokens[i].set()
                        # NOTE: the row is not read further until the serial
                        # requests are done (its tokens wait in its outbox).
                        await rows_joined.wait()
                    else:
                        plain_out[i] = (events, event)

        async def serial_ones() -> None:
            for started in first_tokens:
                await started.wait()
            before = await engine.stats()
            got_json = await _run(engine, structured, grammar)
            got_top = await _run(engine, ranked, TOP)
            during.update(before=before, after=await engine.stats(), json=got_json, top=got_top)
            rows_joined.set()

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(len(plains)):
                    tg.start_soon(plain, i)
                tg.start_soon(serial_ones)
        stats = await engine.stats()

    # NOTE: the three plain rows were decoding batch rows before the serial
    # requests started, and the batch lane went on stepping while they ran.
    # (Whether every row is still joined at the end depends on how many steps
    # the batch lane got between the two serial requests: step chains run
    # there while the serial lane has no work.)
    assert during["before"]["batch"]["batch"]["rows"]["joined"] == 3
    steps = [during[k]["batch"]["batch"]["steps"]["run"] for k in ("before", "after")]
    assert steps[1] > steps[0]
    json_events, json_done = during["json"]
    top_events, _ = during["top"]
    assert [e.token_id for e in json_events] == [e.token_id for e in want_json]
    text = "".join(e.text for e in json_events)
    assert json_done.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    # NOTE: the same tokens, and logprobs equal within float32 rounding: while
    # batch rows run, the batch lane's BLAS thread choice (kernels/engine/
    # _blas_threads.py) also holds for the serial prefill, and on this tiny
    # model's shapes OpenBLAS's thread count moves the low bits (seen: 2e-6;
    # with KVTIER_BATCH_BLAS_TUNE=0 the values are bitwise equal).
    got_ids, got_lp = _answers(top_events)
    want_ids, want_lp = _answers(want_top)
    assert got_ids == want_ids
    for (lp, top), (want_lp1, want_top1) in zip(got_lp, want_lp, strict=True):
        assert lp == pytest.approx(want_lp1, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in want_top1]
        assert [v for _, v in top] == pytest.approx([v for _, v in want_top1], abs=1e-4)
    assert all(len(e.top_logprobs) == 3 for e in top_events)
    for (events, done), want in zip(plain_out, want_plain, strict=True):
        assert [e.token_id for e in events] == [e.token_id for e in want]
        assert done.usage.completion_tokens == len(want)
    assert stats["gateway"]["token"]["batch_refused"] == {}
    assert stats["batch"]["batch"]["joined"] == 5


async def test_a_grammar_that_fails_in_a_row_fails_that_row_alone(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row whose grammar fails mid-answer (scripted: its 4th mask raises GrammarViolation)
    ends with an error after some of the tokens before it (its serial answer's first ones),
    none sampled from unmasked logits; the plain
    row decoding beside it in the same steps finishes with its serial-only answer, and the batch
    counts one row failed alone."""
    from kernels.engine import _structured

    real = _structured.GrammarProcessor._masked
    calls: dict[int, int] = {}

    def failing(self: Any, history: Any, logits: Any) -> Any:
        calls[id(self)] = calls.get(id(self), 0) + 1
        if calls[id(self)] == 4:
            raise _structured.GrammarViolation("scripted: the grammar fails here")
        return real(self, history, logits)

    grammar = GenerationParams(max_tokens=60, grammar=json_schema_grammar(SCHEMA))
    structured = _prompt(tok, "Weather as JSON, please.")
    plain_prompt = _prompt(tok, "Plain request, tell me a story.")
    async with _engine(model, tok, 1) as serial:
        want_json, _ = await _run(serial, structured, grammar)
        want_plain, _ = await _run(serial, plain_prompt, PLAIN)
    monkeypatch.setattr(_structured.GrammarProcessor, "_masked", failing)
    async with _engine(model, tok, 4) as engine:
        got: list[TokenEvent] = []
        failure: list[str] = []

        async def constrained() -> None:
            try:
                async with engine.generate(structured, grammar) as stream:
                    async for event in stream:
                        if isinstance(event, TokenEvent):
                            got.append(event)
            except GenerationFailed as exc:
                failure.append(str(exc))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(constrained)
                plain_events, plain_done = await _run(engine, plain_prompt, PLAIN)
        stats = await engine.stats()
    assert failure
    assert "GrammarViolation" in failure[0]
    # NOTE: masks 1-3 chose tokens 0-2; the step that found the 4th failing drops its row's
    # token (the pipelined decode returns token 2 there; it drops what it cannot vouch for).
    assert 1 <= len(got) <= 3
    assert [e.token_id for e in got] == [e.token_id for e in want_json[:len(got)]]
    assert [e.token_id for e in plain_events] == [e.token_id for e in want_plain]
    assert plain_done.usage.completion_tokens == len(want_plain)
    assert stats["batch"]["batch"]["rows_failed_alone"] == 1


async def test_a_sampled_grammar_row_answers_valid_json_beside_a_plain_row(model: Any, tok: Any) -> None:
    """A sampled (temperature 0.9, seeded) grammar request decodes as a batch row beside a plain
    one (mlx-lm's sampling step applies the row's processor): its answer is valid JSON of the
    schema, and the batch lane joined both."""
    grammar = GenerationParams(max_tokens=60, temperature=0.9, seed=3,
                               grammar=json_schema_grammar(SCHEMA))
    async with _engine(model, tok, 4) as engine:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_run, engine, _prompt(tok, "Plain request, tell me a story."), PLAIN)
                events, done = await _run(engine, _prompt(tok, "Weather as JSON, please."), grammar)
        stats = await engine.stats()
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads("".join(e.text for e in events)), SCHEMA)
    assert stats["batch"]["batch"]["joined"] == 2
    assert stats["gateway"]["token"]["batch_refused"] == {}
