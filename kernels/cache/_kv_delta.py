"""Checkpoint deltas: a new checkpoint file made from the previous one plus the tokens since.

A generation checkpoint is a whole KV file: every ``N`` emitted tokens the
row's caches are read back to host memory and written again, the prompt's
and the earlier tokens' keys and values included. Where reading device
memory on the host is costly (CUDA: the read-back copies into managed
memory, synchronously, on the engine thread), that read grows with the
context: ~140 MB and ~8 ms of engine turn per checkpoint at an 8B shape
with 1,100 tokens, on the H200 (docs/benchmarks.md, #23).

An attention cache only appends: the keys and values of the tokens the
previous checkpoint covered are the same bytes now. So when the previous
file of the same answer is on disk, only each attention tensor's new tokens
(its axis -2 from the previous file's length on) are read back, and the
writer composes each tensor from the previous file's bytes (read and
hash-checked on its worker thread) and that tail. The new file is byte for
byte the file a whole read-back would have written (the writer hashes what
it writes, as always); a previous file that fails its checks makes the
write fail (a lost restart point, never a wrong one).

Only ``kv`` and ``quantized`` layers take part (a rotating or recurrent
cache rewrites its state); every other tensor is read whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kernels._env import OFF_WORDS, env_text

from ._file_port import BytesLike
from ._kv_format import _DTYPE_SIZE, KvFileHeader, LayerRecord, TensorRecord
from ._kv_writer import host_reads_migrate

__all__ = ["DELTA_ENV", "compose_tail", "delta_enabled", "tail_starts"]

DELTA_ENV = "KVTIER_CHECKPOINT_DELTA"
"""Switch: checkpoints read back only the tokens since the previous file of their answer.
Unset: on where host reads of device memory migrate it (CUDA), off elsewhere (a zero-copy
read there costs less than reading the previous file)."""

_APPEND_ONLY = ("kv", "quantized")


def delta_enabled() -> bool:
    """Whether checkpoints are written as deltas (``KVTIER_CHECKPOINT_DELTA``; unset: CUDA only)."""
    value = env_text(DELTA_ENV)
    if value is None:
        return host_reads_migrate()
    return value.lower() not in OFF_WORDS


def _pairs(
    new: Sequence[LayerRecord], old: Sequence[LayerRecord]
) -> list[tuple[LayerRecord, LayerRecord]] | None:
    """Every layer of ``new`` beside its twin in ``old``, depth first (``None``: the trees differ)."""
    if len(new) != len(old):
        return None
    out: list[tuple[LayerRecord, LayerRecord]] = []
    for a, b in zip(new, old, strict=True):
        if a.kind != b.kind or len(a.tensors) != len(b.tensors):
            return None
        out.append((a, b))
        children = _pairs(a.children, b.children)
        if children is None:
            return None
        out.extend(children)
    return out


def _same_but_tokens(a: TensorRecord, b: TensorRecord, n_new: int, n_old: int) -> bool:
    return (
        a.name == b.name
        and a.dtype == b.dtype
        and len(a.shape) == len(b.shape) >= 2
        and a.shape[:-2] == b.shape[:-2]
        and a.shape[-1] == b.shape[-1]
        and a.shape[-2] == n_new
        and b.shape[-2] == n_old
    )


def tail_starts(new: KvFileHeader, old: KvFileHeader) -> dict[int, int]:
    """Tensor index (in ``new``'s file order) -> tokens ``old`` already holds, for every tensor a delta covers.

    Empty when ``old`` cannot be the base of ``new``: another model,
    namespace or layer structure, or tokens that are not a prefix of
    ``new``'s. A layer takes part when it is an attention layer
    (``kv``/``quantized``) of the same settings in both, holding all of
    its file's tokens in each; its tensors must match but for axis -2.
    """
    if (
        old.fingerprint != new.fingerprint
        or old.namespace != new.namespace
        or old.model_id != new.model_id
        or len(old.tokens) > len(new.tokens)
        or new.tokens[: len(old.tokens)] != old.tokens
    ):
        return {}
    pairs = _pairs(new.layers, old.layers)
    if pairs is None:
        return {}
    index = {id(t): i for i, t in enumerate(new.tensors)}
    starts: dict[int, int] = {}
    for a, b in pairs:
        if a.kind not in _APPEND_ONLY:
            continue
        if (a.bits, a.group_size, a.head_dim) != (b.bits, b.group_size, b.head_dim):
            return {}
        # NOTE: each layer must hold exactly its file's tokens: then the previous file's keys
        # and values are those of the token prefix checked above.
        if a.offset != len(new.tokens) or b.offset != len(old.tokens):
            return {}
        for ta, tb in zip(a.tensors, b.tensors, strict=True):
            if not _same_but_tokens(ta, tb, a.offset, b.offset):
                return {}
            starts[index[id(ta)]] = b.offset
    return starts


def compose_tail(prev: BytesLike, tail: BytesLike, rec: TensorRecord, start: int) -> memoryview:
    """Tensor ``rec``'s bytes from its first ``start`` tokens (``prev``) and the rest (``tail``).

    Both are row-major with tokens on axis -2, as the file stores them. Raises
    ``ValueError`` when either has the wrong length.
    """
    if len(rec.shape) < 2 or not 0 <= start <= rec.shape[-2]:
        raise ValueError(f"tensor {rec.name!r} has no tokens after {start}")
    outer = math.prod(rec.shape[:-2])
    row = rec.shape[-1] * _DTYPE_SIZE[rec.dtype]
    head, rest = start * row, (rec.shape[-2] - start) * row
    a = np.frombuffer(prev, dtype=np.uint8)
    b = np.frombuffer(tail, dtype=np.uint8)
    if a.size != outer * head or b.size != outer * rest:
        raise ValueError(f"tensor {rec.name!r}: {a.size} + {b.size} bytes for {rec.nbytes}")
    out = np.empty((outer, head + rest), dtype=np.uint8)
    out[:, :head] = a.reshape(outer, head)
    out[:, head:] = b.reshape(outer, rest)
    return out.reshape(-1).data.cast("B")
