"""R5.2-3: a restore's peak memory is the restored entry itself, plus at most about one tensor.

The landing allocates every plain KV array at its final capacity (step
slack included) and reads the file into it; nothing is copied or padded
afterwards. Mutation that this catches: allocate exact-size arrays and let
the cache build pad them by concatenation (each tensor then exists twice
while padded). Where MLX arrays lend no writable buffer, each tensor goes
through host bytes laid out at its capacity and is copied once, before the
next tensor is read: the host bytes never hold more than one tensor (before,
every tensor's host bytes were kept until the end, then each was copied and
padded by concatenation).
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kernels.cache import _kv_landing
from kernels.cache._file_port import OsFilePort
from kernels.cache._kv_header import read_header
from kernels.cache._kv_landing import land_entry
from kernels.cache._kv_reader import open_entry
from tests.kernels.cache.test_kv_file import _filled_kv, write_entry

PORT = OsFilePort(writeback=None)
LAYERS, TOKENS, HEAD = 6, 1000, 32


def _entry(tmp_path: Path) -> Path:
    caches = [_filled_kv(TOKENS, seed=i) for i in range(LAYERS)]
    path = write_entry(caches, list(range(1, TOKENS + 1)), tmp_path)
    del caches
    gc.collect()
    return path


def _land_measured(path: Path) -> tuple[int, int, int, list[Any]]:
    """Land ``path`` (inline, one fill stream); (peak growth, entry bytes, host peak, caches)."""
    header = read_header(PORT, str(path))
    entry = open_entry(PORT, str(path), header, verify=True)
    try:
        stream = mx.new_stream(mx.cpu)
        gc.collect()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        tracemalloc.start()
        try:
            caches = land_entry(entry, step=256, streams=[stream])
            _, host_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        peak = mx.get_peak_memory() - before
        held = mx.get_active_memory() - before
    finally:
        entry.close()
    return peak, held, host_peak, caches


def _one_tensor() -> int:
    capacity = -(-(TOKENS + 1) // 256) * 256
    return 1 * 2 * capacity * HEAD * 4  # float32 [1, 2, capacity, 32]


def test_landing_peak_is_the_entry_itself(tmp_path: Path) -> None:
    """Peak MLX memory while landing 6 layers is the landed entry, within a quarter tensor."""
    path = _entry(tmp_path)
    peak, held, _, caches = _land_measured(path)
    assert caches[0].keys.shape[2] == -(-(TOKENS + 1) // 256) * 256
    assert held >= 2 * LAYERS * _one_tensor()
    assert peak <= held + _one_tensor() // 4, (peak, held, _one_tensor())


def test_without_writable_buffers_host_bytes_hold_one_tensor_and_nothing_is_concatenated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host-bytes fallback keeps at most one tensor in host memory and lands each at its
    capacity directly (MLX peak = the entry), with the same bytes as the in-place landing."""
    path = _entry(tmp_path)
    _, _, _, direct = _land_measured(path)
    expected = [bytes(memoryview(a)) for c in direct for a in (c.keys, c.values)]
    del direct
    monkeypatch.setattr(_kv_landing, "_writable_view", lambda a: None)
    peak, held, host_peak, caches = _land_measured(path)
    got = [bytes(memoryview(a)) for c in caches for a in (c.keys, c.values)]
    assert got == expected
    assert host_peak <= _one_tensor() * 5 // 4, (host_peak, _one_tensor())
    assert peak <= held + _one_tensor() // 4, (peak, held, _one_tensor())
