"""The restore's answer comes before the reader's pass, the landing goes right behind it, and the
estimator's landing figure is only what the landing adds after the pass."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest

from actors.engine.wiring import spawn_ssd_writer
from actors.runtime import ActorSystem
from actors.ssd_writer import EngineTensorSource, HostStaging, LandingObservation, StagedEntry
from kernels import CacheRegistry, EngineThread, cache_arrays
from kernels.cache._file_port import OsFilePort, WritableBuffer
from kernels.cache._kv_header import read_header
from kernels.cache._kv_reader import PassFailed, open_file
from messages import Restore, RestoreResult, StoreResult
from tests.actors.ssd_writer.support import (
    ASK,
    IDENTITY,
    ThreadTurns,
    config,
    register,
    ssd_stats,
    store_body,
)
from tests.crash.ports import ForwardingPort
from tests.kernels.cache.test_kv_file import _filled_kv, write_entry
from tests.kernels.cache.test_kv_file_overlap import ScriptedPort

WAIT = 10.0


class HoldingPort(ForwardingPort):
    """While ``armed``, the first tensor read of a pass (``pread_into``) waits for ``release``."""

    def __init__(self) -> None:
        super().__init__(OsFilePort(writeback=None))
        self.armed = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """Hold once armed, then forward."""
        if self.armed.is_set() and not self.release.is_set():
            self.held.set()
            assert self.release.wait(WAIT), "the test never released the pass"
        super().pread_into(fd, buf, offset)


class Clock:
    """A scripted clock: each call returns the next reading."""

    def __init__(self, *readings: float) -> None:
        self._readings: Iterator[float] = iter(readings)

    def __call__(self) -> float:
        return next(self._readings)


def _held_entry(tmp_path: Path, *, fail_at: int | None = None) -> tuple[ScriptedPort, StagedEntry]:
    caches = [_filled_kv(9, seed=i) for i in range(3)]
    path = write_entry(caches, list(range(9)), tmp_path)
    header = read_header(OsFilePort(writeback=None), str(path))
    port = ScriptedPort(header, hold_at=1, fail_at=fail_at)
    file = open_file(port, str(path), header)
    port.entry = file
    return port, StagedEntry(str(path), file)


def _run_pass(staged: StagedEntry) -> threading.Thread:
    def run() -> None:
        try:
            staged.file.pass_over()
        except (OSError, PassFailed):
            return  # NOTE: the tests check the landing's side.

    thread = threading.Thread(target=run, name="test-reader")
    thread.start()
    return thread


def test_a_landing_behind_the_pass_reports_only_the_time_after_it(tmp_path: Path) -> None:
    """Landing started at t=0, pass ended at t=5, landing done at t=6: the estimator gets 1 s."""
    port, staged = _held_entry(tmp_path)
    staging = HostStaging(clock=Clock(0.0, 5.0, 6.0))
    seen: list[LandingObservation] = []
    staging.bind_reports(seen.append)
    reader = _run_pass(staged)
    assert port.held.wait(WAIT)
    timer = threading.Timer(0.2, port.release.set)
    timer.start()
    try:
        caches = staging.land(staged)
    finally:
        timer.join(WAIT)
        reader.join(WAIT)
        staging.close()
    assert len(caches) == 3
    [obs] = seen
    assert (obs.ok, obs.seconds, obs.nbytes) == (True, 1.0, staged.nbytes)
    assert staged.file.closed


def test_a_landing_whose_pass_failed_is_not_recorded_against_the_file(tmp_path: Path) -> None:
    """The pass fails at tensor 3: the landing raises PassFailed, records nothing, closes the file."""
    port, staged = _held_entry(tmp_path, fail_at=3)
    staging = HostStaging()
    seen: list[LandingObservation] = []
    staging.bind_reports(seen.append)
    reader = _run_pass(staged)
    assert port.held.wait(WAIT)
    port.release.set()
    try:
        with pytest.raises(PassFailed):
            staging.land(staged)
    finally:
        reader.join(WAIT)
        staging.close()
    assert seen == []
    assert (staging.landed, staging.land_failures) == (0, 0)
    assert staged.file.closed
    assert len(port.closed) == 1


@pytest.mark.anyio
async def test_the_restore_is_answered_before_the_pass_and_lands_behind_it(
    tmp_path: Path, engine: EngineThread, model: Any
) -> None:
    """With the pass held, Restore is answered; the engine turn's landing waits and then is bit-exact."""
    registry = CacheRegistry()
    tokens = tuple(range(1, 13))
    reg = await register(engine, registry, model, tokens)
    originals = await engine.run(
        lambda: [mx.array(a) for a in cache_arrays(registry.get(reg.handle))]
    )
    source = EngineTensorSource(ThreadTurns(engine), registry, IDENTITY)
    port = HoldingPort()
    async with ActorSystem() as system:
        tier = spawn_ssd_writer(system, config=config(tmp_path), source=source, port=port)
        stored = await system.ask(
            "ssd_writer", store_body(reg, tokens), timeout=ASK, expect=StoreResult
        )
        assert stored.path is not None
        port.armed.set()
        restored = await system.ask(
            "ssd_writer", Restore(path=stored.path), timeout=ASK, expect=RestoreResult
        )
        assert restored.ok
        assert restored.staging_id is not None
        assert await anyio.to_thread.run_sync(port.held.wait, WAIT)
        staged = tier.staging.take(restored.staging_id)
        assert staged is not None
        assert not staged.file.passed
        timer = threading.Timer(0.2, port.release.set)
        timer.start()
        try:
            caches = await engine.run(
                lambda: [mx.array(a) for a in cache_arrays(tier.staging.land(staged))]
            )
        finally:
            timer.join(WAIT)
        for _ in range(int(ASK / 0.01)):
            if (await ssd_stats(system, tier)).restores:
                break
            await anyio.sleep(0.01)
        stats = await ssd_stats(system, tier)
    same = await engine.run(
        lambda: [
            bool(mx.array_equal(w, g[..., : w.shape[2], :]).item())
            for w, g in zip(originals, caches, strict=True)
        ]
    )
    assert (stats.restores, stats.restore_failures) == (1, 0)
    assert same == [True] * len(originals)
    assert staged.file.closed
    registry.dispose(reg.handle)
