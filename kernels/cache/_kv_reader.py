"""Reading a KV file's tensor bytes (worker thread): :func:`read_tensors`,
:func:`verify_tensors`, and :class:`OpenEntry`, the reader's one pass over
an open file that a landing can follow tensor by tensor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import xxhash

from ._file_port import FilePort, PageCacheProbe, ShortRead
from ._kv_format import (
    _READ_CHUNK,
    CacheFileCorrupt,
    HostEntry,
    KvFileHeader,
)
from ._kv_header import (
    _check_same,
    _read_preamble,
)

__all__ = [
    "OpenEntry",
    "PassFailed",
    "open_entry",
    "open_file",
    "read_tensors",
    "verify_tensors",
]


def read_tensors(
    port: FilePort, path: str, header: KvFileHeader, *, verify: bool = True
) -> HostEntry:
    """Read every tensor of a validated file into host buffers (worker thread).

    With ``verify`` each tensor's xxh3_64 is checked in the same pass
    (chunk by chunk while the bytes are in cache). The file must still be the
    one ``header`` came from (same size and header hash), else
    :class:`CacheFileCorrupt`.
    """
    fd = _open_same(port, path, header)
    try:
        return _read_host(port, fd, header, verify=verify)
    finally:
        port.close(fd)


def _read_host(port: FilePort, fd: int, header: KvFileHeader, *, verify: bool) -> HostEntry:
    buffers: list[bytearray] = []
    for i, t in enumerate(header.tensors):
        buf = bytearray(t.nbytes)
        view = memoryview(buf)
        hasher = xxhash.xxh3_64() if verify else None
        try:
            for start in range(0, t.nbytes, _READ_CHUNK):
                chunk = view[start : start + _READ_CHUNK]
                port.pread_into(fd, chunk, t.offset + start)
                if hasher is not None:
                    hasher.update(chunk)
        except ShortRead as exc:
            raise CacheFileCorrupt(f"file truncated inside tensor {i}") from exc
        if hasher is not None and hasher.intdigest() != t.hash:
            raise CacheFileCorrupt(f"tensor {i} ({t.name}) hash mismatch")
        buffers.append(buf)
    return HostEntry(header_hash=header.header_hash, buffers=tuple(buffers))


def _open_same(port: FilePort, path: str, header: KvFileHeader) -> int:
    """Open ``path`` for reading and check it is still the file ``header`` came from."""
    fd = port.open_read(path)
    try:
        size = port.fstat(fd).size
        if size != header.file_size:
            raise CacheFileCorrupt("file size changed since its header was read")
        _, header_hash, _ = _read_preamble(port, fd, size)
        if header_hash != header.header_hash:
            raise CacheFileCorrupt("file changed since its header was read")
    except BaseException:
        port.close(fd)
        raise
    return fd


def verify_tensors(port: FilePort, path: str, header: KvFileHeader) -> int:
    """Check every tensor's xxh3_64 without keeping its bytes (worker thread); bytes checked.

    The cold tier's scrubber: reads through one reused 4 MiB buffer, so its
    memory does not grow with the file. Raises :class:`CacheFileCorrupt` on
    a hash mismatch or a truncated file, like :func:`read_tensors`.
    """
    fd = _open_same(port, path, header)
    try:
        return _scan(port, fd, header, verify=True)
    finally:
        port.close(fd)


def _scan(
    port: FilePort,
    fd: int,
    header: KvFileHeader,
    *,
    verify: bool,
    passed: Callable[[int], None] | None = None,
) -> int:
    """Read every tensor through one reused buffer, checking hashes with ``verify``; bytes read.

    ``passed(i)`` is called once tensor ``i`` was read (and checked); it may
    raise to stop the pass (a cancelled restore).
    """
    chunk = bytearray(min(_READ_CHUNK, max((t.nbytes for t in header.tensors), default=0)))
    view = memoryview(chunk)
    checked = 0
    for i, t in enumerate(header.tensors):
        hasher = xxhash.xxh3_64() if verify else None
        try:
            for start in range(0, t.nbytes, _READ_CHUNK):
                part = view[: min(_READ_CHUNK, t.nbytes - start)]
                port.pread_into(fd, part, t.offset + start)
                if hasher is not None:
                    hasher.update(part)
        except ShortRead as exc:
            raise CacheFileCorrupt(f"file truncated inside tensor {i}") from exc
        if hasher is not None and hasher.intdigest() != t.hash:
            raise CacheFileCorrupt(f"tensor {i} ({t.name}) hash mismatch")
        checked += t.nbytes
        if passed is not None:
            passed(i)
    return checked


class PassFailed(Exception):
    """The reader's pass over a staged entry failed or was cancelled; a landing behind it fails.

    The reader reports the file's own fault (corrupt, I/O error); a landing
    waiting on the pass only learns that it cannot go on (a miss).
    """


class _PassCancelled(Exception):
    """The entry was closed while its pass was running."""


class OpenEntry:
    """A validated cache file held open from the worker's check to the engine turn's landing.

    Made by :func:`open_entry` (pass done) or :func:`open_file` (the holder
    runs :meth:`pass_over` on a worker next); consumed by :func:`land_entry`.
    The holder owns the descriptor and must :meth:`close` it on every path
    (landed, dropped, pushed out, shut down); closing is idempotent and
    thread-safe. NOTE: the open descriptor pins the file's inode, so a
    rewrite (a rename over the path) or an unlink between the two passes
    cannot swap the bytes the landing reads; the landing still re-checks
    size and header hash, and hashes every byte again in the memory the
    arrays will own.

    The pass publishes its progress (tensors read and checked so far, under
    a condition): a landing that starts before the pass ended reads tensor
    ``i`` once the pass went past it (from the page cache, right behind the
    reader), and fails with :class:`PassFailed` when the pass fails or is
    cancelled. Every end of a pass (done, failed, cancelled, never run:
    :meth:`abandon`) wakes the landing.
    """

    def __init__(
        self,
        port: FilePort,
        fd: int,
        path: str,
        header: KvFileHeader,
        *,
        verify: bool,
        passed: bool = True,
        check_in_pass: bool = True,
    ) -> None:
        self.port = port
        self.path = path
        self.header = header
        self.verify = verify
        self._check_in_pass = verify and check_in_pass
        self._fd: int | None = fd
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._total = len(header.tensors)
        self._passed = self._total if passed else 0
        # NOTE: set once, at the pass's end (done, failed, cancelled, abandoned).
        self._ended = passed
        self._failure: str | None = None
        self._running = False
        self._close_when_passed = False
        self._callbacks: list[Callable[[], None]] = []

    @property
    def nbytes(self) -> int:
        """Tensor bytes the landing reads (what the restored arrays hold, slack aside)."""
        return self.header.nbytes

    @property
    def closed(self) -> bool:
        """Whether the descriptor was closed (or is to be closed once the running pass stops)."""
        with self._lock:
            return self._fd is None or self._close_when_passed

    @property
    def passed(self) -> bool:
        """Whether the reader's pass went over every tensor."""
        with self._lock:
            return self._ended and self._failure is None

    @property
    def progress(self) -> int:
        """Tensors the pass went past so far (all of them once it passed)."""
        with self._lock:
            return self._passed

    @property
    def pass_failure(self) -> str | None:
        """Why the pass failed or was cancelled (``None``: it did not, or has not ended)."""
        with self._lock:
            return self._failure

    def fileno(self) -> int:
        """The open descriptor; ``ValueError`` once closed."""
        with self._lock:
            if self._fd is None or self._close_when_passed:
                raise ValueError("the entry's file was closed")
            return self._fd

    def close(self) -> None:
        """Close the descriptor (idempotent); a running pass is cancelled and closes it as it stops.

        NOTE: never closed under a running pass's reads: the descriptor's
        number could be reused by another open meanwhile and the pass would
        read another file's bytes.
        """
        with self._lock:
            if self._running:
                self._close_when_passed = True
                return
            fd, self._fd = self._fd, None
        if fd is not None:
            self.port.close(fd)

    def pass_over(self) -> int:
        """The reader's pass over the tensors of an entry from :func:`open_file` (worker thread).

        Reads every tensor through one reused buffer (with ``verify`` each
        tensor's xxh3_64 checked, unless the entry was opened with
        ``check_in_pass=False``), publishing progress after each; the bytes
        read. A pass that checks nothing ends at once, having read 0 bytes,
        when the port says every tensor's bytes are in the page cache
        (:class:`PageCacheProbe`). Raises :class:`CacheFileCorrupt` on a bad
        hash or truncation, the port's ``OSError``, or :class:`PassFailed` when the entry was
        closed meanwhile; every end wakes a waiting landing. Once only.
        """
        with self._lock:
            if self._ended or self._running:
                raise RuntimeError("the entry's pass already ran or ended")
            if self._fd is None or self._close_when_passed:
                self._end_locked("closed before its pass")
                raise PassFailed("the entry was closed before its pass")
            self._running = True
            fd = self._fd
        failure = "the reader's pass stopped"
        try:
            if self._nothing_to_pass(fd):
                failure = ""
                return 0
            nbytes = _scan(
                self.port, fd, self.header, verify=self._check_in_pass, passed=self._advance
            )
            failure = ""
            return nbytes
        except _PassCancelled:
            failure = "the entry was closed during its pass"
            raise PassFailed(failure) from None
        except BaseException as exc:
            failure = f"the reader's pass failed: {exc!r}"
            raise
        finally:
            with self._lock:
                to_close = self._stop_locked()
                self._end_locked(failure or None)
                callbacks, self._callbacks = self._callbacks, []
            try:
                for cb in callbacks:
                    cb()
            finally:
                if to_close is not None:
                    self.port.close(to_close)

    def _nothing_to_pass(self, fd: int) -> bool:
        """Whether the pass may end at once: it checks nothing and every tensor is in the page cache.

        NOTE: a pass that only reads ahead of the landing does nothing for a
        file the page cache already holds but holds the landing back to one
        thread's copy speed (the landing waits for it tensor by tensor); on
        the H200 host that pass, not the landing, set the pace of a restore
        from the page cache. A page evicted after this answer is read by the
        landing itself.
        """
        if self._check_in_pass or not isinstance(self.port, PageCacheProbe):
            return False
        ranges = [(t.offset, t.nbytes) for t in self.header.tensors]
        return self.port.all_cached(fd, self.header.file_size, ranges)

    def _stop_locked(self) -> int | None:
        """The pass stopped running: the descriptor to close now if a close came meanwhile."""
        self._running = False
        if not self._close_when_passed:
            return None
        fd, self._fd, self._close_when_passed = self._fd, None, False
        return fd

    def abandon(self, reason: str = "the reader's pass never ran") -> None:
        """End a pass that will not run (its worker was cancelled before it began); idempotent.

        A no-op once the pass ended or while it runs (it ends by itself).
        """
        with self._lock:
            if self._ended or self._running:
                return
            self._end_locked(reason)
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def when_passed(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` (on the reader's thread) when the pass ends; ``False``: it already has."""
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            return True

    def wait_passed(self, index: int) -> None:
        """Block until the pass went past tensor ``index``; :class:`PassFailed` if it cannot.

        NOTE: called on a landing thread, never the engine thread; it never
        waits forever, as every end of a pass (done, failed, cancelled,
        abandoned) notifies.
        """
        with self._progress:
            while self._passed <= index and not self._ended:
                self._progress.wait()
            if self._passed <= index:
                raise PassFailed(self._failure or "the reader's pass ended early")

    def _advance(self, index: int) -> None:
        with self._progress:
            if self._close_when_passed:
                raise _PassCancelled
            self._passed = index + 1
            self._progress.notify_all()

    def _end_locked(self, failure: str | None) -> None:
        if self._ended:
            return
        self._ended = True
        self._failure = failure
        if failure is None:
            self._passed = self._total
        self._progress.notify_all()

    def take_host(self) -> HostEntry:
        """Every tensor's bytes in host buffers, then close (checkers and tools, not restores).

        Reads through the open descriptor, each tensor's hash checked when
        the entry was opened with ``verify``; :class:`CacheFileCorrupt` on a
        mismatch or truncation. Closed on every path.
        """
        try:
            fd = self.fileno()
            _check_same(self.port, fd, self.header)
            return _read_host(self.port, fd, self.header, verify=self.verify)
        finally:
            # NOTE: a failing close of a read-only descriptor loses nothing
            # (the bytes were read in full, or the read's own error stands).
            with contextlib.suppress(OSError):
                self.close()


def open_entry(
    port: FilePort, path: str, header: KvFileHeader, *, verify: bool = True
) -> OpenEntry:
    """Open a validated file for a restore and pass over its tensors once (worker thread).

    The pass reads every tensor through one reused buffer (memory does not
    grow with the file): with ``verify`` each tensor's xxh3_64 is checked, so
    a corrupt file is known before the request's turn; either way the file
    is left in the page cache for :func:`land_entry`. The file must still be
    the one ``header`` came from (same size and header hash), else
    :class:`CacheFileCorrupt`. The returned entry holds the file open; its
    holder closes it.
    """
    fd = _open_same(port, path, header)
    try:
        _scan(port, fd, header, verify=verify)
    except BaseException:
        port.close(fd)
        raise
    return OpenEntry(port, fd, path, header, verify=verify)


def open_file(
    port: FilePort,
    path: str,
    header: KvFileHeader,
    *,
    verify: bool = True,
    check_in_pass: bool = True,
) -> OpenEntry:
    """Open a validated file for a restore whose pass runs next (worker thread).

    Like :func:`open_entry` without the pass: the file must still be the
    one ``header`` came from, else :class:`CacheFileCorrupt`. The holder
    runs :meth:`OpenEntry.pass_over` on a worker (or :meth:`OpenEntry.abandon`
    if it never will) and may hand the entry to a landing meanwhile: the
    landing goes right behind the pass.

    ``check_in_pass=False`` (with ``verify``): the pass only reads (it
    brings the file into the page cache ahead of the landing) and the
    hashes are checked once, by :func:`land_entry`, in the memory the
    arrays will own. NOTE: the restore's choice: checking in both passes
    hashed every byte twice, and on a host where the landing keeps up with
    the pass that second hash set the pace of a restore from the page
    cache; a bad file then fails its landing instead of its pass, and is
    reported and removed the same way.
    """
    fd = _open_same(port, path, header)
    return OpenEntry(
        port, fd, path, header, verify=verify, passed=False, check_in_pass=check_in_pass
    )
