"""Multi-turn chat through the Engine: turn 2 reuses turn 1's whole prompt from the RAM tier."""

from __future__ import annotations

from typing import Any

import pytest

from actors.engine import Engine, GenerationParams
from kernels import render_chat
from tests.chat_templates import thinking_tokenizer
from tests.tiny_models import kv_llama, tiny_gemma3, tiny_mamba, tiny_tokenizer

pytestmark = pytest.mark.anyio

SYSTEM = "you are a terse assistant that answers in a few words only"
PARAMS = GenerationParams(max_tokens=6)
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "name a color"}]
ARCHS = ["llama", "gemma3-wrapped", "mamba"]


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer with its chat template."""
    return tiny_tokenizer()


def _model(arch: str, tok: Any) -> Any:
    if arch == "llama":
        return kv_llama(vocab_size=len(tok))
    if arch == "mamba":
        return tiny_mamba(vocab_size=len(tok))
    return tiny_gemma3(vocab_size=len(tok), sliding_window=16)


def _rewritten(reply: str) -> str:
    """The reply as a client might send it back: not what the model generated.

    NOTE: its first character differs from the generated text's, so turn 2's
    prompt leaves the completion entry inside the reply (a BPE re-encoding
    that merges differently, a client that strips or edits, a template that
    drops reasoning: all diverge the same way).
    """
    return ("Y" if reply.startswith("X") else "X") + reply


@pytest.mark.parametrize("arch", ARCHS)
async def test_second_turn_reuses_the_first_turn_prompt(arch: str, tok: Any) -> None:
    """Turn 2 (turn 1 + the exact reply + a new user message) hits at least turn 1's prompt."""
    p1 = render_chat(tok, TURN1)
    assert len(p1) > 16  # the gemma ring wraps during turn 1
    async with Engine.from_loaded(
        _model(arch, tok), tok, model_id=arch, prompt_cache_bytes=1 << 26, snapshot_min_new_tokens=1
    ) as engine:
        first = await engine.complete(TURN1, PARAMS)
        assert first.usage.cached_tokens == 0
        assert first.usage.prompt_tokens == len(p1)
        turn2 = [
            *TURN1,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and another one"},
        ]
        second = await engine.complete(turn2, PARAMS)
    p2 = render_chat(tok, turn2)
    assert p2[: len(p1)] == p1
    # NOTE: the snapshot holds the prompt minus its last token (that token is
    # forwarded by the first decode step), so it alone reuses len(p1) - 1.
    assert second.usage.cached_tokens >= len(p1) - 1
    assert second.usage.cached_tokens <= second.usage.prompt_tokens - 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("snapshot", [True, False])
async def test_a_reply_sent_back_differently_still_hits(arch: str, snapshot: bool, tok: Any) -> None:
    """When the client's copy of the reply differs from the generated tokens, turn 2 still
    reuses turn 1's prompt: a trimmable completion entry is cut back to it; an untrimmable
    one (wrapped ring, recurrent state) cannot be, and only the prompt-boundary snapshot
    serves (without the snapshot those models miss entirely).
    """
    p1 = render_chat(tok, TURN1)
    async with Engine.from_loaded(
        _model(arch, tok),
        tok,
        model_id=arch,
        prompt_cache_bytes=1 << 26,
        snapshot_min_new_tokens=1 if snapshot else 1 << 30,
    ) as engine:
        first = await engine.complete(TURN1, PARAMS)
        turn2 = [
            *TURN1,
            {"role": "assistant", "content": _rewritten(first.text)},
            {"role": "user", "content": "and another one"},
        ]
        second = await engine.complete(turn2, PARAMS)
        stats = (await engine.stats())["prompt_cache"]
    p2 = render_chat(tok, turn2)
    assert p2[: len(p1)] == p1
    if arch == "llama":
        # the completion entry (prompt + reply) trims back to the divergence point
        assert second.usage.cached_tokens == len(p1)
    elif snapshot:
        assert second.usage.cached_tokens == len(p1) - 1
    else:
        assert second.usage.cached_tokens == 0
        assert stats["misses"] == 2
    assert stats["bytes"] <= stats["cap_bytes"]


@pytest.mark.parametrize("arch", ARCHS)
async def test_a_thinking_template_still_reuses_the_prompt(arch: str) -> None:
    """With a template whose generation prompt opens a <think> block that history never
    renders again, turn 2 reuses turn 1's prompt up to that opener, for untrimmable caches
    too: the snapshot is taken at the probed stable boundary, not at the prompt's end."""
    tok = thinking_tokenizer()
    p1 = render_chat(tok, TURN1)
    opener = len(tok.encode("<think>\n", add_special_tokens=False))
    async with Engine.from_loaded(
        _model(arch, tok), tok, model_id=arch, prompt_cache_bytes=1 << 26, snapshot_min_new_tokens=1
    ) as engine:
        first = await engine.complete(TURN1, PARAMS)
        turn2 = [
            *TURN1,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and another one"},
        ]
        second = await engine.complete(turn2, PARAMS)
    p2 = render_chat(tok, turn2)
    point = len(p1) - opener
    assert p2[:point] == p1[:point]
    assert p2[point] != p1[point]
    assert second.usage.cached_tokens == point
