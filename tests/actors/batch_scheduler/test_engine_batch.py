"""The batch lane end to end: ``Engine(max_batch=N)`` on a tiny fp32 Llama, real engine thread and actors."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest

from actors.batch_scheduler import BATCH_ADDRESS
from actors.engine import DoneEvent, Engine, GenerationParams, QueueFull, TokenEvent, wiring
from tests.engine_runs import collect, drain

# NOTE: the batch lane is spawned by one entry in actors/engine/wiring.py; until
# that entry is in the tree these tests have nothing to exercise.
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        BATCH_ADDRESS not in {spec.name for spec in wiring.ACTORS},
        reason="the wiring has no batch-lane entry",
    ),
]


def _prompts(tok: Any, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = rng.sample(range(5, 60), n)
    return [[rng.randrange(0, len(tok) - 2) for _ in range(k)] for k in lengths]


async def _all(
    engine: Engine, prompts: list[list[int]], params: list[GenerationParams]
) -> list[tuple[list[int], DoneEvent]]:
    out: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        out[i] = await collect(engine, prompts[i], params[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


async def test_concurrent_requests_in_the_batch_lane_equal_the_serial_lane(
    model: Any, tok: Any
) -> None:
    """6 concurrent requests through max_batch=4 give each request's serial-lane tokens; steps really batched."""
    prompts = _prompts(tok, 6)
    params = [GenerationParams(max_tokens=6 + 3 * i) for i in range(6)]
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=1
    ) as serial:
        expected = [await collect(serial, p, q) for p, q in zip(prompts, params, strict=True)]
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=4
    ) as eng:
        got = await _all(eng, prompts, params)
        stats = await eng.stats()
    for (ids, done), (want, want_done) in zip(got, expected, strict=True):
        assert ids == want
        assert done.finish_reason == want_done.finish_reason
        assert done.usage.completion_tokens == len(want)
    batch = stats["batch"]["batch"]
    assert batch["steps"]["max_rows_decoded"] >= 3, batch
    assert batch["requests"]["finished_length"] + batch["requests"]["finished_stop"] == 6


async def test_cached_prefix_is_reused_by_a_batch_row(model: Any, tok: Any) -> None:
    """A follow-up whose prompt extends a finished row's reports cached_tokens and the cold tokens."""
    prompt = _prompts(tok, 1, seed=3)[0]
    params = GenerationParams(max_tokens=8)
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=1
    ) as serial:
        first, _ = await collect(serial, prompt, params)
        follow = [*prompt, *first, 7, 8, 9]
        cold, _ = await collect(serial, follow, params)
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=1 << 26, max_batch=4
    ) as eng:
        again, _ = await collect(eng, prompt, params)
        warm, done = await collect(eng, follow, params)
    assert again == first
    assert warm == cold
    assert done.usage.cached_tokens >= len(prompt)


async def test_cancel_ends_a_batch_row_and_others_continue(model: Any, tok: Any) -> None:
    """Closing one stream mid-generation ends that row; the other rows finish with their full output."""
    prompts = _prompts(tok, 3, seed=5)
    params = GenerationParams(max_tokens=30)
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=4
    ) as eng:
        got: dict[int, Any] = {}

        async def leaver() -> None:
            n = 0
            async with eng.generate(prompts[0], params) as stream:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        n += 1
                        if n == 3:
                            break
            got[0] = n

        async def stayer(i: int) -> None:
            got[i] = await collect(eng, prompts[i], params)

        async with anyio.create_task_group() as tg:
            tg.start_soon(leaver)
            tg.start_soon(stayer, 1)
            tg.start_soon(stayer, 2)
        stats = await eng.stats()
    assert got[0] == 3
    for i in (1, 2):
        ids, done = got[i]
        assert len(ids) == 30
        assert done.finish_reason == "length"
    assert stats["batch"]["batch"]["requests"]["cancelled"] == 1


async def test_batch_lane_refuses_past_rows_plus_queue(model: Any, tok: Any) -> None:
    """With max_batch=1+… rows full and the queue full, the next request is refused with QueueFull (429)."""
    prompt = _prompts(tok, 1, seed=7)[0]
    params = GenerationParams(max_tokens=40)
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=2, max_queue=1
    ) as eng:
        streams = [eng.generate(prompt, params) for _ in range(3)]
        for s in streams:
            await s.__aenter__()
        with pytest.raises(QueueFull):
            async with eng.generate(prompt, params):
                pass
        for s in streams:
            await s.aclose()


async def test_rows_sharing_a_system_prompt_prefill_it_once(model: Any, tok: Any) -> None:
    """4 chat requests with one long system prompt, at once: later rows wait for the first's snapshot and reuse it."""
    system = "You answer briefly. " * 12
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}]
        for q in ("one", "two two", "three three three", "four")
    ]
    params = GenerationParams(max_tokens=8)

    async def run(eng: Engine, messages: list[dict[str, str]]) -> tuple[list[int], DoneEvent]:
        return await drain(eng.chat(messages, params))

    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=1
    ) as serial:
        expected = [(await run(serial, c))[0] for c in chats]
    got: list[Any] = [None] * len(chats)
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=1 << 26, max_batch=4
    ) as eng:

        async def one(i: int) -> None:
            got[i] = await run(eng, chats[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(chats)):
                tg.start_soon(one, i)
        stats = await eng.stats()
    assert [ids for ids, _ in got] == expected
    reused = sorted(done.usage.cached_tokens for _, done in got)
    assert reused[0] == 0, "the first row prefills the system prompt"
    assert all(n >= 200 for n in reused[1:]), f"the others reuse it: {reused}"
    assert stats["batch"]["batch"]["cached_tokens"] == sum(reused)
