"""The OS file port starts writeback of each range it writes (``sync_file_range`` on Linux)."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kernels.cache._file_port import _DEFAULT_WRITEBACK, OsFilePort
from kernels.cache._kv_format import CacheFileWriteError
from kernels.cache._kv_header import read_header
from kernels.cache._kv_reader import read_tensors
from kernels.cache._kv_writer import KvFileWriter, plan_entry, tensor_bytes


class Recorder:
    """A scripted writeback: records each call; raises ``errors`` in order, then succeeds."""

    def __init__(self, *errors: int) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.errors = list(errors)

    def __call__(self, fd: int, offset: int, nbytes: int) -> None:
        self.calls.append((fd, offset, nbytes))
        if self.errors:
            err = self.errors.pop(0)
            raise OSError(err, os.strerror(err))


def _caches() -> list[Any]:
    mx.random.seed(1)
    out = []
    for _ in range(2):
        c = KVCache()
        k = mx.random.normal((1, 2, 5, 8))
        c.update_and_fetch(k, k + 1)
        out.append(c)
    return out


def _write(port: OsFilePort, directory: Path) -> tuple[Path, list[tuple[int, int]]]:
    """Write a two-layer entry through ``port``; the file and each tensor's (offset, nbytes)."""
    plan = plan_entry(
        _caches(), model_id="m", fingerprint="fp", namespace="", tokenizer_hash="t", tokens=range(5)
    )
    final = directory / "e.kvt"
    with KvFileWriter(port, plan) as writer:
        writer.begin(str(directory))
        for i in range(len(plan.tensors)):
            writer.write_tensor(i, tensor_bytes(plan, i))
        writer.commit(str(final))
    return final, [(t.offset, t.nbytes) for t in plan.tensors]


def test_pwrite_all_starts_writeback_of_exactly_the_range_it_wrote(tmp_path: Path) -> None:
    """Each pwrite_all asks writeback for its own (fd, offset, length), after the bytes are written; an empty write asks nothing."""
    rec = Recorder()
    port = OsFilePort(writeback=rec)
    path = tmp_path / "f"
    fd = port.open_temp(str(path))
    try:
        port.pwrite_all(fd, b"abcdef", 10)
        port.pwrite_all(fd, b"", 3)
        port.pwrite_all(fd, memoryview(b"xyz"), 0)
    finally:
        port.close(fd)
    assert rec.calls == [(fd, 10, 6), (fd, 0, 3)]
    assert path.read_bytes() == b"xyz" + b"\x00" * 7 + b"abcdef"


def test_the_writer_starts_writeback_of_every_tensor_and_the_header(tmp_path: Path) -> None:
    """A stored entry asked writeback for each tensor's range and the header region, and reads back verified."""
    rec = Recorder()
    final, tensors = _write(OsFilePort(writeback=rec), tmp_path)
    ranges = [(off, n) for _, off, n in rec.calls]
    header = read_header(OsFilePort(writeback=None), str(final))
    assert ranges == [*tensors, (0, header.data_offset)]
    host = read_tensors(OsFilePort(writeback=None), str(final), header, verify=True)
    assert [len(b) for b in host.buffers] == [n for _, n in tensors]


def test_a_failed_writeback_start_fails_the_store_and_leaves_no_file(tmp_path: Path) -> None:
    """EIO from the writeback start is a failed write: CacheFileWriteError at step 'write', nothing left on disk."""
    port = OsFilePort(writeback=Recorder(errno.EIO))
    with pytest.raises(CacheFileWriteError) as info:
        _write(port, tmp_path)
    assert info.value.step == "write"
    assert info.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EINVAL, errno.ESPIPE])
def test_unsupported_writeback_is_turned_off_and_the_store_succeeds(
    tmp_path: Path, err: int
) -> None:
    """An 'unsupported' answer turns the early start off for the port (asked once) and the entry is stored."""
    rec = Recorder(err)
    final, _ = _write(OsFilePort(writeback=rec), tmp_path)
    assert len(rec.calls) == 1
    header = read_header(OsFilePort(writeback=None), str(final))
    read_tensors(OsFilePort(writeback=None), str(final), header, verify=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_default_writeback_is_the_real_sync_file_range_on_linux(tmp_path: Path) -> None:
    """On Linux the default calls the kernel: fine on a written file, EBADF on a closed descriptor."""
    assert _DEFAULT_WRITEBACK is not None
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.pwrite(fd, b"x" * 8192, 0)
        _DEFAULT_WRITEBACK(fd, 0, 8192)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        _DEFAULT_WRITEBACK(fd, 0, 8192)
    assert info.value.errno == errno.EBADF
