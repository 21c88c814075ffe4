"""A burst of SSD hits under the batch lane: host staging has room for every row of ``max_batch``.

``Engine(max_batch=N, ssd_cache=...)`` on a tiny fp32 Llama, after a restart
(N = 4 and 6): N rows whose prompts each extend a different stored
conversation arrive together; each one's lookup reaches the SSD index (the
prompt cache keeps that many in flight) and its restored bytes wait in host
staging until its join, so all N restore (none is pushed out and joins cold).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import GenerationParams

from .cold_support import engine, ids, run

pytestmark = pytest.mark.anyio

GREEDY = GenerationParams(max_tokens=8)
TOPICS = (
    "rivers and their deltas",
    "mountain weather in spring",
    "the history of printing",
    "how bridges carry loads",
    "the tides of the north sea",
    "why glass is transparent",
)


# NOTE: 6 rows also exceed the prompt cache's former fixed cap of 4 SSD
# lookups in flight (a lookup past it was answered from RAM: the row joined cold).
@pytest.mark.parametrize("rows", [4, 6])
async def test_concurrent_ssd_hits_with_max_batch_rows_all_restore(
    tmp_path: Path, model: Any, tok: Any, rows: int
) -> None:
    """After a restart, max_batch rows arriving together, each extending its own stored
    conversation, all restore from disk (batch.ssd.restored == rows, each row's cached_tokens
    is its whole stored prefix, nothing pushed out of staging) and give the serial cold tokens."""
    firsts = [ids(tok, f"Tell me about {topic}, in detail please. " * 3) for topic in TOPICS[:rows]]
    async with engine(model, tok, tmp_path, max_batch=1) as writer:
        answers = [list((await writer.complete_prompt(p, GREEDY)).token_ids) for p in firsts]
        flushed = await writer.flush()
        assert flushed is not None
        assert flushed.durable
    seconds = [[*f, *a, *ids(tok, " And then?")] for f, a in zip(firsts, answers, strict=True)]
    async with engine(model, tok, None, prompt_cache_bytes=0, max_batch=1) as serial:
        want = [(await run(serial, p, GREEDY))[0] for p in seconds]

    async with engine(model, tok, tmp_path, max_batch=rows) as restarted:
        running = restarted._running
        assert running is not None
        cold = running.cold
        assert cold is not None
        assert (await restarted.stats())["ssd_cache"]["entries"] == rows
        got: list[Any] = [None] * len(seconds)

        async def one(i: int) -> None:
            got[i] = await run(restarted, seconds[i], GREEDY)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(len(seconds)):
                    tg.start_soon(one, i)
        stats = await restarted.stats()
        pushed_out, staged = cold.staging.evicted, len(cold.staging)

    # NOTE: each stored entry holds its prompt and answer but the answer's last token.
    stored = [len(f) + len(a) - 1 for f, a in zip(firsts, answers, strict=True)]
    assert [done.usage.cached_tokens for _, done in got] == stored
    assert [tokens for tokens, _ in got] == want
    assert stats["batch"]["batch"]["ssd"] == {
        "restored": rows,
        "restored_tokens": sum(stored),
        "restore_failed": 0,
    }
    assert (stats["ssd_cache"]["hits"], stats["ssd_cache"]["restores"]) == (rows, rows)
    assert (pushed_out, staged) == (0, 0)
