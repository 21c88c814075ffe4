"""A restarted Engine resumes an identical request from its generation checkpoint (tiny Llama, serial lane).

The first Engine runs the request until a client cancel after 18 tokens
(a cancel keeps the checkpoints taken at 8 and 16 tokens), waits until
they are durable and closes; a new Engine on the same SSD directory gets
the identical request and must answer exactly what an uninterrupted run
answers, having replayed the checkpoint's tokens instead of computing them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.engine import Engine
from messages.gateway import GenerationParams
from tests.actors.checkpoints.restart_support import (
    EVERY,
    STORY_CASES,
    MakeEngine,
    default_engine,
    default_model_restart,
    files,
    interrupted_run,
    resumed_run,
    section,
    tiny_engine,
    tokens,
    until_removed,
)
from tests.tiny_models import kv_llama, tiny_mamba, tiny_tokenizer

pytestmark = pytest.mark.anyio

CASES = [
    pytest.param(GenerationParams(max_tokens=40), id="greedy"),
    pytest.param(GenerationParams(max_tokens=40, temperature=0.8, seed=11), id="seeded-0.8"),
]


def _serial(net: Any, **extra: Any) -> MakeEngine:
    """``make(root, every)``: a serial-lane Engine (``max_batch`` 1) on ``net``."""
    return lambda root, every: tiny_engine(net, root, every, max_batch=1, **extra)


@pytest.mark.parametrize("params", CASES)
async def test_restarted_engine_resumes_identical_request(
    model: Any, tmp_path: Path, params: GenerationParams
) -> None:
    """Tokens after a restart equal an uninterrupted run; 16 tokens replayed, not computed."""
    make = _serial(model)
    first = await interrupted_run(make, tmp_path, params)
    taken = first.stats["generation_checkpoints"]
    assert taken["taken"] == 2
    assert taken["removed"] == 0
    # NOTE: only the newest checkpoint of the key survives (16 emitted tokens).
    assert [f.name.rsplit("-", 1)[1] for f in files(tmp_path)] == ["16.kvc"]
    resumed, stats = await resumed_run(make, tmp_path, params, flush=True)
    assert resumed == first.expected
    assert stats["generation_checkpoints"]["resumed"] == 1
    assert stats["generation_checkpoints"]["tokens_saved"] == 16
    # NOTE: completion removes the key's checkpoints (after the writes in flight).
    await until_removed(tmp_path)


async def test_refused_requests_are_counted_and_write_nothing(model: Any, tmp_path: Path) -> None:
    """A logprobs request takes no checkpoint and /stats counts it under refused.logprobs."""
    params = GenerationParams(max_tokens=20, logprobs=True)
    async with tiny_engine(model, tmp_path, max_batch=1) as engine:
        await tokens(engine, params, cancel_after=18)
        counted = await section(engine)
    assert counted["refused"] == {"logprobs": 1}
    assert counted["taken"] == 0
    assert files(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("params", STORY_CASES)
async def test_default_model_restart_resumes_identical_request(
    default_model_path: Path, tmp_path: Path, params: GenerationParams
) -> None:
    """The default model: cancel at 70 tokens (checkpoints at 32, 64), restart, equal answer."""
    await default_model_restart(default_model_path, tmp_path, params, max_batch=1)


@pytest.mark.parametrize("kind", ["kv-quant-8", "mamba"])
async def test_restart_resumes_quantized_kv_and_recurrent_caches(tmp_path: Path, kind: str) -> None:
    """8-bit quantized KV and a recurrent (Mamba) model resume to the uninterrupted answer too."""
    # NOTE: sampled, the KV-sensitive model can draw </s>; the answer must run 40 tokens.
    params = GenerationParams(max_tokens=40, temperature=0.8, seed=4, ignore_eos=True)
    net = tiny_mamba(vocab_size=len(tiny_tokenizer())) if kind == "mamba" \
        else kv_llama(vocab_size=len(tiny_tokenizer()), head_dim=64)
    make = _serial(net, **({"kv_quant": "8"} if kind == "kv-quant-8" else {}))
    first = await interrupted_run(make, tmp_path, params, every=EVERY)
    resumed, stats = await resumed_run(make, tmp_path, params)
    assert resumed == first.expected
    assert stats["generation_checkpoints"]["resumed"] == 1
    assert stats["generation_checkpoints"]["tokens_saved"] == 16


@pytest.mark.slow
async def test_default_model_kill_loop_request_cycle_zero(default_model_path: Path,
                                                          tmp_path: Path) -> None:
    """Kill loop cycle 0 in process: checkpointing (every 64) answers, restarted at 262 resumes 256, all equal."""
    # NOTE: a cold engine with checkpoints answers the 400-token greedy
    # request as one without, twice (the second a RAM prefix hit); then
    # cancelled at 262 tokens and restarted, it replays 256 and answers the same.
    from tools.kill_loop_checkpoint import PROMPT

    params = GenerationParams(max_tokens=400)

    def make(root: Path | None, every: int) -> Engine:
        return default_engine(default_model_path, root, every, max_batch=1)

    async def run(e: Engine, cancel_after: int | None = None) -> list[int]:
        return await tokens(e, params, cancel_after=cancel_after, prompt=PROMPT)

    first = await interrupted_run(make, tmp_path / "b", params, every=64, length=400, cut=262,
                                  written=4, prompt=PROMPT)
    async with make(tmp_path / "a", 64) as on:
        assert await run(on) == first.expected
        assert await run(on) == first.expected
    resumed, stats = await resumed_run(make, tmp_path / "b", params, every=64, prompt=PROMPT)
    assert resumed == first.expected
    assert stats["generation_checkpoints"]["resumed"] == 1
    assert stats["generation_checkpoints"]["tokens_saved"] == 256
