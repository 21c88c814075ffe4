"""A restarted Engine resumes an identical request from its generation checkpoint (tiny Llama, serial lane).

The first Engine runs the request until a client cancel after 21 tokens
(a cancel keeps the checkpoints taken at 8 and 16 tokens), waits until
they are durable and closes; a new Engine on the same SSD directory gets
the identical request and must answer exactly what an uninterrupted run
answers, having replayed the checkpoint's tokens instead of computing them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.checkpoints import CHECKPOINT_DIR
from actors.engine import Engine
from messages.gateway import GenerationParams, TokenEvent
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_mamba, tiny_tokenizer

pytestmark = pytest.mark.anyio

PROMPT = [3 + (i * 7) % 80 for i in range(30)]
EVERY = 8
CASES = [
    pytest.param(GenerationParams(max_tokens=40), id="greedy"),
    pytest.param(GenerationParams(max_tokens=40, temperature=0.8, seed=11), id="seeded-0.8"),
]


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module (the same weights in every Engine)."""
    return tiny_llama(vocab_size=len(tiny_tokenizer()))


def _engine(model: Any, root: Path | None, every: int = EVERY) -> Engine:
    return Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                              prompt_cache_bytes=1 << 26, ssd_cache=root, max_batch=1,
                              ssd_writebehind=False, generation_checkpoint=every)


async def _tokens(engine: Engine, params: GenerationParams, *, cancel_after: int | None = None,
                  prompt: Any = PROMPT) -> list[int]:
    out: list[int] = []
    async with engine.generate(prompt, params) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                out.append(event.token_id)
                if cancel_after is not None and len(out) == cancel_after:
                    break
    return out


def _default_engine(model: Path, root: Path | None, every: int) -> Engine:
    """The default model on the serial lane, checkpointing every ``every`` tokens under ``root``."""
    return Engine(model=str(model), ssd_cache=root, max_batch=1, ssd_writebehind=False,
                  generation_checkpoint=every)


def _files(root: Path) -> list[Path]:
    return sorted(root.glob(f"*/{CHECKPOINT_DIR}/*.kvc"))


async def _section(engine: Engine) -> dict[str, Any]:
    stats = await engine.stats(timeout=5)
    section: dict[str, Any] = stats["generation_checkpoints"]
    return section


async def _until_written(engine: Engine, n: int) -> None:
    with anyio.fail_after(60):
        while True:
            if (await _section(engine))["written"] >= n:
                return
            await anyio.sleep(0.05)


@pytest.mark.parametrize("params", CASES)
async def test_restarted_engine_resumes_identical_request(
    model: Any, tmp_path: Path, params: GenerationParams
) -> None:
    """Tokens after a restart equal an uninterrupted run; 16 tokens replayed, not computed."""
    async with _engine(model, None, every=0) as plain:
        expected = await _tokens(plain, params)
    assert len(expected) == 40
    async with _engine(model, tmp_path) as first:
        cut = await _tokens(first, params, cancel_after=21)
        assert cut == expected[:21]
        await _until_written(first, 2)
        section = await _section(first)
    assert section["taken"] == 2
    assert section["removed"] == 0
    files = _files(tmp_path)
    # NOTE: only the newest checkpoint of the key survives (16 emitted tokens).
    assert [f.name.rsplit("-", 1)[1] for f in files] == ["16.kvc"]
    async with _engine(model, tmp_path) as second:
        resumed = await _tokens(second, params)
        section = await _section(second)
        await second.flush(timeout=30)
    assert resumed == expected
    assert section["resumed"] == 1
    assert section["tokens_saved"] == 16
    # NOTE: completion removes the key's checkpoints (after the writes in flight).
    with anyio.fail_after(30):
        while True:
            if not _files(tmp_path):
                break
            await anyio.sleep(0.05)


async def test_refused_requests_are_counted_and_write_nothing(model: Any, tmp_path: Path) -> None:
    """A logprobs request takes no checkpoint and /stats counts it under refused.logprobs."""
    params = GenerationParams(max_tokens=20, logprobs=True)
    async with _engine(model, tmp_path) as engine:
        await _tokens(engine, params, cancel_after=18)
        section = await _section(engine)
    assert section["refused"] == {"logprobs": 1}
    assert section["taken"] == 0
    assert _files(tmp_path) == []


STORY = ("Write a long, detailed story about a lighthouse keeper who finds a message in a "
         "bottle.\n\nChapter 1.")


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    pytest.param(GenerationParams(max_tokens=80), id="greedy"),
    pytest.param(GenerationParams(max_tokens=80, temperature=0.8, seed=5), id="seeded-0.8"),
])
async def test_default_model_restart_resumes_identical_request(
    default_model_path: Path, tmp_path: Path, params: GenerationParams
) -> None:
    """The default model: cancel at 70 tokens (checkpoints at 32, 64), restart, equal answer."""
    def engine(root: Path | None, every: int) -> Engine:
        return _default_engine(default_model_path, root, every)

    async def run(e: Engine, cancel_after: int | None = None) -> list[int]:
        return await _tokens(e, params, cancel_after=cancel_after, prompt=STORY)

    async with engine(None, 0) as plain:
        expected = await run(plain)
    assert len(expected) == 80
    async with engine(tmp_path, 32) as first:
        assert await run(first, cancel_after=70) == expected[:70]
        await _until_written(first, 2)
    async with engine(tmp_path, 32) as second:
        resumed = await run(second)
        section = await _section(second)
    assert resumed == expected
    assert section["resumed"] == 1
    assert section["tokens_saved"] == 64


@pytest.mark.parametrize("kind", ["kv-quant-8", "mamba"])
async def test_restart_resumes_quantized_kv_and_recurrent_caches(tmp_path: Path, kind: str) -> None:
    """8-bit quantized KV and a recurrent (Mamba) model resume to the uninterrupted answer too."""
    params = GenerationParams(max_tokens=40, temperature=0.8, seed=4)
    net = tiny_mamba(vocab_size=len(tiny_tokenizer())) if kind == "mamba" \
        else tiny_llama(vocab_size=len(tiny_tokenizer()), head_dim=64)
    extra: dict[str, Any] = {"kv_quant": "8"} if kind == "kv-quant-8" else {}

    def engine(root: Path | None, every: int) -> Engine:
        return Engine.from_loaded(net, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                                  prompt_cache_bytes=1 << 26, ssd_cache=root, max_batch=1,
                                  ssd_writebehind=False, generation_checkpoint=every, **extra)

    async with engine(None, 0) as plain:
        expected = await _tokens(plain, params)
    assert len(expected) == 40
    async with engine(tmp_path, EVERY) as first:
        assert await _tokens(first, params, cancel_after=21) == expected[:21]
        await _until_written(first, 2)
    async with engine(tmp_path, EVERY) as second:
        resumed = await _tokens(second, params)
        section = await _section(second)
    assert resumed == expected
    assert section["resumed"] == 1
    assert section["tokens_saved"] == 16


@pytest.mark.slow
async def test_default_model_kill_loop_request_cycle_zero(default_model_path: Path,
                                                          tmp_path: Path) -> None:
    """Kill loop cycle 0 in process: checkpointing (every 64) answers, restarted at 262 resumes 256, all equal."""
    # NOTE: a cold engine with checkpoints answers the 400-token greedy
    # request as one without, twice (the second a RAM prefix hit); then
    # cancelled at 262 tokens and restarted, it replays 256 and answers the same.
    from tools.kill_loop_checkpoint import PROMPT

    params = GenerationParams(max_tokens=400)

    def engine(root: Path | None, every: int) -> Engine:
        return _default_engine(default_model_path, root, every)

    async def run(e: Engine, cancel_after: int | None = None) -> list[int]:
        return await _tokens(e, params, cancel_after=cancel_after, prompt=PROMPT)

    async with engine(None, 0) as plain:
        expected = await run(plain)
    assert len(expected) == 400
    async with engine(tmp_path / "a", 64) as on:
        assert await run(on) == expected
        assert await run(on) == expected
    async with engine(tmp_path / "b", 64) as first:
        assert await run(first, cancel_after=262) == expected[:262]
        await _until_written(first, 4)
    async with engine(tmp_path / "b", 64) as second:
        resumed = await run(second)
        section = await _section(second)
    assert resumed == expected
    assert section["resumed"] == 1
    assert section["tokens_saved"] == 256
