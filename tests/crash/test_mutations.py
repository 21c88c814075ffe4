"""Mutated cold-tier files: a typed rejection or a correct answer, never a crash or a wrong answer.

Two Hypothesis properties over valid files made by the real writer (one per
cache kind the format encodes, and a compact one):

- **corruption** (bit flips, byte overwrites, truncation, appended bytes,
  zeroed ranges; no hash is fixed up): the reader raises
  ``CacheFileCorrupt``/``CacheFileIncompatible``, or it accepts the file
  and then every layer record and every tensor byte equals the original.
  A corrupted file can never be served as something else.
- **crafted headers** (JSON field edits, offset/shape/dtype/nbytes edits,
  duplicate keys, huge counts; the header hash recomputed so the edits reach
  the validators): a typed rejection, or an accepted file whose tensors
  pass their hashes and build caches. A consistent header that lies about
  metadata the file cannot contradict (token ids, an in-range rotating
  index) is beyond what any checksum can catch; what matters here is that
  no header makes the reader crash, hang or allocate beyond the file.

Every example reads through a ``CrashFS`` (in memory) and under
``tracemalloc``: the reader's peak allocation stays within a small multiple
of the file's size. The budget is fixed (derandomized) for ``make test``;
``tools/fuzz/kv_file_fuzz.py`` explores further.
"""

from __future__ import annotations

import copy
import json
import re
import struct
import tracemalloc
from typing import Any

import mlx.core as mx
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from kernels.cache._file_port import OsFilePort
from kernels.cache._kv_format import (
    ALIGNMENT,
    PREAMBLE_SIZE,
    CacheFileCorrupt,
    CacheFileIncompatible,
    KvFileHeader,
)
from kernels.cache._kv_header import read_header
from kernels.cache._kv_reader import read_tensors
from kernels.cache._kv_restore import materialize
from kernels.cache._kv_writer import KvFileWriter, plan_entry, tensor_bytes
from tests.crash.crash_fs import CrashFS

FP = "fp-mutation"
PATH = "/m/entry.kvt"
PRE = struct.Struct("<8sIIQQ")
SETTINGS = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _kv(n: int, seed: int) -> KVCache:
    c = KVCache()
    x = (mx.arange(n * 2 * 4, dtype=mx.float32) + seed).reshape(1, 2, n, 4)
    c.update_and_fetch(x, x * 2)
    return c


def _caches(kind: str, n: int) -> list[Any]:
    if kind == "kv":
        return [_kv(n, 0)]
    if kind == "quantized":
        c = KVCache()
        x = (mx.arange(n * 64, dtype=mx.float32) / 7).reshape(1, 1, n, 64)
        c.update_and_fetch(x, -x)
        return [c.to_quantized(group_size=32, bits=4)]
    if kind == "rotating":
        r = RotatingKVCache(max_size=3, keep=1)
        for i in range(n):
            y = mx.full((1, 1, 1, 4), float(i))
            r.update_and_fetch(y, y + 1)
        return [r]
    if kind == "arrays":
        a = ArraysCache(3)
        a[0] = mx.ones((1, 2, 3))
        a[2] = mx.arange(6, dtype=mx.float32).reshape(1, 3, 2)
        vars(a)["_kvtier_offset"] = n
        return [a]
    a = ArraysCache(2)
    a[1] = mx.ones((1, 2))
    return [CacheList(_kv(n, 5), a)]


def _file(kind: str) -> bytes:
    n = 5
    plan = plan_entry(
        _caches(kind, n), model_id="m", fingerprint=FP, namespace="ns", tokenizer_hash="t",
        tokens=list(range(10, 10 + n)), created_at=1.0,
    )  # fmt: skip
    fs = CrashFS()
    fs.makedirs("/w")
    with KvFileWriter(fs, plan) as w:
        w.begin("/w")
        for i in range(len(plan.tensors)):
            w.write_tensor(i, tensor_bytes(plan, i))
        w.commit("/w/x.kvt")
    return fs.read_file("/w/x.kvt")


KINDS = ("kv", "quantized", "rotating", "arrays", "list")


@pytest.fixture(scope="module")
def originals() -> dict[str, tuple[bytes, KvFileHeader, tuple[bytes, ...]]]:
    """kind -> (valid file bytes, its header, its tensor bytes)."""
    out: dict[str, tuple[bytes, KvFileHeader, tuple[bytes, ...]]] = {}
    for kind in KINDS:
        data = _file(kind)
        fs = _mounted(data)
        header = read_header(fs, PATH, expected_fingerprint=FP)
        host = read_tensors(fs, PATH, header, verify=True)
        materialize(header, host)
        out[kind] = (data, header, tuple(bytes(b) for b in host.buffers))
    return out


def _mounted(data: bytes) -> CrashFS:
    fs = CrashFS()
    fs.makedirs("/m")
    fs.put_file(PATH, data)
    return fs


def _read(data: bytes) -> tuple[KvFileHeader, tuple[bytes, ...]] | None:
    """Read ``data`` as a file: None when rejected with a typed error; else header and tensors.

    Anything but a typed rejection propagates (and fails the property). The
    peak allocation of the read is checked against the file's size.
    """
    fs = _mounted(data)
    tracemalloc.start()
    try:
        try:
            header = read_header(fs, PATH, expected_fingerprint=FP)
            host = read_tensors(fs, PATH, header, verify=True)
        except (CacheFileCorrupt, CacheFileIncompatible):
            return None
        finally:
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # NOTE: the header's JSON objects cost a multiple of its text; tensor
    # buffers never exceed the file. A size declared in the file must never
    # turn into an allocation of its own.
    assert peak <= 64 * len(data) + (16 << 20), (peak, len(data))
    materialize(header, host)
    return header, tuple(bytes(b) for b in host.buffers)


# --- corruption: nothing fixed up ----------------------------------------------------------


@st.composite
def corruptions(draw: st.DrawFn, size: int) -> list[tuple[str, int, int]]:
    ops: list[tuple[str, int, int]] = []
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "byte", "truncate", "append", "zero"]))
        pos = draw(
            st.one_of(
                st.integers(0, PREAMBLE_SIZE - 1),
                st.integers(0, min(size, ALIGNMENT) - 1),
                st.integers(0, size - 1),
            )
        )
        ops.append((op, pos, draw(st.integers(0, 255))))
    return ops


def _corrupt(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, arg in ops:
        if not buf:
            break
        pos %= len(buf)
        if op == "flip":
            buf[pos] ^= 1 << (arg % 8)
        elif op == "byte":
            buf[pos] = arg
        elif op == "truncate":
            del buf[pos:]
        elif op == "append":
            buf += bytes([arg]) * (arg + 1)
        else:
            buf[pos : pos + arg + 1] = bytes(len(buf[pos : pos + arg + 1]))
    return bytes(buf)


@SETTINGS
@given(kind=st.sampled_from(KINDS), data=st.data())
def test_corrupted_files_are_rejected_or_served_exactly(
    originals: dict[str, tuple[bytes, KvFileHeader, tuple[bytes, ...]]],
    kind: str,
    data: st.DataObject,
) -> None:
    """A corrupted file is refused with a typed error, or it reads back as the original entry."""
    valid, header, tensors = originals[kind]
    mutated = _corrupt(valid, data.draw(corruptions(len(valid))))
    got = _read(mutated)
    if got is not None:
        new_header, new_tensors = got
        assert new_header.layers == header.layers
        assert new_header.tokens == header.tokens
        assert new_tensors == tensors


# --- crafted headers: hash recomputed ---------------------------------------------------------


def _split(data: bytes) -> tuple[int, dict[str, Any], bytes]:
    header_len = PRE.unpack_from(data)[2]
    end = PREAMBLE_SIZE + header_len
    return header_len, json.loads(data[PREAMBLE_SIZE:end]), data[end:]


def _assemble(text: bytes, header_len: int, rest: bytes) -> bytes:
    """A preamble with the right hash over ``text`` padded to the region (grown when needed)."""
    if len(text) > header_len:
        header_len = -(-(PREAMBLE_SIZE + len(text)) // ALIGNMENT) * ALIGNMENT - PREAMBLE_SIZE
    region = text + b" " * (header_len - len(text))
    pre = PRE.pack(b"\x89KVT\r\n\x1a\n", 1, header_len, xxhash.xxh3_64_intdigest(region), 0)
    return pre + region + rest


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((*prefix, k))
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            out.append((*prefix, i))
            out.extend(_paths(v, (*prefix, i)))
    return out


INTERESTING: list[Any] = [
    0, 1, -1, 2, 3, 7, 16, 32, 64, 4096, ALIGNMENT, ALIGNMENT + 1, 2 * ALIGNMENT, 2**31, 2**32,
    2**40, 2**62, 2**63, 2**64, 10**30, 1.5, -0.0, 1e308, True, False, None, "", "kv", "rotating",
    "quantized", "list", "arrays", "mamba", "float32", "bfloat16", "uint32", "int64", "keys",
    "values", "state.0", "0000000000000000", "ffffffffffffffff", [], [0], [1, 1, 5, 4],
    [2**40, 2**40, 2**40], {}, {"x": 1},
]  # fmt: skip


@st.composite
def header_edits(draw: st.DrawFn, obj: dict[str, Any]) -> list[tuple[str, tuple[Any, ...], Any]]:
    paths = _paths(obj)
    tensor_fields = [
        p for p in paths if p and p[-1] in ("offset", "shape", "nbytes", "dtype", "hash")
    ]
    edits: list[tuple[str, tuple[Any, ...], Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "set_tensor", "delete", "extra", "dup", "huge", "size"]))
        pool = tensor_fields if op == "set_tensor" and tensor_fields else paths
        path = draw(st.sampled_from(pool))
        value = draw(st.one_of(st.sampled_from(INTERESTING), st.integers(-(2**70), 2**70)))
        edits.append((op, path, value))
    return edits


def _walk(obj: Any, path: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """The container holding ``path``'s last step, or None once an earlier edit removed it."""
    for p in path[:-1]:
        if (isinstance(obj, dict) and p in obj) or (
            isinstance(obj, list) and isinstance(p, int) and p < len(obj)
        ):
            obj = obj[p]
        else:
            return None
    key = path[-1]
    if isinstance(obj, dict) or (isinstance(obj, list) and isinstance(key, int) and key < len(obj)):
        return obj, key
    return None


def _edit(obj: dict[str, Any], edits: list[tuple[str, tuple[Any, ...], Any]]) -> tuple[bytes, bool]:
    """Apply the edits; returns the JSON text and whether file_size should be fixed up."""
    dups: list[str] = []
    fix_size = False
    for op, path, value in edits:
        found = _walk(obj, path)
        if found is None:
            continue
        parent, key = found
        # NOTE: a fresh copy: later edits must never mutate the shared pool.
        value = copy.deepcopy(value)
        if op in ("set", "set_tensor"):
            parent[key] = value
        elif op == "delete":
            if isinstance(parent, dict):
                parent.pop(key, None)
            else:
                del parent[key]
        elif op == "extra" and isinstance(parent, dict):
            parent["extra_key"] = value
        elif op == "dup" and isinstance(parent, dict):
            dups.append(str(key))
        elif op == "huge":
            # NOTE: counts past the format's limits where they drive loops: a
            # list grown past 4096 items (layers, tensors, shape, tokens), or
            # a declared count or size far beyond the file.
            if isinstance(parent, list):
                parent.extend([copy.deepcopy(parent[key]) for _ in range(4100)])
            elif key not in parent:
                continue
            else:
                parent[key] = 2**62
        elif op == "size":
            fix_size = True
    text = json.dumps(obj, separators=(",", ":"))
    for key in dups:
        # NOTE: duplicate keys only exist in text; insert one before the first occurrence.
        m = re.search(re.escape(json.dumps(key)) + ":", text)
        if m is not None:
            text = text[: m.start()] + f"{json.dumps(key)}:0," + text[m.start() :]
    return text.encode("ascii", "backslashreplace"), fix_size


@SETTINGS
@given(kind=st.sampled_from(KINDS), data=st.data())
def test_crafted_headers_are_rejected_or_read_without_harm(
    originals: dict[str, tuple[bytes, KvFileHeader, tuple[bytes, ...]]],
    kind: str,
    data: st.DataObject,
) -> None:
    """Any re-hashed header edit gives a typed error, or a file whose tensors verify and build."""
    valid, _, _ = originals[kind]
    header_len, obj, rest = _split(valid)
    text, fix_size = _edit(obj, data.draw(header_edits(obj)))
    mutated = _assemble(text, header_len, rest)
    if fix_size:
        try:
            again = json.loads(text)
        except ValueError:
            again = None
        if isinstance(again, dict) and "file_size" in again:
            again["file_size"] = len(mutated)
            mutated = _assemble(json.dumps(again, separators=(",", ":")).encode(), header_len, rest)
    got = _read(mutated)
    if got is not None:
        new_header, new_tensors = got
        # NOTE: whatever the header claims, every served tensor passed its hash.
        for rec, buf in zip(new_header.tensors, new_tensors, strict=True):
            assert xxhash.xxh3_64_intdigest(buf) == rec.hash


def test_the_valid_files_read_back_exactly(
    originals: dict[str, tuple[bytes, KvFileHeader, tuple[bytes, ...]]],
) -> None:
    """The unmutated files are accepted and read back as written (the properties' baseline)."""
    for valid, header, tensors in originals.values():
        got = _read(valid)
        assert got is not None
        assert got[0].layers == header.layers
        assert got[1] == tensors


def test_the_os_port_reads_the_same_files(
    originals: dict[str, tuple[bytes, KvFileHeader, tuple[bytes, ...]]], tmp_path: Any
) -> None:
    """The in-memory port and the real one read these files identically."""
    port = OsFilePort()
    for kind, (valid, header, tensors) in originals.items():
        path = tmp_path / f"{kind}.kvt"
        path.write_bytes(valid)
        real = read_header(port, str(path), expected_fingerprint=FP)
        assert real.layers == header.layers
        host = read_tensors(port, str(path), real, verify=True)
        assert tuple(bytes(b) for b in host.buffers) == tensors
