"""A batch step's checkpoints read back together (``KVTIER_CHECKPOINT_READ_AHEAD``) stand in for the views turn's own read.

Where host reads migrate (CUDA; forced here with ``_kv_writer._HOST_READ_COPY``)
each read-back is one managed allocation and one synchronous copy, so the
batch lane reads a step's checkpoints in one (``kernels.cache.read_ahead``)
and keeps each read with its registry handle; the checkpoint's views turn
hands that read out when it holds exactly the bytes the turn would read
(``read_fits``: same cuts, same sizes), and reads for itself otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import actors.ssd_writer.ports as ports
from actors.ssd_writer import EngineTensorSource
from kernels import CacheRegistry, EngineThread, RegisteredCache, cache_arrays
from kernels.cache import (
    DELTA_ENV,
    READ_AHEAD_ENV,
    GenerationCheckpoint,
    HostRead,
    OsFilePort,
    _kv_writer,
    plan_entry,
    read_ahead,
    read_fits,
    read_header,
    tensors_bytes,
)
from kernels.engine import BLAS_TUNE_ENV
from messages.gateway import GenerationParams
from tests.actors.checkpoints.restart_support import (
    files,
    resumed_run,
    section,
    tiny_engine,
    tokens,
    until_written,
)
from tests.actors.ssd_writer.support import IDENTITY, ThreadTurns

pytestmark = pytest.mark.anyio

KEY = "cd" * 16
PROMPT = (1, 2, 3, 4, 5)
EMITTED = (6, 7, 8)
TOKENS = (*PROMPT, *EMITTED)


async def _snapshots(engine: EngineThread, registry: CacheRegistry, model: Any, n: int) -> list[RegisteredCache]:
    """``n`` owned snapshots of live caches after :data:`TOKENS` (as a batch step's checkpoints)."""

    def job() -> list[RegisteredCache]:
        out = []
        for _ in range(n):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([list(TOKENS)]), cache=cache), *cache_arrays(cache))
            reg = registry.snapshot(cache, offset=len(TOKENS))
            mx.eval(*cache_arrays(registry.get(reg.handle)))
            out.append(reg)
        return out

    return await engine.run(job)


def _record() -> GenerationCheckpoint:
    return GenerationCheckpoint(KEY, len(PROMPT), 9, len(EMITTED), None)


async def test_a_read_ahead_is_what_the_views_turn_hands_out_and_another_cut_is_not(
    engine: EngineThread, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two checkpoints read back in one buffer: the first's views turn hands out exactly that
    read's views (no read of its own), byte for byte what it would have read; a read cut for
    another base (tails it does not ask for) is set aside and the turn reads for itself."""
    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", True)
    registry = CacheRegistry()
    regs = await _snapshots(engine, registry, model, 2)
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)

    def ahead() -> list[HostRead]:
        plans = [plan_entry(registry.get(r.handle), model_id="", fingerprint="", namespace="",
                            tokenizer_hash="", tokens=TOKENS) for r in regs]
        # NOTE: the second read is cut after 2 tokens: no views turn without a base asks for that.
        reads = read_ahead([(plans[0], {}), (plans[1], dict.fromkeys(range(len(plans[1].tensors)), 2))])
        for reg, read in zip(regs, reads, strict=True):
            registry.attach_read(reg.handle, read)
        return reads

    reads = await engine.run(ahead)
    # NOTE: one buffer behind both reads.
    assert reads[0].views[0].obj is reads[1].views[0].obj
    results = []
    for reg in regs:
        results.append(await source.checkpoint_views(reg.handle, namespace="", tokens=TOKENS,
                                                     checkpoint=_record()))

    def own_bytes(i: int) -> list[bytes]:
        plan = results[i][0]
        return [bytes(v) for v in tensors_bytes(plan, range(len(plan.tensors)))]

    try:
        views0, views1 = (views for _, views in results)
        assert all(v is r for v, r in zip(views0, reads[0].views, strict=True))
        assert [bytes(v) for v in views0] == await engine.run(own_bytes, 0)
        assert not any(v is r for v, r in zip(views1, reads[1].views, strict=False))
        assert [bytes(v) for v in views1] == await engine.run(own_bytes, 1)
        assert (source.read_ahead_used, source.read_ahead_missed) == (1, 1)
        assert registry.take_read(regs[0].handle) is None
    finally:
        for plan, views in results:
            views.clear()
            await source.finish(plan)
        for reg in regs:
            registry.dispose(reg.handle)


def _tensor_bytes(root: Path) -> dict[str, bytes]:
    """Each checkpoint file's tensor data (past its header) by file name."""
    port = OsFilePort()
    out = {}
    for path in files(root):
        header = read_header(port, str(path))
        out[path.name] = path.read_bytes()[header.data_offset:]
    return out


async def _two_answers(root: Path, model: Any, params: GenerationParams,
                       prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, Any]]:
    """Two answers decoding together on the batch lane, cut at 18 tokens, every checkpoint
    durable: their tokens and the ``generation_checkpoints`` statistics."""
    got: list[list[int]] = [[], []]
    async with tiny_engine(model, root, 8, max_batch=4) as first:
        async def run(i: int) -> None:
            got[i] = await tokens(first, params, cancel_after=18, prompt=prompts[i])

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(run, i)
        # NOTE: a key's queued checkpoint gives way to its newer one, so how many of the four
        # are written depends on the writer's pace; the flush waits for every one queued.
        await until_written(first, 2)
        await first.flush(timeout=30)
        counted = await section(first)
    return got, counted


def test_read_ahead_is_on_by_default_only_where_host_reads_migrate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, the read-ahead is on where host reads migrate (CUDA) and off elsewhere; an off word turns it off."""
    monkeypatch.delenv(READ_AHEAD_ENV, raising=False)
    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", True)
    assert _kv_writer.read_ahead_enabled()
    monkeypatch.setenv(READ_AHEAD_ENV, "off")
    assert not _kv_writer.read_ahead_enabled()
    monkeypatch.delenv(READ_AHEAD_ENV)
    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", False)
    assert not _kv_writer.read_ahead_enabled()


async def test_the_batch_lane_reads_a_steps_checkpoints_ahead_and_a_restart_resumes_from_them(
    model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two answers decoding together on the batch lane, deltas on: with read-ahead on, their
    checkpoints' views turns take the step's reads (counted through ``read_fits``), a file of the
    same point holds the same tensor bytes as with it off, and a restarted Engine resumes both
    answers exactly as uninterrupted runs."""
    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", True)
    monkeypatch.setenv(DELTA_ENV, "1")
    monkeypatch.setenv(BLAS_TUNE_ENV, "0")
    fits: list[bool] = []
    real_fits = read_fits

    def spied(*args: Any) -> bool:
        fits.append(real_fits(*args))
        return fits[-1]

    monkeypatch.setattr(ports, "read_fits", spied)
    params = GenerationParams(max_tokens=40)
    prompts = [[3 + (i * 7) % 80 for i in range(30)], [5 + (i * 11) % 70 for i in range(30)]]

    def make(root: Path | None, every: int) -> Any:
        return tiny_engine(model, root, every, max_batch=4)

    async with make(None, 0) as plain:
        expected = [await tokens(plain, params, prompt=p) for p in prompts]
    monkeypatch.setenv(READ_AHEAD_ENV, "off")
    got, counted = await _two_answers(tmp_path / "off", model, params, prompts)
    assert got == [e[:18] for e in expected]
    assert fits == []
    assert (counted["read_ahead_used"], counted["read_ahead_missed"]) == (0, 0)
    monkeypatch.setenv(READ_AHEAD_ENV, "on")
    got, counted = await _two_answers(tmp_path / "on", model, params, prompts)
    assert got == [e[:18] for e in expected]
    assert True in fits
    assert counted["read_ahead_used"] == fits.count(True) >= 1
    assert counted["read_ahead_missed"] == fits.count(False)
    off, on = _tensor_bytes(tmp_path / "off"), _tensor_bytes(tmp_path / "on")
    assert len(on) == len(off) == 2
    # NOTE: a batch row decodes on while its reader lags (its events are held),
    # so on a loaded machine one run's answer may pass the next checkpoint
    # boundary (24) before the cut at 18 lands: a file is named by its sample
    # index, and the bytes compare where both runs checkpointed the same point.
    same = sorted(set(on) & set(off))
    assert same, f"no answer checkpointed at the same point in both runs: {sorted(on)}, {sorted(off)}"
    for name in same:
        assert on[name] == off[name], name
    for i, prompt in enumerate(prompts):
        resumed, stats = await resumed_run(make, tmp_path / "on", params, prompt=prompt)
        assert resumed == expected[i]
        assert stats["generation_checkpoints"]["resumed"] == 1
