"""The memory-pressure guard in a running Engine (tiny fp32 Llama), over HTTP.

Budgets are set low on purpose, relative to the guard's reading (the
process's RSS) measured by a first engine with the same model (the test
process holds other tests' memory too, so absolute numbers would depend on
them). The RSS bound itself, and the relief that persists and drops LRU
entries, are tested on a real ``kvtier serve`` process, where RSS is the
server's own: ``tests/e2e/test_memory_guard_rss.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from actors.engine import Engine
from actors.http import HttpSettings, create_app
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

MIB = 1 << 20
SMALL = list(range(3, 13))
LARGE = [3 + i % 90 for i in range(1500)]


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module."""
    return tiny_llama(vocab_size=len(tiny_tokenizer()))


@asynccontextmanager
async def _served(model: Any, root: Path | None, **options: Any
                  ) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    engine = Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                prompt_cache_bytes=64 * MIB, ssd_cache=root,
                                ssd_writebehind=False, **options)
    async with engine:
        app = create_app(engine, HttpSettings())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as client:
            yield engine, client


async def _complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int
                    ) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": prompt,
                                                      "max_tokens": max_tokens})


async def _memory(engine: Engine) -> dict[str, Any]:
    memory: dict[str, Any] = (await engine.stats(timeout=5))["memory"]
    return memory


async def test_a_request_over_a_low_budget_gets_503_and_the_next_small_one_runs(
    model: Any,
) -> None:
    """With the budget 4 MiB over the engine's idle reading, a 1,500-token prompt (about 16 MiB
    of projected KV and workspace) is refused before admission with an OpenAI-style 503
    (code memory_pressure, a message naming the budget); a 10-token request then succeeds."""
    async with _served(model, None) as (probe, _):
        idle = (await _memory(probe))["active_bytes"]
    budget = idle + 4 * MIB
    async with _served(model, None, memory_budget_bytes=budget) as (engine, client):
        refused = await _complete(client, LARGE, 16)
        small = await _complete(client, SMALL, 8)
        memory = await _memory(engine)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "memory_pressure")
    assert "memory budget" in error["message"]
    assert small.status_code == 200, small.text
    assert small.json()["usage"]["completion_tokens"] == 8
    assert memory["budget_bytes"] == budget
    assert memory["refused_at_admission"] == 1
