"""The file-system port of the cold tier: every file operation goes through it.

The cold tier never calls ``os`` directly. Tests replace :class:`OsFilePort`
with ports that inject faults (``ENOSPC``, ``EIO``, short writes, failed
``fsync``) or model a crash (unsynced data lost), and the codec's guarantees
are proven against those.

All methods are synchronous and may block on the disk; callers run them on
worker threads, never on the event loop or the engine thread.

Descriptors are plain ``int`` values owned by the port that issued them: a
simulated port may hand out any integers it likes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import stat as stat_mod
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "MAX_IOV",
    "BytesLike",
    "DirEntryInfo",
    "FileLock",
    "FilePort",
    "FileStat",
    "LockUnavailable",
    "OsFilePort",
    "PageCacheProbe",
    "ShortRead",
    "WritableBuffer",
    "WritebackFn",
    "full_fsync",
]

BytesLike = bytes | bytearray | memoryview
"""Data a port can write (a C-contiguous buffer; ``memoryview`` is never copied)."""

WritableBuffer = bytearray | memoryview
"""A writable, C-contiguous byte buffer a port reads into."""

MAX_IOV = 1024
"""The most buffers one :meth:`FilePort.preadv_into` takes (Linux's ``IOV_MAX``)."""

# NOTE: O_CLOEXEC keeps cold-tier descriptors out of any child process; it is
# 0 where the platform lacks it, which leaves the flags otherwise unchanged.
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_F_FULLFSYNC: int | None = getattr(fcntl, "F_FULLFSYNC", None)

# NOTE: errnos with which F_FULLFSYNC reports "this file system cannot do it"
# (SMB/NFS/FUSE mounts, some external drives). Only these fall back to fsync;
# EIO and every other error is a real failure and is raised.
_FULLFSYNC_UNSUPPORTED = frozenset(
    {errno.EINVAL, errno.ENOTSUP, errno.ENOTTY, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}
)


# NOTE: errnos with which sync_file_range says "cannot start writeback here"
# (a sandbox without the call, a descriptor it does not apply to). Only these
# turn the early start off; the commit's fsync still makes the data durable.
_WRITEBACK_UNSUPPORTED = frozenset(
    {
        errno.ENOSYS,
        errno.EINVAL,
        errno.ESPIPE,
        errno.ENOTSUP,
        getattr(errno, "EOPNOTSUPP", errno.ENOTSUP),
    }
)
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages in the range, don't wait

WritebackFn = Callable[[int, int, int], None]
"""``(fd, offset, nbytes)``: start writing a just-written range back to the disk, without waiting."""


def _libc_sync_file_range() -> WritebackFn | None:
    """Linux's ``sync_file_range(..., SYNC_FILE_RANGE_WRITE)`` (the os module has no binding).

    ``None`` off Linux or where the C library lacks the call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int, offset: int, nbytes: int) -> None:
        # NOTE: ctypes releases the GIL for the call; it may block only
        # while the device queue is full.
        if fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return start


_DEFAULT_WRITEBACK = _libc_sync_file_range()


class _Residency:
    """``mmap`` + ``mincore`` + ``munmap`` from the C library: which pages of a file are cached.

    NOTE: through ctypes rather than the ``mmap`` module, which lends no
    address of a read-only mapping; the mapping is never read (only its
    page table is asked) and is unmapped before the call returns.
    """

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._mmap = libc.mmap
        self._mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        self._mmap.restype = ctypes.c_void_p
        self._munmap = libc.munmap
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._munmap.restype = ctypes.c_int
        self._mincore = libc.mincore
        self._mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._mincore.restype = ctypes.c_int
        self._page = mmap.PAGESIZE

    def all_cached(self, fd: int, size: int, ranges: Sequence[tuple[int, int]]) -> bool:
        spans = [(o, n) for o, n in ranges if n > 0]
        if not spans:
            return True
        if size <= 0 or any(o < 0 or o + n > size for o, n in spans):
            return False
        addr = self._mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return False
        try:
            page = self._page
            # NOTE: range by range, stopping at the first page out of the
            # cache: a file read from the disk is answered after its first
            # range, not after a walk over all of it. Only the ranges asked
            # count: a file's alignment padding is never read, so its pages
            # may never be cached.
            for offset, nbytes in spans:
                first = offset // page * page
                length = offset + nbytes - first
                pages = (length + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if self._mincore(addr + first, length, vec) != 0:
                    return False
                # NOTE: bit 0 of each byte: the page is resident.
                if not bool(np.all(np.frombuffer(memoryview(vec), dtype=np.uint8) & 1)):
                    return False
            return True
        finally:
            self._munmap(addr, size)


def _libc_residency() -> _Residency | None:
    """The residency probe where the C library has ``mmap``/``mincore`` (``None`` elsewhere)."""
    if not (sys.platform.startswith("linux") or sys.platform == "darwin"):
        return None
    try:
        return _Residency()
    except (OSError, AttributeError):
        return None


_RESIDENCY = _libc_residency()


class ShortRead(OSError):
    """A positional read hit end of file before the requested range was filled.

    For a cold-tier file this means truncation; the codec reports it as corruption.
    """

    def __init__(self, *, offset: int, wanted: int, got: int) -> None:
        super().__init__(
            errno.EIO, f"short read at offset {offset}: wanted {wanted} bytes, got {got}"
        )
        self.offset = offset
        self.wanted = wanted
        self.got = got


class LockUnavailable(OSError):
    """Another process (or descriptor) holds the advisory lock on this path."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EWOULDBLOCK, f"lock held by another owner: {path}")
        self.path = path


@dataclass(frozen=True, slots=True)
class FileStat:
    """The subset of ``stat`` the cold tier uses (symlinks are never followed)."""

    size: int
    mtime_ns: int
    is_file: bool
    is_dir: bool


@dataclass(frozen=True, slots=True)
class DirEntryInfo:
    """One directory entry, stat'ed without following symlinks."""

    name: str
    path: str
    size: int
    mtime_ns: int
    is_file: bool
    is_dir: bool
    is_symlink: bool


@runtime_checkable
class FileLock(Protocol):
    """A held advisory lock; :meth:`release` (or leaving the ``with``) drops it."""

    def release(self) -> None:
        """Drop the lock; idempotent."""
        ...

    def __enter__(self) -> FileLock: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class PageCacheProbe(Protocol):
    """A port that can tell whether a file's bytes are all in the page cache (optional)."""

    def all_cached(self, fd: int, size: int, ranges: Sequence[tuple[int, int]]) -> bool:
        """Whether every page of the byte ``ranges`` (offset, length) of ``fd`` is cached now.

        ``size``: the file's size (every range lies inside it). ``False``
        whenever it cannot tell. A hint only: pages can be evicted right
        after the answer (a read then simply waits for the disk).
        """
        ...


@runtime_checkable
class FilePort(Protocol):
    """Every file operation of the cold tier (synchronous; call from worker threads)."""

    def open_temp(self, path: str) -> int:
        """Create ``path`` exclusively for writing (mode 0o600, no symlink follow)."""
        ...

    def pwrite_all(self, fd: int, data: BytesLike, offset: int) -> None:
        """Write all of ``data`` at ``offset``, looping over short writes."""
        ...

    def truncate(self, fd: int, size: int) -> None:
        """Set the file's length to ``size`` (a hole when it grows)."""
        ...

    def fsync(self, fd: int) -> None:
        """Make the file's data and metadata durable (see :func:`full_fsync`)."""
        ...

    def close(self, fd: int) -> None:
        """Close a descriptor this port issued."""
        ...

    def replace(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` over ``dst`` (same directory / file system)."""
        ...

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creations, renames, unlinks) durable."""
        ...

    def unlink(self, path: str) -> None:
        """Remove a file (``FileNotFoundError`` if it does not exist)."""
        ...

    def listdir(self, path: str) -> list[str]:
        """Names in a directory (unordered)."""
        ...

    def scandir(self, path: str) -> list[DirEntryInfo]:
        """Entries of a directory with size and mtime; vanished entries are skipped."""
        ...

    def stat(self, path: str) -> FileStat:
        """Stat ``path`` without following a final symlink."""
        ...

    def fstat(self, fd: int) -> FileStat:
        """Stat an open descriptor."""
        ...

    def utime(self, path: str, mtime_ns: int | None = None) -> None:
        """Set access and modification time (``None``: now); the LRU clock."""
        ...

    def open_read(self, path: str) -> int:
        """Open ``path`` read-only without following a final symlink."""
        ...

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """Fill ``buf`` from ``offset``; :class:`ShortRead` at end of file."""
        ...

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """Fill ``bufs`` in order from one contiguous range at ``offset``; :class:`ShortRead` at EOF.

        The restore's scatter read: one file range lands in the rows of a
        buffer with slack between them. At most :data:`MAX_IOV` buffers.
        """
        ...

    def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """Read exactly ``size`` bytes from ``offset``; :class:`ShortRead` at end of file."""
        ...

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        """``mkdir -p`` that fsyncs the parent of every directory it created."""
        ...

    def lock(self, path: str) -> FileLock:
        """Take an exclusive, non-blocking advisory lock on ``path`` (created if absent).

        Raises :class:`LockUnavailable` when another owner holds it.
        """
        ...


def full_fsync(
    fd: int,
    *,
    fcntl_fn: Callable[[int, int], object] | None = None,
    fsync_fn: Callable[[int], None] = os.fsync,
    platform: str = sys.platform,
    fullfsync_op: int | None = _F_FULLFSYNC,
) -> None:
    """Flush ``fd`` to stable storage as far as the platform can promise.

    On macOS ``fsync`` only hands data to the drive, whose volatile cache may
    still lose it on power loss; ``fcntl(F_FULLFSYNC)`` also flushes the drive
    cache. When the file system rejects ``F_FULLFSYNC`` as unsupported
    (``EINVAL``/``ENOTSUP``/``ENOTTY``, e.g. network mounts) this falls back to
    ``fsync``, which is the strongest request left; any other error (``EIO``)
    is raised and never followed by a second attempt. On Linux ``fsync``
    already issues a cache flush on devices with a volatile write cache.
    """
    if platform == "darwin" and fullfsync_op is not None:
        call = fcntl_fn if fcntl_fn is not None else fcntl.fcntl
        try:
            call(fd, fullfsync_op)
        except OSError as exc:
            if exc.errno not in _FULLFSYNC_UNSUPPORTED:
                raise
        else:
            return
    fsync_fn(fd)


class _FlockHandle:
    """An ``flock(LOCK_EX)`` held through an open descriptor; closing it releases."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            # NOTE: closing the only descriptor drops the flock; no LOCK_UN needed.
            os.close(fd)

    def __enter__(self) -> _FlockHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.release()


class OsFilePort:
    """The real :class:`FilePort`, on POSIX system calls (a thread-safe port).

    Thread-safe: it holds nothing but the writeback function; every call is
    system calls on its own arguments, so the cold tier's actors and their
    worker threads share one instance.

    ``writeback`` starts the disk write of each range :meth:`pwrite_all`
    wrote (default: Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``;
    ``None`` leaves every write to the page cache until ``fsync``).
    """

    def __init__(self, *, writeback: WritebackFn | None = _DEFAULT_WRITEBACK) -> None:
        self._writeback = writeback

    def open_temp(self, path: str) -> int:
        """See :meth:`FilePort.open_temp`."""
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW | _CLOEXEC
        return os.open(path, flags, 0o600)

    def pwrite_all(self, fd: int, data: BytesLike, offset: int) -> None:
        """See :meth:`FilePort.pwrite_all`.

        ``os.pwrite`` may write fewer bytes than asked (signals, quotas, pipes
        of the file system); the rest is written at the advanced offset. A
        zero-byte write with bytes remaining is reported as ``ENOSPC`` rather
        than looping forever.

        Then the range's writeback is started (``writeback``), so a large
        file streams to the disk while later tensors are written, its dirty
        pages stay few (no writer throttling), and the commit's ``fsync``
        waits only for the tail. Durability still comes from that ``fsync``
        alone. An error of the early start other than "unsupported" (``EIO``,
        ``ENOSPC``) is raised like a failed write; "unsupported" turns the
        early start off for this port.
        """
        view = _byte_view(data)
        done = 0
        total = len(view)
        while done < total:
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except InterruptedError:
                continue
            if n <= 0:
                raise OSError(errno.ENOSPC, "write made no progress")
            done += n
        writeback = self._writeback
        if writeback is not None and total:
            try:
                writeback(fd, offset, total)
            except OSError as exc:
                if exc.errno not in _WRITEBACK_UNSUPPORTED:
                    raise
                self._writeback = None

    def truncate(self, fd: int, size: int) -> None:
        """See :meth:`FilePort.truncate`."""
        os.ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        """See :meth:`FilePort.fsync` and :func:`full_fsync`."""
        full_fsync(fd)

    def close(self, fd: int) -> None:
        """See :meth:`FilePort.close`."""
        os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        """See :meth:`FilePort.replace`."""
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        """See :meth:`FilePort.fsync_dir`."""
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        try:
            full_fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        """See :meth:`FilePort.unlink`."""
        os.unlink(path)

    def listdir(self, path: str) -> list[str]:
        """See :meth:`FilePort.listdir`."""
        return os.listdir(path)

    def scandir(self, path: str) -> list[DirEntryInfo]:
        """See :meth:`FilePort.scandir`."""
        out: list[DirEntryInfo] = []
        with os.scandir(path) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append(
                    DirEntryInfo(
                        name=entry.name,
                        path=entry.path,
                        size=st.st_size,
                        mtime_ns=st.st_mtime_ns,
                        is_file=stat_mod.S_ISREG(st.st_mode),
                        is_dir=stat_mod.S_ISDIR(st.st_mode),
                        is_symlink=stat_mod.S_ISLNK(st.st_mode),
                    )
                )
        return out

    def stat(self, path: str) -> FileStat:
        """See :meth:`FilePort.stat`."""
        return _file_stat(os.stat(path, follow_symlinks=False))

    def fstat(self, fd: int) -> FileStat:
        """See :meth:`FilePort.fstat`."""
        return _file_stat(os.fstat(fd))

    def utime(self, path: str, mtime_ns: int | None = None) -> None:
        """See :meth:`FilePort.utime`."""
        follow = os.utime not in os.supports_follow_symlinks
        if mtime_ns is None:
            os.utime(path, follow_symlinks=follow)
        else:
            os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=follow)

    def open_read(self, path: str) -> int:
        """See :meth:`FilePort.open_read`."""
        return os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """See :meth:`FilePort.pread_into`."""
        view = _byte_view(buf)
        total = len(view)
        done = 0
        while done < total:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except InterruptedError:
                continue
            if n == 0:
                raise ShortRead(offset=offset, wanted=total, got=done)
            done += n

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """See :meth:`FilePort.preadv_into`.

        ``os.preadv`` may return fewer bytes than asked (signals, a range
        split by the file system); the read resumes at the first unfilled
        byte, inside whichever buffer it lies.
        """
        if len(bufs) > MAX_IOV:
            raise ValueError(f"preadv_into takes at most {MAX_IOV} buffers")
        views = [v for v in (_byte_view(b) for b in bufs) if len(v)]
        total = sum(len(v) for v in views)
        done = 0
        while views:
            try:
                n = os.preadv(fd, views, offset + done)
            except InterruptedError:
                continue
            if n == 0:
                raise ShortRead(offset=offset, wanted=total, got=done)
            done += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def all_cached(self, fd: int, size: int, ranges: Sequence[tuple[int, int]]) -> bool:
        """See :meth:`PageCacheProbe.all_cached` (``mincore``; ``False`` where it is missing)."""
        return _RESIDENCY is not None and _RESIDENCY.all_cached(fd, size, ranges)

    def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """See :meth:`FilePort.pread_exact`."""
        buf = bytearray(size)
        self.pread_into(fd, buf, offset)
        return bytes(buf)

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        """See :meth:`FilePort.makedirs`.

        Missing ancestors are created top-down; after each creation its
        parent directory is fsynced so the new entry survives a crash.
        """
        missing: list[str] = []
        cur = os.path.abspath(path)
        while not os.path.isdir(cur):
            missing.append(cur)
            parent = os.path.dirname(cur)
            if parent == cur:
                break
            cur = parent
        for d in reversed(missing):
            try:
                os.mkdir(d, mode)
            except FileExistsError:
                # NOTE: a concurrent creator won; it owns that parent's fsync.
                if not os.path.isdir(d):
                    raise
                continue
            self.fsync_dir(os.path.dirname(d))

    def lock(self, path: str) -> FileLock:
        """See :meth:`FilePort.lock`."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockUnavailable(path) from None
        except BaseException:
            os.close(fd)
            raise
        return _FlockHandle(fd)


def _byte_view(data: BytesLike) -> memoryview:
    view = memoryview(data)
    if view.nbytes == 0:
        return memoryview(b"")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _file_stat(st: os.stat_result) -> FileStat:
    return FileStat(
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        is_file=stat_mod.S_ISREG(st.st_mode),
        is_dir=stat_mod.S_ISDIR(st.st_mode),
    )
