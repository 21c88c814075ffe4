"""Transitioning batch rows: full-attention rows that start plain and convert to quantized KV on their own.

Under a quantizing KV scheme (``--kv-quant 4|8|config``) the serial lane
keeps a request's full-attention KV in the model's dtype until its first
forward that leaves the layer holding at least ``scheme.start`` tokens, then
converts it to mlx-lm's ``QuantizedKVCache`` (``kernels.cache.convert_caches``)
and attends with quantized attention from then on. A batch holds rows at
different points of that history, so :class:`TransitioningBatchKVCache`
(one per full-attention layer the scheme quantizes) tracks the precision of
each row:

- **Each row converts independently**, after the forward in which its
  committed length (its real tokens, never padding) reaches the threshold:
  the forward that crosses it attends plain, the next one quantized, as on
  the serial lane. So a row alone in a batch has the serial lane's precision
  history, and its quantized bytes are the serial lane's
  (``mx.quantize`` works per token and group along head_dim, so quantizing a
  row's history at conversion equals quantizing each token as it came).
- **Mixed batch** (some rows converted, some plain): the attention view is
  dense and left-padded like mlx-lm's ``BatchKVCache``: plain rows as they
  are, converted rows dequantized. The layer keeps a dense plane (converted
  rows hold their dequantized values, written as their tokens arrive) and,
  from the first conversion on, the quantized planes of every row (so a
  plain row converts later without quantizing twice).
- **Every row converted**: only the packed quantized planes remain and the
  layer exposes ``bits``/``group_size``, which is how mlx-lm's
  ``scaled_dot_product_attention`` picks quantized attention (``hasattr(cache,
  "bits")``). The attribute reflects what the last ``update_and_fetch``
  returned, so a row that converts at the end of a forward never flips the
  kind of the view that forward is still attending with.
- **Rows leave as the serial lane's kind**: :meth:`extract` hands back a
  ``QuantizedKVCache`` for a converted row and a ``KVCache`` before, with the
  minimum reusable offset the serial lane would declare (the lent prefix's,
  raised to the transition point when ``scheme.start > 0``: a shorter prefix
  would still be plain in a fresh run).

Masks, offsets, padding, ``prepare``/``finalize``, ``filter``, ``extend`` and
``extract`` follow ``BatchKVCache`` so mlx-lm's ``PromptProcessingBatch`` and
``GenerationBatch`` drive this layer like their own. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, dynamic_roll

from kernels.cache import (
    LayerQuant,
    declare_min_reusable_offset,
    declared_min_reusable_offset,
)

__all__ = ["TransitioningBatchKVCache"]

_Planes = list[mx.array]
"""Plain planes ``[keys, values]`` or quantized ``[k_packed, k_scales, k_biases, v_packed, v_scales, v_biases]``;
each ``(rows, kv_heads, capacity, last)``, tokens on axis 2."""


class TransitioningBatchKVCache:
    """One full-attention layer of a batch whose rows convert to affine-quantized KV independently.

    ``quant`` is the scheme's bits and group size for this layer, ``start``
    its threshold (convert once a row holds at least ``start`` tokens, and
    at least one). Build it with :meth:`merge` (per-row ``KVCache`` /
    ``QuantizedKVCache``, as mlx-lm's batch caches merge) or directly for
    empty rows (``left_padding``).
    """

    step = 256

    def __init__(self, quant: LayerQuant, start: int, left_padding: Sequence[int]) -> None:
        self._quant = quant
        self._start = int(start)
        self._plain: _Planes | None = None
        self._packed: _Planes | None = None
        self._left = [int(p) for p in left_padding]
        self.left_padding = mx.array(self._left)
        self.offset = mx.array([-p for p in self._left])
        self._idx = 0
        self._converted = [False] * len(self._left)
        self._floors = [0] * len(self._left)
        self._right_padding: mx.array | None = None
        self._call: tuple[int, list[int]] | None = None
        """``(token index at prepare, real lengths)`` of a right-padded prompt call in progress."""
        self._reads_packed = False
        """Whether the last ``update_and_fetch`` returned the packed quantized planes."""

    # -- precision -----------------------------------------------------------

    @property
    def quant(self) -> LayerQuant:
        """This layer's bits and group size."""
        return self._quant

    @property
    def start(self) -> int:
        """A row converts after a forward that leaves it holding at least this many tokens (and one)."""
        return self._start

    @property
    def converted(self) -> tuple[bool, ...]:
        """Per row (batch order): whether it holds quantized KV."""
        return tuple(self._converted)

    @property
    def bits(self) -> int:
        """Bits per element, only while attention reads the packed planes (every row converted).

        NOTE: mlx-lm's ``scaled_dot_product_attention`` dispatches on
        ``hasattr(cache, "bits")``; raising ``AttributeError`` makes a dense
        view attend with the plain kernel.
        """
        if not self._reads_packed:
            raise AttributeError("bits: the attention view is dense (a row is still plain)")
        return self._quant.bits

    @property
    def group_size(self) -> int:
        """Quantization group size, only while attention reads the packed planes (see :attr:`bits`)."""
        if not self._reads_packed:
            raise AttributeError("group_size: the attention view is dense (a row is still plain)")
        return self._quant.group_size

    def _committed(self, row: int) -> int:
        """Real tokens the row holds (padding never counts), mid-call included."""
        if self._call is None:
            return max(0, self._idx - self._left[row])
        at, lengths = self._call
        return max(0, at - self._left[row]) + min(self._idx - at, lengths[row])

    # -- the forward -----------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Append ``keys``/``values`` (``(rows, heads, n, dim)``), return the attention view, then convert rows due."""
        n = int(keys.shape[2])
        prev = self._idx
        all_packed = all(self._converted)
        any_packed = any(self._converted)
        self._reserve(keys, values, prev + n, plain=not all_packed, packed=any_packed)
        self.offset = self.offset + n
        self._idx += n
        if any_packed:
            assert self._packed is not None
            q = self._quantize(keys, values)
            for plane, new in zip(self._packed, q, strict=True):
                plane[..., prev : self._idx, :] = new
            if not all_packed:
                # NOTE: converted rows' dense view is their dequantized bytes.
                mask = self._row_mask()
                dk, dv = self._dequantize(q)
                keys = mx.where(mask, dk, keys)
                values = mx.where(mask, dv, values)
        if not all_packed:
            assert self._plain is not None
            self._plain[0][..., prev : self._idx, :] = keys
            self._plain[1][..., prev : self._idx, :] = values
        self._reads_packed = all_packed and bool(self._converted)
        view = self._view()
        due = [
            i
            for i, done in enumerate(self._converted)
            if not done and (c := self._committed(i)) > 0 and c >= self._start
        ]
        if due:
            self._convert(due)
        return view

    def _view(self) -> tuple[Any, Any]:
        if self._reads_packed:
            assert self._packed is not None
            t = [a[..., : self._idx, :] for a in self._packed]
            return (t[0], t[1], t[2]), (t[3], t[4], t[5])
        assert self._plain is not None
        return self._plain[0][..., : self._idx, :], self._plain[1][..., : self._idx, :]

    def _quantize(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        q = self._quant
        return [
            *mx.quantize(keys, group_size=q.group_size, bits=q.bits),
            *mx.quantize(values, group_size=q.group_size, bits=q.bits),
        ]

    def _dequantize(self, packed: Sequence[mx.array]) -> tuple[mx.array, mx.array]:
        q = self._quant
        k = mx.dequantize(packed[0], packed[1], packed[2], group_size=q.group_size, bits=q.bits)
        v = mx.dequantize(packed[3], packed[4], packed[5], group_size=q.group_size, bits=q.bits)
        return k, v

    def _row_mask(self) -> mx.array:
        return mx.array(self._converted)[:, None, None, None]

    def _reserve(
        self, keys: mx.array, values: mx.array, need: int, *, plain: bool, packed: bool
    ) -> None:
        """Capacity for ``need`` tokens in the planes the rows' precisions need (256-token steps)."""
        rows, heads, n, _ = keys.shape
        # NOTE: growth adds whole steps covering the new tokens (BatchKVCache);
        # a fresh plane covers every position up to ``need``.
        steps = (self.step + n - 1) // self.step * self.step
        first = (self.step + need - 1) // self.step * self.step
        if plain:
            self._plain = _grow(
                self._plain,
                lambda: [
                    mx.zeros((rows, heads, first, keys.shape[3]), keys.dtype),
                    mx.zeros((rows, heads, first, values.shape[3]), values.dtype),
                ],
                self._idx,
                need,
                steps,
            )
        if packed:
            self._packed = _grow(
                self._packed,
                lambda: self._quantize(
                    mx.zeros((rows, heads, first, keys.shape[3]), keys.dtype),
                    mx.zeros((rows, heads, first, values.shape[3]), values.dtype),
                ),
                self._idx,
                need,
                steps,
            )

    def _convert(self, rows: Sequence[int]) -> None:
        """Rows ``rows`` (all plain, holding tokens) now hold quantized KV."""
        assert self._plain is not None
        if self._packed is None:
            # NOTE: per-token quantization: the plain rows' bytes are valid
            # too, so later conversions only flip their flag.
            self._packed = self._quantize(self._plain[0], self._plain[1])
        for i in rows:
            self._converted[i] = True
            if self._start > 0:
                self._floors[i] = max(self._floors[i], self._committed(i))
        if all(self._converted):
            self._plain = None
            return
        mask = self._row_mask()
        dk, dv = self._dequantize(self._packed)
        self._plain = [mx.where(mask, dk, self._plain[0]), mx.where(mask, dv, self._plain[1])]

    # -- mlx-lm batch cache protocol ----------------------------------------------

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """The causal mask over this batch's positions with every row's left padding hidden."""
        mask: mx.array = create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, **kwargs
        )
        return mask

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """Before a padded prompt call (``BatchKVCache.prepare``); ``lengths`` are the rows' real tokens."""
        if left_padding is not None:
            if self._idx > 0:
                raise ValueError("left padding can only be added to an empty batch cache")
            self._left = [a + int(b) for a, b in zip(self._left, left_padding, strict=True)]
            self.left_padding = mx.array(self._left)
            self.offset = self.offset - mx.array([int(p) for p in left_padding])
        if right_padding is not None and max(right_padding) > 0:
            if lengths is None:
                raise ValueError("right padding needs the rows' real lengths")
            self._right_padding = mx.array([int(p) for p in right_padding])
            self._call = (self._idx, [int(n) for n in lengths])

    def finalize(self) -> None:
        """After a right-padded prompt call: roll each row's padding to its left (``BatchKVCache.finalize``)."""
        if self._right_padding is None:
            return
        assert self._call is not None
        at, lengths = self._call
        pads = [self._idx - at - n for n in lengths]
        shift = self._right_padding[:, None]
        for planes in (self._plain, self._packed):
            if planes is not None:
                planes[:] = [
                    dynamic_roll(a, shift, axis=2)  # type: ignore[no-untyped-call]
                    for a in planes
                ]
        self.offset = self.offset - self._right_padding
        self._left = [a + p for a, p in zip(self._left, pads, strict=True)]
        self.left_padding = mx.array(self._left)
        self._right_padding = None
        self._call = None

    @property
    def state(self) -> list[mx.array]:
        """Every array this layer holds (what a prompt call evaluates)."""
        return [*(self._plain or ()), *(self._packed or ()), self.offset, self.left_padding]

    def is_trimmable(self) -> bool:
        """Trailing tokens can be dropped (as ``BatchKVCache``)."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every row."""
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        """Positions held per row, padding included."""
        return self._idx

    def empty(self) -> bool:
        """True while no position was written."""
        return self._plain is None and self._packed is None

    @property
    def nbytes(self) -> int:
        """Bytes of the planes this layer holds (dense and packed)."""
        return sum(a.nbytes for a in (*(self._plain or ()), *(self._packed or ())))

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only the rows at ``batch_indices`` (in that order); trim shared left padding."""
        keep = list(batch_indices)
        self._converted = [self._converted[i] for i in keep]
        self._floors = [self._floors[i] for i in keep]
        self._left = [self._left[i] for i in keep]
        index = mx.array(keep)
        self.offset = self.offset[index]
        for planes in (self._plain, self._packed):
            if planes is not None:
                planes[:] = [a[index] for a in planes]
        cut = min(self._left, default=0)
        if cut > 0:
            for planes in (self._plain, self._packed):
                if planes is not None:
                    planes[:] = [a[..., cut:, :] for a in planes]
            self._idx -= cut
            self._left = [p - cut for p in self._left]
        self.left_padding = mx.array(self._left)
        if all(self._converted):
            self._plain = None
        if not any(self._converted):
            self._packed = None

    def extend(self, other: TransitioningBatchKVCache) -> None:
        """Append ``other``'s rows after this batch's, both right-aligned at the longer history."""
        if type(other) is not TransitioningBatchKVCache or other._quant != self._quant:
            raise TypeError("a transitioning batch layer extends only with one of the same scheme")
        joined = _join([self, other])
        self.__dict__.update(joined.__dict__)

    def extract(self, idx: int) -> Any:
        """Row ``idx`` as the serial lane's cache: ``QuantizedKVCache`` once converted, ``KVCache`` before."""
        pad = self._left[idx]
        rows = slice(idx, idx + 1)
        out: Any
        if self._converted[idx]:
            out = QuantizedKVCache(group_size=self._quant.group_size, bits=self._quant.bits)
            if self._packed is not None:
                t = [mx.contiguous(a[rows, :, pad : self._idx]) for a in self._packed]
                out.keys, out.values = (t[0], t[1], t[2]), (t[3], t[4], t[5])
        else:
            out = KVCache()  # type: ignore[no-untyped-call]
            if self._plain is not None:
                out.keys = mx.contiguous(self._plain[0][rows, :, pad : self._idx])
                out.values = mx.contiguous(self._plain[1][rows, :, pad : self._idx])
        out.offset = max(0, self._idx - pad)
        if self._floors[idx] > 0:
            declare_min_reusable_offset(out, self._floors[idx])
        return out

    @classmethod
    def merge(
        cls, caches: Sequence[Any], quant: LayerQuant, start: int
    ) -> TransitioningBatchKVCache:
        """One batch layer from per-row ``KVCache`` (plain rows) / ``QuantizedKVCache`` (converted rows).

        A quantized row must use ``quant``'s bits and group size. Rows are
        left-padded to the longest; each row keeps its declared minimum
        reusable offset. The per-row caches are read, never written.
        """
        return _join([cls._from_row(c, quant, start) for c in caches])

    @classmethod
    def _from_row(cls, cache: Any, quant: LayerQuant, start: int) -> TransitioningBatchKVCache:
        kind = type(cache)
        one = cls(quant, start, [0])
        n = int(cache.offset)
        if kind is QuantizedKVCache:
            if (int(cache.bits), int(cache.group_size)) != (quant.bits, quant.group_size):
                raise ValueError(
                    f"a {cache.bits}-bit (group {cache.group_size}) row cannot join a "
                    f"{quant.bits}-bit (group {quant.group_size}) batch layer"
                )
            one._converted = [True]
            if cache.keys is not None and n > 0:
                one._packed = [a[..., :n, :] for a in (*cache.keys, *cache.values)]
        elif kind is KVCache:
            if cache.keys is not None and n > 0:
                one._plain = [cache.keys[..., :n, :], cache.values[..., :n, :]]
        else:
            raise TypeError(
                f"no transitioning batch rule for {kind.__module__}.{kind.__qualname__}"
            )
        if one._plain is None and one._packed is None:
            n = 0
        one._idx = n
        one.offset = mx.array([n])
        one._floors = [declared_min_reusable_offset(cache)]
        return one


def _grow(
    planes: _Planes | None,
    fresh: Any,
    prev: int,
    need: int,
    steps: int,
) -> _Planes:
    """``planes`` with room for ``need`` tokens (``BatchKVCache``'s growth rule)."""
    if planes is None:
        return list(fresh())
    if need <= planes[0].shape[2]:
        return planes
    if prev % _STEP != 0:
        planes = [a[..., :prev, :] for a in planes]
    return [
        mx.concatenate([a, mx.zeros((*a.shape[:2], steps, a.shape[3]), a.dtype)], axis=2)
        for a in planes
    ]


_STEP = TransitioningBatchKVCache.step


def _dims(caches: Sequence[TransitioningBatchKVCache]) -> tuple[int, int, int, mx.Dtype] | None:
    """Heads, key and value head dims and dtype, from any layer holding tokens."""
    for c in caches:
        if c._plain is not None:
            k, v = c._plain
            return int(k.shape[1]), int(k.shape[3]), int(v.shape[3]), k.dtype
        if c._packed is not None:
            bits = c._quant.bits
            k, v = c._packed[0], c._packed[3]
            dk, dv = int(k.shape[3]) * 32 // bits, int(v.shape[3]) * 32 // bits
            return int(k.shape[1]), dk, dv, c._packed[1].dtype
    return None


def _planes_of(
    c: TransitioningBatchKVCache,
    dims: tuple[int, int, int, mx.Dtype],
    *,
    plain: bool,
    packed: bool,
) -> tuple[_Planes | None, _Planes | None]:
    """``c``'s planes cut to its positions, each kind built when the joined rows need it and ``c`` lacks it."""
    rows = len(c._converted)
    heads, dk, dv, dtype = dims
    n = c._idx
    p = None if c._plain is None else [a[..., :n, :] for a in c._plain]
    q = None if c._packed is None else [a[..., :n, :] for a in c._packed]
    if p is None and q is None:
        p = [mx.zeros((rows, heads, 0, dk), dtype), mx.zeros((rows, heads, 0, dv), dtype)]
        q = c._quantize(
            mx.zeros((rows, heads, 1, dk), dtype), mx.zeros((rows, heads, 1, dv), dtype)
        )
        q = [a[..., :0, :] for a in q]
    elif q is None and packed:
        assert p is not None
        q = c._quantize(p[0], p[1])
    elif p is None and plain:
        assert q is not None
        p = list(c._dequantize(q))
    return (p if plain else None), (q if packed else None)


def _join(caches: Sequence[TransitioningBatchKVCache]) -> TransitioningBatchKVCache:
    """The rows of ``caches`` in one layer, right-aligned at the longest history."""
    first = caches[0]
    out = TransitioningBatchKVCache(first._quant, first._start, [])
    out._converted = [x for c in caches for x in c._converted]
    out._floors = [x for c in caches for x in c._floors]
    width = max(c._idx for c in caches)
    out._left = [p + width - c._idx for c in caches for p in c._left]
    out.left_padding = mx.array(out._left)
    out.offset = mx.concatenate([c.offset for c in caches])
    out._idx = width
    dims = _dims(caches)
    if dims is None:
        return out
    plain, packed = not all(out._converted), any(out._converted)
    parts = [_planes_of(c, dims, plain=plain, packed=packed) for c in caches]
    for kind, want in ((0, plain), (1, packed)):
        if not want:
            continue
        joined: _Planes = []
        for j in range(len(parts[0][kind] or ())):
            pieces = []
            for c, part in zip(caches, parts, strict=True):
                planes = part[kind]
                assert planes is not None
                a = planes[j]
                left = width - c._idx
                if left:
                    a = mx.pad(a, [(0, 0), (0, 0), (left, 0), (0, 0)])
                pieces.append(a)
            joined.append(mx.concatenate(pieces, axis=0))
        if kind == 0:
            out._plain = joined
        else:
            out._packed = joined
    return out
