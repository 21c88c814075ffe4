"""Checkpoint files on disk: write the newest, find it after a restart, invalidate it.

Layout: ``<root>/<fingerprint>/checkpoints/<request key>-<sample index>.kvc``
(format version 2, ``docs/file-format.md``). The tier's prompt-entry scan
reads only ``*.kvt`` files, so it never indexes these.

Rules (worker threads only; every file call goes through the ``FilePort``):

- A new checkpoint is written under its OWN name (the sample index is in
  it), committed by the codec (temp file, fsync, rename, directory fsync),
  and only then are the older files of its key removed. So the previous
  checkpoint stays valid until the new one is durable: a crash or a failed
  write at any step leaves at least the previous one, never a torn file
  under a final name (the codec's temp files are ``*.kvt.tmp``, reaped by
  the tier's startup scan).
- :func:`find_checkpoint` reads every file of the key, fully validates its
  header (fingerprint, key, untrusted-file checks), picks the one with the
  most emitted tokens, and removes the others and any corrupt one; a file
  it cannot read for an OS reason is left alone.
- :func:`remove_checkpoints` deletes every file of a key durably (completion
  invalidates its checkpoint).
- A delta (``kernels.cache._kv_delta``) reads the previous file of the same
  answer, every tensor hash-checked, BEFORE the new file is committed (so
  before the previous one is removed) and writes the same bytes a whole
  read-back would have: the rules above are unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kernels.cache import (
    CacheFileCorrupt,
    CacheFileIncompatible,
    EntryPlan,
    FilePort,
    KvFileHeader,
    KvFileWriter,
    compose_tail,
    read_header,
    read_tensors,
)

__all__ = [
    "CHECKPOINT_DIR",
    "CHECKPOINT_SUFFIX",
    "DeltaBase",
    "FoundCheckpoint",
    "checkpoint_dir",
    "find_checkpoint",
    "remove_checkpoints",
    "write_checkpoint",
]

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_SUFFIX = ".kvc"
_HEX = frozenset("0123456789abcdef")


def checkpoint_dir(root: str, fingerprint: str) -> str:
    """The checkpoint directory of the tier fingerprint ``fingerprint`` under ``root``."""
    return os.path.join(root, fingerprint, CHECKPOINT_DIR)


def _check_key(key: str) -> None:
    if len(key) != 32 or not set(key) <= _HEX:
        raise ValueError("a request key is 32 lowercase hex digits")


def _name(key: str, sample_index: int) -> str:
    return f"{key}-{sample_index}{CHECKPOINT_SUFFIX}"


def _files_of(port: FilePort, directory: str, key: str) -> list[str]:
    try:
        listing = port.scandir(directory)
    except FileNotFoundError:
        return []
    prefix = f"{key}-"
    return sorted(e.path for e in listing
                  if e.is_file and not e.is_symlink and e.name.startswith(prefix)
                  and e.name.endswith(CHECKPOINT_SUFFIX))


@dataclass(frozen=True, slots=True)
class DeltaBase:
    """The previous checkpoint file of the same answer and what a delta takes from it.

    ``starts`` maps a tensor index (the same in both files: their layer
    structure matched) to the tokens the previous file holds of it
    (``kernels.cache.tail_starts``); the new file's view of such a tensor
    holds only the tokens after.
    """

    path: str
    header: KvFileHeader
    starts: Mapping[int, int]


def write_checkpoint(
    port: FilePort,
    directory: str,
    plan: EntryPlan,
    tensor: Callable[[int], memoryview],
    base: DeltaBase | None = None,
) -> str:
    """Write the checkpoint ``plan`` durably, then remove the older files of its key; its path.

    ``tensor(i)`` gives tensor ``i``'s bytes (in serving, one idle engine
    turn each); with ``base``, only the tokens after ``base.starts[i]`` for
    the tensors it lists, the rest read from the previous file (every tensor
    hash-checked). Raises the codec's ``CacheFileWriteError`` (nothing of
    this write is left; the older files are untouched), ``CacheFileCorrupt``
    (a previous file that fails its checks) or ``ValueError``.
    """
    ck = plan.header.checkpoint
    if ck is None:
        raise ValueError("the plan carries no checkpoint section")
    _check_key(ck.request_key)
    final = os.path.join(directory, _name(ck.request_key, ck.sample_index))
    # NOTE: read before the new file commits: the commit removes the previous one.
    prev = read_tensors(port, base.path, base.header, verify=True) if base and base.starts else None
    with KvFileWriter(port, plan) as writer:
        writer.begin(directory)
        for i in range(len(plan.tensors)):
            data = tensor(i)
            if prev is not None and base is not None and i in base.starts:
                data = compose_tail(prev.buffers[i], data, plan.tensors[i], base.starts[i])
            writer.write_tensor(i, data)
        writer.commit(final)
    older = [p for p in _files_of(port, directory, ck.request_key) if p != final]
    _remove(port, directory, older)
    return final


@dataclass(frozen=True, slots=True)
class FoundCheckpoint:
    """A validated checkpoint file: its path and header (``header.checkpoint`` is set)."""

    path: str
    header: KvFileHeader


def find_checkpoint(
    port: FilePort, directory: str, key: str, *, fingerprint: str, namespace: str
) -> FoundCheckpoint | None:
    """The newest valid checkpoint of ``key`` (``None``: none); removes older and corrupt files.

    A file is valid when its header passes every check, its fingerprint and
    namespace are ours and its section names ``key``.
    """
    _check_key(key)
    best: FoundCheckpoint | None = None
    stale: list[str] = []
    for path in _files_of(port, directory, key):
        try:
            header = read_header(port, path, expected_fingerprint=fingerprint)
        except (CacheFileCorrupt, CacheFileIncompatible):
            stale.append(path)
            continue
        except OSError:
            continue  # NOTE: unreadable is not proof of corruption: left alone.
        ck = header.checkpoint
        if ck is None or ck.request_key != key or header.namespace != namespace:
            stale.append(path)
            continue
        found = FoundCheckpoint(path, header)
        if best is None:
            best = found
            continue
        assert best.header.checkpoint is not None
        if ck.sample_index > best.header.checkpoint.sample_index:
            stale.append(best.path)
            best = found
        else:
            stale.append(path)
    _remove(port, directory, stale)
    return best


def remove_checkpoints(port: FilePort, directory: str, key: str) -> tuple[str, ...]:
    """Remove every checkpoint file of ``key`` durably; the paths removed (the cap counts them)."""
    _check_key(key)
    files = _files_of(port, directory, key)
    _remove(port, directory, files)
    return tuple(files)


def _remove(port: FilePort, directory: str, paths: list[str]) -> None:
    if not paths:
        return
    for path in paths:
        try:
            port.unlink(path)
        except FileNotFoundError:
            pass
    # NOTE: one directory fsync makes every unlink above durable.
    port.fsync_dir(directory)
