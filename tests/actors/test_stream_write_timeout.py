"""The stream-write deadline through ``Engine`` on a tiny fp32 Llama: a reader that never reads
does not hold the engine; the other requests, on both lanes, finish; its stream ends with
``stream_write_timeout``."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from actors.engine import DoneEvent, Engine, GenerationFailed, GenerationParams, TokenEvent
from tests.kernels.test_generation import lively_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

TIMEOUT = 0.5
"""The stream-write deadline of these engines (seconds)."""
MARGIN = 10.0
"""What a finished request may take beyond the deadline on a loaded 2-core machine."""
LONG = GenerationParams(max_tokens=3000)
SERIAL_LONG = GenerationParams(max_tokens=3000, prompt_logprobs=1)
"""``prompt_logprobs``: only the serial lane serves it, also with the batch lane on."""
SHORT = GenerationParams(max_tokens=8)
SERIAL_SHORT = GenerationParams(max_tokens=8, prompt_logprobs=1)


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny byte-level BPE tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny fp32 Llama whose greedy output varies."""
    return lively_llama(len(tok))


def _engine(model: Any, tok: Any, max_batch: int) -> Engine:
    return Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=max_batch,
        stream_buffer=2, stream_write_timeout_s=TIMEOUT,
    )


async def _finish(engine: Engine, prompt: list[int], params: GenerationParams) -> DoneEvent:
    async with engine.generate(prompt, params) as stream:
        async for event in stream:
            if isinstance(event, DoneEvent):
                return event
    raise AssertionError("the stream ended without a DoneEvent")


async def _until_idle(engine: Engine) -> None:
    """Wait (at most MARGIN) until the batch lane holds no row."""
    for _ in range(int(MARGIN / 0.05)):
        if not (await engine.stats())["batch"]["batch"]["busy"]:
            return
        await anyio.sleep(0.05)
    raise AssertionError("the batch lane still holds rows")


async def _drain_stalled(stream: Any) -> tuple[int, str]:
    """Read what a stalled stream still holds: its token count and how it ended."""
    tokens = 0
    try:
        async for event in stream:
            if isinstance(event, TokenEvent):
                tokens += 1
            else:
                return tokens, f"done:{event.finish_reason}"
    except GenerationFailed as exc:
        return tokens, str(exc)
    return tokens, "closed"


@pytest.mark.parametrize("max_batch", [1, 2])
async def test_a_serial_stream_nobody_reads_frees_the_engine_within_the_deadline(
    model: Any, tok: Any, max_batch: int
) -> None:
    """A serial-lane request whose reader never reads (2-event buffer, 3000 tokens asked) holds
    neither the engine nor the serial lane: another serial request (and, with the batch lane
    on, a batch request) started after it finishes; past the deadline the stalled reader finds
    its buffered tokens and GenerationFailed(stream_write_timeout), and the lane is free."""
    prompt = [int(t) for t in tok.encode("Nobody reads what this request writes.")]
    other = [int(t) for t in tok.encode("This one is read at once.")]
    async with _engine(model, tok, max_batch) as eng:
        async with eng.generate(prompt, SERIAL_LONG) as stalled:
            await stalled.start()
            # NOTE: let it fill its buffer and block the runner on the next token.
            await anyio.sleep(0.2)
            started = time.monotonic()
            with anyio.fail_after(TIMEOUT + MARGIN):
                done = await _finish(eng, other, SERIAL_SHORT)
                batch_done = await _finish(eng, other, SHORT) if max_batch > 1 else None
            took = time.monotonic() - started
            # NOTE: the others no longer wait for the deadline: let it pass before reading.
            await anyio.sleep(TIMEOUT + 0.2)
            tokens, ending = await _drain_stalled(stalled)
        # NOTE: a DoneEvent reaches the reader before the runner's turn report
        # reaches the gateway; the lane is free within a moment, not at once.
        for _ in range(40):
            stats = await eng.stats()
            if stats["gateway"]["token"]["lane"] is None:
                break
            await anyio.sleep(0.05)
    assert done.finish_reason == "length"
    assert batch_done is None or batch_done.finish_reason == "length"
    assert took < TIMEOUT + MARGIN
    assert tokens <= 2 + 1  # NOTE: the buffer, plus a token accepted as the deadline passed.
    assert ending.startswith("stream_write_timeout"), ending
    assert stats["gateway"]["token"]["lane"] is None
    assert stats["gateway"]["live_requests"] == 0


@pytest.mark.parametrize("lane", ["batch", "serial"])
async def test_a_serial_stream_nobody_reads_holds_neither_lane(model: Any, tok: Any, lane: str) -> None:
    """With the default 30 s deadline, a serial-lane request whose reader stopped reading holds
    no engine turn and no lane: a batch request started after it, or a serial one queued
    behind it, answers in full long before the deadline (each waited for the whole deadline
    while the runner waited on the reader, the serial one until parking); the stalled request
    keeps the serial lane while nobody waits for it and parks, its generation open, for a
    serial request that does."""
    prompt = [int(t) for t in tok.encode("Nobody reads what this request writes.")]
    other = [int(t) for t in tok.encode("This one is read at once.")]
    engine = Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=2,
                                stream_buffer=2, stream_write_timeout_s=30.0)
    async with engine as eng, eng.generate(prompt, SERIAL_LONG) as stalled:
        await stalled.start()
        for _ in range(100):
            token = (await eng.stats())["gateway"]["token"]
            if token["blocked_turns"]:
                break
            await anyio.sleep(0.05)
        started = time.monotonic()
        with anyio.fail_after(MARGIN):
            done = await _finish(eng, other, SHORT if lane == "batch" else SERIAL_SHORT)
        took = time.monotonic() - started
        token = (await eng.stats())["gateway"]["token"]
        await stalled.aclose()
    assert done.finish_reason == "length"
    assert took < MARGIN
    assert token["blocked_turns"] >= 1
    if lane == "batch":
        assert token["lane"] is not None  # NOTE: the stalled request still holds the serial lane.
    else:
        assert token["parked_turns"] >= 1
        assert token["parked"] == 1  # NOTE: the stalled request is parked, not finished.


async def test_a_batch_row_nobody_reads_is_removed_at_the_deadline(model: Any, tok: Any) -> None:
    """A batch-lane request whose reader never reads loses its stream at the deadline (its
    row leaves the batch, its held events are dropped) while a request read at once finishes;
    the stalled reader finds GenerationFailed(stream_write_timeout) and nothing stays held."""
    prompt = [int(t) for t in tok.encode("Nobody reads this batch row.")]
    other = [int(t) for t in tok.encode("This row is read at once.")]
    async with _engine(model, tok, 2) as eng:
        async with eng.generate(prompt, LONG) as stalled:
            await stalled.start()
            with anyio.fail_after(TIMEOUT + MARGIN):
                done = await _finish(eng, other, SHORT)
            await anyio.sleep(TIMEOUT)
            await _until_idle(eng)
            tokens, ending = await _drain_stalled(stalled)
        batch = (await eng.stats())["batch"]["batch"]
    assert done.finish_reason == "length"
    assert ending.startswith("stream_write_timeout"), ending
    assert tokens <= 2
    assert batch["streams"]["write_timeouts"] == 1
    assert batch["streams"]["held"] == 0
