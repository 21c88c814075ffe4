"""The Engine says in stats() and its start-up log when its batch lane replays a compiled one-token step."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engine import Engine, GenerationParams
from kernels.model import COMPILED_DECODE_ENV

pytestmark = [pytest.mark.anyio, pytest.mark.model]

CHAT = [{"role": "user", "content": "the cat in the hat"}]


async def test_stats_count_the_traces_when_switched_on(
    default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With KVTIER_COMPILED_DECODE=1 a chat's decode steps trace the step (``compiled_decode.traces`` ≥ 1); off, the section is absent."""
    monkeypatch.setenv(COMPILED_DECODE_ENV, "1")
    async with Engine(default_model_path, max_queue=1, max_batch=2, prompt_cache_bytes=1 << 26) as engine:
        before = (await engine.stats())["compiled_decode"]["traces"]
        await engine.complete(CHAT, GenerationParams(max_tokens=8))
        after = (await engine.stats())["compiled_decode"]["traces"]
    assert before == 0
    assert after >= 1
    monkeypatch.delenv(COMPILED_DECODE_ENV)
    async with Engine(default_model_path, max_queue=1, max_batch=2, prompt_cache_bytes=1 << 26) as engine:
        await engine.complete(CHAT, GenerationParams(max_tokens=4))
        assert "compiled_decode" not in await engine.stats()
