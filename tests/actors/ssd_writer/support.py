"""Helpers shared by the cold tier's actor tests: engine turns, file ports, small probes."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from actors.runtime import ActorSystem
from actors.ssd_writer import ColdTier, FileIdentity, SsdWriterConfig
from kernels import CacheRegistry, EngineThread, RegisteredCache, cache_arrays
from kernels.cache._file_port import (
    BytesLike,
    DirEntryInfo,
    FileLock,
    FileStat,
    OsFilePort,
    WritableBuffer,
)
from messages import SsdStats, SsdStatsRequest, Store
from messages.ssd_writer import SsdIndex, SsdIndexRequest

ASK = 30.0
T = TypeVar("T")
IDENTITY = FileIdentity(model_id="tiny-llama", fingerprint="fp-test", tokenizer_hash="tok")


class ThreadTurns:
    """Engine turns as plain engine-thread jobs; counts them."""

    def __init__(self, engine: EngineThread) -> None:
        self.engine = engine
        self.turns = 0

    async def run_when_idle(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` as one job on the engine thread."""
        self.turns += 1
        return await self.engine.run(fn)


async def register(
    engine: EngineThread, registry: CacheRegistry, model: Any, tokens: tuple[int, ...]
) -> RegisteredCache:
    """Prefill ``tokens`` on the engine thread and register the cache."""

    def job() -> RegisteredCache:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(tokens)]), cache=cache), *cache_arrays(cache))
        return registry.register(cache, offset=len(tokens))

    return await engine.run(job)


def config(root: Path, max_bytes: int = 1 << 30) -> SsdWriterConfig:
    """The tier's settings for a test (any longer prefix restores: the prompts here are short)."""
    # NOTE: the restore floor (MIN_RESTORE_TOKENS) has its own tests (test_restore_policy.py).
    return SsdWriterConfig(root=str(root), identity=IDENTITY, max_bytes=max_bytes,
                           min_restore_tokens=1)


def store_body(reg: RegisteredCache, tokens: tuple[int, ...]) -> Store:
    """A Store of ``reg`` under ``tokens``."""
    return Store(handle=reg.handle, tokens=tokens, meta=reg.meta)


def files(root: Path, suffix: str) -> list[Path]:
    """Every file under ``root`` ending with ``suffix``."""
    return sorted(p for p in root.rglob(f"*{suffix}") if p.is_file())


def exists(path: str) -> bool:
    """Whether ``path`` exists (a sync helper: async tests do no blocking calls)."""
    return os.path.exists(path)


def flip_last_byte(path: str) -> None:
    """Flip one bit of the file's last byte (inside its last tensor)."""
    raw = bytearray(Path(path).read_bytes())
    raw[-1] ^= 0x01
    Path(path).write_bytes(bytes(raw))


def disk_bytes(root: Path) -> int:
    """Bytes of every entry and temp file under ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*.kvt*") if p.is_file())


# --- file ports -------------------------------------------------------------


class ForwardingPort:
    """A FilePort that forwards every call to an ``OsFilePort`` (subclasses hook in)."""

    def __init__(self) -> None:
        self.inner = OsFilePort()

    def _before(self, method: str, *args: Any) -> None:
        """Hook run before every call."""

    def open_temp(self, path: str) -> int:
        """Forward."""
        self._before("open_temp", path)
        return self.inner.open_temp(path)

    def pwrite_all(self, fd: int, data: BytesLike, offset: int) -> None:
        """Forward."""
        self._before("pwrite_all", fd, data, offset)
        self.inner.pwrite_all(fd, data, offset)

    def truncate(self, fd: int, size: int) -> None:
        """Forward."""
        self._before("truncate", fd, size)
        self.inner.truncate(fd, size)

    def fsync(self, fd: int) -> None:
        """Forward."""
        self._before("fsync", fd)
        self.inner.fsync(fd)

    def close(self, fd: int) -> None:
        """Forward."""
        self._before("close", fd)
        self.inner.close(fd)

    def replace(self, src: str, dst: str) -> None:
        """Forward."""
        self._before("replace", src, dst)
        self.inner.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        """Forward."""
        self._before("fsync_dir", path)
        self.inner.fsync_dir(path)

    def unlink(self, path: str) -> None:
        """Forward."""
        self._before("unlink", path)
        self.inner.unlink(path)

    def listdir(self, path: str) -> list[str]:
        """Forward."""
        self._before("listdir", path)
        return self.inner.listdir(path)

    def scandir(self, path: str) -> list[DirEntryInfo]:
        """Forward."""
        self._before("scandir", path)
        return self.inner.scandir(path)

    def stat(self, path: str) -> FileStat:
        """Forward."""
        self._before("stat", path)
        return self.inner.stat(path)

    def fstat(self, fd: int) -> FileStat:
        """Forward."""
        self._before("fstat", fd)
        return self.inner.fstat(fd)

    def utime(self, path: str, mtime_ns: int | None = None) -> None:
        """Forward."""
        self._before("utime", path)
        self.inner.utime(path, mtime_ns)

    def open_read(self, path: str) -> int:
        """Forward."""
        self._before("open_read", path)
        return self.inner.open_read(path)

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """Forward."""
        self._before("pread_into", fd, buf, offset)
        self.inner.pread_into(fd, buf, offset)

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """Forward."""
        self._before("preadv_into", fd, bufs, offset)
        self.inner.preadv_into(fd, bufs, offset)

    def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """Forward."""
        self._before("pread_exact", fd, size, offset)
        return self.inner.pread_exact(fd, size, offset)

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        """Forward."""
        self._before("makedirs", path)
        self.inner.makedirs(path, mode)

    def lock(self, path: str) -> FileLock:
        """Forward."""
        self._before("lock", path)
        return self.inner.lock(path)


class ThreadRecordingPort(ForwardingPort):
    """Records the thread of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def _before(self, method: str, *args: Any) -> None:
        self.threads.add(threading.get_ident())


class CapCheckingPort(ForwardingPort):
    """Measures bytes on disk under ``root`` before every write and after every truncate."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.cap = 0
        self.max_seen = 0

    def _before(self, method: str, *args: Any) -> None:
        if method in ("pwrite_all", "fsync", "replace"):
            self.max_seen = max(self.max_seen, disk_bytes(self.root / "capped"))

    def truncate(self, fd: int, size: int) -> None:
        """Forward, then measure (the temp file now has its final length)."""
        super().truncate(fd, size)
        self.max_seen = max(self.max_seen, disk_bytes(self.root / "capped"))


class InjectedFault(OSError):
    """The error a :class:`FaultPort` raises."""


class FaultPort(ForwardingPort):
    """Fails ONE call of a store step with ``ENOSPC``, ``EIO`` or a short write, then recovers.

    ``step``: ``open_temp``, ``truncate``, ``write_tensor`` (a positional
    write at a non-zero offset), ``write_header`` (the write at offset 0,
    made last), ``fsync``, ``close``, ``replace``, ``fsync_dir``.
    ``fault``: ``enospc``, ``eio`` or ``short`` (half the bytes written,
    then ``EIO``; writes only).
    """

    def __init__(self, step: str, fault: str) -> None:
        super().__init__()
        self.step = step
        self.fault = fault
        self.fired = False

    def _error(self) -> OSError:
        code = errno.ENOSPC if self.fault == "enospc" else errno.EIO
        return InjectedFault(code, f"injected {self.fault} at {self.step}")

    def _before(self, method: str, *args: Any) -> None:
        if self.fired:
            return
        step = method
        if method == "pwrite_all":
            step = "write_header" if args[2] == 0 else "write_tensor"
        if step != self.step:
            return
        self.fired = True
        if self.fault == "short":
            fd, data, offset = args
            view = memoryview(data).cast("B")
            self.inner.pwrite_all(fd, view[: len(view) // 2], offset)
        raise self._error()

    def close(self, fd: int) -> None:
        """Close for real even when the fault fires (as a failing close(2) does)."""
        try:
            self._before("close", fd)
        finally:
            self.inner.close(fd)


async def ssd_stats(system: ActorSystem, tier: ColdTier) -> SsdStats:
    """The index's statistics, asked (no test reads the index's state)."""
    return await system.ask(tier.name, SsdStatsRequest(), timeout=ASK, expect=SsdStats)


async def ssd_index(system: ActorSystem, tier: ColdTier) -> SsdIndex:
    """The index's files and leftovers, asked."""
    return await system.ask(tier.name, SsdIndexRequest(), timeout=ASK, expect=SsdIndex)
