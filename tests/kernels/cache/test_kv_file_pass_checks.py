"""Where a restore checks the tensor hashes: in the reader's pass, or only in the landing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kernels.cache._file_port import OsFilePort
from kernels.cache._kv_file import (
    CacheFileCorrupt,
    LandingPool,
    land_entry,
    open_file,
    read_header,
)
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
    entry = open_file(PORT, str(path), read_header(PORT, str(path)), check_in_pass=False)
    pool = LandingPool(2) if pooled else None
    try:
        assert entry.pass_over() > 0
        with pytest.raises(CacheFileCorrupt, match="hash mismatch"):
            land_entry(entry, step=4, pool=pool)
    finally:
        entry.close()
        if pool is not None:
            pool.close()


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
