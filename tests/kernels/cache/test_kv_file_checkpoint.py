"""Version-2 files: the generation-checkpoint header section, its round trip and hostile variants."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import xxhash
from mlx_lm.models.cache import ArraysCache, KVCache

from kernels.cache import (
    CHECKPOINT_FORMAT_VERSION,
    FORMAT_VERSION,
    CacheFileCorrupt,
    CacheFileIncompatible,
    GenerationCheckpoint,
    KvFileWriter,
    OsFilePort,
    materialize,
    plan_entry,
    read_header,
    read_tensors,
    tensor_bytes,
)
from kernels.cache._kv_format import ALIGNMENT, PREAMBLE_SIZE

PORT = OsFilePort()
PRE = struct.Struct("<8sIIQQ")
TOKENS = [7, 8, 9, 10, 11, 12]  # 4 prompt tokens, 2 emitted
KEY = "0123456789abcdef0123456789abcdef"
CK = GenerationCheckpoint(KEY, prompt_len=4, pending_token=99, sample_index=2,
                          rng_key=(0xDEADBEEF, 17))


def _caches(n: int) -> list[Any]:
    mx.random.seed(3)
    kv = KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 16)))
    rec = ArraysCache(2)
    rec[0] = mx.random.normal((1, 3, 4))
    vars(rec)["_kvtier_offset"] = n
    return [kv, rec]


def _write(path: Path, checkpoint: GenerationCheckpoint | None) -> None:
    plan = plan_entry(_caches(len(TOKENS)), model_id="m", fingerprint="fp", namespace="",
                      tokenizer_hash="t", tokens=TOKENS, created_at=1.0, checkpoint=checkpoint)
    with KvFileWriter(PORT, plan) as w:
        w.begin(str(path.parent))
        for i in range(len(plan.tensors)):
            w.write_tensor(i, tensor_bytes(plan, i))
        w.commit(str(path))


@pytest.fixture
def ck_file(tmp_path: Path) -> Path:
    path = tmp_path / "c.kvc"
    _write(path, CK)
    return path


def _rewrite(path: Path, mutate: Callable[[dict[str, Any]], None], *, version: int | None = None) -> None:
    """Edit the header JSON, keep the hash right (and optionally set the preamble version)."""
    data = path.read_bytes()
    _, ver, header_len, _, _ = PRE.unpack(data[:PREAMBLE_SIZE])
    region = data[PREAMBLE_SIZE:PREAMBLE_SIZE + header_len]
    obj = json.loads(region.decode("ascii"))
    mutate(obj)
    body = json.dumps(obj, separators=(",", ":")).encode("ascii")
    assert len(body) <= header_len
    region = body + b" " * (header_len - len(body))
    pre = PRE.pack(b"\x89KVT\r\n\x1a\n", ver if version is None else version, header_len,
                   xxhash.xxh3_64_intdigest(region), 0)
    path.write_bytes(pre + region + data[PREAMBLE_SIZE + header_len:])


def test_round_trip(ck_file: Path) -> None:
    """A checkpoint file is version 2, its section reads back equal, its caches restore bit-exact."""
    assert PRE.unpack(ck_file.read_bytes()[:PREAMBLE_SIZE])[1] == CHECKPOINT_FORMAT_VERSION
    header = read_header(PORT, str(ck_file), expected_fingerprint="fp")
    assert header.version == CHECKPOINT_FORMAT_VERSION
    assert header.checkpoint == CK
    assert header.tokens == tuple(TOKENS)
    restored = materialize(header, read_tensors(PORT, str(ck_file), header, verify=True))
    want = _caches(len(TOKENS))
    n = len(TOKENS)
    assert mx.array_equal(restored[0].keys[..., :n, :], want[0].keys[..., :n, :]).item()
    assert mx.array_equal(restored[1][0], want[1][0]).item()


def test_plain_entries_stay_version_1(tmp_path: Path) -> None:
    """Without a checkpoint the file is version 1 exactly as before, and reads with no section."""
    path = tmp_path / "p.kvt"
    _write(path, None)
    assert PRE.unpack(path.read_bytes()[:PREAMBLE_SIZE])[1] == FORMAT_VERSION == 1
    assert "checkpoint" not in path.read_bytes()[:ALIGNMENT].decode("ascii", "replace")
    assert read_header(PORT, str(path)).checkpoint is None


def test_greedy_checkpoint_has_no_key(tmp_path: Path) -> None:
    """A greedy request's checkpoint stores rng_key null and reads back None."""
    path = tmp_path / "g.kvc"
    _write(path, GenerationCheckpoint(KEY, 4, 5, 2, None))
    header = read_header(PORT, str(path))
    assert header.checkpoint is not None
    assert header.checkpoint.rng_key is None


def test_version_and_section_must_agree(ck_file: Path, tmp_path: Path) -> None:
    """A v2 preamble over a v1 header, or a v1 preamble over a checkpoint header, is corrupt."""
    _rewrite(ck_file, lambda o: o.pop("checkpoint"))
    with pytest.raises(CacheFileCorrupt):
        read_header(PORT, str(ck_file))
    plain = tmp_path / "p.kvt"
    _write(plain, None)
    _rewrite(plain, lambda o: o.__setitem__("checkpoint", None), version=1)
    with pytest.raises(CacheFileCorrupt):
        read_header(PORT, str(plain))


def test_unknown_version_is_incompatible(ck_file: Path) -> None:
    """Version 3 is another format: incompatible (kept), not corrupt."""
    _rewrite(ck_file, lambda o: None, version=3)
    with pytest.raises(CacheFileIncompatible):
        read_header(PORT, str(ck_file))


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        obj["checkpoint"][field] = value
    return mutate


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.__setitem__("checkpoint", None),
        lambda o: o.__setitem__("checkpoint", []),
        lambda o: o["checkpoint"].pop("pending_token"),
        lambda o: o["checkpoint"].__setitem__("extra", 1),
        _set("request_key", "XYZ"),
        _set("request_key", KEY.upper()),
        _set("request_key", KEY + "0"),
        _set("request_key", 5),
        _set("prompt_len", 0),
        _set("prompt_len", 7),
        _set("prompt_len", 4.0),
        _set("prompt_len", True),
        _set("sample_index", 1),
        _set("sample_index", -2),
        _set("pending_token", 1 << 32),
        _set("pending_token", -1),
        _set("pending_token", "9"),
        _set("rng_key", [1]),
        _set("rng_key", [1, 2, 3]),
        _set("rng_key", [1, 1 << 32]),
        _set("rng_key", [1, -1]),
        _set("rng_key", {"a": 1}),
        _set("rng_key", "ab"),
        lambda o: o.__setitem__("tokens", o["tokens"][:-1]),
    ],
)
def test_hostile_sections_are_corrupt(ck_file: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Every malformed or inconsistent checkpoint section is corrupt, never a wrong resume."""
    _rewrite(ck_file, mutate)
    with pytest.raises(CacheFileCorrupt):
        read_header(PORT, str(ck_file))


def test_plan_refuses_an_inconsistent_checkpoint() -> None:
    """plan_entry never writes a checkpoint the reader would reject."""
    bad = GenerationCheckpoint(KEY, prompt_len=4, pending_token=1, sample_index=3)
    with pytest.raises(ValueError, match="sample_index"):
        plan_entry(_caches(len(TOKENS)), model_id="m", fingerprint="fp", namespace="",
                   tokenizer_hash="t", tokens=TOKENS, checkpoint=bad)
