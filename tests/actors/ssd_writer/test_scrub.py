"""The idle scrubber: stored files are re-verified while the engine is idle; bad ones go."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import anyio
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from actors.engine import wiring
from actors.runtime import Actor, ActorSystem, Context
from actors.ssd_writer import SsdWriterConfig, core
from kernels.cache import KvFileWriter, OsFilePort, plan_entry, read_header, tensor_bytes
from messages import Envelope, SsdStats
from messages.gateway import RunWhenIdle, TurnDone

from .support import IDENTITY, ssd_stats

pytestmark = pytest.mark.anyio


class _Gateway(Actor):
    """Answers every RunWhenIdle at once: granted (idle) or refused (busy); counts them."""

    def __init__(self, idle: bool, asks: list[str]) -> None:
        self.idle = idle
        self.asks = asks

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        assert isinstance(body, RunWhenIdle)
        self.asks.append(body.step_id)
        await ctx.reply(envelope, TurnDone(step_id=body.step_id, ok=self.idle))


def _store(root: Path, tokens: tuple[int, ...], *, flip: bool = False) -> Path:
    """Write a committed entry for ``tokens`` where the index expects it (a flipped bit in its
    last tensor with ``flip``)."""
    state = core.IndexState(root=str(root), fingerprint=IDENTITY.fingerprint, max_bytes=1 << 30)
    path = Path(state.path_of("", tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    cache = KVCache()
    mx.random.seed(len(tokens))
    n = len(tokens)
    cache.update_and_fetch(mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 16)))
    plan = plan_entry(
        [cache],
        model_id=IDENTITY.model_id,
        fingerprint=IDENTITY.fingerprint,
        namespace="",
        tokenizer_hash=IDENTITY.tokenizer_hash,
        tokens=tokens,
    )
    port = OsFilePort()
    with KvFileWriter(port, plan) as writer:
        writer.begin(str(path.parent))
        for i in range(len(plan.tensors)):
            writer.write_tensor(i, tensor_bytes(plan, i))
        writer.commit(str(path))
    if flip:
        last = read_header(port, str(path)).tensors[-1]
        raw = bytearray(path.read_bytes())
        raw[last.offset] ^= 0x04
        path.write_bytes(bytes(raw))
    return path


def _config(root: Path) -> SsdWriterConfig:
    return SsdWriterConfig(
        root=str(root),
        identity=IDENTITY,
        max_bytes=1 << 30,
        scrub_interval_s=0.02,
        scrub_idle_wait_s=1.0,
    )


class _NoSource:
    """A tensor source no test here reaches (nothing is stored)."""

    async def plan(self, handle: str, *, namespace: str, tokens: tuple[int, ...]) -> object:
        raise AssertionError("no store in this test")

    async def tensor(self, plan: object, index: int) -> bytes:
        raise AssertionError("no store in this test")

    async def finish(self, plan: object) -> None:
        raise AssertionError("no store in this test")


class _UndeletablePort(OsFilePort):
    """The real file system, except that unlinking ``path`` fails with EIO."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def unlink(self, path: str) -> None:
        """Fail for the chosen file."""
        if path == self.path:
            raise OSError(errno.EIO, "injected EIO", path)
        super().unlink(path)


async def _run(
    root: Path,
    *,
    idle: bool,
    until: Callable[[SsdStats], bool],
    seconds: float,
    port: OsFilePort | None = None,
) -> tuple[SsdStats, list[str]]:
    """Run the tier until ``until`` holds for its asked statistics; the last ones and the asks."""
    asks: list[str] = []
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: _Gateway(idle, asks))
        tier = wiring.spawn_ssd_writer(
            system,
            config=_config(root),
            source=_NoSource(),  # type: ignore[arg-type]
            gateway="gateway",
            port=port,
        )
        stats = await ssd_stats(system, tier)
        with anyio.move_on_after(seconds):
            while not until(stats):
                await anyio.sleep(0.01)
                stats = await ssd_stats(system, tier)
        stats = await ssd_stats(system, tier)
    return stats, asks


async def test_the_scrubber_removes_a_file_whose_tensor_went_bad(tmp_path: Path) -> None:
    """With the engine idle, the scrubber re-verifies every stored file in turn; the one with
    a flipped bit is removed and counted, the good one stays indexed and on disk."""
    good = _store(tmp_path, (1, 2, 3, 4))
    bad = _store(tmp_path, (5, 6, 7, 8, 9), flip=True)
    stats, asks = await _run(
        tmp_path, idle=True, until=lambda s: s.scrubbed >= 3, seconds=20.0
    )
    assert stats.scrubbed >= 3
    assert (stats.scrub_corrupt, stats.corrupt_removed, stats.entries) == (1, 1, 1)
    assert (good.exists(), bad.exists()) == (True, False)
    good_bytes = sum(t.nbytes for t in read_header(OsFilePort(), str(good)).tensors)
    assert stats.scrubbed_bytes == (stats.scrubbed - stats.scrub_corrupt) * good_bytes
    assert set(asks) == {wiring.SCRUB_GATE_STEP}


async def test_a_bad_file_the_scrubber_cannot_delete_still_counts_toward_the_cap(
    tmp_path: Path,
) -> None:
    """The scrubber drops a bad file it cannot unlink from the index (it is never offered
    again), but its bytes keep counting: indexed plus leftover bytes equal the bytes on disk."""
    good = _store(tmp_path, (1, 2, 3, 4))
    bad = _store(tmp_path, (5, 6, 7, 8, 9), flip=True)
    stats, _ = await _run(
        tmp_path,
        idle=True,
        until=lambda s: s.scrub_corrupt >= 1,
        seconds=20.0,
        port=_UndeletablePort(bad),
    )
    assert (stats.scrub_corrupt, stats.corrupt_removed, stats.entries) == (1, 0, 1)
    assert bad.exists()
    on_disk = good.stat().st_size + bad.stat().st_size
    assert stats.bytes + stats.leftover_bytes == on_disk
    assert stats.leftover_files == 1


async def test_the_scrubber_reads_nothing_while_the_engine_is_busy(tmp_path: Path) -> None:
    """When the gateway refuses the idle turn (requests keep the engine busy), no file is read:
    the flipped file is still there and nothing was scrubbed."""
    bad = _store(tmp_path, (5, 6, 7, 8, 9), flip=True)
    stats, asks = await _run(tmp_path, idle=False, until=lambda s: False, seconds=0.5)
    assert len(asks) >= 3
    assert (stats.scrubbed, stats.corrupt_removed) == (0, 0)
    assert bad.exists()
