"""Restoring a cold-tier file into MLX arrays: peak memory, consumed host buffers, verify-only reads."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kernels.cache._file_port import OsFilePort
from kernels.cache._kv_format import CacheFileCorrupt
from kernels.cache._kv_header import read_header
from kernels.cache._kv_reader import read_tensors, verify_tensors
from kernels.cache._kv_restore import materialize
from kernels.cache._kv_writer import KvFileWriter, plan_entry, tensor_bytes

PORT = OsFilePort()
LAYERS, HEADS, TOKENS, DIM = 4, 4, 1000, 64


def _write(path: Path) -> None:
    caches = []
    for i in range(LAYERS):
        mx.random.seed(i)
        c = KVCache()
        c.update_and_fetch(
            mx.random.normal((1, HEADS, TOKENS, DIM)), mx.random.normal((1, HEADS, TOKENS, DIM))
        )
        caches.append(c)
    plan = plan_entry(
        caches,
        model_id="m",
        fingerprint="fp",
        namespace="",
        tokenizer_hash="t",
        tokens=list(range(TOKENS)),
    )
    with KvFileWriter(PORT, plan) as w:
        w.begin(str(path.parent))
        for i in range(len(plan.tensors)):
            w.write_tensor(i, tensor_bytes(plan, i))
        w.commit(str(path))


@pytest.fixture(scope="module")
def entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("restore") / "entry.kvt"
    _write(path)
    return path


def test_a_consuming_restore_holds_the_entry_plus_about_one_tensor(entry: Path) -> None:
    """materialize(consume=True) copies tensor by tensor: MLX's peak stays within the restored
    entry (slack included) plus two tensors, and every host buffer is emptied; the caches hold
    the file's bytes exactly."""
    header = read_header(PORT, str(entry))
    host = read_tensors(PORT, str(entry), header)
    reference = read_tensors(PORT, str(entry), header)
    tensor = HEADS * TOKENS * DIM * 4
    capacity = -(-(TOKENS + 1) // 256) * 256
    restored = 2 * LAYERS * HEADS * capacity * DIM * 4
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    caches = materialize(header, host, consume=True)
    peak = mx.get_peak_memory() - base
    assert restored <= peak <= restored + 2 * tensor + (1 << 20)
    assert all(len(b) == 0 for b in host.buffers)
    for i, c in enumerate(caches):
        assert c.offset == TOKENS
        assert c.keys.shape[2] == capacity
        keys = bytes(memoryview(c.keys[..., :TOKENS, :]))
        values = bytes(memoryview(c.values[..., :TOKENS, :]))
        assert (keys, values) == (bytes(reference.buffers[2 * i]), bytes(reference.buffers[2 * i + 1]))
    with pytest.raises(ValueError, match="consumed"):
        materialize(header, host)


def test_verify_tensors_checks_every_hash_without_keeping_the_bytes(
    entry: Path, tmp_path: Path
) -> None:
    """The scrubber's read checks every tensor's hash and reports the bytes it read; a flipped
    bit in any tensor is corrupt."""
    header = read_header(PORT, str(entry))
    assert verify_tensors(PORT, str(entry), header) == sum(t.nbytes for t in header.tensors)
    copy = tmp_path / "flipped.kvt"
    raw = bytearray(entry.read_bytes())
    last = header.tensors[-1]
    raw[last.offset + last.nbytes - 1] ^= 0x10
    copy.write_bytes(bytes(raw))
    with pytest.raises(CacheFileCorrupt, match=f"tensor {len(header.tensors) - 1} "):
        verify_tensors(PORT, str(copy), read_header(PORT, str(copy)))
