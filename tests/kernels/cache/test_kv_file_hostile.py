"""Hostile cold-tier files: every malformed input is a typed rejection, never a crash or hang.

The corpus is derived in the tests from one valid file holding every cache
kind; JSON-level mutations re-hash the header so they reach the validators
behind the header hash.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import xxhash
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

FP = "fp-hostile"
TOKENS = list(range(100, 106))
PORT = OsFilePort()
PRE = struct.Struct("<8sIIQQ")


def _kv(n: int, dtype: Any, seed: int) -> KVCache:
    mx.random.seed(seed)
    c = KVCache()
    c.update_and_fetch(
        mx.random.normal((1, 2, n, 32)).astype(dtype), mx.random.normal((1, 2, n, 32)).astype(dtype)
    )
    return c


def _rotating(n: int) -> RotatingKVCache:
    c = RotatingKVCache(max_size=4, keep=1)
    for i in range(n):
        mx.random.seed(50 + i)
        c.update_and_fetch(mx.random.normal((1, 2, 1, 32)), mx.random.normal((1, 2, 1, 32)))
    return c


def _arrays(slots: int, filled: tuple[int, ...], offset: int) -> ArraysCache:
    c = ArraysCache(slots)
    for i in filled:
        mx.random.seed(70 + i)
        c[i] = mx.random.normal((1, 3, 4))
    # NOTE: the recurrent-offset stamp the registry puts on ArraysCache (same spelling).
    vars(c)["_kvtier_offset"] = offset
    return c


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    n = len(TOKENS)
    caches = [
        _kv(n, mx.float32, 1),
        _kv(n, mx.bfloat16, 2).to_quantized(group_size=32, bits=4),
        _rotating(n),
        _arrays(3, (0, 2), n),
        CacheList(_kv(n, mx.bfloat16, 3), _arrays(2, (1,), 0)),
    ]
    plan = plan_entry(
        caches,
        model_id="tiny",
        fingerprint=FP,
        namespace="ns",
        tokenizer_hash="tok",
        tokens=TOKENS,
        created_at=1.0,
    )
    directory = tmp_path_factory.mktemp("valid")
    with KvFileWriter(PORT, plan) as w:
        w.begin(str(directory))
        for i in range(len(plan.tensors)):
            w.write_tensor(i, tensor_bytes(plan, i))
        w.commit(str(directory / "valid.kvt"))
    return (directory / "valid.kvt").read_bytes()


@pytest.fixture
def valid(tmp_path: Path, valid_bytes: bytes) -> Path:
    path = tmp_path / "entry.kvt"
    path.write_bytes(valid_bytes)
    return path


def _header(path: Path, **kw: Any) -> KvFileHeader:
    return read_header(PORT, str(path), **kw)


def _corrupt(path: Path, **kw: Any) -> CacheFileCorrupt:
    with pytest.raises(CacheFileCorrupt) as info:
        _header(path, **kw)
    return info.value


def _split(data: bytes) -> tuple[int, bytes, bytes]:
    """(header_len, header region, the rest of the file)."""
    header_len = PRE.unpack(data[:PREAMBLE_SIZE])[2]
    end = PREAMBLE_SIZE + header_len
    return header_len, data[PREAMBLE_SIZE:end], data[end:]


def _write_region(path: Path, region: bytes, rest: bytes, *, fix_size: bool = False) -> None:
    """Write ``region`` as a correctly hashed header; grows the region when it must."""
    header_len = len(region)
    if (PREAMBLE_SIZE + header_len) % ALIGNMENT:
        header_len = -(-(PREAMBLE_SIZE + header_len) // ALIGNMENT) * ALIGNMENT - PREAMBLE_SIZE
        region = region + b" " * (header_len - len(region))
    pre = PRE.pack(b"\x89KVT\r\n\x1a\n", 1, header_len, xxhash.xxh3_64_intdigest(region), 0)
    data = pre + region + rest
    if fix_size:
        # NOTE: keep file_size truthful so a later check is the one that fires.
        text = region.decode("ascii")
        obj = json.loads(text)
        obj["file_size"] = len(data)
        body = json.dumps(obj, separators=(",", ":")).encode()
        region = body + b" " * (header_len - len(body))
        pre = PRE.pack(b"\x89KVT\r\n\x1a\n", 1, header_len, xxhash.xxh3_64_intdigest(region), 0)
        data = pre + region + rest
    path.write_bytes(data)


def _edit_text(path: Path, edit: Callable[[str], str], *, fix_size: bool = False) -> None:
    header_len, region, rest = _split(path.read_bytes())
    text = edit(region.decode("ascii").rstrip(" "))
    body = text.encode("latin-1")
    _write_region(path, body + b" " * max(0, header_len - len(body)), rest, fix_size=fix_size)


def _edit_json(
    path: Path, mutate: Callable[[dict[str, Any]], None], *, fix_size: bool = False
) -> None:
    def edit(text: str) -> str:
        obj = json.loads(text)
        mutate(obj)
        return json.dumps(obj, separators=(",", ":"))

    _edit_text(path, edit, fix_size=fix_size)


def _flip(path: Path, pos: int, bit: int = 0) -> None:
    """Flip one bit in place (flipping it again restores the file)."""
    with path.open("r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))


# --- sanity ------------------------------------------------------------------------


def test_the_valid_fixture_reads_verifies_and_materializes(valid: Path) -> None:
    """The unmodified corpus source passes every check (so each rejection below is the mutation's)."""
    header = _header(valid, expected_fingerprint=FP)
    assert [x.kind for x in header.layers] == ["kv", "quantized", "rotating", "arrays", "list"]
    host = read_tensors(PORT, str(valid), header, verify=True)
    assert len(materialize(header, host)) == 5


# --- preamble and framing ------------------------------------------------------------


def test_truncation_at_any_point_is_corrupt(valid: Path, valid_bytes: bytes) -> None:
    """A file cut anywhere (preamble, header, padding, any tensor, last byte) is corrupt."""
    header = _header(valid)
    cuts = {0, 1, 7, 8, 12, 16, 31, 32, 33, 500, header.data_offset - 1, header.data_offset}
    for t in header.tensors:
        cuts.update({t.offset, t.offset + t.nbytes // 2, t.offset + t.nbytes - 1})
    cuts.add(len(valid_bytes) - 1)
    for cut in sorted(c for c in cuts if c < len(valid_bytes)):
        valid.write_bytes(valid_bytes[:cut])
        _corrupt(valid)


def test_truncation_after_the_header_read_is_corrupt(valid: Path, valid_bytes: bytes) -> None:
    """A file that shrinks between read_header and read_tensors is corrupt, not a short buffer."""
    header = _header(valid)
    valid.write_bytes(valid_bytes[: header.tensors[-1].offset + 1])
    with pytest.raises(CacheFileCorrupt):
        read_tensors(PORT, str(valid), header)


def test_appended_bytes_are_corrupt(valid: Path, valid_bytes: bytes) -> None:
    """Trailing bytes beyond the recorded file size are corrupt."""
    valid.write_bytes(valid_bytes + b"\x00")
    assert "size" in _corrupt(valid).reason


def test_wrong_magic_is_corrupt(valid: Path) -> None:
    """A file whose first eight bytes are not the magic is corrupt."""
    _flip(valid, 3)
    assert _corrupt(valid).reason == "bad magic"


def test_wrong_version_is_incompatible(valid: Path, valid_bytes: bytes) -> None:
    """Another format version is incompatible (kept, not deleted), whatever follows."""
    for version in (0, 3, 0xFFFFFFFF):
        valid.write_bytes(valid_bytes[:8] + struct.pack("<I", version) + valid_bytes[12:])
        with pytest.raises(CacheFileIncompatible):
            _header(valid)


def test_nonzero_reserved_field_is_corrupt(valid: Path) -> None:
    """The preamble's reserved word must be zero."""
    _flip(valid, 24)
    assert "reserved" in _corrupt(valid).reason


@pytest.mark.parametrize(
    "header_len",
    [0, 1, ALIGNMENT - PREAMBLE_SIZE - 1, 1 << 31, 0xFFFFFFFF],
    ids=["zero", "one", "unaligned", "past-end", "huge"],
)
def test_bad_header_lengths_are_corrupt(valid: Path, valid_bytes: bytes, header_len: int) -> None:
    """A header length that is zero, unaligned, past the end or above the limit is corrupt."""
    valid.write_bytes(valid_bytes[:12] + struct.pack("<I", header_len) + valid_bytes[16:])
    _corrupt(valid)


def test_header_length_above_the_limit_is_corrupt(valid: Path) -> None:
    """A header longer than max_header_bytes is refused before it is read."""
    assert "limit" not in str(_header(valid).file_size)
    reason = _corrupt(valid, max_header_bytes=1024).reason
    assert "header length" in reason


def test_every_flipped_header_bit_is_corrupt(valid: Path, valid_bytes: bytes) -> None:
    """A flipped bit anywhere in the preamble's hash or the header region fails the header hash."""
    header_len, _, _ = _split(valid_bytes)
    rng = random.Random(1)
    positions = list(range(16, 24)) + rng.sample(
        range(PREAMBLE_SIZE, PREAMBLE_SIZE + header_len), 200
    )
    for pos in positions:
        bit = rng.randrange(8)
        _flip(valid, pos, bit)
        _corrupt(valid)
        _flip(valid, pos, bit)


def test_every_preamble_bit_flip_is_rejected(valid: Path, valid_bytes: bytes) -> None:
    """Any single bit flip in the 32-byte preamble is rejected with a typed error."""
    for pos in range(PREAMBLE_SIZE):
        for bit in range(8):
            _flip(valid, pos, bit)
            with pytest.raises((CacheFileCorrupt, CacheFileIncompatible)):
                _header(valid)
            _flip(valid, pos, bit)


def test_a_flipped_bit_in_each_tensor_is_caught_by_verify(valid: Path, valid_bytes: bytes) -> None:
    """Each tensor's xxh3 catches a flipped bit during read_tensors(verify=True)."""
    header = _header(valid)
    for i, t in enumerate(header.tensors):
        assert t.nbytes > 0
        for pos in (t.offset, t.offset + t.nbytes - 1):
            _flip(valid, pos, i % 8)
            h = _header(valid)  # the header is intact
            with pytest.raises(CacheFileCorrupt, match=f"tensor {i} "):
                read_tensors(PORT, str(valid), h, verify=True)
            read_tensors(PORT, str(valid), h, verify=False)  # only verify catches it
            _flip(valid, pos, i % 8)


def test_foreign_fingerprint_is_incompatible(valid: Path) -> None:
    """A valid file of another fingerprint is incompatible, and readable when none is expected."""
    with pytest.raises(CacheFileIncompatible):
        _header(valid, expected_fingerprint="someone-else")
    assert _header(valid).fingerprint == FP


def test_a_symlink_is_not_followed(valid: Path, tmp_path: Path) -> None:
    """read_header refuses to open a symlink (an OSError, not a read of the target)."""
    link = tmp_path / "link.kvt"
    link.symlink_to(valid)
    with pytest.raises(OSError) as info:
        _header(link)
    assert not isinstance(info.value, CacheFileCorrupt | CacheFileIncompatible)


# --- JSON syntax ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda s: '{"model_id":"x",' + s[1:], id="duplicate-top-key"),
        pytest.param(
            lambda s: s.replace('"kind":"kv"', '"kind":"kv","kind":"kv"', 1),
            id="duplicate-layer-key",
        ),
        pytest.param(lambda s: s.replace('"created_at":1.0', '"created_at":NaN'), id="nan"),
        pytest.param(
            lambda s: s.replace('"created_at":1.0', '"created_at":Infinity'), id="infinity"
        ),
        pytest.param(lambda s: s.replace('"ns"', '"n\xe9"'), id="non-ascii"),
        pytest.param(lambda s: s[:-1], id="unterminated"),
        pytest.param(lambda s: s + "x", id="trailing-garbage"),
        pytest.param(lambda s: s + "\x00", id="nul-padding"),
        pytest.param(lambda s: "[" + s + "]", id="not-an-object"),
        pytest.param(lambda s: "[" * 100_000 + "]" * 100_000, id="deep-nesting"),
        pytest.param(
            lambda s: s.replace('"created_at":1.0', '"created_at":' + "1" * 5000), id="huge-int"
        ),
        pytest.param(lambda s: "", id="empty"),
    ],
)
def test_malformed_json_is_corrupt(valid: Path, edit: Callable[[str], str]) -> None:
    """Correctly hashed but malformed JSON (duplicates, NaN, non-ASCII, nesting) is corrupt."""
    _edit_text(valid, edit)
    _corrupt(valid)


# --- JSON semantics -----------------------------------------------------------------------


def _t(obj: dict[str, Any], layer: int, tensor: int = 0) -> dict[str, Any]:
    t: dict[str, Any] = obj["layers"][layer]["tensors"][tensor]
    return t


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        node: Any = obj
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return mutate


def _call(fn: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        fn(obj)

    return mutate


def _nest(obj: dict[str, Any]) -> None:
    layer = obj["layers"][4]
    for _ in range(5):
        layer = {**layer, "tensors": [], "children": [layer]}
    obj["layers"][4] = layer


MUTATIONS: list[Any] = [
    pytest.param(
        _call(lambda o: _t(o, 0).update(offset=(o["file_size"] // ALIGNMENT + 1) * ALIGNMENT)),
        "outside the data region",
        id="offset-past-end",
    ),
    pytest.param(
        _call(lambda o: _t(o, 0).update(offset=_t(o, 0)["offset"] + 1)),
        "aligned",
        id="offset-unaligned",
    ),
    pytest.param(
        _call(lambda o: _t(o, 0).update(offset=0)), "outside the data region", id="offset-in-header"
    ),
    pytest.param(
        _call(lambda o: _t(o, 0).update(offset=-ALIGNMENT)),
        "offset is not an integer",
        id="offset-negative",
    ),
    pytest.param(
        _call(lambda o: _t(o, 0, 1).update(offset=_t(o, 0)["offset"])), "overlap", id="overlap"
    ),
    pytest.param(
        _call(lambda o: _t(o, 0).update(nbytes=_t(o, 0)["nbytes"] + 4)),
        "dtype x shape",
        id="nbytes-not-shape",
    ),
    pytest.param(
        _call(lambda o: _t(o, 0)["shape"].__setitem__(2, 5)), "dtype x shape", id="shape-not-nbytes"
    ),
    pytest.param(
        _call(lambda o: _t(o, 0).update(dtype="float64")), "unknown dtype", id="unknown-dtype"
    ),
    pytest.param(
        _call(lambda o: _t(o, 0).update(dtype="object")), "unknown dtype", id="object-dtype"
    ),
    pytest.param(
        _call(lambda o: _t(o, 0).update(shape=[1] * 9)), "shape is not a list", id="rank-too-high"
    ),
    pytest.param(
        _call(lambda o: _t(o, 0).update(shape=[1, 2, 6, True])),
        "shape[] is not an integer",
        id="bool-dim",
    ),
    pytest.param(_call(lambda o: _t(o, 0).update(hash="zz" * 8)), "hex digits", id="hash-not-hex"),
    pytest.param(_call(lambda o: _t(o, 0).update(hash="0" * 15)), "hex digits", id="hash-short"),
    pytest.param(
        _call(lambda o: _t(o, 0).update(name="vals")),
        "must be keys, values",
        id="unknown-tensor-name",
    ),
    pytest.param(_call(lambda o: _t(o, 0).pop("hash")), "has keys", id="tensor-key-missing"),
    pytest.param(_call(lambda o: _t(o, 0).update(extra=1)), "has keys", id="tensor-key-extra"),
    pytest.param(_call(lambda o: o["tokens"].pop()), "token count", id="token-count-vs-offsets"),
    pytest.param(_call(lambda o: o["tokens"].__setitem__(0, -1)), "token id", id="token-negative"),
    pytest.param(
        _call(lambda o: o["tokens"].__setitem__(0, 1 << 40)), "token id", id="token-too-big"
    ),
    pytest.param(_call(lambda o: o["tokens"].__setitem__(0, 1.5)), "token id", id="token-float"),
    pytest.param(_call(lambda o: o["tokens"].__setitem__(0, "1")), "token id", id="token-string"),
    pytest.param(_call(lambda o: o["tokens"].__setitem__(0, True)), "token id", id="token-bool"),
    pytest.param(_set(["tokens"], "abc"), "tokens is not a list", id="tokens-not-list"),
    pytest.param(_set(["layers"], {}), "layers is not a list", id="layers-not-list"),
    pytest.param(_set(["format"], 2), "format differs", id="format-disagrees"),
    pytest.param(_set(["file_size"], 10), "file size", id="file-size-disagrees"),
    pytest.param(_set(["created_at"], -1), "created_at", id="created-negative"),
    pytest.param(_set(["created_at"], "now"), "created_at", id="created-string"),
    pytest.param(_set(["model_id"], 7), "model_id", id="model-id-not-str"),
    pytest.param(_set(["namespace"], "x" * 5000), "namespace", id="namespace-too-long"),
    pytest.param(_call(lambda o: o.pop("namespace")), "header has keys", id="top-key-missing"),
    pytest.param(_call(lambda o: o.update(extra=None)), "header has keys", id="top-key-extra"),
    pytest.param(_set(["layers", 0, "kind"], "paged"), "unknown cache kind", id="unknown-kind"),
    pytest.param(_set(["layers", 0, "offset"], 5), "offset", id="kv-offset-vs-tokens"),
    pytest.param(_set(["layers", 0, "head_dim"], 64), "head_dim", id="kv-head-dim"),
    pytest.param(_set(["layers", 0, "bits"], 4), "bits must be null", id="kv-with-bits"),
    pytest.param(
        _call(lambda o: o["layers"][0]["tensors"].reverse()),
        "must be keys, values",
        id="kv-tensor-order",
    ),
    pytest.param(
        _call(lambda o: _t(o, 0, 1).update(dtype="int32")), "disagree", id="kv-dtype-mismatch"
    ),
    pytest.param(_set(["layers", 1, "bits"], 7), "unsupported quantization", id="quant-bits"),
    pytest.param(_set(["layers", 1, "bits"], 8), "packing", id="quant-bits-vs-packing"),
    pytest.param(_set(["layers", 1, "group_size"], 64), "packing", id="quant-group-vs-scales"),
    pytest.param(
        _call(lambda o: o["layers"][1]["tensors"].pop()),
        "quantized tensors must be",
        id="quant-missing-tensor",
    ),
    pytest.param(_set(["layers", 2, "idx"], 99), "idx beyond", id="rotating-idx-past-buffer"),
    pytest.param(_set(["layers", 2, "keep"], 9), "keep exceeds", id="rotating-keep-past-max"),
    pytest.param(_set(["layers", 2, "max_size"], 0), "max_size", id="rotating-max-zero"),
    pytest.param(_set(["layers", 2, "idx"], None), "idx must be set", id="rotating-idx-null"),
    pytest.param(
        _set(["layers", 3, "slots"], 1), "out of order or range", id="arrays-slot-out-of-range"
    ),
    pytest.param(_set(["layers", 3, "slots"], 100_000), "slots is not", id="arrays-too-many-slots"),
    pytest.param(_set(["layers", 3, "offset"], 3), "token count", id="arrays-offset-vs-tokens"),
    pytest.param(
        _call(lambda o: _t(o, 3, 1).update(name="state.02")), "bad slot name", id="arrays-slot-name"
    ),
    pytest.param(
        _call(lambda o: o["layers"][3]["tensors"].reverse()),
        "out of order or range",
        id="arrays-slot-order",
    ),
    pytest.param(_set(["layers", 4, "offset"], 2), "list offset", id="list-offset"),
    pytest.param(
        _call(lambda o: o["layers"][4].update(tensors=[_t(o, 0)])),
        "own tensors",
        id="list-own-tensor",
    ),
    pytest.param(
        _call(lambda o: o["layers"][0].update(children=[o["layers"][3]])),
        "has children",
        id="kv-children",
    ),
    pytest.param(_call(_nest), "nested", id="list-too-deep"),
    pytest.param(
        _set(["layers", 0, "min_reusable_offset"], -3),
        "min_reusable_offset",
        id="min-offset-negative",
    ),
]


@pytest.mark.parametrize(("mutate", "reason"), MUTATIONS)
def test_semantically_invalid_headers_are_corrupt(
    valid: Path, mutate: Callable[[dict[str, Any]], None], reason: str
) -> None:
    """Bounds, overlaps, dtype x shape, types, counts and per-kind rules each reject their mutation."""
    _edit_json(valid, mutate)
    assert reason in _corrupt(valid).reason


def test_layer_count_limit_is_enforced(valid: Path) -> None:
    """More layer records than the format allows are refused before they are walked."""
    minimal = {
        "kind": "kv", "offset": 0, "idx": None, "max_size": None, "keep": None, "bits": None,
        "group_size": None, "head_dim": None, "slots": None, "min_reusable_offset": None,
        "tensors": [], "children": [],
    }  # fmt: skip
    _edit_json(valid, _set(["layers"], [minimal] * 5000), fix_size=True)
    assert "layers" in _corrupt(valid).reason


def test_random_header_mutations_never_escape_typed_errors(valid: Path, valid_bytes: bytes) -> None:
    """Re-hashed random byte edits of the JSON either pass every check and restore, or raise typed errors."""
    header_len, region, rest = _split(valid_bytes)
    text = region.rstrip(b" ")
    rng = random.Random(7)
    alphabet = b'0123456789-.,:[]{}"aez '
    accepted = 0
    for _ in range(300):
        body = bytearray(text)
        for _ in range(rng.randrange(1, 3)):
            body[rng.randrange(len(body))] = rng.choice(alphabet)
        padded = bytes(body) + b" " * (header_len - len(body))
        _write_region(valid, padded, rest)
        try:
            header = _header(valid)
        except (CacheFileCorrupt, CacheFileIncompatible):
            continue
        accepted += 1
        host = read_tensors(PORT, str(valid), header, verify=False)
        materialize(header, host)
    assert accepted < 300
