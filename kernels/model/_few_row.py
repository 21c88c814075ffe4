"""One-token CPU steps through kvtier's few-row product instead of BLAS.

A decode step on the CPU is mostly matrix products with 1-8 input rows, and
OpenBLAS reads the fp32 weights for them at ~11 GB/s on the machines we
measured (it packs every weight panel first). ``kernels.native``'s product
reads each weight row once; on the 2-core VM it took a step's products from
42 / 49 / 48 ms to 20 / 27 / 39 ms at 1 / 4 / 8 rows
(``tools/bench/few_row_gemm.py``, docs/batching.md "Few-row products").

:func:`apply_few_row` routes every product whose input holds ONE position
per row (a decode step: ``x.shape[-2] == 1``) through it: each fp32
``nn.Linear`` (replaced by :class:`FewRowLinear`), each fused group
(``kernels.model._fused``) and a tied LM head (:class:`FewRowHead`). Longer
inputs (prefill chunks) keep MLX's product, exactly as before.

Numbers: the kernel sums in its own order, so a decode step's outputs are
no longer bit for bit mlx-lm's BLAS products (differences ~1e-5 relative).
Every output row is computed alone, with the same arithmetic whatever other
rows share the call, so a row's tokens in the batch lane equal its tokens in
the serial lane (both route one-token steps here). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn

from ._fused import FusedLinear

__all__ = ["FewRowHead", "FewRowLinear", "apply_few_row"]

_Module: Any = getattr(mlx.nn, "Module")  # noqa: B009
_Linear: Any = getattr(mlx.nn, "Linear")  # noqa: B009
_Embedding: Any = getattr(mlx.nn, "Embedding")  # noqa: B009

Product = Callable[[mx.array, mx.array], mx.array]


def _one_position(x: mx.array) -> bool:
    return x.ndim >= 2 and x.shape[-2] == 1


class FewRowLinear(_Module):  # type: ignore[misc]
    """An ``nn.Linear`` whose one-position inputs go through the few-row product (longer ones as before)."""

    def __init__(self, linear: Any, product: Product) -> None:
        super().__init__()
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias
        self._product = product

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array
        if _one_position(x):
            out = self._product(x, self.weight)
            if "bias" in self:
                out = out + self.bias
        elif "bias" in self:
            out = mx.addmm(self.bias, x, self.weight.T)
        else:
            out = x @ self.weight.T
        return out


class FewRowHead(_Embedding):  # type: ignore[misc]
    """A tied embedding whose ``as_linear`` (the LM head) uses the few-row product for one-position inputs."""

    def __init__(self, embedding: Any, product: Product) -> None:
        dims, width = embedding.weight.shape
        super().__init__(dims, width)
        self.weight = embedding.weight
        self._product = product

    def as_linear(self, x: mx.array) -> mx.array:
        out: mx.array = self._product(x, self.weight) if _one_position(x) else x @ self.weight.T
        return out


def _replace_linears(module: Any, product: Product, dtype: mx.Dtype) -> int:
    """Replace every ``nn.Linear`` of ``dtype`` below ``module`` (exact class); returns how many."""
    count = 0
    for name, child in list(module.children().items()):
        items = child if isinstance(child, list) else [child]
        for index, item in enumerate(items):
            if type(item) is _Linear and item.weight.dtype == dtype and item.weight.ndim == 2:
                replacement = FewRowLinear(item, product)
                if isinstance(child, list):
                    child[index] = replacement
                else:
                    setattr(module, name, replacement)
                count += 1
            elif isinstance(item, FusedLinear):
                group = item._group
                if group.weight.dtype == dtype and group.few_row is None:
                    group.few_row = product
                    count += 1
            elif isinstance(item, _Module):
                count += _replace_linears(item, product, dtype)
    return count


def apply_few_row(model: Any, product: Product, dtype: mx.Dtype = mx.float32) -> int:
    """Route the model's one-position products of ``dtype`` weights through ``product`` (in place); returns how many.

    Counts each replaced linear, each fused group, and the tied head. A model
    with no projection of ``dtype`` is left as it is (returns 0). The CPU's
    product takes fp32 (``kernels.native``), CUDA's bf16
    (``kernels.model._cuda_few_row``).
    """
    count = _replace_linears(model, product, dtype)
    inner: Any = getattr(model, "model", None)
    args: Any = getattr(model, "args", None)
    embed: Any = getattr(inner, "embed_tokens", None)
    if (
        count
        and bool(getattr(args, "tie_word_embeddings", False))
        and type(embed) is _Embedding
        and embed.weight.dtype == dtype
    ):
        inner.embed_tokens = FewRowHead(embed, product)
        count += 1
    return count
