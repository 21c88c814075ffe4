"""Checkpoint deltas: a file composed from the previous one plus the new tokens equals a whole read-back."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from actors.checkpoints.store import DeltaBase, checkpoint_dir, write_checkpoint
from kernels.cache import (
    CacheFileCorrupt,
    GenerationCheckpoint,
    KvFileHeader,
    OsFilePort,
    _kv_writer,
    plan_entry,
    read_header,
    tail_starts,
    tensors_bytes,
)

KEY = "0f" * 16
FP = "kvtfp"
PROMPT = [5, 6, 7, 8, 9]


def _grow(cache: Any, n: int, seed: int) -> None:
    """Append ``n`` tokens of seeded keys and values to ``cache`` (an attention cache only appends)."""
    mx.random.seed(seed)
    cache.update_and_fetch(mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
    mx.eval(cache.state)


def _plan(caches: list[Any], emitted: int, *, namespace: str = "") -> Any:
    ck = GenerationCheckpoint(KEY, len(PROMPT), 40 + emitted, emitted, None)
    return plan_entry(caches, model_id="m", fingerprint=FP, namespace=namespace, tokenizer_hash="t",
                      tokens=PROMPT + list(range(100, 100 + emitted)), checkpoint=ck,
                      created_at=1.0)


def _whole(port: Any, directory: str, plan: Any) -> str:
    views = tensors_bytes(plan, range(len(plan.tensors)))
    return write_checkpoint(port, directory, plan, lambda i: views[i])


def _delta(port: Any, directory: str, plan: Any, base_path: str) -> tuple[str, dict[int, int]]:
    base: KvFileHeader = read_header(port, base_path, expected_fingerprint=FP)
    starts = tail_starts(plan.header, base)
    views = tensors_bytes(plan, range(len(plan.tensors)), starts)
    path = write_checkpoint(port, directory, plan, lambda i: views[i], DeltaBase(base_path, base, starts))
    return path, starts


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[str, str]:
    """Two checkpoint directories: one written whole, one by deltas."""
    out = []
    for name in ("whole", "delta"):
        d = checkpoint_dir(str(tmp_path / name), FP)
        os.makedirs(d)
        out.append(d)
    return out[0], out[1]


@pytest.mark.parametrize("migrate", [False, True], ids=["views", "one-buffer copy"])
def test_a_delta_writes_the_bytes_a_whole_read_back_writes(
    dirs: tuple[str, str], monkeypatch: pytest.MonkeyPatch, migrate: bool
) -> None:
    """Three checkpoints of one growing answer, whole vs each built on the previous file: every
    delta file is byte for byte the whole one, its views held only the new tokens, and the
    previous file is gone once the new one is durable."""
    monkeypatch.setattr(_kv_writer, "_HOST_READ_COPY", migrate)
    port = OsFilePort()
    whole_dir, delta_dir = dirs
    kv = KVCache()
    _grow(kv, len(PROMPT) + 4, seed=1)
    first = _plan([kv], 4)
    _whole(port, whole_dir, first)
    base = _whole(port, delta_dir, first)
    emitted = 4
    for step, more in enumerate((6, 9), start=2):
        _grow(kv, more, seed=step)
        emitted += more
        plan = _plan([kv], emitted)
        want = _whole(port, whole_dir, plan)
        got, starts = _delta(port, delta_dir, plan, base)
        assert starts == {0: len(PROMPT) + emitted - more, 1: len(PROMPT) + emitted - more}
        assert Path(got).read_bytes() == Path(want).read_bytes()
        assert not os.path.exists(base)
        base = got


def test_only_attention_layers_of_the_same_structure_take_part() -> None:
    """tail_starts lists the kv and quantized layers' tensors at the previous file's length; a
    rotating layer is read whole; another namespace, tokens that are not a prefix, another layer
    structure, or layers holding other than their file's tokens give no delta."""
    kv, qkv, rot = KVCache(), QuantizedKVCache(group_size=32, bits=8), RotatingKVCache(max_size=64)
    for c in (kv, qkv, rot):
        _grow(c, len(PROMPT) + 3, seed=3)
    old = _plan([kv, qkv, rot], 3).header
    for c in (kv, qkv, rot):
        _grow(c, 2, seed=4)
    new = _plan([kv, qkv, rot], 5).header
    attention = len(new.layers[0].tensors) + len(new.layers[1].tensors)
    assert tail_starts(new, old) == dict.fromkeys(range(attention), len(PROMPT) + 3)
    assert len(new.tensors) > attention, "the rotating layer's tensors are read whole"
    assert tail_starts(_plan([kv, qkv, rot], 5, namespace="other").header, old) == {}
    assert tail_starts(_plan([kv, qkv], 5).header, old) == {}
    other = plan_entry([kv, qkv, rot], model_id="m", fingerprint=FP, namespace="", tokenizer_hash="t",
                       tokens=[1, *PROMPT[1:], *range(100, 105)],
                       checkpoint=GenerationCheckpoint(KEY, len(PROMPT), 45, 5, None))
    assert tail_starts(other.header, old) == {}
    assert tail_starts(new, dataclasses.replace(old, tokens=old.tokens[:-1])) == {}, \
        "a file whose layers hold more tokens than it names is no base"


def test_a_damaged_previous_file_fails_the_write_and_leaves_it(dirs: tuple[str, str]) -> None:
    """A previous file whose tensor bytes fail their hash makes the delta raise CacheFileCorrupt:
    no new file, the previous one left as it was (a lost restart point, never a wrong one)."""
    port = OsFilePort()
    _, directory = dirs
    kv = KVCache()
    _grow(kv, len(PROMPT) + 4, seed=5)
    base = _whole(port, directory, _plan([kv], 4))
    header = read_header(port, base, expected_fingerprint=FP)
    with open(base, "r+b") as f:
        f.seek(header.tensors[0].offset)
        byte = f.read(1)
        f.seek(header.tensors[0].offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    damaged = Path(base).read_bytes()
    _grow(kv, 3, seed=6)
    with pytest.raises(CacheFileCorrupt):
        _delta(port, directory, _plan([kv], 7), base)
    assert os.listdir(directory) == [os.path.basename(base)]
    assert Path(base).read_bytes() == damaged
