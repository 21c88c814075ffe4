"""Checkpoint deltas served: the second checkpoint of an answer builds on its first file, and a
restart resumes from it exactly (tiny Llama, both lanes, 8-bit KV too, KVTIER_CHECKPOINT_DELTA forced on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernels.cache import DELTA_ENV
from kernels.engine import BLAS_TUNE_ENV
from messages.gateway import GenerationParams
from tests.actors.checkpoints.restart_support import (
    files,
    resumed_run,
    section,
    tiny_engine,
    tokens,
    until_removed,
    until_written,
)
from tests.tiny_models import kv_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

LANES = [
    pytest.param(1, None, id="serial"),
    pytest.param(4, None, id="batch"),
    pytest.param(4, 8, id="batch-kv8"),
]


@pytest.mark.parametrize(("max_batch", "kv_quant"), LANES)
async def test_a_delta_checkpoint_resumes_like_an_uninterrupted_run(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_batch: int, kv_quant: int | None
) -> None:
    """With deltas on, the checkpoint at 16 tokens is composed from the file written at 8 (counted,
    its reused bytes too), and the restarted engine's answer equals an uninterrupted one."""
    monkeypatch.setenv(DELTA_ENV, "1")
    monkeypatch.setenv(BLAS_TUNE_ENV, "0")
    params = GenerationParams(max_tokens=40)
    # NOTE: 8-bit KV needs a head dimension its group size divides.
    net = model if kv_quant is None else kv_llama(vocab_size=len(tiny_tokenizer()), head_dim=64)

    def make(root: Path | None, every: int) -> Any:
        return tiny_engine(net, root, every, max_batch=max_batch, kv_quant=kv_quant)

    async with make(None, 0) as plain:
        expected = await tokens(plain, params)
    async with make(tmp_path, 8) as first:
        # NOTE: the spill queue hands the checkpoint at 8 to the writer at once; the one at 16
        # waits behind it and is planned on its file once it is durable.
        got = await tokens(first, params, cancel_after=18)
        await until_written(first, 2)
        counted = await section(first)
    assert got == expected[:18]
    assert counted["deltas"] == 1
    assert counted["delta_reused_bytes"] > 0
    assert [f.name.rsplit("-", 1)[1] for f in files(tmp_path)] == ["16.kvc"]
    resumed, stats = await resumed_run(make, tmp_path, params, flush=True)
    assert resumed == expected
    assert stats["generation_checkpoints"]["resumed"] == 1
    await until_removed(tmp_path)
