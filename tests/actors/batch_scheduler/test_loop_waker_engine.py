"""The batch scheduler's ``LoopWaker`` through ``Engine(max_batch=2)`` on a tiny fp32 Llama: one thread while open, none after."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from actors.engine import Engine, GenerationParams
from tests.engine_runs import collect

pytestmark = pytest.mark.anyio

PARAMS = GenerationParams(max_tokens=12)


def _wakers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kvtier-loop-waker" and t.is_alive()}


async def test_batch_rows_stream_through_the_waker_and_its_thread_ends_with_the_engine(
    model: Any, tok: Any
) -> None:
    """Two batch rows get their serial-lane tokens; the Engine runs one waker thread, gone after close."""
    prompts = [[int(t) for t in tok.encode(text)] for text in ("One row here.", "Another row.")]
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=1
    ) as serial:
        want = [(await collect(serial, p, PARAMS))[0] for p in prompts]
    before = _wakers()
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=2
    ) as eng:
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            got[i] = (await collect(eng, prompts[i], PARAMS))[0]

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(one, i)
        ours = _wakers() - before
        steps = (await eng.stats())["batch"]["batch"]["steps"]["run"]
    for _ in range(1000):
        if not any(t.is_alive() for t in ours):
            break
        await anyio.sleep(0.01)
    assert [got[0], got[1]] == want
    assert steps > 0
    assert len(ours) == 1
    assert not any(t.is_alive() for t in ours)
