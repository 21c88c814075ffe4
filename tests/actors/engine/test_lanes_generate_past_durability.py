"""No lane drains durability work before generating (rule RG-4).

Real Engine (tiny fp32 Llama, SSD tier in a temp directory) whose file port
holds every write: the first request's write-behind store stays in flight,
so the spill queue and the durability coordinator hold unfinished work for
the whole test. Requests on the serial lane (``max_batch=1``) and on the
batch lane (``max_batch=4``, several rows at once) still generate and
complete; the held work is still pending afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import Completion, Engine
from tests.actors.persistence_faults import (
    DEADLINE,
    PARAMS,
    HeldWritesPort,
    ids,
    serving,
    wait_set,
)
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tok))


async def _all_at_once(engine: Engine, prompts: list[list[int]]) -> list[Completion]:
    out: dict[int, Completion] = {}

    async def one(i: int) -> None:
        out[i] = await engine.complete_prompt(prompts[i], PARAMS)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("max_batch", [1, 4], ids=["serial", "batch"])
async def test_requests_generate_while_durability_work_is_stuck(
    tmp_path: Path, model: Any, tok: Any, max_batch: int
) -> None:
    """RG-4: with a write-behind store held in a file write (spill queue and coordinator busy),
    three requests at once (a RAM hit and two misses) complete on the lane under test, and the
    store is still in flight after them: the lane never waited for it."""
    port = HeldWritesPort()
    async with serving(model, tok, tmp_path, port, release=port.release.set,
                       max_batch=max_batch) as engine:
        first = ids(tok, "Durability work never holds a lane back. " * 3)
        done = await engine.complete_prompt(first, PARAMS)
        await wait_set(port.held)
        stuck = await engine.stats()
        prompts = [
            [*first, *done.token_ids, *ids(tok, " Continue.")],
            ids(tok, "An unrelated prompt that misses every tier."),
            ids(tok, "Another one, also new to the cache."),
        ]
        results = await _all_at_once(engine, prompts)
        after = await engine.stats()
        writes = port.writes_started
    for stats in (stuck, after):
        cold = stats["ssd_cache"]
        assert (cold["pending_spills"], cold["entries"], cold["spills"]) == (1, 0, 0)
        assert cold["writebehind_dirty"] >= 1
    assert writes == 1
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert results[0].usage.cached_tokens >= len(first)
    assert after["prompt_cache"]["hits"] == 1
    if max_batch > 1:
        # NOTE: every request of this model runs as a batch row once the lane is on.
        assert after["batch"]["batch"]["joined"] == 4
    else:
        assert "batch" not in after
