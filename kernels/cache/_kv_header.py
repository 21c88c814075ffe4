"""Reading and validating a KV file's preamble and JSON header (worker thread).

Every byte read from disk is untrusted: :func:`read_header` checks the
magic, version, header length, header hash (always), JSON shape and types,
counts, and every tensor's dtype, shape, size and file range before anything
is allocated from it. Failures raise :class:`CacheFileCorrupt` or
:class:`CacheFileIncompatible` and nothing else (``OSError`` from opening or
reading a file passes through, except a short read, which is corruption).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ._file_port import FilePort, ShortRead
from ._kv_format import (
    _CHECKPOINT_KEYS,
    _DTYPE_SIZE,
    _FLOAT_DTYPES,
    _HASH_HEX_WIDTH,
    _INT_DTYPES,
    _KINDS,
    _LAYER_KEYS,
    _MAX_DEPTH,
    _MAX_DIM,
    _MAX_INT,
    _MAX_LAYERS,
    _MAX_RANK,
    _MAX_SLOTS,
    _MAX_STR,
    _MAX_TENSORS,
    _MAX_TOKEN_ID,
    _MAX_TOKENS,
    _PREAMBLE,
    _QUANT_BITS,
    _QUANT_GROUPS,
    _READABLE_VERSIONS,
    _TENSOR_KEYS,
    _TOP_KEYS,
    ALIGNMENT,
    DEFAULT_MAX_HEADER_BYTES,
    FORMAT_VERSION,
    MAGIC,
    PREAMBLE_SIZE,
    CacheFileCorrupt,
    CacheFileIncompatible,
    GenerationCheckpoint,
    KvFileHeader,
    LayerRecord,
    TensorRecord,
)

__all__ = [
    "read_header",
]


# --- reader (worker thread) ---------------------------------------------------------


def read_header(
    port: FilePort,
    path: str,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    expected_fingerprint: str | None = None,
) -> KvFileHeader:
    """Read and fully validate the header of the file at ``path`` (worker thread).

    Raises :class:`CacheFileCorrupt` for any malformed byte,
    :class:`CacheFileIncompatible` for another format version or (when
    ``expected_fingerprint`` is given) another fingerprint.
    """
    fd = port.open_read(path)
    try:
        st = port.fstat(fd)
        if not st.is_file:
            raise CacheFileCorrupt("not a regular file")
        return _read_header_fd(port, fd, st.size, max_header_bytes, expected_fingerprint)
    finally:
        port.close(fd)


def _read_preamble(port: FilePort, fd: int, size: int) -> tuple[int, int, int]:
    if size < PREAMBLE_SIZE:
        raise CacheFileCorrupt("file shorter than the preamble")
    try:
        raw = port.pread_exact(fd, PREAMBLE_SIZE, 0)
    except ShortRead as exc:
        raise CacheFileCorrupt("file shorter than the preamble") from exc
    magic, version, header_len, header_hash, reserved = _PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise CacheFileCorrupt("bad magic")
    if version not in _READABLE_VERSIONS:
        raise CacheFileIncompatible(
            f"format version {version}, expected one of {sorted(_READABLE_VERSIONS)}"
        )
    if reserved != 0:
        raise CacheFileCorrupt("reserved preamble field is not zero")
    return int(header_len), int(header_hash), int(version)


def _read_header_fd(
    port: FilePort,
    fd: int,
    size: int,
    max_header_bytes: int,
    expected_fingerprint: str | None,
) -> KvFileHeader:
    header_len, header_hash, version = _read_preamble(port, fd, size)
    if header_len == 0 or header_len > max_header_bytes:
        raise CacheFileCorrupt(f"header length {header_len} outside (0, {max_header_bytes}]")
    data_offset = PREAMBLE_SIZE + header_len
    if data_offset > size:
        raise CacheFileCorrupt("header runs past the end of the file")
    if data_offset % ALIGNMENT:
        raise CacheFileCorrupt("header region does not end on a 16 KiB boundary")
    try:
        region = port.pread_exact(fd, header_len, PREAMBLE_SIZE)
    except ShortRead as exc:
        raise CacheFileCorrupt("file truncated inside the header") from exc
    if xxhash.xxh3_64_intdigest(region) != header_hash:
        raise CacheFileCorrupt("header hash mismatch")
    obj = _parse_json(region)
    try:
        return _validate(obj, version, size, data_offset, header_hash, expected_fingerprint)
    except (CacheFileCorrupt, CacheFileIncompatible):
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as exc:
        # NOTE: a safety net only; the validators raise CacheFileCorrupt
        # themselves. It keeps the "nothing but typed errors" contract if a
        # check is ever missed.
        raise CacheFileCorrupt(f"malformed header ({type(exc).__name__})") from exc


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise CacheFileCorrupt(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise CacheFileCorrupt(f"non-finite number {name} in header")


def _parse_json(region: bytes) -> Any:
    try:
        text = region.decode("ascii")
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except CacheFileCorrupt:
        raise
    except (ValueError, RecursionError) as exc:
        raise CacheFileCorrupt(f"header is not valid JSON ({type(exc).__name__})") from exc


def _obj(v: Any, keys: tuple[str, ...], what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise CacheFileCorrupt(f"{what} is not an object")
    if set(v) != set(keys):
        raise CacheFileCorrupt(f"{what} has keys {sorted(v)}, expected {sorted(keys)}")
    return v


def _int(v: Any, what: str, *, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise CacheFileCorrupt(f"{what} is not an integer in [{lo}, {hi}]")
    return v


def _opt_int(v: Any, what: str, *, lo: int = 0, hi: int = _MAX_INT) -> int | None:
    return None if v is None else _int(v, what, lo=lo, hi=hi)


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or len(v) > _MAX_STR:
        raise CacheFileCorrupt(f"{what} is not a string of at most {_MAX_STR} characters")
    return v


def _list(v: Any, what: str, limit: int) -> list[Any]:
    if not isinstance(v, list) or len(v) > limit:
        raise CacheFileCorrupt(f"{what} is not a list of at most {limit} items")
    return v


@dataclass(slots=True)
class _Budget:
    layers: int = 0
    tensors: int = 0


def _validate(
    obj: Any,
    version: int,
    size: int,
    data_offset: int,
    header_hash: int,
    expected_fingerprint: str | None,
) -> KvFileHeader:
    keys = _TOP_KEYS if version == FORMAT_VERSION else (*_TOP_KEYS, "checkpoint")
    top = _obj(obj, keys, "header")
    # NOTE: the fingerprint is judged first, so a well-formed file of another
    # model or runtime reads as incompatible (kept) rather than corrupt (deleted).
    fingerprint = _str(top["fingerprint"], "fingerprint")
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise CacheFileIncompatible("fingerprint differs")
    if _int(top["format"], "format") != version:
        raise CacheFileCorrupt("header format differs from the preamble version")
    created = top["created_at"]
    if type(created) not in (int, float) or not math.isfinite(created) or created < 0:
        raise CacheFileCorrupt("created_at is not a finite non-negative number")
    if _int(top["file_size"], "file_size") != size:
        raise CacheFileCorrupt(f"file size {size} differs from the recorded {top['file_size']}")
    raw_tokens = _list(top["tokens"], "tokens", _MAX_TOKENS)
    for t in raw_tokens:
        if type(t) is not int or not 0 <= t < _MAX_TOKEN_ID:
            raise CacheFileCorrupt("token id is not an integer in range")
    tokens = tuple(raw_tokens)
    budget = _Budget()
    layers = tuple(_layer(x, 0, budget) for x in _list(top["layers"], "layers", _MAX_LAYERS))
    for layer in layers:
        if not _offsets_match(layer, len(tokens)):
            raise CacheFileCorrupt("a layer's offset does not match the token count")
    checkpoint = None if version == FORMAT_VERSION else _checkpoint(top["checkpoint"], len(tokens))
    header = KvFileHeader(
        version=version,
        model_id=_str(top["model_id"], "model_id"),
        fingerprint=fingerprint,
        namespace=_str(top["namespace"], "namespace"),
        tokenizer_hash=_str(top["tokenizer_hash"], "tokenizer_hash"),
        created_at=float(created),
        tokens=tokens,
        layers=layers,
        file_size=size,
        data_offset=data_offset,
        header_hash=header_hash,
        checkpoint=checkpoint,
    )
    _check_ranges(header.tensors, data_offset, size)
    return header


def _checkpoint(v: Any, ntokens: int) -> GenerationCheckpoint:
    """A version-2 header's ``checkpoint`` section, strictly typed and consistent with the tokens."""
    obj = _obj(v, _CHECKPOINT_KEYS, "checkpoint")
    raw_key = obj["rng_key"]
    rng: tuple[int, int] | None = None
    if raw_key is not None:
        words = _list(raw_key, "checkpoint rng_key", 2)
        if len(words) != 2:
            raise CacheFileCorrupt("checkpoint rng_key is not two uint32 words")
        rng = (_int(words[0], "rng_key word", hi=(1 << 32) - 1),
               _int(words[1], "rng_key word", hi=(1 << 32) - 1))
    ck = GenerationCheckpoint(
        request_key=_str(obj["request_key"], "checkpoint request_key"),
        prompt_len=_int(obj["prompt_len"], "checkpoint prompt_len"),
        pending_token=_int(obj["pending_token"], "checkpoint pending_token"),
        sample_index=_int(obj["sample_index"], "checkpoint sample_index"),
        rng_key=rng,
    )
    ck.check(ntokens)
    return ck


def _tensor(v: Any, what: str) -> TensorRecord:
    t = _obj(v, _TENSOR_KEYS, what)
    name = _str(t["name"], f"{what}.name")
    dtype = t["dtype"]
    if dtype not in _DTYPE_SIZE:
        raise CacheFileCorrupt(f"{what} has unknown dtype {str(dtype)[:32]!r}")
    dims = _list(t["shape"], f"{what}.shape", _MAX_RANK)
    shape = tuple(_int(d, f"{what}.shape[]", hi=_MAX_DIM) for d in dims)
    offset = _int(t["offset"], f"{what}.offset")
    nbytes = _int(t["nbytes"], f"{what}.nbytes")
    if math.prod(shape) * _DTYPE_SIZE[dtype] != nbytes:
        raise CacheFileCorrupt(f"{what}: dtype x shape does not equal nbytes")
    h = t["hash"]
    if (
        not isinstance(h, str)
        or len(h) != _HASH_HEX_WIDTH
        or any(ch not in "0123456789abcdef" for ch in h)
    ):
        raise CacheFileCorrupt(f"{what}.hash is not {_HASH_HEX_WIDTH} lowercase hex digits")
    return TensorRecord(name, dtype, shape, offset, nbytes, int(h, 16))


def _layer(v: Any, depth: int, budget: _Budget) -> LayerRecord:
    budget.layers += 1
    if budget.layers > _MAX_LAYERS or depth > _MAX_DEPTH:
        raise CacheFileCorrupt("too many or too deeply nested layer records")
    r = _obj(v, _LAYER_KEYS, "layer")
    kind = r["kind"]
    if kind not in _KINDS:
        raise CacheFileCorrupt(f"unknown cache kind {str(kind)[:32]!r}")
    raw_tensors = _list(r["tensors"], "tensors", _MAX_TENSORS)
    budget.tensors += len(raw_tensors)
    if budget.tensors > _MAX_TENSORS:
        raise CacheFileCorrupt("too many tensors")
    tensors = tuple(_tensor(t, f"{kind} tensor") for t in raw_tensors)
    raw_children = _list(r["children"], "children", _MAX_LAYERS)
    children = tuple(_layer(c, depth + 1, budget) for c in raw_children)
    layer = LayerRecord(
        kind=kind,
        offset=_int(r["offset"], "offset"),
        idx=_opt_int(r["idx"], "idx"),
        max_size=_opt_int(r["max_size"], "max_size", lo=1),
        keep=_opt_int(r["keep"], "keep"),
        bits=_opt_int(r["bits"], "bits"),
        group_size=_opt_int(r["group_size"], "group_size", lo=1),
        head_dim=_opt_int(r["head_dim"], "head_dim", lo=1),
        slots=_opt_int(r["slots"], "slots", hi=_MAX_SLOTS),
        min_reusable_offset=_opt_int(r["min_reusable_offset"], "min_reusable_offset"),
        tensors=tensors,
        children=children,
    )
    _check_kind(layer)
    return layer


def _fields(layer: LayerRecord, *present: str) -> None:
    for name in ("idx", "max_size", "keep", "bits", "group_size", "slots"):
        if (getattr(layer, name) is not None) != (name in present):
            raise CacheFileCorrupt(
                f"{layer.kind} layer: field {name} must be {'set' if name in present else 'null'}"
            )


def _names(layer: LayerRecord) -> list[str]:
    return [t.name for t in layer.tensors]


def _check_kv_pair(
    layer: LayerRecord, k: TensorRecord, v: TensorRecord, tokens: int | None
) -> None:
    if len(k.shape) != 4 or len(v.shape) != 4:
        raise CacheFileCorrupt(f"{layer.kind} keys/values are not rank 4")
    if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.dtype not in _FLOAT_DTYPES:
        raise CacheFileCorrupt(f"{layer.kind} keys and values disagree in shape or dtype")
    if tokens is not None and k.shape[2] != tokens:
        raise CacheFileCorrupt(f"{layer.kind} token axis {k.shape[2]} != offset {tokens}")
    if layer.head_dim != k.shape[3]:
        raise CacheFileCorrupt(f"{layer.kind} head_dim disagrees with the keys")


def _check_kind(layer: LayerRecord) -> None:
    kind = layer.kind
    if kind != "list" and layer.children:
        raise CacheFileCorrupt(f"{kind} layer has children")
    if kind in ("kv", "rotating"):
        if kind == "kv":
            _fields(layer)
        else:
            _fields(layer, "idx", "max_size", "keep")
            assert layer.max_size is not None
            assert layer.keep is not None
            if layer.keep > layer.max_size:
                raise CacheFileCorrupt("rotating keep exceeds max_size")
        if not layer.tensors:
            if layer.offset != 0 or layer.head_dim is not None or (layer.idx or 0) != 0:
                raise CacheFileCorrupt(f"empty {kind} layer with state")
            return
        if _names(layer) != ["keys", "values"]:
            raise CacheFileCorrupt(f"{kind} layer tensors must be keys, values")
        k, v = layer.tensors
        _check_kv_pair(layer, k, v, layer.offset if kind == "kv" else None)
        if kind == "rotating":
            assert layer.idx is not None
            if layer.idx > k.shape[2]:
                raise CacheFileCorrupt("rotating idx beyond the buffer")
    elif kind == "quantized":
        _fields(layer, "bits", "group_size")
        if layer.bits not in _QUANT_BITS or layer.group_size not in _QUANT_GROUPS:
            raise CacheFileCorrupt("unsupported quantization bits or group size")
        if not layer.tensors:
            if layer.offset != 0 or layer.head_dim is not None:
                raise CacheFileCorrupt("empty quantized layer with state")
            return
        _check_quantized(layer)
    elif kind in ("arrays", "mamba"):
        _fields(layer, "slots")
        if layer.head_dim is not None:
            raise CacheFileCorrupt(f"{kind} layer has head_dim")
        assert layer.slots is not None
        names = _names(layer)
        extras = [n for n in names if not n.startswith("state.")]
        state = [n for n in names if n.startswith("state.")]
        if extras not in ([], ["left_padding"], ["lengths"], ["left_padding", "lengths"]):
            raise CacheFileCorrupt(f"{kind} layer has unexpected tensors")
        if names != state + extras:
            raise CacheFileCorrupt(f"{kind} layer tensors out of order")
        idxs: list[int] = []
        for n in state:
            digits = n[len("state.") :]
            if not digits.isdigit() or len(digits) > 3 or str(int(digits)) != digits:
                raise CacheFileCorrupt(f"{kind} layer has a bad slot name")
            idxs.append(int(digits))
        if idxs != sorted(set(idxs)) or any(i >= layer.slots for i in idxs):
            raise CacheFileCorrupt(f"{kind} layer slots out of order or range")
        for t in layer.tensors:
            if t.name in ("left_padding", "lengths") and (
                len(t.shape) != 1 or t.dtype not in _INT_DTYPES
            ):
                raise CacheFileCorrupt(f"{kind} {t.name} must be a 1-d integer tensor")
    else:  # list
        _fields(layer)
        if layer.tensors or layer.head_dim is not None:
            raise CacheFileCorrupt("list layer with own tensors or head_dim")
        if layer.offset != max((c.offset for c in layer.children), default=0):
            raise CacheFileCorrupt("list offset differs from its members'")


def _check_quantized(layer: LayerRecord) -> None:
    names = _names(layer)
    n = len(names) // 2
    expected = [f"{s}.{j}" for s in ("keys", "values") for j in range(n)]
    if n not in (2, 3) or names != expected:
        raise CacheFileCorrupt("quantized tensors must be keys.0.., values.0.. (2 or 3 each)")
    assert layer.bits is not None
    assert layer.group_size is not None
    dims: list[int] = []
    for side in (layer.tensors[:n], layer.tensors[n:]):
        data, scales = side[0], side[1]
        rest = side[1:]
        if data.dtype != "uint32" or any(t.dtype not in _FLOAT_DTYPES for t in rest):
            raise CacheFileCorrupt("quantized data must be uint32, scales/biases floating")
        if any(len(t.shape) != 4 for t in side):
            raise CacheFileCorrupt("quantized tensors are not rank 4")
        if any(t.shape[:3] != data.shape[:3] or t.shape != scales.shape for t in rest):
            raise CacheFileCorrupt("quantized tensors disagree in shape")
        if rest and any(t.dtype != scales.dtype for t in rest):
            raise CacheFileCorrupt("quantized scales and biases disagree in dtype")
        if data.shape[2] != layer.offset:
            raise CacheFileCorrupt("quantized token axis != offset")
        dim, rem = divmod(data.shape[3] * 32, layer.bits)
        if rem or scales.shape[3] * layer.group_size != dim:
            raise CacheFileCorrupt("quantized packing disagrees with bits/group_size")
        dims.append(dim)
    if layer.tensors[0].shape[:3] != layer.tensors[n].shape[:3]:
        raise CacheFileCorrupt("quantized keys and values disagree in shape")
    if layer.head_dim != dims[0]:
        raise CacheFileCorrupt("quantized head_dim disagrees with the keys")


def _check_layer_tree(layer: LayerRecord) -> None:
    for child in layer.children:
        _check_layer_tree(child)
    _check_kind(layer)


def _offsets_match(layer: LayerRecord, ntokens: int) -> bool:
    if layer.kind in ("arrays", "mamba"):
        return layer.offset in (0, ntokens)
    if layer.kind == "list":
        return all(_offsets_match(c, ntokens) for c in layer.children)
    return layer.offset == ntokens


def _check_ranges(tensors: Sequence[TensorRecord], data_offset: int, size: int) -> None:
    spans: list[tuple[int, int]] = []
    for t in tensors:
        if t.offset % ALIGNMENT:
            raise CacheFileCorrupt(f"tensor {t.name} offset is not 16 KiB aligned")
        if t.offset < data_offset or t.offset + t.nbytes > size:
            raise CacheFileCorrupt(f"tensor {t.name} lies outside the data region")
        if t.nbytes:
            spans.append((t.offset, t.offset + t.nbytes))
    spans.sort()
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise CacheFileCorrupt("tensor ranges overlap")


def _check_same(port: FilePort, fd: int, header: KvFileHeader) -> None:
    """The open file is still the one ``header`` came from (size and header hash)."""
    if port.fstat(fd).size != header.file_size:
        raise CacheFileCorrupt("file size changed since its header was read")
    _, header_hash, _ = _read_preamble(port, fd, header.file_size)
    if header_hash != header.header_hash:
        raise CacheFileCorrupt("file changed since its header was read")
