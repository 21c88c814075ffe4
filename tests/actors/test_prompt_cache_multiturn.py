"""Multi-turn chat through the Engine: turn 2 reuses turn 1's whole prompt from the RAM tier."""

from __future__ import annotations

from typing import Any

import pytest

from actors.engine import Engine, GenerationParams
from kernels import render_chat
from tests.tiny_models import tiny_gemma3, tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

SYSTEM = "you are a terse assistant that answers in a few words only"
PARAMS = GenerationParams(max_tokens=6)


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer with its chat template."""
    return tiny_tokenizer()


@pytest.mark.parametrize("arch", ["llama", "gemma3-wrapped"])
async def test_second_turn_reuses_the_first_turn_prompt(arch: str, tok: Any) -> None:
    """Turn 2 (turn 1 + reply + new user message) gets a hit covering turn 1's prompt.

    For a full-attention model the completion entry is trimmed to the shared
    prefix; for a sliding-window model whose ring wrapped (untrimmable), the
    prompt-boundary snapshot is what serves it.
    """
    if arch == "llama":
        model = tiny_llama(vocab_size=len(tok))
    else:
        model = tiny_gemma3(vocab_size=len(tok), sliding_window=16)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "name a color"}]
    p1 = render_chat(tok, turn1)
    assert len(p1) > 16  # the ring wraps during turn 1
    async with Engine.from_loaded(
        model, tok, model_id=arch, prompt_cache_bytes=1 << 26, snapshot_min_new_tokens=1
    ) as engine:
        first = await engine.complete(turn1, PARAMS)
        assert first.usage.cached_tokens == 0
        assert first.usage.prompt_tokens == len(p1)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and another one"},
        ]
        second = await engine.complete(turn2, PARAMS)
    p2 = render_chat(tok, turn2)
    assert p2[: len(p1)] == p1
    # NOTE: the snapshot holds the prompt minus its last token (that token is
    # forwarded by the first decode step), so a ring model reuses len(p1) - 1.
    floor = len(p1) if arch == "llama" else len(p1) - 1
    assert second.usage.cached_tokens >= floor
    assert second.usage.cached_tokens <= second.usage.prompt_tokens - 1
