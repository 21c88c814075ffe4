"""A simulated :class:`FilePort` with a crash model, and a port that fails the Nth call.

:class:`CrashFS` is an in-memory file system behind the cold tier's file
port. It records every operation that changes the file system and keeps,
for every file and directory, what is durable and what is not yet:

* a file's **durable content** is what its last successful ``fsync``
  wrote; its writes and truncations since then are **pending**;
* a directory's **durable entries** are the names it held at its last
  ``fsync_dir``; creations, renames and unlinks in it since then are
  pending (``makedirs`` fsyncs the parent of every directory it makes, as
  :class:`OsFilePort` does).

After any operation, :meth:`CrashFS.crash_space` describes every state a
crash at that moment may leave, and :meth:`CrashSpace.states` enumerates
them. The model (in the spirit of LevelDB's fault-injection environment,
SQLite's crash VFS and ALICE/CrashMonkey; the code is our own):

* every pending directory operation persists or not, independently of the
  others (replayed in order over the durable entries): an unsynced
  creation, rename or unlink may be undone unless its directory was
  synced, and a rename is atomic within one directory;
* every pending write of a file persists, is lost, or leaves garbage of the
  same length, independently (writeback has no order); a pending
  truncation persists or not. A file is therefore anything from its last
  synced content ("dropped") to its current content ("kept"), with any mix
  of garbage in the ranges written since;
* synced data and synced directory entries are always kept;
* a failed ``fsync`` (:meth:`CrashFS.writeback_error`) behaves as Linux
  does (*fsyncgate*): the dirty data is dropped from writeback without
  reaching the disk, reads still see it, and the next ``fsync`` succeeds
  over the loss;
* a file's modification time after a crash is the one it had at its last
  ``fsync`` (or creation), or the value of any later ``utime`` that
  persisted (each pending ``utime`` persists or not): a touch that orders
  the LRU can be lost.

Apart from one simplification, this model allows every state ext4, XFS,
btrfs and APFS can leave for these operations (they order more than it
does), so a protocol that is correct under it is correct there. The
simplification: a write is torn only as a whole (kept, lost, or garbage over
its whole range), while a disk may keep some of its pages and not others;
the garbage case stands in for those (any content other than the written
one is equally wrong to a reader). A state with more than
``max_file_variants`` content variants for one file, or more than
``max_dir_subsets`` entry sets for one directory, is enumerated over a
reduced family (all kept/dropped/garbage, each operation alone dropped or
garbage, each prefix kept) and the space says so (:attr:`CrashSpace.reduced`).

:class:`FaultingPort` wraps any port and fails the Nth call of one method
with ``ENOSPC``, ``EIO``, ``EINTR`` or (for ``pwrite_all``) a short write.

Test support only: nothing in the product imports this module.
"""

from __future__ import annotations

import errno
import itertools
import posixpath
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Literal, Protocol, runtime_checkable

import xxhash

from kernels.cache._file_port import (
    BytesLike,
    DirEntryInfo,
    FileLock,
    FilePort,
    FileStat,
    LockUnavailable,
    ShortRead,
    WritableBuffer,
)

__all__ = [
    "PORT_METHODS",
    "CrashFS",
    "CrashFile",
    "CrashSpace",
    "CrashState",
    "Fault",
    "FaultKind",
    "FaultingPort",
    "OpRecord",
    "UnobservedRead",
    "WritebackModel",
]

_ROOT_INO: Final = 1
_KEEP: Final = 0
_DROP: Final = 1
_GARBAGE: Final = 2


class UnobservedRead(RuntimeError):
    """A file declared unobserved for a crash state was read (the collapse was unsound)."""


# --- pending operations ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Write:
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class _Truncate:
    size: int


_FileOp = _Write | _Truncate


@dataclass(frozen=True, slots=True)
class _Link:
    name: str
    ino: int


@dataclass(frozen=True, slots=True)
class _Unlink:
    name: str


@dataclass(frozen=True, slots=True)
class _Rename:
    src: str
    dst: str
    ino: int


_DirOp = _Link | _Unlink | _Rename


def _apply_file_op(buf: bytearray, op: _FileOp, data: bytes | None = None) -> None:
    if isinstance(op, _Truncate):
        if op.size < len(buf):
            del buf[op.size :]
        else:
            buf.extend(bytes(op.size - len(buf)))
        return
    payload = op.data if data is None else data
    end = op.offset + len(payload)
    if end > len(buf):
        buf.extend(bytes(end - len(buf)))
    buf[op.offset : end] = payload


def _replay_dir(durable: Mapping[str, int], ops: Sequence[_DirOp]) -> dict[str, int]:
    out = dict(durable)
    for op in ops:
        if isinstance(op, _Link):
            out[op.name] = op.ino
        elif isinstance(op, _Unlink):
            out.pop(op.name, None)
        else:
            if out.get(op.src) == op.ino:
                del out[op.src]
            # NOTE: when the creation of ``src`` did not persist but the
            # rename did, the inode is reachable under ``dst`` only.
            out[op.dst] = op.ino
    return out


def _garbage(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


# --- records and images -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One operation that changed the file system (``index`` counts from 0).

    ``kind``: ``mkdir``, ``create``, ``write``, ``truncate``, ``fsync``,
    ``fsync_dir``, ``rename``, ``unlink``, ``utime``, ``writeback_error``.
    """

    index: int
    kind: str
    path: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class _FileImage:
    durable: bytes
    pending: tuple[_FileOp, ...]
    mtime_ns: int  # NOTE: as of the last fsync (or creation)
    pending_times: tuple[int, ...]  # utime calls since then, in order


@dataclass(frozen=True, slots=True)
class _DirImage:
    durable: tuple[tuple[str, int], ...]
    pending: tuple[_DirOp, ...]


class CrashFile:
    """One file of a crash state; its content is built on first use."""

    __slots__ = ("_data", "_image", "choice", "ino", "mtime_ns", "observed", "path")

    def __init__(
        self,
        path: str,
        ino: int,
        image: _FileImage,
        choice: tuple[int, ...],
        *,
        observed: bool,
    ) -> None:
        self.path = path
        self.ino = ino
        self.observed = observed
        self.choice = choice
        self._image = image
        self._data: bytes | None = None
        # NOTE: the choice holds one mode per pending write/truncation, then
        # one keep/drop per pending utime; the last kept utime wins.
        self.mtime_ns = image.mtime_ns
        for t, mode in zip(image.pending_times, choice[len(image.pending) :], strict=True):
            if mode == _KEEP:
                self.mtime_ns = t

    @property
    def data(self) -> bytes:
        """The content this crash state leaves in the file."""
        if self._data is None:
            buf = bytearray(self._image.durable)
            modes = self.choice[: len(self._image.pending)]
            for i, (op, mode) in enumerate(zip(self._image.pending, modes, strict=True)):
                if mode == _DROP:
                    continue
                if mode == _GARBAGE:
                    assert isinstance(op, _Write)
                    _apply_file_op(buf, op, _garbage(self.ino * 1_000_003 + i, len(op.data)))
                else:
                    _apply_file_op(buf, op)
            self._data = bytes(buf)
        return self._data

    def digest(self) -> int:
        """xxh3_64 of :attr:`data`."""
        return int(xxhash.xxh3_64_intdigest(self.data))

    @property
    def mode(self) -> str:
        """What happened to the pending writes (``kept``, ``dropped``, ``garbage``, ``mixed``),
        with ``, old mtime`` when a pending utime was lost."""
        pending = self._image.pending
        modes = self.choice[: len(pending)]
        if all(m == _KEEP for m in modes):
            out = "kept"
        elif all(m == _DROP for m in modes):
            out = "dropped"
        elif all(
            m == _GARBAGE or isinstance(op, _Truncate) for m, op in zip(modes, pending, strict=True)
        ):
            out = "garbage"
        else:
            out = "mixed"
        if any(m != _KEEP for m in self.choice[len(pending) :]):
            out += ", old mtime"
        return out


@dataclass(frozen=True, slots=True)
class CrashState:
    """One state a crash may leave: the directories and files that exist after it."""

    point: int
    dirs: tuple[str, ...]
    files: tuple[CrashFile, ...]

    def describe(self) -> str:
        """A short human-readable summary (for violation reports)."""
        parts = [f"{f.path}[{f.mode}]" for f in self.files]
        return f"crash after op {self.point}: " + (", ".join(parts) or "no files")


class CrashSpace:
    """Every state a crash after operation ``point`` may leave (see the module docstring)."""

    def __init__(
        self,
        point: int,
        last_op: OpRecord | None,
        files: Mapping[int, _FileImage],
        dirs: Mapping[int, _DirImage],
        *,
        max_file_variants: int,
        max_dir_subsets: int,
    ) -> None:
        self.point = point
        self.last_op = last_op
        self._files = files
        self._dirs = dirs
        self._max_file_variants = max_file_variants
        self._max_dir_subsets = max_dir_subsets
        self.reduced = False

    @property
    def pending_dir_ops(self) -> int:
        """Directory operations not yet made durable."""
        return sum(len(d.pending) for d in self._dirs.values())

    @property
    def pending_file_ops(self) -> int:
        """File writes and truncations not yet made durable."""
        return sum(len(f.pending) for f in self._files.values())

    def _dir_choices(self, ino: int) -> list[dict[str, int]]:
        image = self._dirs[ino]
        durable = dict(image.durable)
        ops = image.pending
        if not ops:
            return [durable]
        n = len(ops)
        if 2**n <= self._max_dir_subsets:
            masks: Iterator[tuple[bool, ...]] = itertools.product((True, False), repeat=n)
        else:
            self.reduced = True
            masks = iter(_reduced_masks(n))
        seen: dict[frozenset[tuple[str, int]], dict[str, int]] = {}
        for mask in masks:
            result = _replay_dir(durable, [op for op, keep in zip(ops, mask, strict=True) if keep])
            seen.setdefault(frozenset(result.items()), result)
        return list(seen.values())

    def _file_choices(self, ino: int) -> list[tuple[int, ...]]:
        image = self._files[ino]
        options = [
            (_KEEP, _DROP, _GARBAGE) if isinstance(op, _Write) else (_KEEP, _DROP)
            for op in image.pending
        ] + [(_KEEP, _DROP)] * len(image.pending_times)
        total = 1
        for o in options:
            total *= len(o)
        if total <= self._max_file_variants:
            return list(itertools.product(*options))
        self.reduced = True
        n = len(options)
        out: dict[tuple[int, ...], None] = {}
        out[(_KEEP,) * n] = None
        out[(_DROP,) * n] = None
        out[tuple(_GARBAGE if len(o) == 3 else _DROP for o in options)] = None
        for i in range(n):
            out[tuple(_DROP if j == i else _KEEP for j in range(n))] = None
            if len(options[i]) == 3:
                out[tuple(_GARBAGE if j == i else _KEEP for j in range(n))] = None
            out[tuple(_KEEP if j < i else _DROP for j in range(n))] = None
        return list(out)

    def states(self, observe: Callable[[str], bool] | None = None) -> Iterator[CrashState]:
        """Every distinct crash state.

        ``observe(path)`` false declares that nothing will read that file's
        content: it is enumerated with one content only (its current one),
        and :meth:`CrashFS.mount` makes reading it raise
        :class:`UnobservedRead`, so the shortcut cannot hide a difference.
        """
        dir_inos = sorted(self._dirs)
        per_dir = [self._dir_choices(ino) for ino in dir_inos]
        seen: set[tuple[object, ...]] = set()
        for combo in itertools.product(*per_dir):
            mapping = dict(zip(dir_inos, combo, strict=True))
            dirs, files = _walk(mapping, self._files)
            file_opts: list[list[tuple[int, ...]]] = []
            observed: list[bool] = []
            for path, ino in files:
                obs = observe is None or observe(path)
                observed.append(obs)
                if obs:
                    file_opts.append(self._file_choices(ino))
                else:
                    image = self._files[ino]
                    file_opts.append([(_KEEP,) * (len(image.pending) + len(image.pending_times))])
            for choice in itertools.product(*file_opts):
                key = (tuple(dirs), tuple(zip(files, choice, strict=True)))
                if key in seen:
                    continue
                seen.add(key)
                yield CrashState(
                    point=self.point,
                    dirs=tuple(dirs),
                    files=tuple(
                        CrashFile(path, ino, self._files[ino], ch, observed=obs)
                        for (path, ino), ch, obs in zip(files, choice, observed, strict=True)
                    ),
                )


def _reduced_masks(n: int) -> list[tuple[bool, ...]]:
    out: dict[tuple[bool, ...], None] = {(True,) * n: None, (False,) * n: None}
    for i in range(n):
        out[tuple(j != i for j in range(n))] = None
        out[tuple(j == i for j in range(n))] = None
        out[tuple(j < i for j in range(n))] = None
    return list(out)


def _child(path: str, name: str) -> str:
    # NOTE: plain concatenation: posixpath.join dominated the enumeration's profile.
    return ("" if path == "/" else path) + "/" + name


def _walk(
    mapping: Mapping[int, Mapping[str, int]], files: Mapping[int, _FileImage]
) -> tuple[list[str], list[tuple[str, int]]]:
    dirs: list[str] = ["/"]
    found: list[tuple[str, int]] = []
    stack: list[tuple[str, int]] = [("/", _ROOT_INO)]
    visited = {_ROOT_INO}
    while stack:
        path, ino = stack.pop()
        for name, child in mapping.get(ino, {}).items():
            child_path = _child(path, name)
            if child in mapping:
                if child not in visited:
                    visited.add(child)
                    dirs.append(child_path)
                    stack.append((child_path, child))
            elif child in files:
                found.append((child_path, child))
    dirs.sort()
    found.sort()
    return dirs, found


# --- the live file system ----------------------------------------------------------------


class _File:
    __slots__ = (
        "data", "durable", "durable_mtime", "image", "ino", "mtime_ns", "pending",
        "pending_times", "sealed",
    )  # fmt: skip

    def __init__(self, ino: int, mtime_ns: int, data: bytes = b"") -> None:
        self.ino = ino
        self.durable = data
        self.data = bytearray(data)
        self.pending: list[_FileOp] = []
        self.mtime_ns = mtime_ns
        self.durable_mtime = mtime_ns
        self.pending_times: list[int] = []
        self.sealed = False
        self.image: _FileImage | None = None


class _Dir:
    __slots__ = ("durable", "entries", "image", "ino", "pending")

    def __init__(self, ino: int, entries: dict[str, int] | None = None) -> None:
        self.ino = ino
        self.entries: dict[str, int] = dict(entries or {})
        self.durable: dict[str, int] = dict(entries or {})
        self.pending: list[_DirOp] = []
        self.image: _DirImage | None = None


@runtime_checkable
class WritebackModel(Protocol):
    """A port that can model a failed writeback (what a failing ``fsync`` reports)."""

    def writeback_error(self, fd: int) -> None:
        """The dirty data of ``fd``'s file is dropped without reaching the disk."""
        ...


class _SimLock:
    def __init__(self, fs: CrashFS, ino: int) -> None:
        self._fs: CrashFS | None = fs
        self._ino = ino

    def release(self) -> None:
        fs, self._fs = self._fs, None
        if fs is not None:
            fs._locks.discard(self._ino)

    def __enter__(self) -> _SimLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _err(code: int, path: str) -> OSError:
    # NOTE: OSError(errno, msg, filename) picks the matching subclass
    # (FileNotFoundError, FileExistsError, ...), as the os module's errors do.
    return OSError(code, posixpath.basename(path) or path, path)


class CrashFS:
    """An in-memory :class:`FilePort` that records operations and models crashes.

    With ``record=True`` it keeps a :class:`CrashSpace` for the moment
    before the first operation and after every operation that changes the
    file system (:attr:`spaces`). ``on_change(record)`` runs after each such
    operation, under the file system's (reentrant) lock, so it sees the state
    right after it and may call the probes (:meth:`tree`, :meth:`read_file`).
    Thread-safe (one lock around every call). Modification times come from
    a logical clock (``tick_ns`` per change).
    """

    def __init__(
        self,
        *,
        record: bool = False,
        start_ns: int = 1_700_000_000 * 10**9,
        tick_ns: int = 1_000_000,
        max_file_variants: int = 729,
        max_dir_subsets: int = 1024,
        on_change: Callable[[OpRecord], None] | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self.on_change = on_change
        self._next_ino = _ROOT_INO + 1
        self._dirs: dict[int, _Dir] = {_ROOT_INO: _Dir(_ROOT_INO)}
        self._files: dict[int, _File] = {}
        self._fds: dict[int, tuple[int, bool]] = {}
        self._next_fd = 3
        self._locks: set[int] = set()
        self._now = start_ns
        self._tick = tick_ns
        self._ops: list[OpRecord] = []
        self._record = record
        self._max_file_variants = max_file_variants
        self._max_dir_subsets = max_dir_subsets
        self.calls: Counter[str] = Counter()
        self.spaces: list[CrashSpace] = []
        if record:
            self.spaces.append(self._space(None))

    # -- observation ------------------------------------------------------------

    @property
    def ops(self) -> tuple[OpRecord, ...]:
        """Every operation that changed the file system, in order."""
        with self._lock:
            return tuple(self._ops)

    @property
    def op_count(self) -> int:
        """How many operations changed the file system so far."""
        with self._lock:
            return len(self._ops)

    def crash_space(self) -> CrashSpace:
        """The crash states of a crash now."""
        with self._lock:
            return self._space(self._ops[-1] if self._ops else None)

    def tree(self) -> dict[str, int]:
        """Every file reachable now (the live view, not a crash state): path -> size."""
        with self._lock:
            out: dict[str, int] = {}
            stack = [("/", _ROOT_INO)]
            while stack:
                path, ino = stack.pop()
                for name, child in self._dirs[ino].entries.items():
                    p = _child(path, name)
                    if child in self._dirs:
                        stack.append((p, child))
                    else:
                        out[p] = len(self._files[child].data)
            return out

    def read_file(self, path: str) -> bytes:
        """The live content of the file at ``path`` (a test probe; not an operation)."""
        with self._lock:
            return bytes(self._file_at(path).data)

    def put_file(self, path: str, data: bytes, *, mtime_ns: int | None = None) -> None:
        """Create or replace a durable file (a test fixture: parents must exist; not recorded)."""
        with self._lock:
            parent, name = self._parent(path)
            ino = self._new_ino()
            f = _File(ino, self._now if mtime_ns is None else mtime_ns, data)
            self._files[ino] = f
            parent.entries[name] = ino
            parent.durable[name] = ino
            parent.image = None

    @classmethod
    def mount(cls, state: CrashState, *, record: bool = False) -> CrashFS:
        """A fresh file system holding ``state``, everything durable (the restart after a crash).

        Files of ``state`` that were not observed raise :class:`UnobservedRead`
        when opened for reading.
        """
        fs = cls(record=False)
        with fs._lock:
            latest = fs._now
            for d in state.dirs:
                if d != "/":
                    parent, name = fs._parent(d)
                    ino = fs._new_ino()
                    fs._dirs[ino] = _Dir(ino)
                    parent.entries[name] = ino
                    parent.durable[name] = ino
            for f in state.files:
                parent, name = fs._parent(f.path)
                ino = fs._new_ino()
                node = _File(ino, f.mtime_ns, f.data)
                node.sealed = not f.observed
                fs._files[ino] = node
                parent.entries[name] = ino
                parent.durable[name] = ino
                latest = max(latest, f.mtime_ns)
            # NOTE: the clock resumes after every surviving mtime, as a
            # restarted machine's clock would.
            fs._now = latest
            fs._record = record
            if record:
                fs.spaces.append(fs._space(None))
        return fs

    # -- the crash model ----------------------------------------------------------

    def writeback_error(self, fd: int) -> None:
        """Model a failed ``fsync`` of ``fd`` (Linux): dirty data dropped, still readable.

        The pending writes will never reach the disk; reads keep seeing them
        (the page cache marks them clean); the next ``fsync`` has nothing to
        write and succeeds.
        """
        with self._lock:
            f = self._fd_file(fd)
            f.pending.clear()
            f.image = None
            self._changed("writeback_error", self._path_hint(f.ino))

    def _space(self, last: OpRecord | None) -> CrashSpace:
        files: dict[int, _FileImage] = {}
        for ino, f in self._files.items():
            if f.image is None:
                f.image = _FileImage(
                    f.durable, tuple(f.pending), f.durable_mtime, tuple(f.pending_times)
                )
            files[ino] = f.image
        dirs: dict[int, _DirImage] = {}
        for ino, d in self._dirs.items():
            if d.image is None:
                d.image = _DirImage(tuple(sorted(d.durable.items())), tuple(d.pending))
            dirs[ino] = d.image
        return CrashSpace(
            len(self._ops),
            last,
            files,
            dirs,
            max_file_variants=self._max_file_variants,
            max_dir_subsets=self._max_dir_subsets,
        )

    def _changed(self, kind: str, path: str, detail: str = "") -> None:
        rec = OpRecord(len(self._ops), kind, path, detail)
        self._ops.append(rec)
        if self._record:
            self.spaces.append(self._space(rec))
        if self.on_change is not None:
            self.on_change(rec)

    def _clock(self) -> int:
        self._now += self._tick
        return self._now

    @property
    def now_ns(self) -> int:
        """The file system's clock (ns): the mtime the next change would get, less one tick."""
        return self._now

    # -- path helpers -----------------------------------------------------------------

    def _new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    @staticmethod
    def _parts(path: str) -> list[str]:
        if not path.startswith("/"):
            raise ValueError(f"CrashFS paths are absolute: {path!r}")
        return [p for p in posixpath.normpath(path).split("/") if p]

    def _lookup(self, path: str) -> int | None:
        ino = _ROOT_INO
        for part in self._parts(path):
            d = self._dirs.get(ino)
            if d is None:
                raise _err(errno.ENOTDIR, path)
            nxt = d.entries.get(part)
            if nxt is None:
                return None
            ino = nxt
        return ino

    def _parent(self, path: str) -> tuple[_Dir, str]:
        parts = self._parts(path)
        if not parts:
            raise _err(errno.EEXIST, path)
        ino = _ROOT_INO
        for part in parts[:-1]:
            d = self._dirs.get(ino)
            if d is None:
                raise _err(errno.ENOTDIR, path)
            nxt = d.entries.get(part)
            if nxt is None:
                raise _err(errno.ENOENT, path)
            ino = nxt
        d = self._dirs.get(ino)
        if d is None:
            raise _err(errno.ENOTDIR, path)
        return d, parts[-1]

    def _file_at(self, path: str) -> _File:
        ino = self._lookup(path)
        if ino is None:
            raise _err(errno.ENOENT, path)
        f = self._files.get(ino)
        if f is None:
            raise _err(errno.EISDIR, path)
        return f

    def _fd_file(self, fd: int) -> _File:
        entry = self._fds.get(fd)
        if entry is None:
            raise OSError(errno.EBADF, f"bad file descriptor {fd}")
        f = self._files.get(entry[0])
        if f is None:
            raise OSError(errno.EISDIR, f"descriptor {fd} is a directory")
        return f

    def _path_hint(self, ino: int) -> str:
        for d in self._dirs.values():
            for name, child in d.entries.items():
                if child == ino:
                    return f"<dir {d.ino}>/{name}"
        return f"<ino {ino}>"

    def _dir_link(self, d: _Dir, op: _DirOp) -> None:
        if isinstance(op, _Link):
            d.entries[op.name] = op.ino
        elif isinstance(op, _Unlink):
            d.entries.pop(op.name, None)
        else:
            d.entries.pop(op.src, None)
            d.entries[op.dst] = op.ino
        d.pending.append(op)
        d.image = None

    def _file_op(self, f: _File, op: _FileOp) -> None:
        _apply_file_op(f.data, op)
        f.pending.append(op)
        f.mtime_ns = self._clock()
        f.image = None

    # -- FilePort -------------------------------------------------------------------

    def open_temp(self, path: str) -> int:
        """See :meth:`FilePort.open_temp`."""
        with self._lock:
            self.calls["open_temp"] += 1
            parent, name = self._parent(path)
            if name in parent.entries:
                raise _err(errno.EEXIST, path)
            ino = self._new_ino()
            self._files[ino] = _File(ino, self._clock())
            self._dir_link(parent, _Link(name, ino))
            fd = self._next_fd
            self._next_fd += 1
            self._fds[fd] = (ino, True)
            self._changed("create", path)
            return fd

    def pwrite_all(self, fd: int, data: BytesLike, offset: int) -> None:
        """See :meth:`FilePort.pwrite_all`."""
        with self._lock:
            self.calls["pwrite_all"] += 1
            entry = self._fds.get(fd)
            if entry is None or not entry[1]:
                raise OSError(errno.EBADF, f"descriptor {fd} is not open for writing")
            f = self._fd_file(fd)
            payload = bytes(memoryview(data).cast("B")) if memoryview(data).nbytes else b""
            self._file_op(f, _Write(offset, payload))
            self._changed("write", self._path_hint(f.ino), f"{len(payload)}@{offset}")

    def truncate(self, fd: int, size: int) -> None:
        """See :meth:`FilePort.truncate`."""
        with self._lock:
            self.calls["truncate"] += 1
            f = self._fd_file(fd)
            self._file_op(f, _Truncate(size))
            self._changed("truncate", self._path_hint(f.ino), str(size))

    def fsync(self, fd: int) -> None:
        """See :meth:`FilePort.fsync`: the pending writes become the durable content."""
        with self._lock:
            self.calls["fsync"] += 1
            f = self._fd_file(fd)
            if not f.pending and not f.pending_times and f.durable_mtime == f.mtime_ns:
                return
            f.durable_mtime = f.mtime_ns
            f.pending_times.clear()
            # NOTE: durable := durable + pending, not the live bytes: after a
            # writeback error the live bytes hold data that never got there.
            buf = bytearray(f.durable)
            for op in f.pending:
                _apply_file_op(buf, op)
            f.durable = bytes(buf)
            f.pending.clear()
            f.image = None
            self._changed("fsync", self._path_hint(f.ino))

    def close(self, fd: int) -> None:
        """See :meth:`FilePort.close`."""
        with self._lock:
            self.calls["close"] += 1
            if self._fds.pop(fd, None) is None:
                raise OSError(errno.EBADF, f"bad file descriptor {fd}")

    def replace(self, src: str, dst: str) -> None:
        """See :meth:`FilePort.replace` (atomic within one directory)."""
        with self._lock:
            self.calls["replace"] += 1
            sdir, sname = self._parent(src)
            ddir, dname = self._parent(dst)
            ino = sdir.entries.get(sname)
            if ino is None:
                raise _err(errno.ENOENT, src)
            if ino in self._dirs or ddir.entries.get(dname) in self._dirs:
                raise _err(errno.EISDIR, dst)
            if sdir is ddir:
                self._dir_link(sdir, _Rename(sname, dname, ino))
            else:
                self._dir_link(sdir, _Unlink(sname))
                self._dir_link(ddir, _Link(dname, ino))
            self._changed("rename", src, dst)

    def fsync_dir(self, path: str) -> None:
        """See :meth:`FilePort.fsync_dir`: the directory's entries become durable."""
        with self._lock:
            self.calls["fsync_dir"] += 1
            ino = self._lookup(path)
            if ino is None:
                raise _err(errno.ENOENT, path)
            d = self._dirs.get(ino)
            if d is None:
                raise _err(errno.ENOTDIR, path)
            d.durable = dict(d.entries)
            d.pending.clear()
            d.image = None
            self._changed("fsync_dir", path)

    def unlink(self, path: str) -> None:
        """See :meth:`FilePort.unlink`."""
        with self._lock:
            self.calls["unlink"] += 1
            parent, name = self._parent(path)
            ino = parent.entries.get(name)
            if ino is None:
                raise _err(errno.ENOENT, path)
            if ino in self._dirs:
                raise _err(errno.EISDIR, path)
            self._dir_link(parent, _Unlink(name))
            self._changed("unlink", path)

    def _dir_at(self, path: str) -> _Dir:
        ino = self._lookup(path)
        if ino is None:
            raise _err(errno.ENOENT, path)
        d = self._dirs.get(ino)
        if d is None:
            raise _err(errno.ENOTDIR, path)
        return d

    def listdir(self, path: str) -> list[str]:
        """See :meth:`FilePort.listdir`."""
        with self._lock:
            self.calls["listdir"] += 1
            return sorted(self._dir_at(path).entries)

    def scandir(self, path: str) -> list[DirEntryInfo]:
        """See :meth:`FilePort.scandir`."""
        with self._lock:
            self.calls["scandir"] += 1
            d = self._dir_at(path)
            out: list[DirEntryInfo] = []
            for name, ino in sorted(d.entries.items()):
                f = self._files.get(ino)
                out.append(
                    DirEntryInfo(
                        name=name,
                        path=posixpath.join(path, name),
                        size=len(f.data) if f is not None else 0,
                        mtime_ns=f.mtime_ns if f is not None else 0,
                        is_file=f is not None,
                        is_dir=f is None,
                        is_symlink=False,
                    )
                )
            return out

    def _stat(self, ino: int) -> FileStat:
        f = self._files.get(ino)
        if f is None:
            return FileStat(size=0, mtime_ns=0, is_file=False, is_dir=True)
        return FileStat(size=len(f.data), mtime_ns=f.mtime_ns, is_file=True, is_dir=False)

    def stat(self, path: str) -> FileStat:
        """See :meth:`FilePort.stat`."""
        with self._lock:
            self.calls["stat"] += 1
            ino = self._lookup(path)
            if ino is None:
                raise _err(errno.ENOENT, path)
            return self._stat(ino)

    def fstat(self, fd: int) -> FileStat:
        """See :meth:`FilePort.fstat`."""
        with self._lock:
            self.calls["fstat"] += 1
            entry = self._fds.get(fd)
            if entry is None:
                raise OSError(errno.EBADF, f"bad file descriptor {fd}")
            return self._stat(entry[0])

    def utime(self, path: str, mtime_ns: int | None = None) -> None:
        """See :meth:`FilePort.utime` (``None``: the logical clock's next tick)."""
        with self._lock:
            self.calls["utime"] += 1
            f = self._file_at(path)
            f.mtime_ns = self._clock() if mtime_ns is None else mtime_ns
            f.pending_times.append(f.mtime_ns)
            f.image = None
            self._changed("utime", path, str(f.mtime_ns))

    def open_read(self, path: str) -> int:
        """See :meth:`FilePort.open_read` (directories open too, as on Linux)."""
        with self._lock:
            self.calls["open_read"] += 1
            ino = self._lookup(path)
            if ino is None:
                raise _err(errno.ENOENT, path)
            f = self._files.get(ino)
            if f is not None and f.sealed:
                raise UnobservedRead(f"{path} was declared unobserved for this crash state")
            fd = self._next_fd
            self._next_fd += 1
            self._fds[fd] = (ino, False)
            return fd

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """See :meth:`FilePort.pread_into`."""
        with self._lock:
            self.calls["pread_into"] += 1
            self._pread(fd, buf, offset)

    def _pread(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        f = self._fd_file(fd)
        view = memoryview(buf).cast("B")
        want = len(view)
        got = max(0, min(want, len(f.data) - offset))
        view[:got] = f.data[offset : offset + got]
        if got < want:
            raise ShortRead(offset=offset, wanted=want, got=got)

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """See :meth:`FilePort.preadv_into` (one buffer after the other, as the range runs)."""
        with self._lock:
            self.calls["preadv_into"] += 1
            for buf in bufs:
                self._pread(fd, buf, offset)
                offset += memoryview(buf).nbytes

    def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """See :meth:`FilePort.pread_exact`."""
        with self._lock:
            self.calls["pread_exact"] += 1
            buf = bytearray(size)
            self._pread(fd, buf, offset)
            return bytes(buf)

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        """See :meth:`FilePort.makedirs`: each new directory, then its parent's fsync."""
        del mode
        with self._lock:
            self.calls["makedirs"] += 1
            ino = _ROOT_INO
            cur = "/"
            for part in self._parts(path):
                d = self._dirs.get(ino)
                if d is None:
                    raise _err(errno.ENOTDIR, cur)
                nxt = d.entries.get(part)
                child_path = posixpath.join(cur, part)
                if nxt is None:
                    nxt = self._new_ino()
                    self._dirs[nxt] = _Dir(nxt)
                    self._dir_link(d, _Link(part, nxt))
                    self._changed("mkdir", child_path)
                    d.durable = dict(d.entries)
                    d.pending.clear()
                    d.image = None
                    self._changed("fsync_dir", cur)
                ino, cur = nxt, child_path
            if ino not in self._dirs:
                raise _err(errno.EEXIST, path)

    def lock(self, path: str) -> FileLock:
        """See :meth:`FilePort.lock` (locks are per :class:`CrashFS`; a crash drops them)."""
        with self._lock:
            self.calls["lock"] += 1
            parent, name = self._parent(path)
            ino = parent.entries.get(name)
            if ino is None:
                ino = self._new_ino()
                self._files[ino] = _File(ino, self._clock())
                self._dir_link(parent, _Link(name, ino))
                self._changed("create", path)
            elif ino in self._dirs:
                raise _err(errno.EISDIR, path)
            if ino in self._locks:
                raise LockUnavailable(path)
            self._locks.add(ino)
            return _SimLock(self, ino)


# --- Nth-operation faults ------------------------------------------------------------------

FaultKind = Literal["enospc", "eio", "eintr", "short"]

_FAULT_ERRNO: Final[Mapping[str, int]] = {
    "enospc": errno.ENOSPC,
    "eio": errno.EIO,
    "eintr": errno.EINTR,
}

PORT_METHODS: Final = (
    "open_temp",
    "pwrite_all",
    "truncate",
    "fsync",
    "close",
    "replace",
    "fsync_dir",
    "unlink",
    "listdir",
    "scandir",
    "stat",
    "fstat",
    "utime",
    "open_read",
    "pread_into",
    "preadv_into",
    "pread_exact",
    "makedirs",
    "lock",
)
"""Every :class:`FilePort` method, in protocol order."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Fail the ``n``-th call (from 1) of port method ``method`` with ``kind``.

    ``short`` (``pwrite_all`` only): the first half of the data is written,
    then the call fails with ``ENOSPC``, as a write that ran out of room
    part-way does. ``eintr`` raises :class:`InterruptedError`.
    """

    method: str
    n: int
    kind: FaultKind

    def __post_init__(self) -> None:
        if self.method not in PORT_METHODS:
            raise ValueError(f"unknown port method {self.method!r}")
        if self.n < 1:
            raise ValueError("n counts from 1")
        if self.kind == "short" and self.method != "pwrite_all":
            raise ValueError("short writes apply to pwrite_all only")


class FaultingPort:
    """A :class:`FilePort` that forwards to ``inner`` and fails one chosen call.

    ``calls`` counts every call by method (the fault's own included);
    ``fired`` says whether the fault has happened. A failed ``fsync`` calls
    ``inner.writeback_error(fd)`` first when ``inner`` models writeback
    (:class:`CrashFS`), so the loss behind the error is real; a failed
    ``close`` still closes the descriptor, as ``close(2)`` does.
    """

    def __init__(self, inner: FilePort, fault: Fault | None = None) -> None:
        self.inner = inner
        self.fault = fault
        self.calls: Counter[str] = Counter()
        self.fired = False

    def _hit(self, method: str) -> bool:
        self.calls[method] += 1
        f = self.fault
        if f is None or self.fired or f.method != method or self.calls[method] != f.n:
            return False
        self.fired = True
        return True

    def _fail_if_chosen(self, method: str) -> None:
        """Count a call of ``method``; raise the fault if it is the chosen call."""
        if self._hit(method):
            raise self._error(method)

    def _error(self, method: str) -> OSError:
        assert self.fault is not None
        kind = self.fault.kind
        code = errno.ENOSPC if kind == "short" else _FAULT_ERRNO[kind]
        msg = f"injected {kind} on call {self.fault.n} of {method}"
        if code == errno.EINTR:
            return InterruptedError(code, msg)
        return OSError(code, msg)

    def open_temp(self, path: str) -> int:
        """Forward or fail."""
        self._fail_if_chosen("open_temp")
        return self.inner.open_temp(path)

    def pwrite_all(self, fd: int, data: BytesLike, offset: int) -> None:
        """Forward or fail (a short write lands half the bytes first)."""
        if self._hit("pwrite_all"):
            assert self.fault is not None
            if self.fault.kind == "short":
                view = memoryview(data).cast("B") if memoryview(data).nbytes else memoryview(b"")
                if len(view) > 1:
                    self.inner.pwrite_all(fd, view[: len(view) // 2], offset)
            raise self._error("pwrite_all")
        self.inner.pwrite_all(fd, data, offset)

    def truncate(self, fd: int, size: int) -> None:
        """Forward or fail."""
        self._fail_if_chosen("truncate")
        self.inner.truncate(fd, size)

    def fsync(self, fd: int) -> None:
        """Forward or fail; a failure loses the dirty data when ``inner`` models writeback."""
        if self._hit("fsync"):
            if isinstance(self.inner, WritebackModel):
                self.inner.writeback_error(fd)
            raise self._error("fsync")
        self.inner.fsync(fd)

    def close(self, fd: int) -> None:
        """Forward; a failure is reported after the descriptor is closed."""
        failing = self._hit("close")
        self.inner.close(fd)
        if failing:
            raise self._error("close")

    def replace(self, src: str, dst: str) -> None:
        """Forward or fail."""
        self._fail_if_chosen("replace")
        self.inner.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        """Forward or fail (the directory's pending entries stay pending)."""
        self._fail_if_chosen("fsync_dir")
        self.inner.fsync_dir(path)

    def unlink(self, path: str) -> None:
        """Forward or fail."""
        self._fail_if_chosen("unlink")
        self.inner.unlink(path)

    def listdir(self, path: str) -> list[str]:
        """Forward or fail."""
        self._fail_if_chosen("listdir")
        return self.inner.listdir(path)

    def scandir(self, path: str) -> list[DirEntryInfo]:
        """Forward or fail."""
        self._fail_if_chosen("scandir")
        return self.inner.scandir(path)

    def stat(self, path: str) -> FileStat:
        """Forward or fail."""
        self._fail_if_chosen("stat")
        return self.inner.stat(path)

    def fstat(self, fd: int) -> FileStat:
        """Forward or fail."""
        self._fail_if_chosen("fstat")
        return self.inner.fstat(fd)

    def utime(self, path: str, mtime_ns: int | None = None) -> None:
        """Forward or fail."""
        self._fail_if_chosen("utime")
        self.inner.utime(path, mtime_ns)

    def open_read(self, path: str) -> int:
        """Forward or fail."""
        self._fail_if_chosen("open_read")
        return self.inner.open_read(path)

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        """Forward or fail."""
        self._fail_if_chosen("pread_into")
        self.inner.pread_into(fd, buf, offset)

    def preadv_into(self, fd: int, bufs: Sequence[WritableBuffer], offset: int) -> None:
        """Forward or fail."""
        self._fail_if_chosen("preadv_into")
        self.inner.preadv_into(fd, bufs, offset)

    def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """Forward or fail."""
        self._fail_if_chosen("pread_exact")
        return self.inner.pread_exact(fd, size, offset)

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        """Forward or fail (before any directory is made)."""
        self._fail_if_chosen("makedirs")
        self.inner.makedirs(path, mode)

    def lock(self, path: str) -> FileLock:
        """Forward or fail."""
        self._fail_if_chosen("lock")
        return self.inner.lock(path)
