"""The batch lane's BLAS thread tuning through ``Engine``: on with OpenBLAS, off by the switch, shown in stats."""

from __future__ import annotations

from typing import Any

import pytest

from actors.batch_scheduler import BATCH_ADDRESS
from actors.engine import Engine, GenerationParams, wiring
from kernels.engine import BLAS_TUNE_ENV, find_openblas
from tests.actors.batch_scheduler.test_engine_batch import _all, _prompts
from tests.engine_runs import collect

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        BATCH_ADDRESS not in {spec.name for spec in wiring.ACTORS},
        reason="the wiring has no batch-lane entry",
    ),
]

_BLAS = find_openblas()


@pytest.mark.skipif(
    _BLAS is None or _BLAS.get_threads() < 2, reason="needs OpenBLAS with 2+ threads (LD_PRELOAD)"
)
async def test_tuning_is_on_shown_in_stats_and_gives_the_default_back(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With OpenBLAS of 2+ threads the batch lane tunes (stats 'blas'), rows keep their serial tokens, and the idle lane leaves OpenBLAS at its default."""
    assert _BLAS is not None
    default = _BLAS.get_threads()
    monkeypatch.delenv(BLAS_TUNE_ENV, raising=False)
    prompts = _prompts(tok, 3, seed=11)
    params = [GenerationParams(max_tokens=40) for _ in prompts]
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=1
    ) as serial:
        expected = [await collect(serial, p, q) for p, q in zip(prompts, params, strict=True)]
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=4
    ) as eng:
        got = await _all(eng, prompts, params)
        stats = await eng.stats()
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    blas = stats["batch"]["batch"]["blas"]
    assert blas["threads"] == default, f"released to the default once idle: {blas}"
    # NOTE: a due trial runs, or is skipped when the two threads had their
    # cores (a free machine): either way the chooser was consulted.
    assert blas["trials"] + blas["skipped"] >= 1, (
        f"40 decode steps of 3 rows reach at least one due trial: {blas}"
    )
    assert _BLAS.get_threads() == default


async def test_switch_turns_it_off(model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_BATCH_BLAS_TUNE=0: no tuning (no 'blas' in the batch stats)."""
    monkeypatch.setenv(BLAS_TUNE_ENV, "0")
    prompts = _prompts(tok, 2, seed=12)
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=0, max_batch=4
    ) as eng:
        await _all(eng, prompts, [GenerationParams(max_tokens=4)] * 2)
        stats = await eng.stats()
    assert "blas" not in stats["batch"]["batch"]
