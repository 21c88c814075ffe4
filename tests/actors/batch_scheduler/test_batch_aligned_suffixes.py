"""Rows joining together over one cached prefix with suffixes of different lengths (an agent's turns).

The batch lane aligns them (the shorter re-forward the last tokens of their
lent prefix) instead of padding and rolling every layer's cache; what a row
reports as ``cached_tokens`` is what it really reused.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from actors.engine import DoneEvent, GenerationParams
from kernels import read_first_setting

from .cold_support import engine, ids, run

pytestmark = pytest.mark.anyio

GREEDY = GenerationParams(max_tokens=6)


async def test_turns_over_one_prefix_report_the_prefix_they_really_reused(
    model: Any, tok: Any
) -> None:
    """Two follow-ups of one stored exchange, sent together, join in one step: the longer reuses
    the whole stored prefix, the shorter gives back the difference of their suffixes, the step
    forwards the longer suffix for both, and both answer like a cold engine."""
    first = ids(tok, "Agents send their turns together over one system prompt. " * 2)
    short_q = ids(tok, " Why?")
    long_q = ids(tok, " And what happens to the shorter one then?")
    # NOTE: a wide gather window: on a loaded machine the second request's
    # lookup may take longer than the default 50 ms, and the test is about
    # two rows joining in one step, not about the window's default.
    async with engine(model, tok, None, max_batch=4, batch_gather_s=5.0) as eng:
        assert (await eng.stats())["batch"]["batch"]["gather_ms"] == 5000
        answer, _ = await run(eng, first, GREEDY)
        stored = [*first, *answer]
        prompts = [[*stored, *short_q], [*stored, *long_q]]
        out: list[Any] = [None, None]

        async def one(i: int) -> None:
            out[i] = await run(eng, prompts[i], GREEDY)

        before = (await eng.stats())["batch"]["batch"]["steps"]["prefill_tokens"]
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(one, i)
        after = (await eng.stats())["batch"]["batch"]["steps"]["prefill_tokens"]
    done: list[DoneEvent] = [o[1] for o in out]
    reused = [d.usage.cached_tokens for d in done]
    # NOTE: under read first (the CPU's default) the stored exchange ends
    # before the answer's last token: the first turn left without waiting
    # for that token's forward (RowExit).
    shared = len(stored) - read_first_setting()
    assert reused[1] == shared
    assert reused[0] == shared - (len(long_q) - len(short_q))
    assert after - before == 2 * (len(prompts[1]) - shared - 1), "both forward the longer suffix, once"
    async with engine(model, tok, None, max_batch=1) as cold:
        for prompt, (tokens, _) in zip(prompts, out, strict=True):
            want, _ = await run(cold, prompt, GREEDY)
            assert tokens == want
