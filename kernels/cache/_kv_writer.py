"""Writing a KV file: planning an entry on the engine thread, writing it on a worker thread.

:func:`plan_entry` records metadata, offsets and size (engine thread);
:func:`tensor_bytes` reads one tensor back to host at a time;
:class:`KvFileWriter` writes a temp file with positional writes, patches the
header last, fsyncs, renames and fsyncs the directory (worker thread).
The format is described in ``_kv_format`` and ``docs/file-format.md``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NoReturn

import mlx.core as mx
import numpy as np
import xxhash

from kernels._env import env_switch, env_text
from kernels._memory import on_cuda

from ._file_port import BytesLike, FilePort
from ._kv_format import (
    _DTYPE_SIZE,
    _DTYPES,
    _HASH_HEX_WIDTH,
    _LAYER_KEYS,
    _MAMBA_CLS,
    _MAX_DEPTH,
    _MAX_INT,
    _MAX_LAYERS,
    _MAX_SLOTS,
    _MAX_STR,
    _MAX_TENSORS,
    _MAX_TOKEN_ID,
    _MAX_TOKENS,
    _MIN_OFFSET_ATTR,
    _PREAMBLE,
    _STAMP_ATTR,
    ALIGNMENT,
    CHECKPOINT_FORMAT_VERSION,
    FORMAT_VERSION,
    MAGIC,
    PREAMBLE_SIZE,
    TEMP_SUFFIX,
    CacheFileCorrupt,
    CacheFileWriteError,
    CacheKindUnsupported,
    EntryPlan,
    GenerationCheckpoint,
    KvFileHeader,
    LayerRecord,
    TensorRecord,
    _mlc,
)
from ._kv_header import (
    _check_layer_tree,
    _offsets_match,
)

__all__ = [
    "KvFileWriter",
    "WriterState",
    "host_reads_migrate",
    "plan_entry",
    "release_host_copies",
    "tensor_bytes",
    "tensors_bytes",
]


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


_HOST_READ_COPY: bool | None = None
"""Test hook: force (True) or skip (False) the device-side copy; None: decide by the device."""

HOST_READ_ENV = "KVTIER_CUDA_HOST_READ"
"""Diagnostic: ``direct`` reads each tensor's own contiguous array where host reads migrate
(no one-buffer device-side copy per group); ``host`` makes the one-buffer copy and then copies
its bytes into host memory on the engine thread, so the SSD writer never touches device-managed
pages; unset or ``flat``: the one-buffer copy, read by the writer."""

RELEASE_CACHE_ENV = "KVTIER_CUDA_RELEASE_CACHE"
"""Switch (default off): on empties MLX's buffer cache after host-read views are dropped on CUDA."""

_copy_streams = threading.local()
"""The copy stream of each thread that made host copies (MLX streams belong to the thread that made them)."""


def host_reads_migrate() -> bool:
    """Whether reading an MLX array's memory on the host moves it off the device.

    MLX's CUDA backend keeps a kernel's output in device memory; the first
    host read of an array moves it into a fresh CUDA managed buffer (a
    synchronous copy) whose pages the host's reads then fault over, and the
    next kernel that uses the array faults them back. A prompt-cache entry
    read for write-behind would then be slow on its next hit (a 4.4k-token
    8B-shape prefix is ~0.6 GB). CPU and Metal share one memory: nothing
    moves there.
    """
    if _HOST_READ_COPY is not None:
        return _HOST_READ_COPY
    # NOTE: on_cuda, not CUDA's presence: with the CPU chosen beside a GPU
    # (--device cpu) arrays live in host memory.
    return on_cuda()


def release_host_copies() -> None:
    """Empty MLX's buffer cache after host-read views were dropped, where switched on (engine thread).

    On MLX's CUDA backend a host read (the ``memoryview`` that
    :func:`tensors_bytes` takes) moves the device-side copy into a fresh
    CUDA managed buffer; freed, it goes to MLX's buffer cache, which may
    hand it to a later kernel's temporaries, whose pages then fault back
    to the device. ``KVTIER_CUDA_RELEASE_CACHE=on`` clears the cache after
    every such drop to rule that out.
    NOTE: off by default, by measurement (H200, 8B shape, 20 sequential
    distinct requests with the SSD tier on vs off, three pairs of servers
    each way): with the cache emptied after each write-behind read, decode
    ran 0.68x the tier-off rate in every pair and TTFT p99 1.24x; kept,
    decode 0.95x and TTFT p99 1.08x. Emptying it also drops every device
    buffer the batch lane's prefill and decode steps keep for reuse
    (``KVTIER_BATCH_PREFILL_CLEAR``), which the following steps then
    allocate afresh, and the ``finish`` turn that emptied it held the
    engine thread ~18 ms each time.
    """
    if host_reads_migrate() and env_switch(RELEASE_CACHE_ENV, default=False):
        mx.clear_cache()


def _thread_copy_stream() -> Any:
    """The calling thread's copy stream (made on first use).

    NOTE: one stream per thread: MLX refuses a stream on a thread other than
    its maker's, and an engine thread may be replaced (a new Engine in the
    same process).
    """
    stream = getattr(_copy_streams, "stream", None)
    if stream is None:
        stream = _copy_streams.stream = mx.new_stream(mx.default_device())
    return stream


def tensor_bytes(plan: EntryPlan, i: int) -> memoryview:
    """Read tensor ``i`` of ``plan`` back to host memory (engine thread).

    Returns a byte view of a contiguous copy (or the array itself when
    already contiguous; where host reads migrate, always a device-side
    copy); the view keeps that array alive until dropped, so at most one
    tensor's transient exists if callers drop each view after writing it.
    """
    return tensors_bytes(plan, [i])[0]


def tensors_bytes(
    plan: EntryPlan, indices: Sequence[int], tails: Mapping[int, int] | None = None
) -> list[memoryview]:
    """Read the tensors ``indices`` of ``plan`` back to host memory, evaluated together (engine thread).

    Each view is what :func:`tensor_bytes` returns for its index. ``tails``
    maps an index to a token count: that tensor's view holds only the
    tokens after it (its axis -2 from there on; a checkpoint delta,
    ``kernels.cache._kv_delta``).
    NOTE: one evaluation for all of them: evaluating per tensor is one
    device round trip per tensor (64 for an 8B-shape entry, ~20 ms on the
    H200's CUDA backend, inside an engine turn).
    """
    arrays, sizes = _tail_arrays(plan, indices, tails or {})
    # NOTE: KVTIER_CUDA_HOST_READ=direct is a diagnostic (which part of the
    # SSD tier's host reads slows decoding on CUDA): it reads the entry's own
    # arrays, whose pages then move to the host.
    mode = (env_text(HOST_READ_ENV) or "flat").lower()
    if host_reads_migrate() and mode != "direct":
        return _flat_host_views(indices, arrays, sizes, host_copy=mode == "host")
    # NOTE: when ``a`` is already contiguous, ``x`` shares its buffer. That
    # is safe while a worker reads the view: MLX updates a buffer in place
    # only when nothing else references it, and the view keeps ``x`` alive.
    copies: list[Any] = [None if n == 0 else mx.contiguous(a) for n, a in zip(sizes, arrays, strict=True)]
    mx.eval([x for x in copies if x is not None])
    views: list[memoryview] = []
    for i, n, x in zip(indices, sizes, copies, strict=True):
        if x is None:
            views.append(memoryview(b""))
            continue
        view = memoryview(x).cast("B")
        if len(view) != n:
            raise RuntimeError(f"tensor {i} read back {len(view)} bytes, planned {n}")
        views.append(view)
    return views


def _tail_arrays(
    plan: EntryPlan, indices: Sequence[int], tails: Mapping[int, int]
) -> tuple[list[Any], list[int]]:
    """The arrays :func:`tensors_bytes` reads for ``indices`` (each cut to its tail) and their bytes."""
    arrays: list[Any] = []
    sizes: list[int] = []
    for i in indices:
        a = plan._arrays[i]
        if a is None:
            raise RuntimeError("plan arrays were released")
        rec = plan.tensors[i]
        start = tails.get(i)
        if start is not None:
            if len(rec.shape) < 2 or not 0 <= start <= rec.shape[-2]:
                raise ValueError(f"tensor {i} has no tokens after {start}")
            a = a[..., start:, :]
            sizes.append(rec.nbytes // rec.shape[-2] * (rec.shape[-2] - start) if rec.shape[-2] else 0)
        else:
            sizes.append(rec.nbytes)
        arrays.append(a)
    return arrays, sizes


@dataclass(frozen=True, slots=True)
class HostRead:
    """A plan's tensor views read ahead of its file's views turn: what :func:`tensors_bytes` gives for ``tails``.

    ``views[i]`` is tensor ``i``'s bytes (its tail after ``tails[i]`` tokens
    where ``tails`` names it); ``nbytes`` their sum. The views keep their
    one read-back buffer alive until the last is dropped.
    """

    tails: Mapping[int, int]
    views: tuple[memoryview, ...]
    nbytes: int


READ_AHEAD_ENV = "KVTIER_CHECKPOINT_READ_AHEAD"
"""Switch (default on; only where host reads migrate, CUDA): the batch lane reads a step's checkpoints
back in one read-back (:func:`read_ahead`) instead of one views turn's read-back each.
NOTE: on since the one-concatenation gather (:func:`_flat_host_views`): on an H100 at 8 streams,
on/off 1.13 by medians (paired 1.175, 1.03, 1.088) against 0.948 for per-turn read-backs in the
same run (docs/benchmarks.md, 2026-12-06); before that gather it measured 0.941."""


def read_ahead_enabled() -> bool:
    """Whether the batch lane reads a step's checkpoints ahead: host reads migrate and :data:`READ_AHEAD_ENV` is not off."""
    return host_reads_migrate() and env_switch(READ_AHEAD_ENV, default=True)


def read_ahead(plans: Sequence[tuple[EntryPlan, Mapping[int, int]]]) -> list[HostRead]:
    """Every tensor of several plans read back to host memory in ONE buffer (engine thread).

    Each result holds exactly the bytes :func:`tensors_bytes` would give for
    its plan and tails (same arrays, same cuts, row-major). Where host reads
    migrate (CUDA) a read-back pays one gather into one device buffer and one
    synchronous copy to managed memory; the rows of a batch step reach their
    checkpoints together, so one read-back serves them all and their views
    turns read nothing (on an H100 at 8 streams: 1.13 x checkpoints off,
    against 0.95 x for a read-back per views turn). Elsewhere each plan's
    views are taken as :func:`tensors_bytes` takes them (no copy to save).
    """
    if not plans:
        return []
    # NOTE: the diagnostic read modes (HOST_READ_ENV) keep their per-plan reads.
    if not host_reads_migrate() or (env_text(HOST_READ_ENV) or "flat").lower() != "flat":
        return [_host_read(tails, tensors_bytes(plan, range(len(plan.tensors)), tails))
                for plan, tails in plans]
    arrays: list[Any] = []
    sizes: list[int] = []
    counts: list[int] = []
    for plan, tails in plans:
        a, n = _tail_arrays(plan, range(len(plan.tensors)), tails)
        arrays.extend(a)
        sizes.extend(n)
        counts.append(len(a))
    views = _flat_host_views(range(len(arrays)), arrays, sizes)
    out: list[HostRead] = []
    at = 0
    for (_, tails), count in zip(plans, counts, strict=True):
        out.append(_host_read(tails, views[at:at + count]))
        at += count
    return out


def read_fits(plan: EntryPlan, read: HostRead, tails: Mapping[int, int] | None) -> bool:
    """Whether ``read`` holds what :func:`tensors_bytes` would read for ``plan`` with ``tails``.

    The same cuts (``tails``, ``{}`` for none) and, tensor by tensor, the
    planned byte counts: a read made for another base, or for another
    cache, never stands in for this one.
    """
    if dict(read.tails) != dict(tails or {}) or len(read.views) != len(plan.tensors):
        return False
    for i, (rec, view) in enumerate(zip(plan.tensors, read.views, strict=True)):
        start = read.tails.get(i)
        if start is None:
            want = rec.nbytes
        elif len(rec.shape) < 2 or not 0 <= start <= rec.shape[-2]:
            return False
        else:
            want = rec.nbytes // rec.shape[-2] * (rec.shape[-2] - start) if rec.shape[-2] else 0
        if len(view) != want:
            return False
    return True


def _host_read(tails: Mapping[int, int], views: Sequence[memoryview]) -> HostRead:
    return HostRead(tails=dict(tails), views=tuple(views), nbytes=sum(len(v) for v in views))


def _stackable(arrays: Sequence[Any]) -> bool:
    """Whether ``arrays`` share a dtype and every axis past the first (one concatenation on axis 0 holds them)."""
    first = arrays[0]
    if first.ndim < 1:
        return False
    return all(a.dtype == first.dtype and a.ndim == first.ndim and a.shape[1:] == first.shape[1:]
               for a in arrays)


def _flat_host_views(
    indices: Sequence[int], arrays: Sequence[Any], sizes: Sequence[int], *, host_copy: bool = False
) -> list[memoryview]:
    """Where host reads migrate: every tensor's bytes copied into one device buffer (a few past :data:`FLAT_GROUP_BYTES`), one view each.

    ``sizes``: each tensor's planned bytes (what its array holds).
    NOTE: on MLX's CUDA backend each array's first host read allocates a
    managed buffer and copies into it synchronously, holding the GIL; one
    buffer per call makes that one allocation and one copy per group (a
    checkpoint, a spill's 64 MiB group) instead of one per tensor. The copy
    runs on the thread's own copy stream, so it does not queue behind the
    decode step in flight on the default one, and never
    touches the entry's own buffers. Row-major bytes of each tensor, as
    :func:`mx.contiguous` would lay them out.
    """
    stream = _thread_copy_stream()
    if len(sizes) != len(arrays):
        raise ValueError(f"{len(arrays)} arrays, {len(sizes)} sizes")
    groups = _byte_groups(sizes)
    if not groups:
        return [memoryview(b"") for _ in indices]
    buffers = [_one_buffer([arrays[i] for i in group], stream) for group in groups]
    if host_copy:
        # NOTE: the diagnostic ``host`` read (HOST_READ_ENV): every page of the
        # managed buffer is read here, at once, on the engine thread; the
        # writer then reads plain host memory. Tests whether the writer's
        # page faults over device-managed memory slow decoding on CUDA.
        buffers = [memoryview(bytearray(b)) for b in buffers]
    views = [memoryview(b"") for _ in sizes]
    for group, whole in zip(groups, buffers, strict=True):
        at = 0
        for i in group:
            views[i] = whole[at:at + sizes[i]]
            at += sizes[i]
        if at != len(whole):
            raise RuntimeError(f"tensors {list(indices)} read back {len(whole)} bytes, planned {at}")
    return views


FLAT_GROUP_BYTES = 1 << 30
"""The most bytes :func:`_flat_host_views` copies into one device buffer.

NOTE: MLX's shape dimensions are 32-bit, so one flat ``uint8`` buffer holds
at most 2**31 - 1 bytes: 64 rows of the 8B shape reaching their checkpoints
in one step read back 2.19 GB and the one concatenation failed (the step's
read-ahead was lost). Past this bound the tensors go to more buffers, each
one allocation and one copy; a lone tensor larger than the bound keeps a
buffer of its own."""


def _byte_groups(sizes: Sequence[int]) -> list[list[int]]:
    """The indices of the non-empty sizes cut, in order, into runs of at most :data:`FLAT_GROUP_BYTES` bytes."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if not n:
            continue
        if not groups or total + n > FLAT_GROUP_BYTES:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def _one_buffer(kept: Sequence[Any], stream: Any) -> memoryview:
    """Every array's row-major bytes copied, in turn, into one new device buffer, read as host bytes."""
    flat: Any
    if len(kept) > 1 and _stackable(kept):
        # NOTE: tensors of one dtype and one shape past the first axis (a
        # checkpoint's K and V slices, layer after layer): one concatenation
        # along the first axis lays each tensor's row-major bytes out in turn,
        # as the per-tensor path below does, with one strided copy per tensor
        # and no intermediate buffer (that path copies a strided slice twice:
        # into its own flat buffer, then into the concatenation).
        whole_t = mx.concatenate(list(kept), axis=0, stream=stream)
        flat = mx.flatten(mx.view(whole_t, mx.uint8, stream=stream), stream=stream)
    else:
        parts = [mx.flatten(mx.view(a, mx.uint8, stream=stream), stream=stream) for a in kept]
        # NOTE: a concatenation always writes a new buffer; a lone part may be a
        # view of the entry's own buffer, so it is copied (``x * 1`` is exact on bytes).
        flat = (mx.concatenate(parts, stream=stream) if len(parts) > 1
                else mx.multiply(parts[0], mx.array(1, dtype=mx.uint8), stream=stream))
    mx.eval(flat)
    return memoryview(flat).cast("B")


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
