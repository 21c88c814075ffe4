"""Where a restore checks the tensor hashes: in the reader's pass, or only in the landing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kernels.cache._file_port import OsFilePort, WritableBuffer
from kernels.cache._kv_format import CacheFileCorrupt
from kernels.cache._kv_header import read_header
from kernels.cache._kv_landing import LandingPool, land_entry
from kernels.cache._kv_reader import open_file
from tests.crash.ports import ForwardingPort
from tests.kernels.cache.test_kv_file import _filled_kv, assert_same_state, write_entry

PORT = OsFilePort(writeback=None)


def _file(tmp_path: Path, *, flip: bool) -> tuple[Path, list[Any]]:
    caches = [_filled_kv(9, mx.bfloat16, seed=i) for i in range(3)]
    path = write_entry(caches, list(range(9)), tmp_path)
    if flip:
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x01  # NOTE: inside the last tensor; the header stays valid.
        path.write_bytes(bytes(raw))
    return path, list(caches)


@pytest.mark.parametrize("pooled", [False, True])
def test_a_pass_without_checks_leaves_the_flipped_bit_to_the_landing(
    tmp_path: Path, pooled: bool
) -> None:
    """With ``check_in_pass=False`` the pass reads a corrupt file to its end and the landing,
    which hashes in the arrays' memory, fails with ``CacheFileCorrupt``."""
    path, _ = _file(tmp_path, flip=True)
    port = ForwardingPort(PORT)  # NOTE: no page-cache probe: the pass reads.
    header = read_header(port, str(path))
    entry = open_file(port, str(path), header, check_in_pass=False)
    pool = LandingPool(2) if pooled else None
    try:
        assert entry.pass_over() == header.nbytes
        with pytest.raises(CacheFileCorrupt, match="hash mismatch"):
            land_entry(entry, step=4, pool=pool)
    finally:
        entry.close()
        if pool is not None:
            pool.close()


class _Probe(ForwardingPort):
    """A port that says what the page cache holds as scripted, and counts the pass's reads."""

    def __init__(self, cached: bool) -> None:
        super().__init__(PORT)
        self.cached = cached
        self.asked = 0
        self.preads = 0

    def all_cached(self, fd: int, size: int, ranges: Sequence[tuple[int, int]]) -> bool:
        self.asked += 1
        return self.cached

    def pread_into(self, fd: int, buf: WritableBuffer, offset: int) -> None:
        self.preads += 1
        super().pread_into(fd, buf, offset)


@pytest.mark.parametrize("cached", [True, False])
def test_a_pass_that_checks_nothing_ends_at_once_on_a_cached_file(
    tmp_path: Path, cached: bool
) -> None:
    """A pass without checks reads nothing when the port says the file is all in the page
    cache (0 bytes, and the landing still lands every byte and checks it); else it reads."""
    path, caches = _file(tmp_path, flip=False)
    port = _Probe(cached)
    header = read_header(port, str(path))
    reads_before = port.preads
    entry = open_file(port, str(path), header, check_in_pass=False)
    try:
        assert entry.pass_over() == (0 if cached else header.nbytes)
        assert port.asked == 1
        assert (port.preads == reads_before) == cached
        assert entry.passed
        landed = land_entry(entry, step=4)
    finally:
        entry.close()
    for got, want in zip(landed, caches, strict=True):
        assert_same_state(got, want)


def test_a_pass_that_checks_never_asks_the_page_cache(tmp_path: Path) -> None:
    """A pass that checks hashes reads every tensor whatever the page cache holds."""
    path, _ = _file(tmp_path, flip=False)
    port = _Probe(cached=True)
    header = read_header(port, str(path))
    entry = open_file(port, str(path), header)
    try:
        assert entry.pass_over() == header.nbytes
    finally:
        entry.close()
    assert port.asked == 0


def test_the_real_port_sees_a_file_it_just_read_as_cached(tmp_path: Path) -> None:
    """``OsFilePort.all_cached`` says yes for ranges read a moment ago and for no range, and no
    for a range outside the file."""
    path, _ = _file(tmp_path, flip=False)
    header = read_header(PORT, str(path))
    ranges = [(t.offset, t.nbytes) for t in header.tensors]
    fd = PORT.open_read(str(path))
    try:
        size = path.stat().st_size
        for offset, nbytes in ranges:
            if nbytes:
                PORT.pread_exact(fd, nbytes, offset)
        assert PORT.all_cached(fd, size, ranges)
        assert PORT.all_cached(fd, size, [])
        assert not PORT.all_cached(fd, size, [(size - 1, 2)])
    finally:
        PORT.close(fd)


def test_the_default_pass_checks_and_fails_on_the_flipped_bit(tmp_path: Path) -> None:
    """By default (``check_in_pass=True``) the pass itself finds the corrupt tensor."""
    path, _ = _file(tmp_path, flip=True)
    entry = open_file(PORT, str(path), read_header(PORT, str(path)))
    try:
        with pytest.raises(CacheFileCorrupt, match="hash mismatch"):
            entry.pass_over()
    finally:
        entry.close()


def test_a_good_file_lands_the_same_state_without_checks_in_the_pass(tmp_path: Path) -> None:
    """A sound file restored with the checks only in the landing equals the original caches."""
    path, caches = _file(tmp_path, flip=False)
    entry = open_file(PORT, str(path), read_header(PORT, str(path)), check_in_pass=False)
    try:
        entry.pass_over()
        landed = land_entry(entry, step=4)
    finally:
        entry.close()
    for got, want in zip(landed, caches, strict=True):
        assert_same_state(got, want)
