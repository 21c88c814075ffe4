"""Checkpoint files: newest kept, the previous survives a failed write, corrupt ones are never resumed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from actors.checkpoints.store import (
    checkpoint_dir,
    find_checkpoint,
    remove_checkpoints,
    write_checkpoint,
)
from kernels.cache import (
    CacheFileWriteError,
    GenerationCheckpoint,
    OsFilePort,
    plan_entry,
    tensor_bytes,
)

KEY = "0f" * 16
OTHER = "1e" * 16
FP = "kvtfp"
PROMPT = [5, 6, 7, 8]


def _plan(key: str, emitted: int, *, namespace: str = "") -> Any:
    n = len(PROMPT) + emitted
    mx.random.seed(emitted)
    kv = KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 16)))
    ck = GenerationCheckpoint(key, len(PROMPT), 40 + emitted, emitted, None)
    return plan_entry([kv], model_id="m", fingerprint=FP, namespace=namespace, tokenizer_hash="t",
                      tokens=PROMPT + list(range(100, 100 + emitted)), checkpoint=ck)


def _write(port: Any, directory: str, key: str, emitted: int) -> str:
    plan = _plan(key, emitted)
    return write_checkpoint(port, directory, plan, lambda i: tensor_bytes(plan, i))


@pytest.fixture
def directory(tmp_path: Path) -> str:
    d = checkpoint_dir(str(tmp_path), FP)
    os.makedirs(d)
    return d


def _found_index(port: Any, directory: str, key: str = KEY) -> int | None:
    found = find_checkpoint(port, directory, key, fingerprint=FP, namespace="")
    if found is None:
        return None
    assert found.header.checkpoint is not None
    return found.header.checkpoint.sample_index


def test_newest_replaces_previous(directory: str) -> None:
    """A newer checkpoint of a key is found and the older file is gone; other keys are untouched."""
    port = OsFilePort()
    _write(port, directory, KEY, 8)
    _write(port, directory, OTHER, 3)
    path = _write(port, directory, KEY, 16)
    assert _found_index(port, directory) == 16
    assert sorted(os.listdir(directory)) == sorted([os.path.basename(path), f"{OTHER}-3.kvc"])
    assert _found_index(port, directory, OTHER) == 3


class _FailAt(OsFilePort):
    """Fails the n-th call of ``op`` with EIO (a crash-like failure inside a write)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def fsync(self, fd: int) -> None:
        if self.op == "fsync":
            raise OSError(5, "EIO")
        super().fsync(fd)

    def replace(self, src: str, dst: str) -> None:
        if self.op == "replace":
            raise OSError(5, "EIO")
        super().replace(src, dst)


@pytest.mark.parametrize("op", ["fsync", "replace"])
def test_failed_write_keeps_previous(directory: str, op: str) -> None:
    """A write that fails before it is durable leaves the previous checkpoint valid and nothing else."""
    _write(OsFilePort(), directory, KEY, 8)
    with pytest.raises(CacheFileWriteError):
        _write(_FailAt(op), directory, KEY, 16)
    assert os.listdir(directory) == [f"{KEY}-8.kvc"]
    assert _found_index(OsFilePort(), directory) == 8


def test_crash_between_commit_and_cleanup(directory: str) -> None:
    """Two committed files of a key (a crash before the older was removed): the newest wins, the other goes."""
    port = OsFilePort()
    _write(port, directory, KEY, 8)
    keep = os.path.join(directory, f"{KEY}-8.kvc")
    saved = Path(keep).read_bytes()
    _write(port, directory, KEY, 16)
    Path(keep).write_bytes(saved)
    assert _found_index(port, directory) == 16
    assert not os.path.exists(keep)


def test_corrupt_newest_falls_back(directory: str) -> None:
    """A torn newest file is removed and never resumed; the older valid one (left by a crash) is found."""
    port = OsFilePort()
    older = _write(port, directory, KEY, 8)
    saved = Path(older).read_bytes()
    newest = _write(port, directory, KEY, 16)
    Path(older).write_bytes(saved)
    data = bytearray(Path(newest).read_bytes())
    data[40] ^= 1
    Path(newest).write_bytes(bytes(data))
    assert _found_index(port, directory) == 8
    assert not os.path.exists(newest)


def test_foreign_namespace_or_key_not_resumed(directory: str) -> None:
    """A file under the key's name whose section or namespace differs is never resumed."""
    port = OsFilePort()
    plan = _plan(KEY, 8, namespace="other")
    write_checkpoint(port, directory, plan, lambda i: tensor_bytes(plan, i))
    assert _found_index(port, directory) is None
    _write(port, directory, OTHER, 4)
    os.rename(os.path.join(directory, f"{OTHER}-4.kvc"), os.path.join(directory, f"{KEY}-4.kvc"))
    assert _found_index(port, directory) is None
    assert os.listdir(directory) == []


def test_remove_invalidates(directory: str) -> None:
    """Completion's removal leaves nothing to resume."""
    port = OsFilePort()
    _write(port, directory, KEY, 8)
    assert len(remove_checkpoints(port, directory, KEY)) == 1
    assert _found_index(port, directory) is None
