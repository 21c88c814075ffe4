"""RoPE tables computed once per forward instead of twice per layer (CPU), with the same bits.

On the CPU device ``mx.fast.rope`` is its fallback graph: each call builds
the positions, the inverse frequencies, ``cos`` and ``sin`` of their
product (about 20 graph nodes plus broadcasts), then rotates the input
(about 10 more). A decode step of a 30-layer model calls it 60 times with
the same offsets and length: 2 calls per layer (queries and keys), and every
layer's cache holds the same number of tokens.

:class:`SharedRope` replaces an ``nn.RoPE`` (non-traditional) and keeps one
table per (offset, length, dtype) in a memo shared by the model's layers:

- The table is taken from ``mx.fast.rope`` itself, applied to a unit input
  (ones in the first half of the rotated dims, zeros in the second):
  ``1·cos - 0·sin`` and ``1·sin + 0·cos`` are ``cos`` and ``sin`` exactly,
  so the table holds the fallback's own values.
- The rotation is the fallback's: ``x1·cos - x2·sin`` and ``x1·sin +
  x2·cos``, concatenated with the unrotated tail, in that order.
- A table is reused when the offset is the same integer (the serial lane's
  ``KVCache``) or the very same array object (the batch lane's caches; the
  decode batch makes its layers share one offset array per step,
  ``kernels.engine._greedy``). Anything else computes a new table.

:func:`share_rope_tables` checks every replacement against the original
module on random inputs (integer and per-row offsets, several lengths) and
installs nothing when any bit differs. Engine thread only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn

__all__ = ["SharedRope", "declare_equal_offsets", "has_shared_rope", "share_rope_tables"]

_MEMO_ATTR = "kvtier_rope_memo"

# NOTE: mlx.nn has no type information; its classes are Any here.
_Module: Any = getattr(mlx.nn, "Module")  # noqa: B009
_RoPE: Any = getattr(mlx.nn, "RoPE")  # noqa: B009


class _Memo:
    """The last table built: its key and arrays (shared by every layer of one model).

    ``equal``: offset arrays declared equal in value for the forward about to
    run (:func:`declare_equal_offsets`); a table built for one serves all.
    """

    def __init__(self) -> None:
        self.offset: Any = None
        self.length = -1
        self.dtype: Any = None
        self.table: tuple[mx.array, mx.array] | None = None
        self.equal: dict[int, Any] = {}

    def _declared(self, a: Any, b: Any) -> bool:
        # NOTE: ids with the objects kept alive, so an id is never a reused one.
        return self.equal.get(id(a)) is a and self.equal.get(id(b)) is b

    def find(self, offset: Any, length: int, dtype: Any) -> tuple[mx.array, mx.array] | None:
        if self.table is None or self.length != length or self.dtype != dtype:
            return None
        if isinstance(offset, mx.array) or isinstance(self.offset, mx.array):
            same = offset is self.offset or self._declared(offset, self.offset)
            return self.table if same else None
        return self.table if offset == self.offset else None

    def keep(self, offset: Any, length: int, dtype: Any, table: tuple[mx.array, mx.array]) -> None:
        self.offset, self.length, self.dtype, self.table = offset, length, dtype, table


class SharedRope(_Module):  # type: ignore[misc]
    """An ``nn.RoPE`` (non-traditional) whose cos/sin table is shared through a memo; same outputs."""

    def __init__(self, rope: Any, memo: _Memo) -> None:
        super().__init__()
        self.dims = int(rope.dims)
        self.base = rope.base
        self.scale = rope.scale
        self._memo = memo

    def _table(self, x: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
        length = x.shape[2]
        hit = self._memo.find(offset, length, x.dtype)
        if hit is not None:
            return hit
        half = self.dims // 2
        rows = offset.size if isinstance(offset, mx.array) and offset.size > 1 else 1
        unit = mx.concatenate(
            [
                mx.ones((rows, 1, length, half), x.dtype),
                mx.zeros((rows, 1, length, self.dims - half), x.dtype),
            ],
            axis=-1,
        )
        rotated = mx.fast.rope(
            unit, self.dims, traditional=False, base=self.base, scale=self.scale, offset=offset
        )
        table = (rotated[..., :half], rotated[..., half : self.dims])
        self._memo.keep(offset, length, x.dtype, table)
        return table

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if x.ndim != 4:
            return mx.fast.rope(
                x, self.dims, traditional=False, base=self.base, scale=self.scale, offset=offset
            )
        coss, sins = self._table(x, offset)
        half = self.dims // 2
        x1 = x[..., :half]
        x2 = x[..., half : self.dims]
        # NOTE: the fallback's operations in its order (mlx fast.cpp, rope).
        parts = [x1 * coss - x2 * sins, x1 * sins + x2 * coss]
        if self.dims < x.shape[-1]:
            parts.append(x[..., self.dims :])
        return mx.concatenate(parts, axis=-1)


def _same_outputs(rope: Any, shared: SharedRope, dtype: Any, heads: int, head_dim: int) -> bool:
    cases: tuple[tuple[int, int, Any], ...] = (
        (1, 1, 0),
        (1, 1, 37),
        (1, 9, 5),
        (3, 1, mx.array([5, 0, -2])),
        (2, 7, mx.array([11, 300])),
        (1, 1, mx.array([4])),
    )
    for i, (rows, length, offset) in enumerate(cases):
        x = mx.random.normal((rows, heads, length, head_dim), key=mx.random.key(7 + i)).astype(
            dtype
        )
        want = rope(x, offset=offset)
        got = shared(x, offset=offset)
        got_again = shared(x, offset=offset)  # NOTE: the second call reads the memo.
        if not (mx.array_equal(want, got).item() and mx.array_equal(want, got_again).item()):
            return False
    return True


def has_shared_rope(model: Any) -> bool:
    """True when :func:`share_rope_tables` replaced the model's RoPE modules."""
    return isinstance(getattr(model, _MEMO_ATTR, None), _Memo)


def declare_equal_offsets(model: Any, offsets: list[Any]) -> None:
    """Tell the model's shared RoPE that these offset arrays hold equal values for its next forward.

    The caller vouches for the values (a decode batch whose layers hold the
    same rows and tokens); a model without :class:`SharedRope` ignores it.
    """
    memo = getattr(model, _MEMO_ATTR, None)
    if isinstance(memo, _Memo):
        memo.equal = {id(o): o for o in offsets}


def share_rope_tables(model: Any, *, dtype: Any, head_dim: int, heads: int) -> int:
    """Replace each layer's ``nn.RoPE`` (non-traditional) by a :class:`SharedRope`; returns how many.

    Nothing is replaced unless every replacement gives the original's bits on
    the check inputs (in ``dtype``, ``heads`` x ``head_dim``).
    """
    memo = _Memo()
    found: list[tuple[Any, Any]] = []
    for layer in getattr(model, "layers", None) or []:
        attn = getattr(layer, "self_attn", None)
        rope: Any = getattr(attn, "rope", None)
        # NOTE: exact class: scaled variants (Llama 3, YaRN, SuScaled) compute other tables.
        if type(rope) is not _RoPE or rope.traditional:
            continue
        found.append((attn, rope))
    if not found:
        return 0
    checked: dict[tuple[Any, ...], bool] = {}
    for _attn, rope in found:
        sig = (rope.dims, rope.base, rope.scale)
        if sig not in checked:
            checked[sig] = _same_outputs(rope, SharedRope(rope, _Memo()), dtype, heads, head_dim)
        if not checked[sig]:
            return 0
    for attn, rope in found:
        attn.rope = SharedRope(rope, memo)
    setattr(model, _MEMO_ATTR, memo)
    return len(found)
