"""A restarted Engine resumes an identical request from its generation checkpoint on the BATCH lane.

The first Engine (``max_batch`` 4: every request is a batch row) runs the
request until a client cancel after 18 tokens (a cancel keeps the
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
from tests.actors.checkpoints.restart_support import (
    EVERY,
    PROMPT,
    STORY_CASES,
    MakeEngine,
    default_model_restart,
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


@pytest.fixture(autouse=True)
def _fixed_blas_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch lane at the process's BLAS thread count in every Engine of a test.

    NOTE: with the thread tuning on, each Engine chooses its decode steps'
    count by timing them, and some products' low bits depend on it
    (kernels/engine/_blas_threads.py); on a loaded machine the plain run and
    the resumed one could then choose differently and a seeded sample flip.
    """
    monkeypatch.setenv(BLAS_TUNE_ENV, "0")


def _batched(net: Any, **extra: Any) -> MakeEngine:
    """``make(root, every)``: an Engine whose every request is a batch row (``max_batch`` 4) on ``net``."""
    return lambda root, every: tiny_engine(net, root, every, max_batch=4, **extra)


@pytest.mark.parametrize("params", CASES)
async def test_restarted_engine_resumes_a_batch_row(
    model: Any, tmp_path: Path, params: GenerationParams
) -> None:
    """Batch-lane tokens after a restart equal an uninterrupted batch run; 16 replayed, then voided."""
    make = _batched(model)
    first = await interrupted_run(make, tmp_path, params)
    assert first.stats["generation_checkpoints"]["taken"] == 2
    assert first.stats["batch"]["batch"]["checkpoints"]["sent"] == 2
    assert first.stats["batch"]["batch"]["requests"]["admitted"] == 1
    resumed, stats = await resumed_run(make, tmp_path, params, flush=True)
    batch = stats["batch"]["batch"]
    assert resumed == first.expected
    assert stats["generation_checkpoints"]["resumed"] == 1
    assert stats["generation_checkpoints"]["tokens_saved"] == 16
    assert batch["checkpoints"]["resumed"] == 1
    # NOTE: the restored row joined without forwarding its prompt.
    assert batch["steps"]["prefill_tokens"] == 0
    await until_removed(tmp_path)


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
            out[name] = await tokens(engine, params, prompt=prompt)

        async with anyio.create_task_group() as tg:
            for name in plans:
                tg.start_soon(one, name)
        return out

    make = _batched(model)
    async with make(None, 0) as plain:
        expected = await run_all(plain)
    async with make(tmp_path, EVERY) as engine:
        got = await run_all(engine)
        counted = await section(engine)
        stats = await engine.stats(timeout=5)
    assert got == expected
    assert counted["refused"] == {"logprobs": 1}
    # NOTE: 40 tokens, one every 8 that did not end the answer: 8, 16, 24, 32.
    assert counted["taken"] == 4
    assert stats["batch"]["batch"]["checkpoints"]["sent"] == 4
    assert stats["batch"]["batch"]["steps"]["max_rows_decoded"] == 2


@pytest.mark.parametrize("kind", ["kv-quant-8", "mamba"])
async def test_batch_row_resumes_quantized_kv_and_recurrent_caches(tmp_path: Path,
                                                                    kind: str) -> None:
    """8-bit quantized KV (transitioning rows) and a Mamba model resume on the batch lane too."""
    # NOTE: sampled, the KV-sensitive model can draw </s>; the answer must run 40 tokens.
    params = GenerationParams(max_tokens=40, temperature=0.8, seed=4, ignore_eos=True)
    net = tiny_mamba(vocab_size=len(tiny_tokenizer())) if kind == "mamba" \
        else kv_llama(vocab_size=len(tiny_tokenizer()), head_dim=64)
    make = _batched(net, **({"kv_quant": "8"} if kind == "kv-quant-8" else {}))
    first = await interrupted_run(make, tmp_path, params)
    resumed, stats = await resumed_run(make, tmp_path, params)
    assert resumed == first.expected
    assert stats["generation_checkpoints"]["tokens_saved"] == 16
    assert stats["batch"]["batch"]["checkpoints"]["resumed"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("params", STORY_CASES)
async def test_default_model_batch_row_restart_resumes(
    default_model_path: Path, tmp_path: Path, params: GenerationParams
) -> None:
    """The default model on the batch lane: cancel at 70 (checkpoints at 32, 64), restart, equal answer."""
    stats = await default_model_restart(default_model_path, tmp_path, params, max_batch=4)
    assert stats["batch"]["batch"]["checkpoints"]["resumed"] == 1
