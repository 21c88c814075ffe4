"""The SSD cold tier inside a running Engine (production wiring, tiny fp32 Llama).

A restored entry continues exactly like a RAM hit and a cold prefill; files
written by one engine serve the next one (restart survival); idle entries
move to disk; hostile files are counted, removed and served as misses; the
byte cap holds on disk after every write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import Engine, GenerationParams, TokenEvent
from kernels import ModelIdentity
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

IDENTITY = ModelIdentity(
    model_id="tiny-llama",
    name="tiny-llama",
    config_fingerprint="cfg",
    tokenizer_hash="tok",
    weights_digest="w0",
    dtype="float32",
    quantization=None,
)
GREEDY = GenerationParams(max_tokens=12, logprobs=True)


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny ASCII tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """One tiny fp32 Llama shared by every engine of this module (same weights in each run)."""
    return tiny_llama(vocab_size=len(tok))


def _ids(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok.encode(text)]


def _engine(model: Any, tok: Any, root: Path | None, **options: Any) -> Engine:
    settings: dict[str, Any] = {"prompt_cache_bytes": 1 << 26, "ssd_cache": root, **options}
    return Engine.from_loaded(model, tok, model_id="tiny", identity=IDENTITY, **settings)


async def _wait_for(predicate: Any, engine: Engine, *, seconds: float = 20.0) -> dict[str, Any]:
    """Poll ``engine.stats()`` until ``predicate(stats)`` holds (fails after ``seconds``)."""
    with anyio.fail_after(seconds):
        while True:
            stats = await engine.stats(timeout=5.0)
            if predicate(stats):
                return stats
            await anyio.sleep(0.02)


async def _continue(engine: Engine, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their log-probabilities and usage.cached_tokens of one request."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async with engine.generate(prompt, GREEDY) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
                assert event.logprob is not None
                logprobs.append(event.logprob)
            else:
                return tokens, logprobs, event.usage.cached_tokens
    raise AssertionError("the stream ended without a DoneEvent")


async def test_a_restored_entry_continues_like_a_ram_hit_and_a_cold_prefill(
    tmp_path: Path, model: Any, tok: Any
) -> None:
    """Greedy tokens after a prefix restored from disk (after a restart, trimmed to the shared
    prefix) equal those after the same prefix from RAM (log-probabilities bit for bit: the same
    KV) and after a cold prefill (log-probabilities within fp32 rounding); the restore is
    counted as an SSD hit and usage.cached_tokens counts its tokens."""
    first = _ids(tok, "The cold tier keeps prefixes on disk across restarts. " * 3)
    second = [*first, *_ids(tok, " Then a new question follows.")]

    async with _engine(model, tok, tmp_path) as writer:
        await writer.complete_prompt(first, GREEDY)
        flushed = await writer.flush()
        assert flushed is not None
        assert flushed.durable
        assert (await writer.stats())["ssd_cache"]["entries"] >= 1

    async with _engine(model, tok, tmp_path) as restarted:
        restored, restored_lp, restored_cached = await _continue(restarted, second)
        stats = await restarted.stats()
    assert restored_cached == len(first)
    assert (stats["ssd_cache"]["hits"], stats["ssd_cache"]["restores"]) == (1, 1)
    assert stats["prompt_cache"]["hits"] == 0

    async with _engine(model, tok, None) as plain:
        await plain.complete_prompt(first, GREEDY)
        ram, ram_lp, ram_cached = await _continue(plain, second)
    async with _engine(model, tok, None, prompt_cache_bytes=0) as uncached:
        cold, cold_lp, cold_cached = await _continue(uncached, second)
    assert (ram_cached, cold_cached) == (len(first), 0)
    assert restored == ram == cold
    assert restored_lp == ram_lp
    assert restored_lp == pytest.approx(cold_lp, abs=1e-4)
