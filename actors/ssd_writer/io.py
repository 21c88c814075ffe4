"""Blocking file work of the cold tier, run on worker threads only.

Every function here goes through a :class:`FilePort` (so tests inject
faults) and is called through ``anyio.to_thread.run_sync`` with the tier's
capacity limiter: never on the event loop, never on the engine thread. The
decisions (what to index, what to remove) belong to ``core``; these
functions only observe and act.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass

from actors.checkpoints import CHECKPOINT_DIR, CHECKPOINT_SUFFIX
from kernels import UntrustedPath, trust_problem
from kernels.cache import (
    TEMP_SUFFIX,
    CacheFileCorrupt,
    CacheFileIncompatible,
    CacheFileWriteError,
    FileLock,
    FilePort,
    KvFileHeader,
    LockUnavailable,
    OpenEntry,
    open_file,
    read_header,
    verify_tensors,
)

from .core import ENTRY_SUFFIX, IndexEntry, ScannedCheckpoint, ScannedFile, ScanResult

__all__ = [
    "DEFAULT_MAX_BYTES_CEILING",
    "LOCK_NAME",
    "Removal",
    "check_tier_dirs",
    "default_max_bytes",
    "lock_directory",
    "remove_durably",
    "remove_files",
    "scan",
    "store_failure_reason",
    "sync_directories",
    "verify_entry",
]

LOCK_NAME = "lock"
"""The advisory lock file inside ``<root>/<fingerprint>`` (no entry suffix: never scanned)."""


DEFAULT_MAX_BYTES_CEILING = 32 * 1024**3
"""The default cap never exceeds 32 GiB."""


def default_max_bytes(root: str) -> int:
    """The default cap of a tier at ``root``: the smaller of 32 GiB and a quarter of the free space.

    Measured on the file system that holds ``root`` (its nearest existing
    ancestor when it does not exist yet). Never unbounded.
    """
    path = os.path.abspath(root)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    free = shutil.disk_usage(path).free
    return min(DEFAULT_MAX_BYTES_CEILING, free // 4)


def check_tier_dirs(root: str, fingerprint: str | None = None) -> None:
    """Raise :class:`kernels.UntrustedPath` unless the tier's directories that exist are private.

    ``root``, ``<root>/<fingerprint>`` and its namespace directories (every
    fingerprint directory when ``fingerprint`` is ``None``) must belong to
    this user and be writable by nobody else. NOTE: whoever can write there
    can plant a file under our fingerprint whose header hash they computed:
    its KV would be served as this model's. Directories the tier creates are
    mode 0700; this refuses ones made otherwise. Absent ones pass.
    """
    dirs = [root]
    if os.path.isdir(root):
        subdirs = [fingerprint] if fingerprint is not None else sorted(
            e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)
        )
        for name in subdirs:
            fp_dir = os.path.join(root, name)
            if not os.path.isdir(fp_dir):
                continue
            dirs.append(fp_dir)
            dirs.extend(
                e.path for e in os.scandir(fp_dir) if e.is_dir(follow_symlinks=False)
            )
    for d in dirs:
        try:
            problem = trust_problem(d)
        except FileNotFoundError:
            continue
        if problem is not None:
            raise UntrustedPath(d, problem)


def lock_directory(port: FilePort, fingerprint_dir: str) -> FileLock | None:
    """Create ``fingerprint_dir`` and take its exclusive lock; ``None`` if another owner holds it."""
    port.makedirs(fingerprint_dir)
    try:
        return port.lock(os.path.join(fingerprint_dir, LOCK_NAME))
    except LockUnavailable:
        return None


def _dirs(port: FilePort, path: str) -> list[tuple[str, str]]:
    try:
        entries = port.scandir(path)
    except FileNotFoundError:
        return []
    return [(e.name, e.path) for e in entries if e.is_dir and not e.is_symlink]


def scan(
    port: FilePort,
    root: str,
    fingerprint: str,
    *,
    tokenizer_hash: str | None,
    max_header_bytes: int | None,
    now_ns: int | None = None,
) -> ScanResult:
    """Header-only scan of ``<root>/<fingerprint>/*/``: entries, problems, orphans, foreign dirs.

    A file that cannot be read for an OS reason (permissions, EIO) is
    reported ``unreadable`` with its listed size: that is not proof of
    corruption, so it is kept (and counted toward the cap).
    A directory that cannot be listed makes the result ``incomplete``: the
    files in it are unknown, so the tier cannot keep its cap in this run.
    Generation checkpoint files (``checkpoints/*.kvc``) are listed with
    their sizes and mtimes, against ``now_ns`` (default: the wall clock).
    """
    try:
        foreign = sum(1 for name, _ in _dirs(port, root) if name != fingerprint)
    except OSError:
        foreign = 0  # NOTE: only a statistic; other fingerprints are never touched.
    files: list[ScannedFile] = []
    orphans: list[str] = []
    orphan_bytes: list[int] = []
    directories: list[str] = []
    checkpoints: list[ScannedCheckpoint] = []
    try:
        ours = _dirs(port, os.path.join(root, fingerprint))
    except OSError:
        return ScanResult(foreign_dirs=foreign, incomplete=True)
    incomplete = False
    for _, directory in ours:
        directories.append(directory)
        try:
            listing = port.scandir(directory)
        except FileNotFoundError:
            continue
        except OSError:
            incomplete = True
            continue
        for e in listing:
            if e.is_symlink or not e.is_file:
                continue  # NOTE: never follow or delete what we did not write.
            if e.name.endswith(CHECKPOINT_SUFFIX):
                if os.path.basename(directory) == CHECKPOINT_DIR:
                    checkpoints.append(ScannedCheckpoint(e.path, e.size, e.mtime_ns))
            elif e.name.endswith(TEMP_SUFFIX):
                orphans.append(e.path)
                orphan_bytes.append(e.size)
            elif e.name.endswith(ENTRY_SUFFIX):
                scanned = _scan_file(
                    port,
                    e.path,
                    directory,
                    e.mtime_ns,
                    e.size,
                    fingerprint,
                    tokenizer_hash,
                    max_header_bytes,
                )
                if scanned is not None:
                    files.append(scanned)
    return ScanResult(
        files=tuple(files),
        orphans=tuple(orphans),
        foreign_dirs=foreign,
        orphan_bytes=tuple(orphan_bytes),
        directories=tuple(directories),
        incomplete=incomplete,
        checkpoints=tuple(checkpoints),
        now_ns=time.time_ns() if now_ns is None else now_ns,
    )


def _scan_file(
    port: FilePort,
    path: str,
    directory: str,
    mtime_ns: int,
    size: int,
    fingerprint: str,
    tokenizer_hash: str | None,
    max_header_bytes: int | None,
) -> ScannedFile | None:
    try:
        header = _read_header(port, path, fingerprint, max_header_bytes)
    except CacheFileCorrupt as exc:
        return ScannedFile(path, directory, "corrupt", exc.reason, file_bytes=size)
    except CacheFileIncompatible as exc:
        return ScannedFile(path, directory, "incompatible", exc.reason, file_bytes=size)
    except FileNotFoundError:
        return None  # NOTE: vanished since the listing.
    except OSError as exc:
        # NOTE: unreadable (permissions, EIO): not indexed, not deleted, counted.
        return ScannedFile(path, directory, "unreadable", str(exc), file_bytes=size)
    if tokenizer_hash is not None and header.tokenizer_hash != tokenizer_hash:
        return ScannedFile(
            path, directory, "incompatible", "tokenizer hash differs", file_bytes=size
        )
    entry = IndexEntry(
        path=path,
        namespace=header.namespace,
        tokens=header.tokens,
        file_bytes=header.file_size,
        last_used=mtime_ns,
        trimmable=header.trimmable,
        min_reusable_offset=header.min_reusable_offset,
    )
    return ScannedFile(path, directory, None, entry=entry, file_bytes=size)


def _read_header(
    port: FilePort, path: str, fingerprint: str, max_header_bytes: int | None
) -> KvFileHeader:
    if max_header_bytes is None:
        return read_header(port, path, expected_fingerprint=fingerprint)
    return read_header(
        port, path, max_header_bytes=max_header_bytes, expected_fingerprint=fingerprint
    )


def remove_files(port: FilePort, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Unlink ``paths``; returns those still on disk (a vanished file counts as removed)."""
    left: list[str] = []
    for path in paths:
        try:
            port.unlink(path)
        except FileNotFoundError:
            continue
        except OSError:
            left.append(path)
    return tuple(left)


@dataclass(frozen=True, slots=True)
class Removal:
    """What :func:`remove_durably` did with each path.

    ``gone``: unlinked (or already absent) and its directory fsynced: it
    cannot come back. ``failed``: the unlink failed; the file is still
    there. ``unsynced``: unlinked, but its directory's fsync failed: a crash
    may bring it back.
    """

    gone: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    unsynced: tuple[str, ...] = ()

    @property
    def left(self) -> tuple[str, ...]:
        """Paths that may still take room: ``failed`` and ``unsynced``."""
        return (*self.failed, *self.unsynced)


def remove_durably(port: FilePort, paths: tuple[str, ...]) -> Removal:
    """Unlink ``paths``, then fsync each of their directories once.

    NOTE: an unlink is a directory operation like a rename: until the
    directory is fsynced, a crash may undo it. The cold tier reuses the room
    of a removed file only once its removal is durable, so that no crash can
    leave more than the cap on disk. A path already absent counts as
    unlinked (an earlier unlink whose directory fsync failed, which this
    fsync completes).
    """
    unlinked: list[str] = []
    failed: list[str] = []
    for path in paths:
        try:
            port.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            failed.append(path)
            continue
        unlinked.append(path)
    gone: list[str] = []
    unsynced: list[str] = []
    by_dir: dict[str, list[str]] = {}
    for path in unlinked:
        by_dir.setdefault(os.path.dirname(path), []).append(path)
    for directory, members in by_dir.items():
        try:
            port.fsync_dir(directory)
        except FileNotFoundError:
            gone.extend(members)  # NOTE: the directory itself is gone.
        except OSError:
            unsynced.extend(members)  # NOTE: never retried into a success (fsyncgate).
        else:
            gone.extend(members)
    return Removal(gone=tuple(gone), failed=tuple(failed), unsynced=tuple(unsynced))


def sync_directories(port: FilePort, directories: tuple[str, ...]) -> tuple[str, ...]:
    """fsync each directory; returns those whose fsync failed.

    NOTE: the startup makes the directories it scanned durable as they are
    now, so that an unlink an earlier run could not sync (its directory
    fsync failed, then the process stopped) cannot come back after a later
    crash, when this run no longer counts it.
    """
    failed: list[str] = []
    for directory in directories:
        try:
            port.fsync_dir(directory)
        except OSError:
            failed.append(directory)
    return tuple(failed)


def open_for_restore(
    port: FilePort,
    path: str,
    *,
    fingerprint: str,
    namespace: str,
    tokens: tuple[int, ...],
    verify: bool,
    max_header_bytes: int | None,
) -> OpenEntry:
    """Check one file's header against what the index knows and open it; its pass runs next.

    The reader stages the returned entry at once and then runs its pass
    (:meth:`kernels.cache.OpenEntry.pass_over`, :func:`pass_entry`), so the
    request's landing can go right behind it. Raises
    :class:`CacheFileCorrupt` when the header fails its checks or the file is
    not the entry the index expects (nothing is left open).
    """
    header = _read_header(port, path, fingerprint, max_header_bytes)
    if header.namespace != namespace or header.tokens != tokens:
        raise CacheFileCorrupt("header does not match the indexed entry")
    # NOTE: the landing hashes every tensor in the arrays' own memory, so the
    # pass only reads ahead of it (kernels.cache.open_file says why).
    return open_file(port, path, header, verify=verify, check_in_pass=False)


def pass_entry(port: FilePort, file: OpenEntry, *, touch: bool) -> tuple[int, bool]:
    """Run ``file``'s pass (hashes as the entry was opened), then touch it for LRU.

    The bytes the pass read (0 when the file was all in the page cache and
    the pass had nothing to check: it then ends at once) and whether the
    mtime was set to now. Raises what the pass raises (the holder keeps the
    file and closes it).
    """
    nbytes = file.pass_over()
    if not touch:
        return nbytes, False
    try:
        port.utime(file.path)
    except OSError:
        return nbytes, False  # NOTE: the LRU touch is best effort; the read stands.
    return nbytes, True


def verify_entry(
    port: FilePort,
    path: str,
    *,
    fingerprint: str,
    namespace: str,
    tokens: tuple[int, ...],
    max_header_bytes: int | None,
) -> int:
    """Re-check one file against the index and every tensor's hash; the bytes checked.

    The scrubber's read: nothing is kept and the mtime is not touched (a
    check is not a use). Raises :class:`CacheFileCorrupt` like
    :func:`open_for_restore` and a failing pass.
    """
    header = _read_header(port, path, fingerprint, max_header_bytes)
    if header.namespace != namespace or header.tokens != tokens:
        raise CacheFileCorrupt("header does not match the indexed entry")
    return verify_tensors(port, path, header)


def store_failure_reason(exc: BaseException) -> str:
    """The ``StoreResult.reason`` for a failed write."""
    if isinstance(exc, CacheFileWriteError):
        if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
            return "disk_full"
        if exc.fsync_failed:
            return "fsync_failed"
        return "io_error"
    if isinstance(exc, OSError):
        return "disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io_error"
    return "source_failed"
