"""The cold tier's file format: one prefix entry (caches + tokens) per file.

This module holds the format's constants, limits, errors and records. The
codec is split by concern: ``_kv_writer`` (planning and writing),
``_kv_header`` (reading and validating the preamble and header),
``_kv_reader`` (tensor reads and the reader's pass), ``_kv_restore``
(host bytes to caches) and ``_kv_landing`` (file bytes straight into MLX
memory); ``kernels.cache`` re-exports their public names.

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

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import mlx.core as mx
from mlx_lm.models import cache as _mlc_module

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
    "LayerRecord",
    "TensorRecord",
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
