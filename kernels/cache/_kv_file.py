"""The cold tier's file codec: one prefix entry (caches + tokens) per file.

Layout (``docs/file-format.md`` has it byte by byte)::

    [0, 32)                 preamble: magic, u32 version, u32 header length,
                            u64 xxh3_64 of the header region, u64 zero
    [32, 32 + header_len)   JSON header, ASCII, space-padded; ends on a 16 KiB boundary
    [data_offset, ...)      tensor bytes, each at a 16 KiB-aligned offset

The work is split by thread. MLX runs on the engine thread only, file I/O on
worker threads:

* engine thread: :func:`plan_entry` (metadata, offsets, size), then
  :func:`tensor_bytes` once per tensor (one tensor read back to host at a
  time), later :func:`materialize` (host bytes -> MLX arrays -> caches);
* worker thread: :class:`KvFileWriter` (temp file, positional writes,
  header patched last, fsync, rename, directory fsync), :func:`read_header`
  and :func:`read_tensors`.

Every byte read from disk is untrusted: :func:`read_header` checks the
magic, version, header length, header hash (always), JSON shape and types,
counts, and every tensor's dtype, shape, size and file range before anything
is allocated from it. Failures raise :class:`CacheFileCorrupt` or
:class:`CacheFileIncompatible` and nothing else (``OSError`` from opening or
reading a file passes through, except a short read, which is corruption).

Cache kinds (``LayerRecord.kind``), all from ``mlx_lm.models.cache``:

* ``kv``: ``KVCache``; keys/values sliced to ``offset`` on disk, restored
  into a buffer with step-rounded slack so the next decode writes in place;
* ``quantized``: ``QuantizedKVCache``; ``(data, scales[, biases])`` tuples
  sliced to ``offset`` (tensors ``keys.0..``, ``values.0..``), same slack;
* ``rotating``: ``RotatingKVCache``; the ring buffers exactly as held, plus
  ``offset``, ``idx`` (``_idx``), ``max_size`` and ``keep``, so the restored
  object continues exactly like the original, wrapped or not;
* ``arrays`` / ``mamba``: ``ArraysCache`` (``MambaCache`` where mlx-lm still
  has it); ``slots`` state arrays, ``None`` slots simply have no tensor
  (``state.<i>``), plus optional ``left_padding`` / ``lengths`` tensors;
  ``offset`` carries the registry's ``_kvtier_offset`` stamp (0 = none);
* ``list``: ``CacheList``; members nest as ``children`` records, the list
  itself has no tensors and ``offset`` = the largest member offset.

A cache's ``_kvtier_min_reusable_offset`` attribute is recorded as
``min_reusable_offset`` (``null`` when absent) and set again on restore.

Format versions: a plain prefix entry is version 1. A generation checkpoint
(:class:`GenerationCheckpoint`: the request key, the pending sampled token
and the sampler state of an interrupted answer) is version 2, whose header
has one more key, ``checkpoint``. The reader accepts both; a version-1
reader treats a version-2 file as incompatible (kept, never served).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import queue
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final, NoReturn

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models import cache as _mlc_module

from kernels._env import env_text

from ._file_port import BytesLike, FilePort, PageCacheProbe, ShortRead

__all__ = [
    "ALIGNMENT",
    "CHECKPOINT_FORMAT_VERSION",
    "DEFAULT_MAX_HEADER_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "PREAMBLE_SIZE",
    "TEMP_SUFFIX",
    "CacheFileCorrupt",
    "CacheFileIncompatible",
    "CacheFileWriteError",
    "CacheKindUnsupported",
    "EntryPlan",
    "GenerationCheckpoint",
    "HostEntry",
    "KvFileHeader",
    "KvFileWriter",
    "LandingPool",
    "LayerRecord",
    "OpenEntry",
    "TensorRecord",
    "WriterState",
    "land_entry",
    "materialize",
    "open_entry",
    "plan_entry",
    "read_header",
    "read_tensors",
    "tensor_bytes",
    "verify_tensors",
]

MAGIC: Final = b"\x89KVT\r\n\x1a\n"
"""File signature. The high byte and CR/LF/^Z catch 7-bit and text-mode mangling."""

FORMAT_VERSION: Final = 1
"""Version of a plain prefix entry (and the tier fingerprint's format input)."""
CHECKPOINT_FORMAT_VERSION: Final = 2
"""Version of a file that carries a generation checkpoint section (``checkpoint`` key)."""
_READABLE_VERSIONS: Final = frozenset({FORMAT_VERSION, CHECKPOINT_FORMAT_VERSION})
PREAMBLE_SIZE: Final = 32
ALIGNMENT: Final = 16 * 1024
"""Tensor offsets (and the header region's end) are multiples of 16 KiB (arm64 page)."""

TEMP_SUFFIX: Final = ".kvt.tmp"
DEFAULT_MAX_HEADER_BYTES: Final = 64 * 1024 * 1024

_PREAMBLE = struct.Struct("<8sIIQQ")
assert _PREAMBLE.size == PREAMBLE_SIZE

# NOTE: hard limits on what a header may declare, checked before any loop or
# allocation sized by the file, so a hostile header cannot make the reader
# spin or allocate beyond the file's own size.
_MAX_LAYERS: Final = 4096  # layer records in total, nested ones included
_MAX_DEPTH: Final = 4  # CacheList nesting
_MAX_TENSORS: Final = 65536
_MAX_TOKENS: Final = 1 << 24
_MAX_RANK: Final = 8
_MAX_DIM: Final = 1 << 40
_MAX_STR: Final = 4096
_MAX_SLOTS: Final = 256
_MAX_TOKEN_ID: Final = 1 << 32
_MAX_INT: Final = 1 << 62

_HASH_HEX_WIDTH: Final = 16
_READ_CHUNK: Final = 4 * 1024 * 1024
_QUANT_BITS: Final = frozenset({2, 3, 4, 5, 6, 8})
_QUANT_GROUPS: Final = frozenset({32, 64, 128})

_DTYPES: Final[dict[str, Any]] = {
    "bool": mx.bool_,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint64": mx.uint64,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}
_DTYPE_SIZE: Final[dict[str, int]] = {name: int(dt.size) for name, dt in _DTYPES.items()}
_FLOAT_DTYPES: Final = frozenset({"float16", "bfloat16", "float32"})
_INT_DTYPES: Final = frozenset(
    {"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"}
)

_KINDS: Final = frozenset({"kv", "quantized", "rotating", "arrays", "mamba", "list"})
_TOP_KEYS: Final = (
    "format",
    "model_id",
    "fingerprint",
    "namespace",
    "tokenizer_hash",
    "created_at",
    "file_size",
    "tokens",
    "layers",
)
_LAYER_KEYS: Final = (
    "kind",
    "offset",
    "idx",
    "max_size",
    "keep",
    "bits",
    "group_size",
    "head_dim",
    "slots",
    "min_reusable_offset",
    "tensors",
    "children",
)
_TENSOR_KEYS: Final = ("name", "dtype", "shape", "offset", "nbytes", "hash")
_CHECKPOINT_KEYS: Final = (
    "request_key",
    "prompt_len",
    "pending_token",
    "sample_index",
    "rng_key",
)
_KEY_HEX_WIDTH: Final = 32
_MIN_OFFSET_ATTR: Final = "_kvtier_min_reusable_offset"
_STAMP_ATTR: Final = "_kvtier_offset"

# NOTE: typed as Any so mypy does not track mlx-lm's partly annotated classes,
# whose signatures change between releases.
_mlc: Any = _mlc_module
_MAMBA_CLS: Final[Any] = getattr(_mlc, "MambaCache", None)


# --- errors ------------------------------------------------------------------


class CacheFileCorrupt(ValueError):
    """A cache file failed validation; ``reason`` says which check."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"corrupt cache file: {reason}")
        self.reason = reason


class CacheFileIncompatible(ValueError):
    """A well-formed file this process must not use (other version or fingerprint)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"incompatible cache file: {reason}")
        self.reason = reason


class CacheFileWriteError(OSError):
    """Writing a cache file failed at ``step``; the partial file has been discarded.

    ``fsync_failed`` marks a failed file or directory fsync: the kernel may
    already have dropped the dirty pages, so the data is never reported
    durable and the writer cannot be retried (it is failed for good).
    """

    def __init__(
        self, message: str, *, step: str, fsync_failed: bool, os_errno: int | None = None
    ) -> None:
        super().__init__(os_errno if os_errno is not None else 0, message)
        self.step = step
        self.fsync_failed = fsync_failed


class CacheKindUnsupported(TypeError):
    """:func:`plan_entry` met a cache class the format does not encode."""


# --- records -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor's place in the file. ``hash`` is xxh3_64 of its bytes (0 in a plan)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    hash: int


@dataclass(frozen=True, slots=True)
class LayerRecord:
    """One cache object. Fields that do not apply to ``kind`` are ``None``."""

    kind: str
    offset: int
    idx: int | None
    max_size: int | None
    keep: int | None
    bits: int | None
    group_size: int | None
    head_dim: int | None
    slots: int | None
    min_reusable_offset: int | None
    tensors: tuple[TensorRecord, ...]
    children: tuple[LayerRecord, ...]

    @property
    def trimmable(self) -> bool:
        """Whether the restored cache can drop trailing tokens (mlx-lm's ``is_trimmable``)."""
        if self.kind in ("kv", "quantized"):
            return True
        if self.kind == "rotating":
            return self.max_size is not None and self.offset < self.max_size
        if self.kind == "list":
            return all(c.trimmable for c in self.children)
        return False


@dataclass(frozen=True, slots=True)
class GenerationCheckpoint:
    """The generation state of an interrupted answer, beside the caches of its emitted prefix.

    The file's ``tokens`` are the prompt (its first ``prompt_len`` ids) and
    every token emitted so far; the caches cover all of them.
    ``pending_token`` was sampled from the last emitted token's forward but
    not yet emitted. ``sample_index`` is the number of tokens sampled before
    it (= tokens emitted). ``rng_key`` is the request's PRNG key (two uint32
    words) AFTER the pending token's draw, ``None`` for greedy requests. The
    logits processors' history is the file's ``tokens``.
    """

    request_key: str
    prompt_len: int
    pending_token: int
    sample_index: int
    rng_key: tuple[int, int] | None = None

    def check(self, ntokens: int) -> None:
        """Raise :class:`CacheFileCorrupt` unless this record fits a file of ``ntokens`` tokens."""
        key = self.request_key
        if len(key) != _KEY_HEX_WIDTH or any(c not in "0123456789abcdef" for c in key):
            raise CacheFileCorrupt("checkpoint request_key is not 32 lowercase hex digits")
        if not 0 < self.prompt_len <= ntokens:
            raise CacheFileCorrupt("checkpoint prompt_len outside (0, tokens]")
        if self.sample_index != ntokens - self.prompt_len:
            raise CacheFileCorrupt("checkpoint sample_index differs from the emitted tokens")
        if not 0 <= self.pending_token < _MAX_TOKEN_ID:
            raise CacheFileCorrupt("checkpoint pending_token out of range")
        if self.rng_key is not None and (
            len(self.rng_key) != 2 or any(not 0 <= w < 1 << 32 for w in self.rng_key)
        ):
            raise CacheFileCorrupt("checkpoint rng_key is not two uint32 words")


@dataclass(frozen=True, slots=True)
class KvFileHeader:
    """A validated header (or, inside an :class:`EntryPlan`, the one to be written).

    ``tensors`` lists every tensor in file order: a depth-first walk over
    ``layers``, each record's own tensors before its children's.
    """

    version: int
    model_id: str
    fingerprint: str
    namespace: str
    tokenizer_hash: str
    created_at: float
    tokens: tuple[int, ...]
    layers: tuple[LayerRecord, ...]
    file_size: int
    data_offset: int
    header_hash: int
    checkpoint: GenerationCheckpoint | None = None
    """Set exactly in version-2 files (a generation checkpoint)."""
    tensors: tuple[TensorRecord, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(_walk_tensors(self.layers)))

    @property
    def offset(self) -> int:
        """Tokens the entry covers."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Tensor bytes in the file (what a restore copies)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def trimmable(self) -> bool:
        """Whether every layer can drop trailing tokens after restore."""
        return all(layer.trimmable for layer in self.layers)

    @property
    def min_reusable_offset(self) -> int:
        """The largest declared ``min_reusable_offset`` of any layer (0 if none)."""
        return max(_walk_min_offsets(self.layers), default=0)


@dataclass(slots=True)
class EntryPlan:
    """What :func:`plan_entry` decided: header, tensor offsets, file size.

    Holds references to the source arrays for :func:`tensor_bytes`; call
    :meth:`release_arrays` on the engine thread once every tensor has been
    read back, so the worker that keeps the plan never frees MLX memory.
    """

    header: KvFileHeader
    header_len: int
    _arrays: list[Any | None]

    @property
    def tensors(self) -> tuple[TensorRecord, ...]:
        """Every tensor in file order (hashes 0 until written)."""
        return self.header.tensors

    @property
    def file_size(self) -> int:
        """The final file length in bytes."""
        return self.header.file_size

    def release_arrays(self) -> None:
        """Drop the references to the source arrays (engine thread)."""
        self._arrays = [None] * len(self._arrays)


@dataclass(frozen=True, slots=True)
class HostEntry:
    """Tensor bytes read from a file, parallel to ``KvFileHeader.tensors``."""

    header_hash: int
    buffers: tuple[bytearray, ...]

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(len(b) for b in self.buffers)


def _walk_tensors(layers: Sequence[LayerRecord]) -> Iterator[TensorRecord]:
    for layer in layers:
        yield from layer.tensors
        yield from _walk_tensors(layer.children)


def _walk_min_offsets(layers: Sequence[LayerRecord]) -> Iterator[int]:
    for layer in layers:
        if layer.min_reusable_offset is not None:
            yield layer.min_reusable_offset
        yield from _walk_min_offsets(layer.children)


# --- planning (engine thread) -----------------------------------------------------


def _dtype_name(dt: Any) -> str:
    for name, known in _DTYPES.items():
        if dt == known:
            return name
    raise CacheKindUnsupported(f"dtype {dt} is not encodable")


def _min_offset(c: Any) -> int | None:
    v = getattr(c, _MIN_OFFSET_ATTR, None)
    if v is None:
        return None
    if not 0 <= int(v) <= _MAX_INT:
        raise ValueError(f"{_MIN_OFFSET_ATTR} out of range: {v}")
    return int(v)


@dataclass(slots=True)
class _Planner:
    arrays: list[Any] = field(default_factory=list)
    layers_seen: int = 0

    def tensor(self, name: str, a: Any) -> TensorRecord:
        dtype = _dtype_name(a.dtype)
        shape = tuple(int(d) for d in a.shape)
        self.arrays.append(a)
        nbytes = math.prod(shape) * _DTYPE_SIZE[dtype]
        return TensorRecord(name=name, dtype=dtype, shape=shape, offset=0, nbytes=nbytes, hash=0)

    def layer(self, c: Any, depth: int) -> LayerRecord:
        self.layers_seen += 1
        if self.layers_seen > _MAX_LAYERS or depth > _MAX_DEPTH:
            raise CacheKindUnsupported("cache structure too large or too deeply nested")
        cls = type(c)
        base: dict[str, Any] = dict.fromkeys(_LAYER_KEYS)
        base["min_reusable_offset"] = _min_offset(c)
        base["children"] = ()
        base["tensors"] = ()
        if cls is _mlc.KVCache:
            off = int(c.offset)
            base.update(kind="kv", offset=off)
            if c.keys is not None:
                base["head_dim"] = int(c.keys.shape[-1])
                base["tensors"] = (
                    self.tensor("keys", c.keys[..., :off, :]),
                    self.tensor("values", c.values[..., :off, :]),
                )
        elif cls is _mlc.QuantizedKVCache:
            off = int(c.offset)
            base.update(
                kind="quantized", offset=off, bits=int(c.bits), group_size=int(c.group_size)
            )
            if c.keys is not None:
                if len(c.keys) not in (2, 3) or len(c.keys) != len(c.values):
                    raise CacheKindUnsupported("quantized cache tuples must have 2 or 3 arrays")
                base["head_dim"] = int(c.keys[0].shape[-1]) * 32 // int(c.bits)
                base["tensors"] = tuple(
                    self.tensor(f"{side}.{j}", a[..., :off, :])
                    for side, parts in (("keys", c.keys), ("values", c.values))
                    for j, a in enumerate(parts)
                )
        elif cls is _mlc.RotatingKVCache:
            base.update(
                kind="rotating",
                offset=int(c.offset),
                idx=int(c._idx),
                max_size=int(c.max_size),
                keep=int(c.keep),
            )
            if c.keys is not None:
                base["head_dim"] = int(c.keys.shape[-1])
                base["tensors"] = (self.tensor("keys", c.keys), self.tensor("values", c.values))
        elif cls is _mlc.ArraysCache or (_MAMBA_CLS is not None and cls is _MAMBA_CLS):
            slots = list(c.cache)
            if len(slots) > _MAX_SLOTS:
                raise CacheKindUnsupported(f"ArraysCache with {len(slots)} slots")
            tensors = [self.tensor(f"state.{i}", a) for i, a in enumerate(slots) if a is not None]
            for extra in ("left_padding", "lengths"):
                a = getattr(c, extra, None)
                if a is not None:
                    tensors.append(self.tensor(extra, a))
            base.update(
                kind="arrays" if cls is _mlc.ArraysCache else "mamba",
                offset=int(getattr(c, _STAMP_ATTR, 0)),
                slots=len(slots),
                tensors=tuple(tensors),
            )
        elif cls is _mlc.CacheList:
            children = tuple(self.layer(x, depth + 1) for x in c.caches)
            base.update(
                kind="list", offset=max((x.offset for x in children), default=0), children=children
            )
        else:
            raise CacheKindUnsupported(f"cannot encode {cls.__module__}.{cls.__qualname__}")
        return LayerRecord(**base)


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _place(
    layers: tuple[LayerRecord, ...], data_offset: int
) -> tuple[tuple[LayerRecord, ...], int]:
    """Assign file offsets in file order; returns the placed layers and the file size."""
    cursor = data_offset
    end = data_offset

    def place_layer(layer: LayerRecord) -> LayerRecord:
        nonlocal cursor, end
        placed: list[TensorRecord] = []
        for t in layer.tensors:
            placed.append(TensorRecord(t.name, t.dtype, t.shape, cursor, t.nbytes, t.hash))
            end = max(end, cursor + t.nbytes)
            # NOTE: an empty tensor takes no range, so it does not advance the
            # cursor; its offset is still aligned and within the file.
            if t.nbytes:
                cursor = _align(cursor + t.nbytes)
        children = tuple(place_layer(c) for c in layer.children)
        return _replace_layer(layer, tensors=tuple(placed), children=children)

    out = tuple(place_layer(x) for x in layers)
    return out, end


def _replace_layer(
    layer: LayerRecord, *, tensors: tuple[TensorRecord, ...], children: tuple[LayerRecord, ...]
) -> LayerRecord:
    return LayerRecord(
        kind=layer.kind,
        offset=layer.offset,
        idx=layer.idx,
        max_size=layer.max_size,
        keep=layer.keep,
        bits=layer.bits,
        group_size=layer.group_size,
        head_dim=layer.head_dim,
        slots=layer.slots,
        min_reusable_offset=layer.min_reusable_offset,
        tensors=tensors,
        children=children,
    )


def plan_entry(
    caches: Sequence[Any],
    *,
    model_id: str,
    fingerprint: str,
    namespace: str,
    tokenizer_hash: str,
    tokens: Sequence[int],
    created_at: float | None = None,
    checkpoint: GenerationCheckpoint | None = None,
) -> EntryPlan:
    """Plan the file for one prefix entry (engine thread; metadata only, no eval).

    Every layer's ``offset`` must equal ``len(tokens)`` (recurrent layers:
    equal, or 0 when unstamped); otherwise ``ValueError``. Unknown cache
    classes or dtypes raise :class:`CacheKindUnsupported`. With
    ``checkpoint`` the file is a version-2 generation checkpoint (the record
    must fit ``tokens``, else ``ValueError``).
    """
    for name, s in (
        ("model_id", model_id),
        ("fingerprint", fingerprint),
        ("namespace", namespace),
        ("tokenizer_hash", tokenizer_hash),
    ):
        if not isinstance(s, str) or len(s) > _MAX_STR:
            raise ValueError(f"{name} must be a str of at most {_MAX_STR} characters")
    toks, tokens_len = _checked_tokens(tokens)
    if checkpoint is not None:
        try:
            checkpoint.check(len(toks))
        except CacheFileCorrupt as exc:
            raise ValueError(exc.reason) from exc
    stamp = float(time.time() if created_at is None else created_at)
    if not math.isfinite(stamp) or stamp < 0:
        raise ValueError("created_at must be a finite, non-negative time")
    planner = _Planner()
    layers = tuple(planner.layer(c, 0) for c in caches)
    if len(planner.arrays) > _MAX_TENSORS:
        raise CacheKindUnsupported(f"{len(planner.arrays)} tensors exceed the format's limit")
    for layer in layers:
        if not _offsets_match(layer, len(toks)):
            raise ValueError(f"a {layer.kind} layer's offset does not match {len(toks)} tokens")
        # NOTE: the reader's own per-kind rules, so no file is written that
        # read_header would reject.
        try:
            _check_layer_tree(layer)
        except CacheFileCorrupt as exc:
            raise CacheKindUnsupported(f"cache state not encodable: {exc.reason}") from exc

    def build(data_offset: int, layers_: tuple[LayerRecord, ...], size: int) -> KvFileHeader:
        return KvFileHeader(
            version=FORMAT_VERSION if checkpoint is None else CHECKPOINT_FORMAT_VERSION,
            model_id=model_id,
            fingerprint=fingerprint,
            namespace=namespace,
            tokenizer_hash=tokenizer_hash,
            created_at=stamp,
            tokens=toks,
            layers=layers_,
            file_size=size,
            data_offset=data_offset,
            header_hash=0,
            checkpoint=checkpoint,
        )

    def body_len(header: KvFileHeader) -> int:
        # NOTE: the token list dominates the header; its JSON length is
        # computed, not encoded, so the engine thread never serializes it
        # (the writer does, on its worker thread).
        return len(_encode_json(header, tokens_json="[]")) - 2 + tokens_len

    # NOTE: the header records offsets and the file size, which depend on
    # where data starts, which depends on the header's length: grow the data
    # offset until the serialized header fits in front of it. Hashes are
    # fixed-width, so the committed header has exactly the planned length.
    data_offset = _align(PREAMBLE_SIZE + body_len(build(0, layers, 0)))
    while True:
        placed, size = _place(layers, data_offset)
        header = build(data_offset, placed, size)
        needed = PREAMBLE_SIZE + body_len(header)
        if needed <= data_offset:
            break
        data_offset = _align(needed)
    return EntryPlan(
        header=header, header_len=data_offset - PREAMBLE_SIZE, _arrays=list(planner.arrays)
    )


def tensor_bytes(plan: EntryPlan, i: int) -> memoryview:
    """Read tensor ``i`` of ``plan`` back to host memory (engine thread).

    Returns a byte view of a contiguous copy (or the array itself when
    already contiguous); the view keeps that array alive until dropped, so
    at most one tensor's transient exists if callers drop each view after
    writing it.
    """
    a = plan._arrays[i]
    if a is None:
        raise RuntimeError("plan arrays were released")
    expected = plan.tensors[i].nbytes
    if expected == 0:
        return memoryview(b"")
    # NOTE: when ``a`` is already contiguous, ``x`` shares its buffer. That
    # is safe while a worker reads the view: MLX updates a buffer in place
    # only when nothing else references it, and the view keeps ``x`` alive.
    x: Any = mx.contiguous(a)
    mx.eval(x)
    view = memoryview(x).cast("B")
    if len(view) != expected:
        raise RuntimeError(f"tensor {i} read back {len(view)} bytes, planned {expected}")
    return view


# --- header encoding ---------------------------------------------------------------


def _tensor_json(t: TensorRecord, h: int) -> dict[str, Any]:
    return {
        "name": t.name,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "offset": t.offset,
        "nbytes": t.nbytes,
        "hash": f"{h:0{_HASH_HEX_WIDTH}x}",
    }


def _layer_json(layer: LayerRecord, hashes: Iterator[int]) -> dict[str, Any]:
    return {
        "kind": layer.kind,
        "offset": layer.offset,
        "idx": layer.idx,
        "max_size": layer.max_size,
        "keep": layer.keep,
        "bits": layer.bits,
        "group_size": layer.group_size,
        "head_dim": layer.head_dim,
        "slots": layer.slots,
        "min_reusable_offset": layer.min_reusable_offset,
        "tensors": [_tensor_json(t, next(hashes)) for t in layer.tensors],
        "children": [_layer_json(c, hashes) for c in layer.children],
    }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _tokens_json(tokens: Sequence[int]) -> str:
    return _dumps(list(tokens))


def _checked_tokens(tokens: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """The token ids as a tuple and the length of their JSON list (``[1,22]`` -> 6)."""
    # NOTE: vectorized; this runs on the engine thread, where a Python-level
    # loop over a long prompt would cost about a second per million tokens.
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError("token ids must be integers") from exc
    if arr.size == 0:
        return (), 2
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError("token ids must be a flat sequence of integers")
    if arr.size > _MAX_TOKENS or int(arr.min()) < 0 or int(arr.max()) >= _MAX_TOKEN_ID:
        raise ValueError("token ids out of range or too many tokens")
    digits = arr.size + sum(int(np.count_nonzero(arr >= 10**k)) for k in range(1, 10))
    return tuple(arr.tolist()), 2 + digits + arr.size - 1


def _encode_json(
    header: KvFileHeader, hashes: Sequence[int] | None = None, *, tokens_json: str | None = None
) -> bytes:
    # NOTE: the token list dominates the header; it is serialized once per
    # plan (``tokens_json``) and spliced in, rather than re-encoded per attempt.
    it = iter(hashes) if hashes is not None else iter([0] * len(header.tensors))
    head = {
        "format": header.version,
        "model_id": header.model_id,
        "fingerprint": header.fingerprint,
        "namespace": header.namespace,
        "tokenizer_hash": header.tokenizer_hash,
        "created_at": header.created_at,
        "file_size": header.file_size,
    }
    layers = [_layer_json(x, it) for x in header.layers]
    toks = tokens_json if tokens_json is not None else _tokens_json(header.tokens)
    text = _dumps(head)[:-1] + ',"tokens":' + toks + ',"layers":' + _dumps(layers)
    if header.version == CHECKPOINT_FORMAT_VERSION:
        ck = header.checkpoint
        assert ck is not None
        section = {
            "request_key": ck.request_key,
            "prompt_len": ck.prompt_len,
            "pending_token": ck.pending_token,
            "sample_index": ck.sample_index,
            "rng_key": None if ck.rng_key is None else list(ck.rng_key),
        }
        text += ',"checkpoint":' + _dumps(section)
    return (text + "}").encode("ascii")


# --- writer (worker thread) ---------------------------------------------------------


class WriterState(Enum):
    """Lifecycle of a :class:`KvFileWriter`."""

    NEW = "new"
    OPEN = "open"
    COMMITTED = "committed"
    FAILED = "failed"
    ABORTED = "aborted"


class KvFileWriter:
    """Writes one planned entry through a :class:`FilePort` (worker thread).

    ``begin`` creates ``<uuid>.kvt.tmp`` in the target directory at its final
    length; ``write_tensor`` writes each tensor at its planned offset (any
    order, each once) and records its xxh3_64; ``commit`` writes preamble and
    header last, fsyncs, renames over the final name and fsyncs the
    directory. Any failure discards the temp file (and, when the directory
    fsync fails after the rename, the final file), raises
    :class:`CacheFileWriteError`, and leaves the writer failed for good.
    Used as a context manager, an uncommitted writer is aborted on exit.
    """

    def __init__(self, port: FilePort, plan: EntryPlan) -> None:
        self._port = port
        self._plan = plan
        self._fd: int | None = None
        self._dir: str | None = None
        self._temp: str | None = None
        self._hashes: list[int | None] = [None] * len(plan.tensors)
        self._state = WriterState.NEW
        self._failure: CacheFileWriteError | None = None

    @property
    def state(self) -> WriterState:
        """Where the writer is in its lifecycle."""
        return self._state

    @property
    def temp_path(self) -> str | None:
        """The temp file's path once :meth:`begin` succeeded."""
        return self._temp

    def __enter__(self) -> KvFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state is not WriterState.COMMITTED:
            self.abort()

    def begin(self, directory: str, *, temp_id: str | None = None) -> str:
        """Create the temp file in ``directory`` (which must exist); returns its path.

        ``temp_id`` names it ``<temp_id>.kvt.tmp`` (a simulation passes its
        own ids); by default a random UUID.
        """
        self._expect(WriterState.NEW)
        stem = temp_id if temp_id is not None else uuid.uuid4().hex
        if not stem or os.sep in stem or stem in (".", ".."):
            raise ValueError(f"bad temp id {stem!r}")
        path = os.path.join(directory, f"{stem}{TEMP_SUFFIX}")
        try:
            self._fd = self._port.open_temp(path)
        except OSError as exc:
            self._fail("open", exc, fsync=False)
        self._dir, self._temp = directory, path
        self._state = WriterState.OPEN
        try:
            self._port.truncate(self._fd, self._plan.file_size)
        except OSError as exc:
            self._fail("truncate", exc, fsync=False)
        return path

    def write_tensor(self, i: int, data: BytesLike) -> None:
        """Write tensor ``i`` (exactly its planned ``nbytes``) and record its hash."""
        self._expect(WriterState.OPEN)
        rec = self._plan.tensors[i]
        if self._hashes[i] is not None:
            raise RuntimeError(f"tensor {i} already written")
        raw = memoryview(data)
        view = raw.cast("B") if raw.nbytes else memoryview(b"")
        if len(view) != rec.nbytes:
            raise ValueError(f"tensor {i} has {len(view)} bytes, planned {rec.nbytes}")
        assert self._fd is not None
        h = xxhash.xxh3_64_intdigest(view)
        try:
            self._port.pwrite_all(self._fd, view, rec.offset)
        except OSError as exc:
            self._fail("write", exc, fsync=False)
        self._hashes[i] = h

    def commit(self, final_path: str) -> None:
        """Patch the header, make the file durable and give it ``final_path``.

        ``final_path`` must be in the directory given to :meth:`begin` (the
        rename is atomic only within one directory).
        """
        self._expect(WriterState.OPEN)
        assert self._fd is not None
        assert self._dir is not None
        assert self._temp is not None
        if os.path.dirname(os.path.abspath(final_path)) != os.path.abspath(self._dir):
            raise ValueError("final_path must be in the writer's directory")
        missing = [i for i, h in enumerate(self._hashes) if h is None]
        if missing:
            raise RuntimeError(f"tensors not written: {missing[:8]}")
        hashes = [h for h in self._hashes if h is not None]
        region = _header_region(self._plan, hashes)
        pre = _PREAMBLE.pack(
            MAGIC, self._plan.header.version, len(region), xxhash.xxh3_64_intdigest(region), 0
        )
        port = self._port
        try:
            port.pwrite_all(self._fd, pre + region, 0)
        except OSError as exc:
            self._fail("write", exc, fsync=False)
        try:
            port.fsync(self._fd)
        except OSError as exc:
            self._fail("fsync", exc, fsync=True)
        fd, self._fd = self._fd, None
        try:
            port.close(fd)
        except OSError as exc:
            # NOTE: close can surface a deferred write error (NFS); the data
            # is not trusted then, same as a failed fsync.
            self._fail("close", exc, fsync=True)
        try:
            port.replace(self._temp, final_path)
        except OSError as exc:
            self._fail("replace", exc, fsync=False)
        self._temp = None
        try:
            port.fsync_dir(self._dir)
        except OSError as exc:
            # NOTE: the rename may or may not survive a crash; the entry is
            # not durable, so it is removed rather than reported stored.
            self._temp = final_path
            self._fail("fsync_dir", exc, fsync=True)
        self._state = WriterState.COMMITTED

    def abort(self) -> None:
        """Close and unlink the temp file (best effort, idempotent)."""
        if self._state in (WriterState.COMMITTED, WriterState.ABORTED):
            return
        self._discard()
        if self._state is not WriterState.FAILED:
            self._state = WriterState.ABORTED

    def _discard(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                self._port.close(fd)
            except OSError:
                pass
        path, self._temp = self._temp, None
        if path is not None:
            try:
                self._port.unlink(path)
            except OSError:
                pass

    def _expect(self, state: WriterState) -> None:
        if self._state is WriterState.FAILED and self._failure is not None:
            # NOTE: fsyncgate: after a failed write or fsync the dirty pages
            # may be gone; no later call may turn this writer into a success.
            raise CacheFileWriteError(
                f"writer already failed at {self._failure.step}",
                step=self._failure.step,
                fsync_failed=self._failure.fsync_failed,
                os_errno=self._failure.errno,
            )
        if self._state is not state:
            raise RuntimeError(f"writer is {self._state.value}, expected {state.value}")

    def _fail(self, step: str, exc: OSError, *, fsync: bool) -> NoReturn:
        err = CacheFileWriteError(
            f"cache file {step} failed: {exc}", step=step, fsync_failed=fsync, os_errno=exc.errno
        )
        self._failure = err
        self._discard()
        self._state = WriterState.FAILED
        raise err from exc


def _header_region(plan: EntryPlan, hashes: Sequence[int]) -> bytes:
    body = _encode_json(plan.header, hashes)
    if len(body) > plan.header_len:
        raise RuntimeError("header outgrew its planned length")
    return body + b" " * (plan.header_len - len(body))


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


def read_tensors(
    port: FilePort, path: str, header: KvFileHeader, *, verify: bool = True
) -> HostEntry:
    """Read every tensor of a validated file into host buffers (worker thread).

    With ``verify`` each tensor's xxh3_64 is checked in the same pass
    (chunk by chunk while the bytes are in cache). The file must still be the
    one ``header`` came from (same size and header hash), else
    :class:`CacheFileCorrupt`.
    """
    fd = _open_same(port, path, header)
    try:
        return _read_host(port, fd, header, verify=verify)
    finally:
        port.close(fd)


def _read_host(port: FilePort, fd: int, header: KvFileHeader, *, verify: bool) -> HostEntry:
    buffers: list[bytearray] = []
    for i, t in enumerate(header.tensors):
        buf = bytearray(t.nbytes)
        view = memoryview(buf)
        hasher = xxhash.xxh3_64() if verify else None
        try:
            for start in range(0, t.nbytes, _READ_CHUNK):
                chunk = view[start : start + _READ_CHUNK]
                port.pread_into(fd, chunk, t.offset + start)
                if hasher is not None:
                    hasher.update(chunk)
        except ShortRead as exc:
            raise CacheFileCorrupt(f"file truncated inside tensor {i}") from exc
        if hasher is not None and hasher.intdigest() != t.hash:
            raise CacheFileCorrupt(f"tensor {i} ({t.name}) hash mismatch")
        buffers.append(buf)
    return HostEntry(header_hash=header.header_hash, buffers=tuple(buffers))


def _open_same(port: FilePort, path: str, header: KvFileHeader) -> int:
    """Open ``path`` for reading and check it is still the file ``header`` came from."""
    fd = port.open_read(path)
    try:
        size = port.fstat(fd).size
        if size != header.file_size:
            raise CacheFileCorrupt("file size changed since its header was read")
        _, header_hash, _ = _read_preamble(port, fd, size)
        if header_hash != header.header_hash:
            raise CacheFileCorrupt("file changed since its header was read")
    except BaseException:
        port.close(fd)
        raise
    return fd


def verify_tensors(port: FilePort, path: str, header: KvFileHeader) -> int:
    """Check every tensor's xxh3_64 without keeping its bytes (worker thread); bytes checked.

    The cold tier's scrubber: reads through one reused 4 MiB buffer, so its
    memory does not grow with the file. Raises :class:`CacheFileCorrupt` on
    a hash mismatch or a truncated file, like :func:`read_tensors`.
    """
    fd = _open_same(port, path, header)
    try:
        return _scan(port, fd, header, verify=True)
    finally:
        port.close(fd)


def _scan(
    port: FilePort,
    fd: int,
    header: KvFileHeader,
    *,
    verify: bool,
    passed: Callable[[int], None] | None = None,
) -> int:
    """Read every tensor through one reused buffer, checking hashes with ``verify``; bytes read.

    ``passed(i)`` is called once tensor ``i`` was read (and checked); it may
    raise to stop the pass (a cancelled restore).
    """
    chunk = bytearray(min(_READ_CHUNK, max((t.nbytes for t in header.tensors), default=0)))
    view = memoryview(chunk)
    checked = 0
    for i, t in enumerate(header.tensors):
        hasher = xxhash.xxh3_64() if verify else None
        try:
            for start in range(0, t.nbytes, _READ_CHUNK):
                part = view[: min(_READ_CHUNK, t.nbytes - start)]
                port.pread_into(fd, part, t.offset + start)
                if hasher is not None:
                    hasher.update(part)
        except ShortRead as exc:
            raise CacheFileCorrupt(f"file truncated inside tensor {i}") from exc
        if hasher is not None and hasher.intdigest() != t.hash:
            raise CacheFileCorrupt(f"tensor {i} ({t.name}) hash mismatch")
        checked += t.nbytes
        if passed is not None:
            passed(i)
    return checked


class PassFailed(Exception):
    """The reader's pass over a staged entry failed or was cancelled; a landing behind it fails.

    The reader reports the file's own fault (corrupt, I/O error); a landing
    waiting on the pass only learns that it cannot go on (a miss).
    """


class _PassCancelled(Exception):
    """The entry was closed while its pass was running."""


class OpenEntry:
    """A validated cache file held open from the worker's check to the engine turn's landing.

    Made by :func:`open_entry` (pass done) or :func:`open_file` (the holder
    runs :meth:`pass_over` on a worker next); consumed by :func:`land_entry`.
    The holder owns the descriptor and must :meth:`close` it on every path
    (landed, dropped, pushed out, shut down); closing is idempotent and
    thread-safe. NOTE: the open descriptor pins the file's inode, so a
    rewrite (a rename over the path) or an unlink between the two passes
    cannot swap the bytes the landing reads; the landing still re-checks
    size and header hash, and hashes every byte again in the memory the
    arrays will own.

    The pass publishes its progress (tensors read and checked so far, under
    a condition): a landing that starts before the pass ended reads tensor
    ``i`` once the pass went past it (from the page cache, right behind the
    reader), and fails with :class:`PassFailed` when the pass fails or is
    cancelled. Every end of a pass (done, failed, cancelled, never run:
    :meth:`abandon`) wakes the landing.
    """

    def __init__(
        self,
        port: FilePort,
        fd: int,
        path: str,
        header: KvFileHeader,
        *,
        verify: bool,
        passed: bool = True,
        check_in_pass: bool = True,
    ) -> None:
        self.port = port
        self.path = path
        self.header = header
        self.verify = verify
        self._check_in_pass = verify and check_in_pass
        self._fd: int | None = fd
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._total = len(header.tensors)
        self._passed = self._total if passed else 0
        # NOTE: set once, at the pass's end (done, failed, cancelled, abandoned).
        self._ended = passed
        self._failure: str | None = None
        self._running = False
        self._close_when_passed = False
        self._callbacks: list[Callable[[], None]] = []

    @property
    def nbytes(self) -> int:
        """Tensor bytes the landing reads (what the restored arrays hold, slack aside)."""
        return self.header.nbytes

    @property
    def closed(self) -> bool:
        """Whether the descriptor was closed (or is to be closed once the running pass stops)."""
        with self._lock:
            return self._fd is None or self._close_when_passed

    @property
    def passed(self) -> bool:
        """Whether the reader's pass went over every tensor."""
        with self._lock:
            return self._ended and self._failure is None

    @property
    def progress(self) -> int:
        """Tensors the pass went past so far (all of them once it passed)."""
        with self._lock:
            return self._passed

    @property
    def pass_failure(self) -> str | None:
        """Why the pass failed or was cancelled (``None``: it did not, or has not ended)."""
        with self._lock:
            return self._failure

    def fileno(self) -> int:
        """The open descriptor; ``ValueError`` once closed."""
        with self._lock:
            if self._fd is None or self._close_when_passed:
                raise ValueError("the entry's file was closed")
            return self._fd

    def close(self) -> None:
        """Close the descriptor (idempotent); a running pass is cancelled and closes it as it stops.

        NOTE: never closed under a running pass's reads: the descriptor's
        number could be reused by another open meanwhile and the pass would
        read another file's bytes.
        """
        with self._lock:
            if self._running:
                self._close_when_passed = True
                return
            fd, self._fd = self._fd, None
        if fd is not None:
            self.port.close(fd)

    def pass_over(self) -> int:
        """The reader's pass over the tensors of an entry from :func:`open_file` (worker thread).

        Reads every tensor through one reused buffer (with ``verify`` each
        tensor's xxh3_64 checked, unless the entry was opened with
        ``check_in_pass=False``), publishing progress after each; the bytes
        read. A pass that checks nothing ends at once, having read 0 bytes,
        when the port says every tensor's bytes are in the page cache
        (:class:`PageCacheProbe`). Raises :class:`CacheFileCorrupt` on a bad
        hash or truncation, the port's ``OSError``, or :class:`PassFailed` when the entry was
        closed meanwhile; every end wakes a waiting landing. Once only.
        """
        with self._lock:
            if self._ended or self._running:
                raise RuntimeError("the entry's pass already ran or ended")
            if self._fd is None or self._close_when_passed:
                self._end_locked("closed before its pass")
                raise PassFailed("the entry was closed before its pass")
            self._running = True
            fd = self._fd
        failure = "the reader's pass stopped"
        try:
            if self._nothing_to_pass(fd):
                failure = ""
                return 0
            nbytes = _scan(
                self.port, fd, self.header, verify=self._check_in_pass, passed=self._advance
            )
            failure = ""
            return nbytes
        except _PassCancelled:
            failure = "the entry was closed during its pass"
            raise PassFailed(failure) from None
        except BaseException as exc:
            failure = f"the reader's pass failed: {exc!r}"
            raise
        finally:
            with self._lock:
                to_close = self._stop_locked()
                self._end_locked(failure or None)
                callbacks, self._callbacks = self._callbacks, []
            try:
                for cb in callbacks:
                    cb()
            finally:
                if to_close is not None:
                    self.port.close(to_close)

    def _nothing_to_pass(self, fd: int) -> bool:
        """Whether the pass may end at once: it checks nothing and every tensor is in the page cache.

        NOTE: a pass that only reads ahead of the landing does nothing for a
        file the page cache already holds but holds the landing back to one
        thread's copy speed (the landing waits for it tensor by tensor); on
        the H200 host that pass, not the landing, set the pace of a restore
        from the page cache. A page evicted after this answer is read by the
        landing itself.
        """
        if self._check_in_pass or not isinstance(self.port, PageCacheProbe):
            return False
        ranges = [(t.offset, t.nbytes) for t in self.header.tensors]
        return self.port.all_cached(fd, self.header.file_size, ranges)

    def _stop_locked(self) -> int | None:
        """The pass stopped running: the descriptor to close now if a close came meanwhile."""
        self._running = False
        if not self._close_when_passed:
            return None
        fd, self._fd, self._close_when_passed = self._fd, None, False
        return fd

    def abandon(self, reason: str = "the reader's pass never ran") -> None:
        """End a pass that will not run (its worker was cancelled before it began); idempotent.

        A no-op once the pass ended or while it runs (it ends by itself).
        """
        with self._lock:
            if self._ended or self._running:
                return
            self._end_locked(reason)
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def when_passed(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` (on the reader's thread) when the pass ends; ``False``: it already has."""
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            return True

    def wait_passed(self, index: int) -> None:
        """Block until the pass went past tensor ``index``; :class:`PassFailed` if it cannot.

        NOTE: called on a landing thread, never the engine thread; it never
        waits forever, as every end of a pass (done, failed, cancelled,
        abandoned) notifies.
        """
        with self._progress:
            while self._passed <= index and not self._ended:
                self._progress.wait()
            if self._passed <= index:
                raise PassFailed(self._failure or "the reader's pass ended early")

    def _advance(self, index: int) -> None:
        with self._progress:
            if self._close_when_passed:
                raise _PassCancelled
            self._passed = index + 1
            self._progress.notify_all()

    def _end_locked(self, failure: str | None) -> None:
        if self._ended:
            return
        self._ended = True
        self._failure = failure
        if failure is None:
            self._passed = self._total
        self._progress.notify_all()

    def take_host(self) -> HostEntry:
        """Every tensor's bytes in host buffers, then close (checkers and tools, not restores).

        Reads through the open descriptor, each tensor's hash checked when
        the entry was opened with ``verify``; :class:`CacheFileCorrupt` on a
        mismatch or truncation. Closed on every path.
        """
        try:
            fd = self.fileno()
            _check_same(self.port, fd, self.header)
            return _read_host(self.port, fd, self.header, verify=self.verify)
        finally:
            # NOTE: a failing close of a read-only descriptor loses nothing
            # (the bytes were read in full, or the read's own error stands).
            with contextlib.suppress(OSError):
                self.close()


def open_entry(
    port: FilePort, path: str, header: KvFileHeader, *, verify: bool = True
) -> OpenEntry:
    """Open a validated file for a restore and pass over its tensors once (worker thread).

    The pass reads every tensor through one reused buffer (memory does not
    grow with the file): with ``verify`` each tensor's xxh3_64 is checked, so
    a corrupt file is known before the request's turn; either way the file
    is left in the page cache for :func:`land_entry`. The file must still be
    the one ``header`` came from (same size and header hash), else
    :class:`CacheFileCorrupt`. The returned entry holds the file open; its
    holder closes it.
    """
    fd = _open_same(port, path, header)
    try:
        _scan(port, fd, header, verify=verify)
    except BaseException:
        port.close(fd)
        raise
    return OpenEntry(port, fd, path, header, verify=verify)


def open_file(
    port: FilePort,
    path: str,
    header: KvFileHeader,
    *,
    verify: bool = True,
    check_in_pass: bool = True,
) -> OpenEntry:
    """Open a validated file for a restore whose pass runs next (worker thread).

    Like :func:`open_entry` without the pass: the file must still be the
    one ``header`` came from, else :class:`CacheFileCorrupt`. The holder
    runs :meth:`OpenEntry.pass_over` on a worker (or :meth:`OpenEntry.abandon`
    if it never will) and may hand the entry to a landing meanwhile: the
    landing goes right behind the pass.

    ``check_in_pass=False`` (with ``verify``): the pass only reads (it
    brings the file into the page cache ahead of the landing) and the
    hashes are checked once, by :func:`land_entry`, in the memory the
    arrays will own. NOTE: the restore's choice: checking in both passes
    hashed every byte twice, and on a host where the landing keeps up with
    the pass that second hash set the pace of a restore from the page
    cache; a bad file then fails its landing instead of its pass, and is
    reported and removed the same way.
    """
    fd = _open_same(port, path, header)
    return OpenEntry(
        port, fd, path, header, verify=verify, passed=False, check_in_pass=check_in_pass
    )


# --- restore (engine thread) -------------------------------------------------------


def _array(rec: TensorRecord, buf: bytearray) -> Any:
    dt = _DTYPES[rec.dtype]
    if rec.nbytes == 0:
        return mx.zeros(rec.shape, dtype=dt)
    # NOTE: mx.array copies the buffer at construction, so the result never
    # aliases host memory the caller may reuse or free.
    src: Any = memoryview(buf)
    return mx.array(src).view(dt).reshape(rec.shape)


def _with_slack(a: Any, capacity: int) -> Any:
    pad = capacity - a.shape[2]
    if pad <= 0:
        return a
    shape = (*a.shape[:2], pad, *a.shape[3:])
    return mx.concatenate([a, mx.zeros(shape, dtype=a.dtype)], axis=2)


def _padded(a: Any, capacity: int) -> Any:
    """``a`` with slack up to ``capacity`` on its token axis, evaluated now.

    NOTE: evaluated here so the unpadded copy is dropped before the next
    tensor is copied (one tensor's worth of extra memory at a time).
    """
    out = _with_slack(a, capacity)
    mx.eval(out)
    return out


def materialize(
    header: KvFileHeader, host: HostEntry, *, step: int = 256, consume: bool = False
) -> list[Any]:
    """Build the cache objects from host bytes (engine thread).

    Plain and quantized KV buffers get capacity ``ceil((offset + 1) / step) *
    step`` so the next decode step writes in place; rotating buffers are
    restored exactly. All arrays are evaluated before returning and none
    references ``host``.

    Tensors are copied one at a time, each evaluated (slack included) before
    the next is read. With ``consume`` each host buffer is emptied as soon
    as its copy exists, so peak memory is the restored entry plus about one
    tensor instead of the whole entry twice; ``host`` is unusable afterwards.
    """
    if host.header_hash != header.header_hash or len(host.buffers) != len(header.tensors):
        raise ValueError("host entry does not belong to this header")
    if any(len(b) != t.nbytes for t, b in zip(header.tensors, host.buffers, strict=True)):
        raise ValueError("host entry was already consumed")
    if step < 1:
        raise ValueError("step must be positive")
    arrays = _copies(header, host, consume=consume)
    caches = [_build(layer, arrays, step) for layer in header.layers]
    mx.eval(*[a for c in caches for a in _cache_arrays(c)])
    return caches


def _copies(header: KvFileHeader, host: HostEntry, *, consume: bool) -> Iterator[Any]:
    """Each tensor as an evaluated MLX array, in file order (lazily, one at a time)."""
    for rec, buf in zip(header.tensors, host.buffers, strict=True):
        a = _array(rec, buf)
        mx.eval(a)
        if consume:
            # NOTE: the array owns a copy now (mx.array copies at
            # construction) and no view of the buffer is left, so it can
            # be freed before the next tensor is copied.
            buf.clear()
        yield a


def _build(layer: LayerRecord, arrays: Iterator[Any], step: int) -> Any:
    kind = layer.kind
    out: Any
    capacity = -(-(layer.offset + 1) // step) * step
    if kind == "kv":
        out = _mlc.KVCache()
        if layer.tensors:
            out.keys = _padded(next(arrays), capacity)
            out.values = _padded(next(arrays), capacity)
            out.offset = layer.offset
    elif kind == "quantized":
        assert layer.bits is not None
        assert layer.group_size is not None
        out = _mlc.QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
        if layer.tensors:
            n = len(layer.tensors) // 2
            parts = [_padded(next(arrays), capacity) for _ in range(2 * n)]
            out.keys, out.values = tuple(parts[:n]), tuple(parts[n:])
            out.offset = layer.offset
    elif kind == "rotating":
        out = _mlc.RotatingKVCache(max_size=layer.max_size, keep=layer.keep)
        if layer.tensors:
            out.keys = next(arrays)
            out.values = next(arrays)
        out.offset = layer.offset
        out._idx = layer.idx
    elif kind in ("arrays", "mamba"):
        assert layer.slots is not None
        cls = _MAMBA_CLS if kind == "mamba" and _MAMBA_CLS is not None else _mlc.ArraysCache
        out = cls.__new__(cls)
        _mlc.ArraysCache.__init__(out, layer.slots)
        for t in layer.tensors:
            a = next(arrays)
            if t.name == "left_padding":
                out.left_padding = a
            elif t.name == "lengths":
                out.lengths = a
            else:
                out.cache[int(t.name[len("state.") :])] = a
        if layer.offset:
            setattr(out, _STAMP_ATTR, layer.offset)
    else:
        out = _mlc.CacheList(*(_build(c, arrays, step) for c in layer.children))
    if layer.min_reusable_offset is not None:
        setattr(out, _MIN_OFFSET_ATTR, layer.min_reusable_offset)
    return out


def _cache_arrays(c: Any) -> list[Any]:
    if type(c) is _mlc.CacheList:
        return [a for x in c.caches for a in _cache_arrays(x)]
    if isinstance(c, _mlc.ArraysCache):
        extra = [getattr(c, "left_padding", None), getattr(c, "lengths", None)]
        return [a for a in (*c.cache, *extra) if a is not None]
    keys, values = c.keys, c.values
    if keys is None:
        return []
    if isinstance(keys, tuple):
        return [*keys, *values]
    return [keys, values]


# --- landing: file bytes straight into MLX memory (engine thread + landing workers) ---------

_MAX_IOV_PER_READ: Final = 512
"""Buffers per scatter read (below Linux's ``IOV_MAX`` of 1024)."""

_Job = Callable[[], None]


class LandingPool:
    """A few threads that read file ranges into buffers the engine thread hands them, and hash them.

    NOTE: the workers never call MLX. The engine thread allocates and
    evaluates each destination array and takes its ``memoryview``; a worker
    only fills that memory (``preadv``) and hashes it (xxh3), both of which
    release the GIL. A worker drops every reference to a job before it
    reports the job done, so the last reference to a view (and so to its
    array) is always the engine thread's.
    """

    def __init__(self, threads: int = 2, *, name: str = "kvtier-land") -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._jobs: queue.SimpleQueue[tuple[_Job, queue.SimpleQueue[BaseException | None]] | None]
        self._jobs = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        self._closed = False
        self._lock = threading.Lock()
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, done = item
            del item
            error: BaseException | None = None
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - NOTE: handed to the engine thread as is.
                error = exc
            del job
            done.put(error)
            del error, done

    def submit(self, job: _Job, done: queue.SimpleQueue[BaseException | None]) -> None:
        """Queue ``job``; its outcome (``None`` or the exception) is put on ``done``.

        ``RuntimeError`` once the pool is closed. NOTE: under the lock that
        :meth:`close` takes, so no job is queued behind the workers' stop
        marks (it would never run, and its waiter would wait forever).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("landing pool is closed")
            self._jobs.put((job, done))

    def post(self, job: _Job) -> None:
        """Queue ``job`` with nobody waiting for it (closing files); its outcome is dropped.

        A job posted this way must handle its own errors.
        """
        self.submit(job, queue.SimpleQueue())

    def close(self) -> None:
        """Stop the workers once the queued jobs ran (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
        for t in self._threads:
            t.join()


def _destinations(
    layers: Sequence[LayerRecord], step: int
) -> Iterator[tuple[TensorRecord, int | None]]:
    """Each tensor in file order with its landing capacity (token axis), ``None``: exact shape."""
    for layer in layers:
        capacity = -(-(layer.offset + 1) // step) * step
        for t in layer.tensors:
            yield t, capacity if layer.kind in ("kv", "quantized") else None
        yield from _destinations(layer.children, step)


def _rows(view: memoryview, rec: TensorRecord, capacity: int | None) -> list[memoryview]:
    """Where the file's bytes of ``rec`` go in its destination ``view``, in file order.

    A ``[B, H, T, ...]`` tensor landing in a ``[B, H, C, ...]`` buffer (C >=
    T, slack after each row) is ``B * H`` rows of ``T * ...`` elements, one
    every ``C * ...`` elements; without slack it is one contiguous range.
    """
    if capacity is None or capacity == rec.shape[2] or rec.nbytes == 0:
        return [view[: rec.nbytes]] if rec.nbytes else []
    rows = rec.shape[0] * rec.shape[1]
    row = rec.nbytes // rows
    stride = row // rec.shape[2] * capacity
    return [view[i * stride : i * stride + row] for i in range(rows)]


def _fill(
    port: FilePort, fd: int, index: int, rec: TensorRecord, rows: list[memoryview], verify: bool
) -> None:
    """Read ``rec``'s file range into ``rows`` (scatter reads of about 4 MiB), hashing as it goes."""
    hasher = xxhash.xxh3_64() if verify else None
    pieces: list[memoryview] = []
    for r in rows:
        pieces.extend(r[i : i + _READ_CHUNK] for i in range(0, len(r), _READ_CHUNK))
    offset = rec.offset
    try:
        start = 0
        while start < len(pieces):
            end, size = start, 0
            while end < len(pieces) and end - start < _MAX_IOV_PER_READ and size < _READ_CHUNK:
                size += len(pieces[end])
                end += 1
            batch = pieces[start:end]
            port.preadv_into(fd, batch, offset)
            if hasher is not None:
                for b in batch:
                    hasher.update(b)
            offset += size
            start = end
    except ShortRead as exc:
        raise CacheFileCorrupt(f"file truncated inside tensor {index}") from exc
    if hasher is not None and hasher.intdigest() != rec.hash:
        raise CacheFileCorrupt(f"tensor {index} ({rec.name}) hash mismatch")


def _fill_behind(
    entry: OpenEntry,
    port: FilePort,
    fd: int,
    index: int,
    rec: TensorRecord,
    rows: list[memoryview],
    verify: bool,
) -> None:
    """:func:`_fill` once the reader's pass went past tensor ``index`` (at once when it ended)."""
    entry.wait_passed(index)
    _fill(port, fd, index, rec, rows, verify)


FILL_STREAMS_MAX: Final = 8
"""The most fill streams the product chooses by itself."""

FILL_STREAMS_ENV: Final = "KVTIER_LANDING_FILL_STREAMS"
"""Environment override of the fill-stream count (an integer from 1 to 8)."""

LANDING_THREADS_ENV: Final = "KVTIER_LANDING_THREADS"
"""Environment override of the landing-thread count (an integer from 1 to 16)."""


def _override(value: str | None, most: int) -> int | None:
    if value is not None and value.strip().isdigit() and 1 <= int(value) <= most:
        return int(value)
    return None


def fill_stream_count(cpus: int, override: str | None = None) -> int:
    """How many CPU streams a landing allocates (zero-fills) its arrays on.

    One per 2 usable CPUs, at least 2 and at most :data:`FILL_STREAMS_MAX`;
    1 on a single CPU. NOTE: measured with ``tools/bench/cold_tier_io.py
    --restore-only`` and probes of 1-8 streams (2026-12-01): on the 16-core
    H200 host the fill of fresh memory bounds a restore from the page cache;
    the fill alone ran 2.2 / 3.7 / 5.1 / 6.6 / 7.6 GB/s on 1 / 2 / 4 / 6 /
    8 streams, and 8 streams with 4 landing threads restored 1 GiB at 6.8
    GB/s, 0.98 of ``dd`` (4 streams: 4.9), while a restore from the disk
    stayed at the disk's speed. On the 2-core VM two streams restored
    1.06-1.26x (cold) and 1.19-1.34x (warm) faster than one over three
    runs, once the reader's pass stopped hashing (before, 0.92-1.12x).
    ``override`` (the :data:`FILL_STREAMS_ENV` value) wins when it is an
    integer from 1 to 8; any other value is ignored.
    """
    chosen = _override(override, 8)
    if chosen is not None:
        return chosen
    if cpus < 2:
        return 1
    return min(FILL_STREAMS_MAX, max(2, cpus // 2))


def landing_thread_count(cpus: int, override: str | None = None) -> int:
    """How many landing threads (reads and hashes of a landing) a restore uses.

    2, or 4 from 8 usable CPUs. NOTE: on the 16-core H200 host, with 8 fill
    streams, 2 / 4 / 6 landing threads restored 1 GiB from the page cache
    at 5.5 / 6.8 / 6.7 GB/s; with 4 fill streams the count did not matter
    (4.8-4.9). ``override`` (the :data:`LANDING_THREADS_ENV` value) wins
    when it is an integer from 1 to 16.
    """
    chosen = _override(override, 16)
    if chosen is not None:
        return chosen
    return 4 if cpus >= 8 else 2


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return len(affinity(0))
    return os.cpu_count() or 1


_FILL_STREAMS = threading.local()


def default_fill_streams() -> list[Any]:
    """The calling thread's fill streams for :func:`land_entry` (engine thread).

    NOTE: made once per thread and kept: each extra MLX CPU stream owns a
    worker thread for the life of the process, and a stream is used only by
    the thread that made it.
    """
    streams: list[Any] | None = getattr(_FILL_STREAMS, "streams", None)
    if streams is None:
        count = fill_stream_count(usable_cpus(), env_text(FILL_STREAMS_ENV))
        streams = [mx.cpu, *(mx.new_stream(mx.cpu) for _ in range(count - 1))]
        _FILL_STREAMS.streams = streams
    return streams


def _allocate(
    dests: Sequence[tuple[TensorRecord, int | None]], streams: Sequence[Any]
) -> list[Any]:
    """Allocate and evaluate the destinations of ``dests``, the i-th on ``streams[i]`` (engine thread).

    NOTE: every stream is a CPU stream, so the pages the landing writes are
    host pages; on CUDA (managed memory) a GPU-side fill would migrate them
    to the device, and the writes back, page by page. MLX zero-fills each
    new array on its stream's thread inside this ``mx.eval``: that fill is
    the first touch of the array's fresh pages (the landing's floor on a
    CPU device), before Python can see the array's address. So no
    huge-page advice (``madvise``) can reach an array's pages before they
    are faulted in 4 KiB at a time; glibc's process-wide
    ``glibc.malloc.hugetlb=1`` tunable can, and lost on the VM once freed
    memory had gone back to the host (docs/benchmarks/cold_tier.md,
    "Landing memory").
    """
    group = [
        mx.zeros(
            rec.shape if capacity is None else (*rec.shape[:2], capacity, *rec.shape[3:]),
            dtype=_DTYPES[rec.dtype],
            stream=stream,
        )
        for (rec, capacity), stream in zip(dests, streams, strict=False)
    ]
    mx.eval(*group)
    return group


def land_entry(
    entry: OpenEntry,
    *,
    step: int = 256,
    pool: LandingPool | None = None,
    streams: Sequence[Any] | None = None,
) -> list[Any]:
    """Build the cache objects by reading the file straight into MLX memory (engine thread).

    Each destination array is allocated at its final size (plain and
    quantized KV with capacity ``ceil((offset + 1) / step) * step`` so the
    next decode step writes in place; everything else exactly) and
    evaluated here; then the file's bytes are read into it, row by row for a
    buffer with slack, and hashed again in the same pass when the entry was
    opened with ``verify`` (the bytes checked are the bytes the model will
    read). With ``pool`` the reads and hashes of a tensor run on its workers
    while this thread allocates the next tensor; without, inline.

    When the entry's pass (:meth:`OpenEntry.pass_over`) is still running,
    each tensor is read once the pass went past it (with ``pool``, its
    worker waits; without, this thread), so the landing overlaps the pass.

    ``streams``: CPU streams to allocate the arrays on, the next
    ``len(streams)`` tensors at once, one per stream, each zero-filled
    (page-faulted) on its stream's thread; made on the calling thread, the
    only one that may use them. Default: :func:`default_fill_streams` (one
    per 2 usable CPUs, from 2 up to 8; :func:`fill_stream_count` says why).

    Peak memory is the restored entry itself: no host copy. The entry stays
    open (its holder closes it). Raises :class:`CacheFileCorrupt` when the
    file changed, is truncated, or a hash disagrees, :class:`PassFailed`
    when the pass failed or was cancelled; no array escapes then.
    """
    if step < 1:
        raise ValueError("step must be positive")
    header = entry.header
    port, fd, verify = entry.port, entry.fileno(), entry.verify
    dests = list(_destinations(header.layers, step))
    arrays: list[Any] = []
    views: list[memoryview] = []
    done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
    checked: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
    checking = False
    pending = 0
    errors: list[BaseException] = []
    try:
        # NOTE: with a pool even this check runs on a worker (no file call on
        # the engine thread); its failure fails the landing like a bad hash.
        check = functools.partial(_check_same, port, fd, header)
        if pool is None:
            check()
        else:
            pool.submit(check, checked)
            checking = True
        fill = list(streams) if streams else default_fill_streams()
        ready: list[Any] = []
        for index, (rec, capacity) in enumerate(dests):
            if not ready:
                ready = _allocate(dests[index : index + len(fill)], fill)
            a = ready.pop(0)
            arrays.append(a)
            if rec.nbytes == 0 and not verify and entry.passed:
                # NOTE: while the pass runs, even an empty tensor's job waits
                # for it: the landing ends after the pass, never cancels it.
                continue
            view = None if a.nbytes == 0 else _writable_view(a)
            if view is not None:
                rows = _rows(view, rec, capacity)
            elif a.nbytes == 0:
                rows = []
            else:
                # NOTE: a backend whose arrays lend no writable host buffer:
                # this tensor is read into host bytes laid out at its final
                # capacity (slack left zero) and copied ONCE into an MLX
                # array of that shape, before the next tensor: at most one
                # tensor's host bytes exist at a time, and no exact-size
                # copy is padded by concatenation (which held the tensor
                # twice, plus every other tensor's host bytes).
                arrays[-1] = None
                del a
                arrays[-1] = _land_through_host(entry, pool, index, rec, capacity)
                continue
            if view is not None:
                views.append(view)
            job = functools.partial(_fill_behind, entry, port, fd, index, rec, rows, verify)
            del rows
            if pool is None:
                job()
            else:
                pool.submit(job, done)
                pending += 1
            del job
            while pending:
                # NOTE: a failed job ends the landing early (no more
                # allocations for arrays that will be thrown away).
                try:
                    outcome = done.get_nowait()
                except queue.Empty:
                    break
                pending -= 1
                if outcome is not None:
                    errors.append(outcome)
            if errors:
                break
    finally:
        # NOTE: every submitted job is waited for, even on failure, so no
        # worker still writes into (or references) memory this thread drops.
        while pending:
            outcome = done.get()
            pending -= 1
            if outcome is not None:
                errors.append(outcome)
        if checking:
            # NOTE: a changed file is reported as such, before whatever a
            # read of it ran into meanwhile (a short read, a bad hash).
            outcome = checked.get()
            if outcome is not None:
                errors.insert(0, outcome)
    if errors:
        raise errors[0]
    del views
    it = iter(arrays)
    caches = [_build(layer, it, step) for layer in header.layers]
    return caches


def _land_through_host(
    entry: OpenEntry, pool: LandingPool | None, index: int, rec: TensorRecord, capacity: int | None
) -> Any:
    """Tensor ``index`` read into host bytes at its landing shape, then one evaluated MLX copy.

    The fallback for arrays that lend no writable buffer (engine thread).
    NOTE: with ``pool`` the read runs on a worker (no file call on this
    thread) and this thread waits for it; the host bytes are dropped as soon
    as MLX owns its copy, so the landing's extra memory is one tensor.
    """
    dtype = _DTYPES[rec.dtype]
    shape = rec.shape if capacity is None else (*rec.shape[:2], capacity, *rec.shape[3:])
    host = bytearray(math.prod(shape) * dtype.size)
    view = memoryview(host)
    rows = _rows(view, rec, capacity)
    job = functools.partial(_fill_behind, entry, entry.port, entry.fileno(), index, rec, rows,
                            entry.verify)
    try:
        if pool is None:
            job()
        else:
            done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
            pool.submit(job, done)
            outcome = done.get()
            if outcome is not None:
                raise outcome
    finally:
        # NOTE: the job holds row views of ``host``; dropped here, so the
        # host bytes go as soon as the copy below exists.
        del job, rows
        view.release()
    src: Any = memoryview(host)
    landed = mx.array(src).view(dtype).reshape(shape) if host else mx.zeros(shape, dtype=dtype)
    mx.eval(landed)
    del host
    return landed


def _writable_view(a: Any) -> memoryview | None:
    """A writable, contiguous byte view of evaluated array ``a`` (``None``: it lends none)."""
    buffer: Any = a
    try:
        view = memoryview(buffer)
    except (TypeError, ValueError, BufferError):
        return None
    if view.readonly or not view.c_contiguous or view.nbytes != a.nbytes:
        view.release()
        return None
    return view.cast("B")


def _check_same(port: FilePort, fd: int, header: KvFileHeader) -> None:
    """The open file is still the one ``header`` came from (size and header hash)."""
    if port.fstat(fd).size != header.file_size:
        raise CacheFileCorrupt("file size changed since its header was read")
    _, header_hash, _ = _read_preamble(port, fd, header.file_size)
    if header_hash != header.header_hash:
        raise CacheFileCorrupt("file changed since its header was read")
