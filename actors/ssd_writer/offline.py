"""The SSD tier's files outside a server: list them, purge them (``kvtier cache``).

The tier keeps prompts' token ids on disk (every file's header holds the
prefix it caches). This module is how an operator sees what is there and
removes it. Blocking file work through a :class:`kernels.cache.FilePort`
(run it from a command, or on a worker thread).

Purging a fingerprint directory takes that directory's lock first, the one
a running server holds for its whole life (``io.lock_directory``): a
directory in use is left untouched and reported ``busy``. NOTE: a server
that starts while a purge holds a lock runs that one start read-only (it
logs ``ssd_cache.read_only``), as with any second server. Every removal is
durable before it is reported: files through :func:`io.remove_durably`
(unlink, then the directory's fsync), directories by ``rmdir`` and an
fsync of their parent.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from kernels.cache import TEMP_SUFFIX, FilePort

from .core import ENTRY_SUFFIX
from .io import LOCK_NAME, check_tier_dirs, lock_directory, remove_durably

__all__ = ["FingerprintUsage", "PurgeReport", "list_tier", "purge_tier"]


@dataclass(frozen=True, slots=True)
class FingerprintUsage:
    """One fingerprint directory: its committed entries, other files (temp files), newest use."""

    name: str
    path: str
    entries: int = 0
    entry_bytes: int = 0
    other_files: int = 0
    other_bytes: int = 0
    newest_mtime_ns: int | None = None
    """The most recent entry use (the tier's LRU clock is the files' mtime)."""

    @property
    def total_bytes(self) -> int:
        """Every byte the directory's files take."""
        return self.entry_bytes + self.other_bytes


@dataclass(slots=True)
class PurgeReport:
    """What a purge did (or, with ``dry_run``, would do)."""

    removed_files: int = 0
    removed_bytes: int = 0
    removed_dirs: list[str] = field(default_factory=list)
    """Fingerprint directories removed entirely."""
    busy: list[str] = field(default_factory=list)
    """Fingerprint directories a running server holds: untouched."""
    failed: list[str] = field(default_factory=list)
    """Paths whose removal failed or is not durable (a crash may bring them back)."""


@dataclass(frozen=True, slots=True)
class _File:
    path: str
    size: int
    mtime_ns: int
    is_entry: bool


def _subdirs(port: FilePort, path: str) -> list[tuple[str, str]]:
    try:
        listing = port.scandir(path)
    except FileNotFoundError:
        return []
    # NOTE: never follow a symlink: only what the tier wrote is listed or removed.
    return sorted((e.name, e.path) for e in listing if e.is_dir and not e.is_symlink)


def _files(port: FilePort, fingerprint_dir: str) -> list[_File]:
    out: list[_File] = []
    for _, ns_dir in _subdirs(port, fingerprint_dir):
        try:
            listing = port.scandir(ns_dir)
        except FileNotFoundError:
            continue
        for e in listing:
            if e.is_symlink or not e.is_file:
                continue
            if e.name.endswith(ENTRY_SUFFIX):
                out.append(_File(e.path, e.size, e.mtime_ns, is_entry=True))
            elif e.name.endswith(TEMP_SUFFIX):
                out.append(_File(e.path, e.size, e.mtime_ns, is_entry=False))
    return out


def list_tier(port: FilePort, root: str) -> list[FingerprintUsage]:
    """Every fingerprint directory under ``root`` with its files' counts and bytes (by name)."""
    usages: list[FingerprintUsage] = []
    for name, path in _subdirs(port, root):
        files = _files(port, path)
        entries = [f for f in files if f.is_entry]
        others = [f for f in files if not f.is_entry]
        usages.append(
            FingerprintUsage(
                name=name,
                path=path,
                entries=len(entries),
                entry_bytes=sum(f.size for f in entries),
                other_files=len(others),
                other_bytes=sum(f.size for f in others),
                newest_mtime_ns=max((f.mtime_ns for f in entries), default=None),
            )
        )
    return usages


def purge_tier(
    port: FilePort,
    root: str,
    *,
    select_dir: Callable[[str], bool],
    older_than_ns: int | None = None,
    remove_dirs: bool = False,
    dry_run: bool = False,
) -> PurgeReport:
    """Remove the tier's files in the fingerprint directories ``select_dir(name)`` picks.

    ``older_than_ns``: only files last used (mtime) before this time (ns
    since the epoch); ``None``: every file. ``remove_dirs``: also remove the
    emptied namespace directories, the lock file and the fingerprint
    directory itself. Raises :class:`kernels.UntrustedPath` when the tier's
    directories are not private (a swapped directory could redirect an
    unlink), before anything is removed.
    """
    check_tier_dirs(root, None)
    report = PurgeReport()
    for name, fp_dir in _subdirs(port, root):
        if not select_dir(name):
            continue
        if dry_run:
            _purge_dir(port, fp_dir, older_than_ns, remove_dirs=False, dry_run=True, report=report)
            continue
        lock = lock_directory(port, fp_dir)
        if lock is None:
            report.busy.append(fp_dir)
            continue
        try:
            emptied = _purge_dir(
                port, fp_dir, older_than_ns, remove_dirs=remove_dirs, dry_run=False, report=report
            )
            if emptied:
                # NOTE: unlinked while held: a server opening the name now
                # creates a new lock file, so it never shares ours.
                _remove_durably(port, (os.path.join(fp_dir, LOCK_NAME),), report)
        finally:
            lock.release()
        if emptied and _rmdir_durably(port, fp_dir, report):
            report.removed_dirs.append(fp_dir)
    return report


def _purge_dir(
    port: FilePort,
    fp_dir: str,
    older_than_ns: int | None,
    *,
    remove_dirs: bool,
    dry_run: bool,
    report: PurgeReport,
) -> bool:
    """Remove the chosen files of one fingerprint directory; whether it may now be removed."""
    chosen = [
        f for f in _files(port, fp_dir) if older_than_ns is None or f.mtime_ns < older_than_ns
    ]
    if dry_run:
        report.removed_files += len(chosen)
        report.removed_bytes += sum(f.size for f in chosen)
        return False
    removal = remove_durably(port, tuple(f.path for f in chosen))
    gone = set(removal.gone)
    report.removed_files += len(gone)
    report.removed_bytes += sum(f.size for f in chosen if f.path in gone)
    report.failed.extend(removal.left)
    if not remove_dirs:
        return False
    emptied = True
    for _, ns_dir in _subdirs(port, fp_dir):
        emptied = _rmdir_durably(port, ns_dir, report) and emptied
    return emptied


def _remove_durably(port: FilePort, paths: tuple[str, ...], report: PurgeReport) -> None:
    report.failed.extend(remove_durably(port, paths).left)


def _rmdir_durably(port: FilePort, path: str, report: PurgeReport) -> bool:
    """``rmdir`` then fsync the parent; False (reported) when it is not empty or the sync failed."""
    try:
        # NOTE: FilePort has no rmdir; the parent's fsync below makes it durable.
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        report.failed.append(path)
        return False
    try:
        port.fsync_dir(os.path.dirname(path))
    except OSError:
        report.failed.append(path)
        return False
    return True
