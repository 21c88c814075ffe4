"""Checkpoint files count under ``--ssd-cache-max`` in a real Engine (tiny Llama, serial lane).

A tier too small for a checkpoint refuses it ``over_cap`` and the answer
completes as an uninterrupted run; a restart's scan counts the checkpoint
files left on disk, and the completion of the resumed answer subtracts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.engine import Engine
from messages.gateway import GenerationParams
from tests.actors.checkpoints.restart_support import EVERY
from tests.actors.checkpoints.restart_support import files as _files
from tests.actors.checkpoints.restart_support import section as _section
from tests.actors.checkpoints.restart_support import tokens as _tokens
from tests.actors.checkpoints.restart_support import until_written as _until_written
from tests.actors.test_cold_tier_engine import IDENTITY
from tests.tiny_models import kv_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio

PARAMS = GenerationParams(max_tokens=40)


@pytest.fixture(scope="module")
def model() -> Any:
    """One tiny fp32 Llama for the module (the same weights in every Engine)."""
    return kv_llama(vocab_size=len(tiny_tokenizer()))


def _engine(model: Any, root: Path | None, *, max_bytes: int | None = None,
            every: int = EVERY) -> Engine:
    # NOTE: a stream of 2 events keeps the engine within 3 tokens of its
    # reader: a cancel after 18 tokens lands before the boundary at 24 however
    # loaded the machine, so no third checkpoint is written behind the scan.
    return Engine.from_loaded(model, tiny_tokenizer(), model_id="tiny", identity=IDENTITY,
                              prompt_cache_bytes=1 << 26, ssd_cache=root, max_batch=1,
                              ssd_writebehind=False, generation_checkpoint=every,
                              ssd_cache_max_bytes=max_bytes, stream_buffer=2)


async def _ssd(engine: Engine) -> dict[str, Any]:
    stats = await engine.stats(timeout=5)
    section: dict[str, Any] = stats["ssd_cache"]
    return section


async def test_tier_too_small_refuses_checkpoints_over_cap_and_answer_completes(
    model: Any, tmp_path: Path
) -> None:
    """With a 1 KiB cap every checkpoint is refused over_cap; the answer equals a plain run's."""
    async with _engine(model, None, every=0) as plain:
        expected = await _tokens(plain, PARAMS)
    async with _engine(model, tmp_path, max_bytes=1024) as engine:
        got = await _tokens(engine, PARAMS)
        await engine.flush(timeout=30)
        section = await _section(engine)
        ssd = await _ssd(engine)
    assert got == expected
    assert section["written"] == 0
    assert section["refused"].get("over_cap", 0) >= 1
    assert section["write_failed"] == 0
    assert ssd["checkpoint_bytes"] == 0
    assert _files(tmp_path) == []


async def test_restart_scan_counts_checkpoint_files_and_completion_subtracts(
    model: Any, tmp_path: Path
) -> None:
    """A restart's ssd_cache.checkpoint_bytes is the files' size; the resumed answer's end frees it."""
    async with _engine(model, tmp_path) as first:
        await _tokens(first, PARAMS, cancel_after=18)
        await _until_written(first, 2)
        written = (await _ssd(first))["checkpoint_bytes"]
    on_disk = sum(f.stat().st_size for f in _files(tmp_path))
    assert on_disk > 0
    assert written == on_disk
    async with _engine(model, tmp_path) as second:
        ssd = await _ssd(second)
        assert ssd["checkpoint_bytes"] == on_disk
        assert ssd["bytes"] >= on_disk
        await _tokens(second, PARAMS)
        await second.flush(timeout=30)
        with anyio.fail_after(30):
            while True:
                if (await _ssd(second))["checkpoint_bytes"] == 0:
                    break
                await anyio.sleep(0.05)
        assert (await _section(second))["removed"] >= 1
    assert _files(tmp_path) == []
