"""The weights part of a model's identity: a hash of every byte of its safetensors files.

Two fine-tunes of one base have the same names, shapes and dtypes and may
share most bytes; only a hash of all of them keeps their KV caches apart.
Each file is read in 16 MiB chunks into one reused buffer (an anonymous
mapping, not a heap block: below) and hashed with
xxh3-128 (several GB/s, so a hash costs about what the load's own read
does); the per-file digests, with names and sizes, are folded into one.

A file's digest is remembered in a small memo under ``$KVTIER_HOME``, keyed
by what changes when its bytes do: device, inode, size, mtime and ctime
(NOTE: ctime too, because ``touch -d`` can set an mtime back but nothing
can set a ctime). A restart of an unchanged model reads no weight byte.
The memo is untrusted on read: bounded in size, its entries checked one by
one (a bad one is dropped), and ignored unless it belongs to this user and
nobody else may write to it (``kernels._trust``).

NOTE: blocking file work: call it where the model is loaded (the engine
thread in the server), never on the event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import xxhash

from kernels._trust import make_private_dirs, trust_problem

__all__ = [
    "MEMO_NAME",
    "FileKey",
    "OsWeightFiles",
    "WeightFiles",
    "WeightsMemo",
    "hash_weights",
]

MEMO_NAME = "weights-digests.json"
"""The memo's file name under ``$KVTIER_HOME``."""

_CHUNK = 16 << 20
_MEMO_VERSION = 1
_MEMO_MAX_BYTES = 1 << 20
_MEMO_MAX_ENTRIES = 512
_HEX128 = re.compile(r"^[0-9a-f]{32}$")
_DIGEST_BYTES = 16

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FileKey:
    """What identifies one version of a file's bytes without reading them."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def as_list(self) -> list[int]:
        """The key as the memo stores it."""
        return [self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns]


class WeightFiles(Protocol):
    """The file calls of the hash (tests count reads through a fake)."""

    def key(self, path: Path) -> FileKey:
        """The file's identity (``stat``, symlinks followed: hub snapshots link to blobs)."""
        ...

    def chunks(self, path: Path) -> Iterator[memoryview]:
        """The file's bytes in order, in chunks (each valid until the next is asked for)."""
        ...


class OsWeightFiles:
    """:class:`WeightFiles` over the OS: ``stat`` and ``readinto`` a reused 16 MiB buffer.

    NOTE: the buffer is an anonymous mapping, not a ``bytearray``: glibc
    serves a 16 MiB ``malloc`` with ``mmap`` and, once it is freed, raises
    its mmap threshold to 16 MiB, so the process's later blocks up to that
    size stayed on the heap and were not given back when freed: a server
    that hashed a new model idled ~20 MiB higher for its life than one that
    found the digest in the memo. The mapping goes back to the OS when its
    last view is dropped (not closed here: a caller may still hold the last
    chunk's view, and closing an exported mapping raises).
    """

    def key(self, path: Path) -> FileKey:
        """See :meth:`WeightFiles.key`."""
        st = os.stat(path)
        return FileKey(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def chunks(self, path: Path) -> Iterator[memoryview]:
        """See :meth:`WeightFiles.chunks`."""
        view = memoryview(mmap.mmap(-1, _CHUNK))
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    return
                yield view[:n]


def _valid_entry(item: Any) -> tuple[tuple[int, ...], str] | None:
    if not isinstance(item, dict) or set(item) != {"key", "xxh3_128"}:
        return None
    key, digest = item["key"], item["xxh3_128"]
    if not isinstance(key, list) or len(key) != 5:
        return None
    if not all(type(v) is int and 0 <= v < 1 << 64 for v in key):
        return None
    if not isinstance(digest, str) or not _HEX128.match(digest):
        return None
    return tuple(key), digest


class WeightsMemo:
    """Per-file digests by :class:`FileKey`, kept in one small JSON file (``None``: in memory only).

    Loaded at construction (a missing, oversized, malformed, foreign or
    group/other-writable file counts as empty; malformed entries are
    dropped), saved by :meth:`save` atomically (temp file, fsync, rename,
    directory fsync) with mode 0600. Holds at most 512 entries, the newest.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[tuple[int, ...], str] = {}
        self._dirty = False
        if path is not None:
            self._entries = _load_memo(path)

    def get(self, key: FileKey) -> str | None:
        """The remembered digest of this version of a file."""
        return self._entries.get(tuple(key.as_list()))

    def put(self, key: FileKey, digest: str) -> None:
        """Remember ``digest`` for ``key`` (the newest entries are kept)."""
        k = tuple(key.as_list())
        self._entries.pop(k, None)
        self._entries[k] = digest
        while len(self._entries) > _MEMO_MAX_ENTRIES:
            del self._entries[next(iter(self._entries))]
        self._dirty = True

    def save(self) -> None:
        """Write the memo if it changed (a failure is logged: the memo only saves time)."""
        if self.path is None or not self._dirty:
            return
        body = {
            "version": _MEMO_VERSION,
            "entries": [{"key": list(k), "xxh3_128": d} for k, d in self._entries.items()],
        }
        try:
            _write_atomic(self.path, json.dumps(body, separators=(",", ":")).encode())
        except OSError as exc:
            _log.warning("weights digest memo not saved at %s: %s", self.path, exc)
            return
        self._dirty = False


def _load_memo(path: Path) -> dict[tuple[int, ...], str]:
    try:
        problem = trust_problem(path, file=True) or trust_problem(path.parent)
        if problem is not None:
            _log.warning("weights digest memo %s ignored: it %s", path, problem)
            return {}
        with open(path, "rb") as f:
            raw = f.read(_MEMO_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        _log.warning("weights digest memo %s ignored: %s", path, exc)
        return {}
    if len(raw) > _MEMO_MAX_BYTES:
        _log.warning("weights digest memo %s ignored: larger than %d bytes", path, _MEMO_MAX_BYTES)
        return {}
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        _log.warning("weights digest memo %s ignored: not JSON", path)
        return {}
    if not isinstance(obj, dict) or obj.get("version") != _MEMO_VERSION:
        return {}
    items = obj.get("entries")
    if not isinstance(items, list):
        return {}
    out: dict[tuple[int, ...], str] = {}
    for item in items[:_MEMO_MAX_ENTRIES]:
        valid = _valid_entry(item)
        if valid is not None:
            out[valid[0]] = valid[1]
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    make_private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _file_digest(files: WeightFiles, path: Path) -> str:
    h = xxhash.xxh3_128()
    for chunk in files.chunks(path):
        h.update(chunk)
    return h.hexdigest()


def hash_weights(
    paths: list[Path], *, memo: WeightsMemo, files: WeightFiles | None = None
) -> str:
    """One hex digest over the files' names, sizes and full-content digests (``paths`` in order).

    Uses and updates ``memo`` (saved before returning). NOTE: a file whose
    key changed while it was read is not remembered (its digest may mix
    two versions); the digest returned is still the one of the bytes read.
    """
    port = files if files is not None else OsWeightFiles()
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(b"kvtier-weights-xxh3-128-v1\0")
    for path in paths:
        key = port.key(path)
        digest = memo.get(key)
        if digest is None:
            digest = _file_digest(port, path)
            if port.key(path) == key:
                memo.put(key, digest)
        # NOTE: name and length framing keeps ("ab", "c") and ("a", "bc") apart.
        h.update(path.name.encode() + b"\0" + key.size.to_bytes(8, "little"))
        h.update(bytes.fromhex(digest))
    memo.save()
    return h.hexdigest()
