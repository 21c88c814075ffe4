"""The RAM tier inside a running Engine (production wiring): memory it really keeps."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from actors.engine import Engine, GenerationParams
from kernels import cache_arrays
from tests.tiny_models import kv_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

PROMPT = [int(t) for t in tiny_tokenizer().encode("a short prompt")]


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


async def test_an_idle_engine_drops_the_arrays_of_disposed_entries(tok: Any) -> None:
    """A repeated request replaces the first one's entry; with no request coming after it,
    the replaced entry's arrays are still dropped (a background turn), and /stats shows no
    pending disposal once that turn ran."""
    async with Engine.from_loaded(
        kv_llama(vocab_size=len(tok)), tok, model_id="tiny", prompt_cache_bytes=1 << 26
    ) as engine:
        params = GenerationParams(max_tokens=3)
        await engine.complete_prompt(PROMPT, params)
        warm = await engine.complete_prompt(PROMPT, params)
        assert warm.usage.cached_tokens == len(PROMPT) - 1
        for _ in range(1000):  # NOTE: polls for up to ~10 s; the turn comes in milliseconds
            snapshot = await engine.stats()
            stats, registry = snapshot["prompt_cache"], snapshot["cache_registry"]
            if not (registry["pending_dispose"] or stats["pending_disposals"]):
                break
            await anyio.sleep(0.01)
    assert (registry["pending_dispose"], registry["pending_bytes"]) == (0, 0)
    assert (stats["replaced"], stats["pending_disposals"], stats["pending_disposal_bytes"]) == (1, 0, 0)


async def test_a_short_completion_keeps_only_its_tokens(tok: Any) -> None:
    """The entry of a short request holds its own tokens' KV, not a 256-token slab, and the
    cache's byte count says so."""
    async with Engine.from_loaded(
        kv_llama(vocab_size=len(tok)), tok, model_id="tiny", prompt_cache_bytes=1 << 26
    ) as engine:
        await engine.complete_prompt(PROMPT, GenerationParams(max_tokens=3))
        registry = engine.cache_registry
        assert registry is not None
        ((handle, meta),) = registry.entries().items()
        per_token = sum(a.nbytes // a.shape[-2] for a in cache_arrays(list(registry.get(handle))))
        stats = (await engine.stats())["prompt_cache"]
    assert meta.offset < 32
    assert meta.nbytes == meta.offset * per_token
    assert stats["bytes"] == meta.nbytes
