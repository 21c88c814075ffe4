"""A restarted Engine resumes an identical request from its generation checkpoint on the BATCH lane.

The first Engine (``max_batch`` 4: every request is a batch row) runs the
request until a client cancel after 21 tokens (a cancel keeps the
checkpoints taken at 8 and 16 tokens), waits until they are durable and
closes; a new Engine on the same SSD directory gets the identical request
and must answer exactly what an uninterrupted batch run answers, having
replayed the checkpoint's tokens instead of computing them, its row
joining the batch without a forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import Engine
from kernels.engine import BLAS_TUNE_ENV
from messages.gateway import GenerationParams
from tests.actors.checkpoints.test_engine_restart import (
    EVERY,
    PROMPT,
    STORY,
    _files,
    _section,
    _tokens,
    _until_written,
)
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import tiny_llama, tiny_mamba, tiny_tokenizer

pytestmark = pytest.mark.anyio

CASES = [
    pytest.param(GenerationParams(max_tokens=40), id="greedy"),
    pytest.param(GenerationParams(max_tokens=40, temperature=0.8, seed=11), id="seeded-0.8"),
]


@pytest.fixture(autouse=True)
def _fixed_blas_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch lane at the process's BLAS thread count in every Engine of a test.

    NOTE: with the thread tuning on, each Engine chooses its decode steps'
    count by timing them, and some products' low bits depend on it
    (kernels/engine/_blas_threads.py); on a loaded machine the plain run and
    the resumed one could then choose differently and a seeded sample flip.
    """
    monkeypatch.setenv(BLAS_TUNE_ENV, "0")


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module (the same weights in every Engine)."""
    return tiny_llama(vocab_size=len(tiny_tokenizer()))


def _engine(net: Any, root: Path | None, every: int = EVERY, **extra: Any) -> Engine:
    return Engine.from_loaded(net, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                              prompt_cache_bytes=1 << 26, ssd_cache=root, max_batch=4,
                              ssd_writebehind=False, generation_checkpoint=every, **extra)


async def _batch(engine: Engine) -> dict[str, Any]:
    stats = await engine.stats(timeout=5)
    section: dict[str, Any] = stats["batch"]["batch"]
    return section


@pytest.mark.parametrize("params", CASES)
async def test_restarted_engine_resumes_a_batch_row(
    model: Any, tmp_path: Path, params: GenerationParams
) -> None:
    """Batch-lane tokens after a restart equal an uninterrupted batch run; 16 replayed, then voided."""
    async with _engine(model, None, every=0) as plain:
        expected = await _tokens(plain, params)
    assert len(expected) == 40
    async with _engine(model, tmp_path) as first:
        cut = await _tokens(first, params, cancel_after=21)
        assert cut == expected[:21]
        await _until_written(first, 2)
        section = await _section(first)
        batch = await _batch(first)
    assert section["taken"] == 2
    assert batch["checkpoints"]["sent"] == 2
    assert batch["requests"]["admitted"] == 1
    async with _engine(model, tmp_path) as second:
        resumed = await _tokens(second, params)
        section = await _section(second)
        batch = await _batch(second)
        await second.flush(timeout=30)
    assert resumed == expected
    assert section["resumed"] == 1
    assert section["tokens_saved"] == 16
    assert batch["checkpoints"]["resumed"] == 1
    # NOTE: the restored row joined without forwarding its prompt.
    assert batch["steps"]["prefill_tokens"] == 0
    with anyio.fail_after(30):
        while True:
            if not _files(tmp_path):
                break
            await anyio.sleep(0.05)


async def test_checkpointed_row_beside_rows_without(model: Any, tmp_path: Path) -> None:
    """A checkpointed row decodes beside a logprobs row (refused) and a row of another prompt; all equal their plain runs."""
    plans = {
        "ck": (PROMPT, GenerationParams(max_tokens=40, temperature=0.8, seed=3)),
        "lp": (PROMPT[:20], GenerationParams(max_tokens=30, logprobs=True)),
    }

    async def run_all(engine: Engine) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}

        async def one(name: str) -> None:
            prompt, params = plans[name]
            out[name] = await _tokens(engine, params, prompt=prompt)

        async with anyio.create_task_group() as tg:
            for name in plans:
                tg.start_soon(one, name)
        return out

    async with _engine(model, None, every=0) as plain:
        expected = await run_all(plain)
    async with _engine(model, tmp_path) as engine:
        got = await run_all(engine)
        section = await _section(engine)
        batch = await _batch(engine)
    assert got == expected
    assert section["refused"] == {"logprobs": 1}
    # NOTE: 40 tokens, one every 8 that did not end the answer: 8, 16, 24, 32.
    assert section["taken"] == 4
    assert batch["checkpoints"]["sent"] == 4
    assert batch["steps"]["max_rows_decoded"] == 2


@pytest.mark.parametrize("kind", ["kv-quant-8", "mamba"])
async def test_batch_row_resumes_quantized_kv_and_recurrent_caches(tmp_path: Path,
                                                                    kind: str) -> None:
    """8-bit quantized KV (transitioning rows) and a Mamba model resume on the batch lane too."""
    params = GenerationParams(max_tokens=40, temperature=0.8, seed=4)
    net = tiny_mamba(vocab_size=len(tiny_tokenizer())) if kind == "mamba" \
        else tiny_llama(vocab_size=len(tiny_tokenizer()), head_dim=64)
    extra: dict[str, Any] = {"kv_quant": "8"} if kind == "kv-quant-8" else {}
    async with _engine(net, None, 0, **extra) as plain:
        expected = await _tokens(plain, params)
    async with _engine(net, tmp_path, **extra) as first:
        assert await _tokens(first, params, cancel_after=21) == expected[:21]
        await _until_written(first, 2)
    async with _engine(net, tmp_path, **extra) as second:
        resumed = await _tokens(second, params)
        section = await _section(second)
        batch = await _batch(second)
    assert resumed == expected
    assert section["tokens_saved"] == 16
    assert batch["checkpoints"]["resumed"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    pytest.param(GenerationParams(max_tokens=80), id="greedy"),
    pytest.param(GenerationParams(max_tokens=80, temperature=0.8, seed=5), id="seeded-0.8"),
])
async def test_default_model_batch_row_restart_resumes(
    default_model_path: Path, tmp_path: Path, params: GenerationParams
) -> None:
    """The default model on the batch lane: cancel at 70 (checkpoints at 32, 64), restart, equal answer."""
    def engine(root: Path | None, every: int) -> Engine:
        return Engine(model=str(default_model_path), ssd_cache=root, max_batch=4,
                      ssd_writebehind=False, generation_checkpoint=every)

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
        batch = await _batch(second)
    assert resumed == expected
    assert section["tokens_saved"] == 64
    assert batch["checkpoints"]["resumed"] == 1
