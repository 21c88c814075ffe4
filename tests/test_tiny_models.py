"""The tiny test models' answers depend on their KV cache, so cache tests can fail."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.tiny_models import kv_llama, tiny_gemma3

PROMPTS = 10
TOKENS = 16


def _greedy(model: Any, prompt: list[int], prefill: list[int] | None = None) -> list[int]:
    """``TOKENS`` greedy tokens after ``prompt``, its cache prefilled with ``prefill`` (default:
    all of ``prompt`` but its last token) before the last token is forwarded."""
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1] if prefill is None else prefill]), cache=cache)
    logits = model(mx.array([prompt[-1:]]), cache=cache)
    out: list[int] = []
    for _ in range(TOKENS):
        token = int(mx.argmax(logits[0, -1]).item())  # type: ignore[arg-type]  # mlx stubs: .item() is int|float|complex
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


@pytest.mark.parametrize("build", [kv_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_another_prompts_cache_or_a_missing_token_changes_the_answer(build: Any) -> None:
    """For every one of 10 random 30-token prompts, continuing from another prompt's cache, or
    from a cache one token short, gives greedy tokens other than the right cache's."""
    model = build()
    rng = random.Random(0)
    for _ in range(PROMPTS):
        prompt = [rng.randrange(3, 250) for _ in range(30)]
        other = [rng.randrange(3, 250) for _ in range(30)]
        right = _greedy(model, prompt)
        assert _greedy(model, prompt, other[:-1]) != right
        assert _greedy(model, prompt, prompt[:-2]) != right
