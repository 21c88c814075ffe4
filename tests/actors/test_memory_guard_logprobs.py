"""The memory guard counts what reporting generated tokens' logprobs (``logprobs``, ``top_logprobs``) holds on the host."""

from __future__ import annotations

import gc
import json
import tracemalloc
from collections.abc import Iterable

import pytest

from actors.engine_thread.memory_guard import (
    LOGPROB_ALTERNATIVE_BYTES,
    LOGPROB_TOKEN_BYTES,
    Footprint,
    MemoryGauge,
    MemoryGuard,
    token_logprob_bytes,
)
from actors.errors import MemoryPressure
from actors.http._answer import ChatAnswer, LogprobOptions
from actors.http._convert import chat_response
from messages.gateway import DoneEvent, Generate, GenerationParams, TokenEvent, Usage
from tests.actors.test_memory_guard_engine import MIB, _memory, _served, model  # noqa: F401

VOCAB = 49152


def _request(max_tokens: int, *, logprobs: bool = False, top: int = 0) -> Generate:
    return Generate(request_id="r", prompt_tokens=tuple(range(64)),
                    params=GenerationParams(max_tokens=max_tokens, logprobs=logprobs,
                                            top_logprobs=top))


def _guard(budget: int) -> MemoryGuard:
    footprint = Footprint(kv_bytes_at=lambda n: n * 100, chunk=512)
    return MemoryGuard(budget=budget, footprint=footprint, gauge=MemoryGauge(lambda: 0))


def test_logprob_bytes_are_per_token_plus_per_alternative() -> None:
    """Nothing without logprobs; each of the tokens adds the entry and its alternatives."""
    assert token_logprob_bytes(1000, False, 0) == 0
    assert token_logprob_bytes(1000, True, 0) == 1000 * LOGPROB_TOKEN_BYTES
    assert token_logprob_bytes(1000, True, 20) == 1000 * (
        LOGPROB_TOKEN_BYTES + 20 * LOGPROB_ALTERNATIVE_BYTES)
    assert token_logprob_bytes(-5, True, 20) == 0


def test_before_prefill_refuses_a_top_logprobs_request_the_plain_one_fits() -> None:
    """Same prompt and max_tokens, same budget: the plain request passes, top_logprobs 20 is refused."""
    guard = _guard(0)
    base = guard.footprint.at_prefill(64, 4096)
    guard.budget = base + token_logprob_bytes(4096, True, 20) - 1
    guard.before_prefill(_request(4096), cached_tokens=0)
    guard.before_prefill(_request(4096, logprobs=True, top=19), cached_tokens=0)
    with pytest.raises(MemoryPressure, match="logprobs"):
        guard.before_prefill(_request(4096, logprobs=True, top=20), cached_tokens=0)
    assert guard.refused == 1


def test_during_decode_counts_the_logprobs_still_to_come() -> None:
    """During decode the tokens still to come count (those produced are in the reading)."""
    guard = _guard(0)
    request = _request(4096, logprobs=True, top=20)
    final = 64 + 4096
    now = 64 + 1024
    kv = guard.footprint.in_decode(now, final)
    guard.budget = kv + token_logprob_bytes(final - now, True, 20)
    guard.during_decode(request, now)
    guard.budget -= 1
    with pytest.raises(MemoryPressure):
        guard.during_decode(request, now)
    # NOTE: with fewer tokens still to come the same budget fits again.
    guard.during_decode(request, now + 1)


class _Speller:
    """Spells every id as 8 bytes (longer than an English BPE token's average of about 4)."""

    eos_token_ids: frozenset[int] = frozenset()

    def __call__(self, token_ids: Iterable[int]) -> list[bytes]:
        return [f"t{t % 10_000_000:07d}".encode() for t in token_ids]


def _answer_peak(tokens: int, top: int) -> int:
    """Peak host bytes of a chat answer's logprobs: the entries, the response model, its dict and JSON."""
    events = [TokenEvent(request_id="r", index=i, token_id=(i * 7919) % VOCAB, text="ab",
                         logprob=-0.5 - i / tokens,
                         top_logprobs=tuple(((i * 31 + j * 977) % VOCAB, -1.0 - j / 7)
                                            for j in range(top)))
              for i in range(tokens)]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        answer = ChatAnswer(logprobs=LogprobOptions(top=top, spell=_Speller()))
        for event in events:
            answer.feed(event)
        done = DoneEvent(request_id="r", finish_reason="length",
                         usage=Usage(prompt_tokens=1, completion_tokens=tokens))
        answer.finish(done)
        body = chat_response("id", 0, "m", [(answer, done)], logprobs=True).model_dump(mode="json")
        encoded = json.dumps(body, ensure_ascii=False).encode()
        assert len(answer.logprobs) == tokens
        assert encoded
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("top", [0, 5, 20])
def test_the_estimate_covers_a_non_streamed_chat_answers_peak(top: int) -> None:
    """A non-streamed chat answer's measured peak (entries, response, dict, JSON) stays under the estimate."""
    tokens = 300
    peak = _answer_peak(tokens, top)
    estimate = token_logprob_bytes(tokens, True, top)
    assert peak <= estimate, (peak / tokens, estimate / tokens)
    # NOTE: and the estimate is no wild over-count (within 3x of the measured peak).
    assert estimate <= 3 * peak, (peak / tokens, estimate / tokens)


@pytest.mark.anyio
async def test_admission_refuses_top_logprobs_that_do_not_fit_and_serves_the_plain_request(
    model: object,  # noqa: F811
) -> None:
    """6 MiB over the idle reading: 256 tokens with top_logprobs 20 (about 11 MB of entries) get
    503 memory_pressure before admission; the same request without logprobs answers 200."""
    async with _served(model, None) as (probe, _):
        idle = (await _memory(probe))["active_bytes"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 256,
            "temperature": 0}
    async with _served(model, None, memory_budget_bytes=idle + 6 * MIB) as (engine, client):
        refused = await client.post("/v1/chat/completions",
                                    json={**body, "logprobs": True, "top_logprobs": 20})
        plain = await client.post("/v1/chat/completions", json=body)
        memory = await _memory(engine)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "memory_pressure"
    assert plain.status_code == 200, plain.text
    assert memory["refused_at_admission"] == 1



def test_a_running_requests_growth_is_its_kv_and_logprobs_still_to_come() -> None:
    """``growth``: the KV buffers still to allocate up to max_tokens (256-token steps) plus the
    logprobs of the tokens still to come; nothing once the request holds its final length."""
    guard = _guard(0)
    kv = guard.footprint.kv_bytes_at
    plain, top = _request(1000), _request(1000, logprobs=True, top=5)
    assert guard.growth(plain, 64) == kv(1280) - kv(256)
    assert guard.growth(top, 64) == kv(1280) - kv(256) + token_logprob_bytes(1000, True, 5)
    assert guard.growth(plain, 1064) == 0
    assert guard.growth(top, 1064) == 0
