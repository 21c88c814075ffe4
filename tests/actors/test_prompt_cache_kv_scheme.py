"""``kv_quant`` (``kvtier serve --kv-quant``) reaches the engine: stored entries are quantized."""

from __future__ import annotations

from typing import Any

import pytest

from actors.engine import Engine, GenerationParams
from kernels.cache import InvalidKvScheme
from tests.tiny_models import kv_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

CHAT = [
    {"role": "system", "content": "you answer with one short sentence about the sea"},
    {"role": "user", "content": "tell me something"},
]


@pytest.mark.parametrize(
    ("kv_quant", "signature"), [("off", "kv:plain"), (8, "kv:quant:8:64"), ("4", "kv:quant:4:64")]
)
async def test_engine_stores_entries_in_its_kv_scheme(kv_quant: Any, signature: str) -> None:
    """Every cache entry an engine keeps has the scheme's signature, and a hit on it decodes
    the same greedy text as the cold request that stored it."""
    tok = tiny_tokenizer()
    # NOTE: head_dim 64 so K/V rows divide into the server's 64-element groups.
    model = kv_llama(vocab_size=len(tok), head_dim=64)
    params = GenerationParams(max_tokens=6)
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=1 << 26, kv_quant=kv_quant
    ) as engine:
        cold = await engine.complete(CHAT, params)
        warm = await engine.complete(CHAT, params)
        registry = engine.cache_registry
        assert registry is not None
        entries = registry.entries()
    assert cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens == warm.usage.prompt_tokens - 1
    assert warm.text == cold.text
    assert entries
    for meta in entries.values():
        assert set(meta.signatures) == {signature}


async def test_a_scheme_the_model_cannot_take_is_refused_at_start() -> None:
    """``kv_quant=8`` (groups of 64) on a model with 16-wide heads fails ``start()`` with a
    clear message instead of starting a server whose every request would fail."""
    tok = tiny_tokenizer()
    engine = Engine.from_loaded(
        kv_llama(vocab_size=len(tok)), tok, model_id="tiny", prompt_cache_bytes=1 << 26, kv_quant=8
    )
    with pytest.raises(InvalidKvScheme, match="not divisible by the group size 64"):
        await engine.start()
    await engine.aclose()
