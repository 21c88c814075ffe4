"""File ports for the crash suite: a forwarding base and deliberately broken writers.

Each broken variant wraps a correct port and changes one thing the write
protocol depends on, as a buggy writer would. The crash checker must catch
every one of them (``test_broken_writers.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels.cache._file_port import (
    BytesLike,
    DirEntryInfo,
    FileLock,
    FilePort,
    FileStat,
    WritableBuffer,
)

__all__ = [
    "ForwardingPort",
    "NoDirFsyncPort",
    "RenameBeforeFsyncPort",
    "TrustedRetryFsyncPort",
]


class ForwardingPort:
    """A :class:`FilePort` that forwards every call to ``inner`` (variants override some)."""

    def __init__(self, inner: FilePort) -> None:
        self.inner = inner

    def open_temp(self, path: str) -> int:
        """Forward."""
        return self.inner.open_temp(path)

    def pwrite_all(self, fd: int, data: BytesLike, offset: int) -> None:
        """Forward."""
        self.inner.pwrite_all(fd, data, offset)

    def truncate(self, fd: int, size: int) -> None:
        """Forward."""
        self.inner.truncate(fd, size)

    def fsync(self, fd: int) -> None:
        """Forward."""
        self.inner.fsync(fd)

    def close(self, fd: int) -> None:
        """Forward."""
        self.inner.close(fd)

    def replace(self, src: str, dst: str) -> None:
        """Forward."""
        self.inner.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        """Forward."""
        self.inner.fsync_dir(path)

    def unlink(self, path: str) -> None:
        """Forward."""
        self.inner.unlink(path)

    def listdir(self, path: str) -> list[str]:
        """Forward."""
        return self.inner.listdir(path)

    def scandir(self, path: str) -> list[DirEntryInfo]:
        """Forward."""
        return self.inner.scandir(path)

    def stat(self, path: str) -> FileStat:
        """Forward."""
        return self.inner.stat(path)

    def fstat(self, fd: int) -> FileStat:
        """Forward."""
        return self.inner.fstat(fd)

    def utime(self, path: str, mtime_ns: int | None = None) -> None:
        """Forward."""
        self.inner.utime(path, mtime_ns)

    def open_read(self, path: str) -> int:
        """Forward."""
        return self.inner.open_read(path)

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """Forward."""
        self.inner.pread_into(fd, buf, offset)

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """Forward."""
        self.inner.preadv_into(fd, bufs, offset)

    def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """Forward."""
        return self.inner.pread_exact(fd, size, offset)

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        """Forward."""
        self.inner.makedirs(path, mode)

    def lock(self, path: str) -> FileLock:
        """Forward."""
        return self.inner.lock(path)


class NoDirFsyncPort(ForwardingPort):
    """Broken: the directory is never fsynced after the rename (the call claims success)."""

    def fsync_dir(self, path: str) -> None:
        """Do nothing."""


class RenameBeforeFsyncPort(ForwardingPort):
    """Broken: the file gets its final name before its data is synced.

    The writer's ``fsync`` and ``close`` are held back and performed right
    after its ``replace``: the rename reaches the directory while the data
    is still only in the page cache.
    """

    def __init__(self, inner: FilePort) -> None:
        super().__init__(inner)
        self._held: list[int] = []
        self._closing: set[int] = set()

    def fsync(self, fd: int) -> None:
        """Hold the fsync until the next rename."""
        self._held.append(fd)

    def close(self, fd: int) -> None:
        """Hold the close of a descriptor whose fsync is held."""
        if fd in self._held:
            self._closing.add(fd)
            return
        self.inner.close(fd)

    def replace(self, src: str, dst: str) -> None:
        """Rename first, then the held fsyncs and closes."""
        self.inner.replace(src, dst)
        held, self._held = self._held, []
        for fd in held:
            self.inner.fsync(fd)
            if fd in self._closing:
                self._closing.discard(fd)
                self.inner.close(fd)


class TrustedRetryFsyncPort(ForwardingPort):
    """Broken (*fsyncgate*): a failed ``fsync`` is retried, and the retry's success trusted."""

    def __init__(self, inner: FilePort) -> None:
        super().__init__(inner)
        self.retried = 0

    def fsync(self, fd: int) -> None:
        """fsync; on failure fsync again and report whatever the second call says."""
        try:
            self.inner.fsync(fd)
        except OSError:
            self.retried += 1
            self.inner.fsync(fd)
