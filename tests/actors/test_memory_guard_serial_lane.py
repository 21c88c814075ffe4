"""The serial lane's in-turn memory checks (rule R5.4-2): before a request's prefill and every 256
decode tokens the engine thread reads the memory in use again and fails the request over the budget.

The checks are exercised through a real Engine on its serial lane (``max_batch=1``, tiny fp32
Llama). The memory in use is the process's RSS, so the test raises it for real: it fills a
buffer the size of several budgets' headroom, which no settle can give back. Admission decides
on the reading the last engine job left and the process's RSS now; memory it cannot see (grown
after the request was admitted, or not resident: CUDA's device memory) is seen only by the
in-turn checks; each test shows them refusing what admission let through.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from actors.engine import Engine
from actors.engine_thread.memory_guard import DECODE_CHECK_EVERY
from actors.errors import MemoryPressure
from messages.gateway import GenerationParams, TokenEvent
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

MIB = 1 << 20
HEADROOM = 24 * MIB
"""The budget over the idle engine's reading: a short request's footprint (well under 2 MiB) fits."""
GROWTH = 160 * MIB
"""What the test allocates once admitted: far past the headroom."""
PROMPT = list(range(3, 13))


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tiny_tokenizer()))


@asynccontextmanager
async def _serial(model: Any, budget: int | None) -> AsyncIterator[Engine]:
    engine = Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=16 * MIB, max_batch=1,
                                memory_budget_bytes=budget)
    async with engine:
        yield engine


async def _memory(engine: Engine) -> dict[str, Any]:
    memory: dict[str, Any] = (await engine.stats(timeout=5))["memory"]
    return memory


async def _budget(model: Any) -> int:
    gc.collect()
    async with _serial(model, None) as probe:
        idle: int = (await _memory(probe))["active_bytes"]
    return idle + HEADROOM


def _resident(size: int) -> bytearray:
    """``size`` bytes written through, so every page is resident (counted in RSS)."""
    return bytearray(b"\x01") * size


async def _tokens(engine: Engine, params: GenerationParams, seen: list[int],
                  grow_after_first: list[bytearray] | None = None) -> None:
    """Run one request, appending each token id to ``seen``; after the first token, allocate
    :data:`GROWTH` into ``grow_after_first`` (when given)."""
    async with engine.generate(PROMPT, params) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                seen.append(event.token_id)
                if grow_after_first is not None and not grow_after_first:
                    grow_after_first.append(_resident(GROWTH))


async def test_decode_check_fails_the_request_at_256_tokens_when_memory_grew(model: Any) -> None:
    """Admitted within budget, a 400-token request whose process grows by 160 MiB after its first
    token fails with MemoryPressure at the 256-token check, after exactly 256 tokens (none lost)."""
    grown: list[bytearray] = []
    tokens: list[int] = []
    async with _serial(model, await _budget(model)) as engine:
        params = GenerationParams(max_tokens=400, temperature=0.0)
        try:
            with pytest.raises(MemoryPressure, match="memory budget"):
                await _tokens(engine, params, tokens, grown)
        finally:
            # NOTE: freed here even when the assertion fails (its traceback keeps this frame).
            grown.clear()
        memory = await _memory(engine)
    assert len(tokens) == DECODE_CHECK_EVERY
    assert (memory["refused_in_turn"], memory["refused_before_prefill"]) == (1, 0)
    assert memory["refused_at_admission"] == 0
    assert memory["settled_in_turn"] >= 1


async def _grown_then_back(model: Any) -> tuple[list[int], dict[str, Any], list[int]]:
    """With :data:`GROWTH` resident since the last engine job, an 8-token request fails with
    MemoryPressure; then, the memory back, another runs: the first's tokens, the guard's
    figures after it, the second's tokens."""
    async with _serial(model, await _budget(model)) as engine:
        params = GenerationParams(max_tokens=8, temperature=0.0)
        grown = [_resident(GROWTH)]
        tokens: list[int] = []
        try:
            with pytest.raises(MemoryPressure, match="memory budget"):
                await _tokens(engine, params, tokens)
        finally:
            grown.clear()
        refused = await _memory(engine)
        after: list[int] = []
        await _tokens(engine, params, after)
    return tokens, refused, after


async def test_prefill_check_fails_a_request_admitted_on_an_older_reading(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where admission cannot see memory that grew after the last engine job (RSS now unreadable;
    under CUDA, MLX's device memory is not resident memory), the request is admitted on the
    latest reading, and the check before its prefill reads again and refuses it with no token;
    taken back to admission once (where relief could run), it is refused there (nothing cached
    to move out; it would fit at rest, but no other request runs to wait for); the next
    request, once the memory is back, runs."""
    from actors.engine.memory import ProcessMemory

    monkeypatch.setattr(ProcessMemory, "resident_now", lambda self: None)
    tokens, refused, after = await _grown_then_back(model)
    assert tokens == []
    assert (refused["refused_in_turn"], refused["refused_before_prefill"],
            refused["readmissions"], refused["busy_at_admission"],
            refused["admission_busy_failed"]) == (1, 1, 1, 1, 1)
    assert len(after) == 8


async def test_admission_sees_memory_grown_since_the_last_engine_job(model: Any) -> None:
    """RSS now is in admission's figure: memory grown after the last engine job fails the request
    at admission (where relief could run), not in its turn; the next request, once the memory is
    back, runs."""
    tokens, refused, after = await _grown_then_back(model)
    assert tokens == []
    assert (refused["refused_in_turn"], refused["busy_at_admission"],
            refused["admission_busy_failed"]) == (0, 1, 1)
    assert len(after) == 8


@pytest.mark.parametrize("max_batch", [1, 4], ids=["serial-lane", "batch-lane"])
async def test_a_request_refused_before_its_prefill_is_admitted_again_and_answers_in_full(
    model: Any, monkeypatch: pytest.MonkeyPatch, max_batch: int
) -> None:
    """The check before a request's prefill refuses it once (scripted: the first check raises
    MemoryShortAtStart); the engine API takes it back to admission and submits it again under
    the same id, and the caller gets one whole answer equal to an unrefused run's, on either lane;
    the stream tells when it was admitted again (the HTTP timeline's admission phase ends there)."""
    from actors.engine_thread.memory_guard import MemoryGuard
    from actors.errors import MemoryShortAtStart

    params = GenerationParams(max_tokens=8, temperature=0.0)
    budget = 1 << 40

    readmitted: list[float | None] = []

    async def answer() -> tuple[list[int], dict[str, Any]]:
        engine = Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                    prompt_cache_bytes=16 * MIB, max_batch=max_batch,
                                    memory_budget_bytes=budget)
        async with engine:
            seen: list[int] = []
            async with engine.generate(PROMPT, params) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        seen.append(event.token_id)
                readmitted.append(stream.readmitted_at)
            return seen, await _memory(engine)

    began = time.monotonic()
    expected, _ = await answer()
    assert readmitted == [None]
    real = MemoryGuard.before_prefill
    refusals: list[str] = []

    def refuse_once(self: MemoryGuard, request: Any, cached_tokens: int, pending: int = 0,
                    settle: bool = True) -> int:
        if not refusals:
            refusals.append(request.request_id)
            raise MemoryShortAtStart("scripted: not enough memory before the prefill")
        return real(self, request, cached_tokens, pending, settle)

    monkeypatch.setattr(MemoryGuard, "before_prefill", refuse_once)
    got, memory = await answer()
    assert len(refusals) == 1
    assert got == expected
    assert (memory["readmissions"], memory["refused_at_admission"]) == (1, 0)
    again = readmitted[1]
    assert again is not None
    assert began < again < time.monotonic()


@pytest.mark.parametrize("max_batch", [1, 4], ids=["serial-lane", "batch-lane"])
async def test_admission_refused_for_memory_running_requests_hold_waits_for_one_to_end(
    model: Any, monkeypatch: pytest.MonkeyPatch, max_batch: int
) -> None:
    """While a first stream is live the memory check answers MemoryBusy (scripted: the memory
    running requests hold); a second request waits for the first to end instead of failing,
    is asked again and answers in full, its first token after the first's final event."""
    from actors.engine import _memory_asks
    from actors.errors import MemoryBusy
    from messages.gateway import DoneEvent

    order: list[str] = []
    asked: list[int] = []

    engine = Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=16 * MIB, max_batch=max_batch,
                                memory_budget_bytes=1 << 40)

    async def scripted(running: Any, request_id: str, prompt_tokens: int, params: Any, *,
                       timeout: float, refused_in_turn: bool = False) -> None:
        asked.append(prompt_tokens)
        if prompt_tokens == len(PROMPT) + 2 and engine._streams.live > 0:
            raise MemoryBusy("scripted: running requests hold the memory")

    monkeypatch.setattr(_memory_asks, "admit", scripted)

    async def run(name: str, prompt: list[int], params: GenerationParams,
                  admitted: anyio.Event | None = None) -> None:
        async with engine.generate(prompt, params) as stream:
            await stream.start()
            if admitted is not None:
                admitted.set()
            async for event in stream:
                if isinstance(event, DoneEvent):
                    order.append(f"{name}.done")
                elif f"{name}.first" not in order:
                    order.append(f"{name}.first")

    async with engine:
        first_admitted = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", PROMPT, GenerationParams(max_tokens=40, temperature=0.0),
                          first_admitted)
            await first_admitted.wait()
            tg.start_soon(run, "b", [*PROMPT, 5, 6], GenerationParams(max_tokens=8,
                                                                       temperature=0.0))
        memory = await _memory(engine)
    assert order.index("a.done") < order.index("b.first")
    assert order[-1] == "b.done"
    assert asked.count(len(PROMPT) + 2) == 2
    assert memory["admission_waits"] >= 1


async def test_admission_refused_for_memory_with_nothing_running_fails_at_once(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no stream live there is nothing to wait for: a MemoryBusy answer reaches the caller
    as MemoryPressure at once, without a wait or another ask."""
    from actors.engine import _memory_asks
    from actors.errors import MemoryBusy

    asked: list[int] = []

    async def scripted(running: Any, request_id: str, prompt_tokens: int, params: Any, *,
                       timeout: float, refused_in_turn: bool = False) -> None:
        asked.append(prompt_tokens)
        raise MemoryBusy("scripted: running requests hold the memory")

    monkeypatch.setattr(_memory_asks, "admit", scripted)
    async with _serial(model, 1 << 40) as engine:
        with pytest.raises(MemoryPressure, match="scripted"):
            await _tokens(engine, GenerationParams(max_tokens=4), [])
        memory = await _memory(engine)
    assert len(asked) == 1
    assert memory["admission_waits"] == 0


async def test_a_request_refused_again_beside_a_running_one_waits_for_it_to_end(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch-lane request refused before its prefill twice (scripted) while a serial-lane
    request (prompt_logprobs) runs, with no batch row to wait for: the first refusal goes back to
    admission at once, the second only after the running request ended; its first token comes
    after the other's final event, and it answers in full."""
    from actors.engine_thread.memory_guard import MemoryGuard
    from actors.errors import MemoryShortAtStart
    from messages.gateway import DoneEvent

    real = MemoryGuard.before_prefill
    refusals: list[str] = []
    order: list[str] = []
    b_prompt = [*PROMPT, 5, 6]
    # NOTE: set on the engine thread (threading.Events): "a"'s reader holds
    # its stream open until the second refusal, so "a" is still running then
    # however fast its 60 tokens are on a loaded machine; then for up to a
    # second more, or until "b" reaches its prefill: a "b" that did not wait
    # for "a" to end would reach it inside that second.
    refused_twice = threading.Event()
    b_prefilled = threading.Event()

    def refuse_b_once(self: MemoryGuard, request: Any, cached_tokens: int, pending: int = 0,
                      settle: bool = True) -> int:
        if list(request.prompt_tokens) == b_prompt:
            if len(refusals) < 2:
                refusals.append(request.request_id)
                order.append(f"b.refused{len(refusals)}")
                if len(refusals) == 2:
                    refused_twice.set()
                raise MemoryShortAtStart("scripted: not enough memory beside the running request")
            if not b_prefilled.is_set():
                order.append("b.prefill")
                b_prefilled.set()
        return real(self, request, cached_tokens, pending, settle)

    monkeypatch.setattr(MemoryGuard, "before_prefill", refuse_b_once)
    engine = Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=16 * MIB, max_batch=4,
                                memory_budget_bytes=1 << 40)

    async def run(name: str, prompt: list[int], params: GenerationParams,
                  first: anyio.Event | None = None) -> None:
        async with engine.generate(prompt, params) as stream:
            async for event in stream:
                if isinstance(event, DoneEvent):
                    order.append(f"{name}.done")
                elif f"{name}.first" not in order:
                    order.append(f"{name}.first")
                    if first is not None:
                        first.set()
                        assert await anyio.to_thread.run_sync(refused_twice.wait, 60)
                        await anyio.to_thread.run_sync(b_prefilled.wait, 1.0)

    async with engine:
        a_first = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", PROMPT, GenerationParams(
                max_tokens=60, temperature=0.0, prompt_logprobs=1), a_first)
            await a_first.wait()
            tg.start_soon(run, "b", b_prompt, GenerationParams(max_tokens=8, temperature=0.0))
        memory = await _memory(engine)
    assert len(refusals) == 2
    # NOTE: the first refusal went back at once: the second came while "a" still ran.
    assert order.index("b.refused2") < order.index("a.done") < order.index("b.prefill") \
        < order.index("b.first")
    assert order[-1] == "b.done"
    assert memory["readmissions"] == 2


async def test_a_second_refusal_with_nothing_running_is_the_503(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before its prefill twice (scripted) with no other stream to wait for: the first
    refusal goes back to admission, the second reaches the caller as MemoryPressure."""
    from actors.engine_thread.memory_guard import MemoryGuard
    from actors.errors import MemoryShortAtStart

    def refuse(self: MemoryGuard, request: Any, cached_tokens: int, pending: int = 0,
               settle: bool = True) -> int:
        raise MemoryShortAtStart("scripted: not enough memory before the prefill")

    monkeypatch.setattr(MemoryGuard, "before_prefill", refuse)
    engine = Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=16 * MIB, max_batch=1,
                                memory_budget_bytes=1 << 40)
    async with engine:
        with pytest.raises(MemoryPressure, match="scripted"):
            await _tokens(engine, GenerationParams(max_tokens=8, temperature=0.0), [])
        memory = await _memory(engine)
    assert memory["readmissions"] == 1
