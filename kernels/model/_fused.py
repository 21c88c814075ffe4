"""Fused projections: one matrix product for q|k|v and one for gate|up, where it is bit for bit the same.

A decode step of a small model on a CPU is about 210 matrix products, each
reading its weights from memory once and each paying BLAS's fixed cost
(thread hand-off, packing set-up). In the Llama-style families mlx-lm
serves, the query, key and value projections read the same input, and so
do the MLP's gate and up projections. :func:`fuse_projections` replaces
each such group by one product over the concatenated weights, sliced back
into the members' outputs: 4 products per layer instead of 7.

The rule is that the model's numbers do not change. One output element of
``x @ W.T`` is a dot product of one input row with one weight row; BLAS
computes it the same way whatever other rows share the call, except where
the library picks a different kernel by problem size (OpenBLAS 0.3.21 runs
products below ~10^6 multiply-adds through a "small matrix" kernel with
another summation order: on the default model, q|k|v at 2-6 input rows).
So each fused group is checked when it is built, on random data of its
shapes, against the separate products for every row count from 1 to
:data:`FUSE_MAX_ROWS`; a row count where the fused product differs in any
bit computes the members separately instead. Above :data:`FUSE_MAX_ROWS`
rows (prefill, where the products are compute-bound and fusing saves
little) the members are always computed separately, through views of the
fused weight: the same BLAS call on the same values as the unfused model.
Hence logits and KV are bitwise the unfused model's for every input, on
every BLAS, and cached KV needs no separate fingerprint.

Applied by :func:`kernels.load_model` on the CPU device only (the device
where it was measured; ``KVTIER_FUSED_PROJECTIONS=0`` turns it off), for
the model types in :data:`FUSED_MODEL_TYPES` whose projections are plain
``nn.Linear`` layers. Engine thread only (it builds and evaluates arrays).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn

from kernels._env import env_switch

# NOTE: mlx.nn has no type information; its classes are Any here.
_Module: Any = getattr(mlx.nn, "Module")  # noqa: B009
_Linear: Any = getattr(mlx.nn, "Linear")  # noqa: B009

__all__ = [
    "FUSED_MODEL_TYPES",
    "FUSED_PROJECTIONS_ENV",
    "FUSE_MAX_ROWS",
    "FusedLinear",
    "FusionReport",
    "fuse_gate_up",
    "fuse_projections",
    "fused_projections_enabled",
]

FUSED_PROJECTIONS_ENV = "KVTIER_FUSED_PROJECTIONS"
"""Environment switch: ``0`` keeps every projection separate."""

FUSE_MAX_ROWS = 16
"""Input rows (batch x tokens) up to which a group runs as one product; above, its members run separately.

Decode steps of up to 16 rows: the memory-bound products fusing helps. The
check at load time costs a few products per row count (~0.3 s with
OpenBLAS, ~1 s with MLX's own BLAS, for the default model).
"""

FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""mlx-lm model types whose attention calls q/k/v on one input and whose MLP calls gate/up on one input."""

_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("mlp", ("gate_proj", "up_proj")),
)


def fused_projections_enabled(env: Mapping[str, str] | None = None) -> bool:
    """False when ``KVTIER_FUSED_PROJECTIONS`` is ``0``/``false``/``off``/``no`` (default: enabled)."""
    return env_switch(FUSED_PROJECTIONS_ENV, env)


@dataclass(frozen=True, slots=True)
class FusionReport:
    """What :func:`fuse_projections` did.

    ``groups``: groups fused; ``rope_layers``: layers whose RoPE table is
    shared; ``split_rows``: per group signature, the row
    counts (1..:data:`FUSE_MAX_ROWS`) that compute the members separately
    because the fused product differed there; ``skipped``: why the model
    (or a group) was left as it was, ``""`` when nothing was skipped.
    """

    groups: int = 0
    split_rows: tuple[tuple[str, tuple[int, ...]], ...] = ()
    skipped: str = ""
    rope_layers: int = 0
    """Layers whose RoPE shares its cos/sin table (``kernels.model._rope``)."""
    few_row: int = 0
    """Products whose one-position inputs use the few-row product (``kernels.model._few_row``)."""
    few_row_status: str = ""
    """Why that is on or off here (``kernels.native.few_row_status``); ``""``: not considered."""


class _Group:
    """The fused weight of one group, its members' views, and the product of the current input."""

    def __init__(
        self,
        weight: mx.array,
        bias: mx.array | None,
        bounds: Sequence[tuple[int, int]],
        split_rows: frozenset[int],
        *,
        always: bool = False,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.bounds = tuple(bounds)
        self.split_rows = split_rows
        self.always = always
        """One product at every row count (``fuse_gate_up``): no separate members, no views."""
        # NOTE: views share the fused buffer; a separate product through a
        # view is the same BLAS call on the same values as the unfused layer.
        self.views = [] if always else [weight[a:b] for a, b in self.bounds]
        self.bias_views = (
            [bias[a:b] for a, b in self.bounds] if bias is not None and not always else None
        )
        mx.eval(self.views, self.bias_views or [])
        self._x: mx.array | None = None
        self._y: mx.array | None = None
        self._left: set[int] = set()
        self.few_row: Callable[[mx.array, mx.array], mx.array] | None = None
        """The few-row product for one-token inputs (``kernels.model._few_row``); ``None``: BLAS."""

    def separate(self, index: int, x: mx.array) -> mx.array:
        w = self.views[index]
        if self.bias_views is not None:
            return mx.addmm(self.bias_views[index], x, w.T)
        return x @ w.T

    def take(self, index: int, x: mx.array) -> mx.array:
        few_row = self.few_row if x.ndim >= 2 and x.shape[-2] == 1 else None
        rows = x.size // x.shape[-1] if x.shape[-1] else 0
        if few_row is None and not self.always and (rows > FUSE_MAX_ROWS or rows in self.split_rows):
            return self.separate(index, x)
        # NOTE: the members are called one after the other on the same input
        # object; a new input, or a member asking twice, starts a new product.
        if self._x is not x or index not in self._left:
            if few_row is not None:
                # NOTE: one token per row: each output row is summed alone, so the
                # fused product equals the members' at every row count.
                product = few_row(x, self.weight)
                self._y = product + self.bias if self.bias is not None else product
            elif self.bias is not None:
                self._y = mx.addmm(self.bias, x, self.weight.T)
            else:
                self._y = x @ self.weight.T
            self._x = x
            self._left = set(range(len(self.bounds)))
        y = self._y
        assert y is not None
        self._left.discard(index)
        if not self._left:
            # NOTE: drop the references so a prefill's activations are not kept.
            self._x = None
            self._y = None
        a, b = self.bounds[index]
        return y[..., a:b]


class FusedLinear(_Module):  # type: ignore[misc]
    """One member of a fused projection group (replaces an ``nn.Linear``; same outputs)."""

    def __init__(self, group: _Group, index: int) -> None:
        super().__init__()
        # NOTE: a plain attribute, not a child module: the group's weight is
        # a parameter once (of the first member), not once per member.
        self._group = group
        self._index = index
        if index == 0:
            self.weight = group.weight
            if group.bias is not None:
                self.bias = group.bias

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.take(self._index, x)


def _signature(layers: Sequence[Any]) -> str:
    w = layers[0].weight
    sizes = "+".join(str(layer.weight.shape[0]) for layer in layers)
    bias = "bias" if "bias" in layers[0] else "nobias"
    return f"{w.shape[1]}:{sizes}:{w.dtype}:{bias}"


def _probe(layers: Sequence[Any]) -> frozenset[int] | None:
    """Row counts where a fused product of these shapes differs from the separate ones; None: views differ too."""
    k = layers[0].weight.shape[1]
    dtype = layers[0].weight.dtype
    key = mx.random.key(0)
    keys = mx.random.split(key, 2 * len(layers) + 1)
    weights = [
        mx.random.normal(layer.weight.shape, key=keys[i]).astype(dtype)
        for i, layer in enumerate(layers)
    ]
    has_bias = "bias" in layers[0]
    biases = (
        [
            mx.random.normal(layer.bias.shape, key=keys[len(layers) + i]).astype(dtype)
            for i, layer in enumerate(layers)
        ]
        if has_bias
        else None
    )
    bounds: list[tuple[int, int]] = []
    start = 0
    for w in weights:
        bounds.append((start, start + w.shape[0]))
        start += w.shape[0]
    group = _Group(
        mx.concatenate(weights, axis=0),
        mx.concatenate(biases) if biases is not None else None,
        bounds,
        frozenset(),
    )
    x_all = mx.random.normal((FUSE_MAX_ROWS, k), key=keys[-1]).astype(dtype)
    mx.eval(weights, biases or [], x_all)
    split: set[int] = set()
    for rows in range(1, FUSE_MAX_ROWS + 1):
        x = x_all[:rows]
        ref = [
            mx.addmm(biases[i], x, w.T) if biases is not None else x @ w.T
            for i, w in enumerate(weights)
        ]
        fused = [group.take(i, x) for i in range(len(weights))]
        views = [group.separate(i, x) for i in range(len(weights))]
        mx.eval(ref, fused, views)
        if not all(mx.array_equal(r, v).item() for r, v in zip(ref, views, strict=True)):
            return None
        if not all(mx.array_equal(r, f).item() for r, f in zip(ref, fused, strict=True)):
            split.add(rows)
    return frozenset(split)


def _linears(parent: Any, names: Sequence[str]) -> list[Any] | None:
    layers = [getattr(parent, name, None) for name in names]
    # NOTE: exact class: a QuantizedLinear or LoRA layer computes something else.
    if not all(type(layer) is _Linear for layer in layers):
        return None
    linears: list[Any] = [layer for layer in layers if isinstance(layer, _Linear)]
    first = linears[0].weight
    if any(
        layer.weight.ndim != 2
        or layer.weight.shape[1] != first.shape[1]
        or layer.weight.dtype != first.dtype
        or ("bias" in layer) != ("bias" in linears[0])
        for layer in linears
    ):
        return None
    return linears


def _install(
    parent: Any,
    names: Sequence[str],
    linears: Sequence[Any],
    split_rows: frozenset[int],
    *,
    always: bool = False,
) -> None:
    """Replace ``parent``'s ``names`` by members of one group over the concatenated weights."""
    bounds: list[tuple[int, int]] = []
    start = 0
    for linear in linears:
        bounds.append((start, start + linear.weight.shape[0]))
        start += linear.weight.shape[0]
    weight = mx.concatenate([linear.weight for linear in linears], axis=0)
    bias = mx.concatenate([lin.bias for lin in linears]) if "bias" in linears[0] else None
    mx.eval(weight, bias if bias is not None else [])
    group = _Group(weight, bias, bounds, split_rows, always=always)
    for index, name in enumerate(names):
        setattr(parent, name, FusedLinear(group, index))


def fuse_gate_up(model: Any) -> FusionReport:
    """Make each layer's MLP gate|up ONE product at every row count, in place (GPU; engine thread).

    Why: on the H200 a decode step is paced by the host building and
    launching its kernels, and one product of twice the width is also the
    better-shaped one: with gate|up fused this way an 8B-shaped model's
    8- and 32-row decode steps ran 1.16x faster by the median of 6 rounds
    (``tools/bench/gpu_fused_step.py --variant gate-up``;
    docs/benchmarks/gpu.md). Unlike :func:`fuse_projections` no row count is
    split off and no member is computed through a view of the fused weight
    (on CUDA that was slower than not fusing): the outputs are not bit for
    bit mlx-lm's separate products, but the batch and serial lanes share
    the model, so they agree with each other as before. q|k|v stays as it
    is (its slices would need copies before the heads' reshape).
    """
    model_type = getattr(model, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return FusionReport(skipped=f"model type {model_type!r} is not fused")
    fused = 0
    for layer in getattr(model, "layers", None) or []:
        parent = getattr(layer, "mlp", None)
        names = ("gate_proj", "up_proj")
        linears = _linears(parent, names) if parent is not None else None
        if linears is None:
            continue
        _install(parent, names, linears, frozenset(), always=True)
        fused += 1
    return FusionReport(groups=fused, skipped="" if fused else "no plain gate|up projections")


def fuse_projections(model: Any) -> FusionReport:
    """Fuse q|k|v and gate|up of every layer in place where that keeps every output bit (engine thread).

    Returns what was done; a model type outside :data:`FUSED_MODEL_TYPES`,
    or layers that are not plain ``nn.Linear``, are left untouched.
    """
    model_type = getattr(model, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return FusionReport(skipped=f"model type {model_type!r} is not fused")
    layers = getattr(model, "layers", None)
    if not layers:
        return FusionReport(skipped="the model has no layers")
    probes: dict[str, frozenset[int] | None] = {}
    fused = 0
    for layer in layers:
        for part, names in _GROUPS:
            parent = getattr(layer, part, None)
            linears = _linears(parent, names) if parent is not None else None
            if linears is None:
                continue
            sig = _signature(linears)
            if sig not in probes:
                probes[sig] = _probe(linears)
            split = probes[sig]
            if split is None:
                continue
            _install(parent, names, linears, split)
            fused += 1
    split_rows = tuple(
        (sig, tuple(sorted(rows))) for sig, rows in probes.items() if rows is not None
    )
    refused = [sig for sig, rows in probes.items() if rows is None]
    return FusionReport(
        groups=fused,
        split_rows=split_rows,
        skipped=f"views differ from separate products: {', '.join(refused)}" if refused else "",
    )
