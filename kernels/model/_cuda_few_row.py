"""A decode step's bf16 products on CUDA with 2-8 input rows, through tensor cores, one kernel for every row count.

A batch decode step multiplies 1-32 token rows by every weight matrix. MLX
runs one row through its gemv kernel and more rows through cuBLASLt, whose
tiles are made for large products. :func:`few_row_product` computes
``x @ w.T`` for ``x`` of :data:`min_rows`-8 rows and bf16 weights in one
kernel built on the ``mma.m16n8k16`` tensor-core instruction: each warp
takes a 16-row tile of ``w`` (the instruction's A) and the x rows as the
instruction's 8 columns (B; rows past ``M`` are zeros). The 8 warps of a
block split ``K`` and add their partial sums in shared memory. Two ways
to read ``w`` (:data:`VARIANTS`): "quad", fragments straight from global
memory (64-byte row segments a load), and "tile", the default, 256-byte
row segments a load parked in shared memory first.

Numbers: fp32 accumulation, as cuBLAS (the largest error against an fp32
reference equals MLX's bf16 product's on the 8B shape's projections). The
summation order of one output element does not depend on the other rows
present (the instruction sums each column on its own; ``M`` only guards the
loads), so a row's outputs are bit for bit the same beside 1-7 others.

Measured on an H100 (``tools/bench/cuda_few_row.py``, docs/benchmarks.md
2026-12-07 02:45): the 8B shape's projections alone read the weights at
2.1 TB/s ("tile") against MLX's 2.2-2.5 (gemv at one row, cuBLASLt
above) and 1.6 ("quad"); yet kvtier's 8-row decode step took 7.18 against
8.32 ms with MLX's products (1.15 x, every round faster) and a plain-cache
8-row step 7.62 vs 10.25 ms: inside a step MLX's cuBLASLt products cost
more than alone. Served, 8 streams ran 723-727 tok/s with it in two runs
and 580-612 in two more, against 540-630 without: not yet beyond the
spread, so it stays off unless ``KVTIER_CUDA_FEW_ROW`` asks for it.

The K index is permuted inside each 32-wide chunk (lane ``t`` of a quad
loads 8 consecutive elements with one 16-byte load; the instruction's
fragment layout wants pairs 2t and 2t+8): both operands use the same
permutation, and a dot product does not depend on the order of its terms'
indices, only the summation order, which is fixed.

Requirements checked by :func:`fits` (otherwise ``x @ w.T``): CUDA the
default device, bf16 ``x`` and ``w``, ``K`` a multiple of 32 ("quad") or
128 ("tile"), ``N % 16 == 0``, :data:`min_rows`-8 rows. Engine thread only
(it builds MLX arrays).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

import mlx.core as mx
import mlx.nn

from kernels._env import env_switch, env_text
from kernels._memory import on_cuda

from ._few_row import FewRowLinear

__all__ = [
    "CUDA_FEW_ROW_ENV",
    "CUDA_FEW_ROW_QKV_ENV",
    "KERNELS",
    "MAX_ROWS",
    "QkvMember",
    "apply_qkv",
    "cuda_few_row_enabled",
    "few_row_product",
    "fits",
    "fits_qkv",
    "qkv_enabled",
    "qkv_product",
    "requested_variant",
    "self_check",
    "self_check_qkv",
    "use_variant",
]

# NOTE: mlx.nn has no type information; its classes are Any here.
_Module: Any = getattr(mlx.nn, "Module")  # noqa: B009
_Linear: Any = getattr(mlx.nn, "Linear")  # noqa: B009

CUDA_FEW_ROW_ENV = "KVTIER_CUDA_FEW_ROW"
"""Environment switch: ``1`` routes one-token bf16 products through :func:`few_row_product` on CUDA."""

CUDA_FEW_ROW_QKV_ENV = "KVTIER_CUDA_FEW_ROW_QKV"
"""Environment switch: ``1`` also joins each layer's q, k, v products into one launch (:func:`apply_qkv`)."""

MAX_ROWS = 8
"""The most input rows one call takes (the instruction's 8 columns)."""

_WARPS = 8
"""Warps per block; each takes a contiguous share of K."""

_PROLOGUE = r"""
    // NOTE: the row count is read at run time (not a template argument), so
    // one compile serves 1-8 rows; it only guards loads and stores.
    const int M = x_shape[0];
    const int N = w_shape[0];
    const int K = w_shape[1];
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = blockIdx.y * 16;
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
"""

_EPILOGUE = r"""
    __shared__ float part[WARPS][128];
    // NOTE: the accumulator's layout: c0, c1 are (w row g, x rows 2t, 2t+1);
    // c2, c3 are (w row g + 8, the same x rows).
    part[warp][g * 8 + 2 * t] = c0;
    part[warp][g * 8 + 2 * t + 1] = c1;
    part[warp][(g + 8) * 8 + 2 * t] = c2;
    part[warp][(g + 8) * 8 + 2 * t + 1] = c3;
    __syncthreads();
    const int tid = warp * 32 + lane;
    if (tid < 128) {
        const int r = tid >> 3;
        const int m = tid & 7;
        if (m < M) {
            float s = 0.f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                s += part[v][tid];
            }
            y[(size_t)m * N + n0 + r] = __float2bfloat16(s);
        }
    }
"""

# NOTE: "quad": each lane loads its fragments straight from global memory;
# one load instruction reads 8 rows x 64 bytes. Measured on an H100
# (cuda_few_row.py): 1.44-1.60 TB/s of weights against MLX's 2.1-2.4.
_QUAD = r"""
    const int chunks = K >> 5;
    const int per = (chunks + WARPS - 1) / WARPS;
    const int c_begin = warp * per;
    const int c_end = min(chunks, c_begin + per);
    const uint4* w_lo = reinterpret_cast<const uint4*>(w + (size_t)(n0 + g) * K);
    const uint4* w_hi = reinterpret_cast<const uint4*>(w + (size_t)(n0 + g + 8) * K);
    const uint4* x_row = reinterpret_cast<const uint4*>(x + (size_t)(g < M ? g : 0) * K);
    int c = c_begin;
    for (; c + 4 <= c_end; c += 4) {
        uint4 a[4], b[4], xs[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = ((c + u) << 2) + t;
            a[u] = w_lo[i];
            b[u] = w_hi[i];
            xs[u] = g < M ? x_row[i] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            kvtier_mma(c0, c1, c2, c3, a[u].x, b[u].x, a[u].y, b[u].y, xs[u].x, xs[u].y);
            kvtier_mma(c0, c1, c2, c3, a[u].z, b[u].z, a[u].w, b[u].w, xs[u].z, xs[u].w);
        }
    }
    for (; c < c_end; ++c) {
        const int i = (c << 2) + t;
        const uint4 a = w_lo[i];
        const uint4 b = w_hi[i];
        const uint4 xs = g < M ? x_row[i] : make_uint4(0, 0, 0, 0);
        kvtier_mma(c0, c1, c2, c3, a.x, b.x, a.y, b.y, xs.x, xs.y);
        kvtier_mma(c0, c1, c2, c3, a.z, b.z, a.w, b.w, xs.z, xs.w);
    }
"""

# NOTE: "tile": a warp reads a 16-row x 128-k tile of w with each load
# instruction covering 2 rows x 256 contiguous bytes (streamed past L1),
# parks it in its own stretch of shared memory (rows 320 bytes apart: the
# fragment reads of 8 lanes then fall on 32 distinct banks), and reads its
# fragments from there.
_TILE = r"""
    const int tiles = K >> 7;
    const int per = (tiles + WARPS - 1) / WARPS;
    const int t_begin = warp * per;
    const int t_end = min(tiles, t_begin + per);
    __shared__ __align__(16) unsigned char stage_all[WARPS][16 * 320];
    unsigned char* stage = stage_all[warp];
    const int hrow = lane >> 4;
    const int col = lane & 15;
    const int row_u4 = K >> 3;
    const uint4* w_tile = reinterpret_cast<const uint4*>(w + (size_t)n0 * K);
    const uint4* x_row = reinterpret_cast<const uint4*>(x + (size_t)(g < M ? g : 0) * K);
    for (int tt = t_begin; tt < t_end; ++tt) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            v[j] = kvtier_ld_stream(w_tile + (size_t)(2 * j + hrow) * row_u4 + (tt << 4) + col);
        }
        uint4 xs[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            xs[q] = g < M ? x_row[(tt << 4) + (q << 2) + t] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            *reinterpret_cast<uint4*>(stage + (2 * j + hrow) * 320 + col * 16) = v[j];
        }
        __syncwarp();
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const uint4 a = *reinterpret_cast<const uint4*>(stage + g * 320 + q * 64 + t * 16);
            const uint4 b = *reinterpret_cast<const uint4*>(stage + (g + 8) * 320 + q * 64 + t * 16);
            kvtier_mma(c0, c1, c2, c3, a.x, b.x, a.y, b.y, xs[q].x, xs[q].y);
            kvtier_mma(c0, c1, c2, c3, a.z, b.z, a.w, b.w, xs[q].z, xs[q].w);
        }
        __syncwarp();
    }
"""

# NOTE: one launch for a layer's q, k and v products (they read the same x):
# the blocks over wq's rows write yq, then wk's yk, then wv's yv; each block
# runs the "tile" body on its own weight. Three calls' host work become one.
_PROLOGUE_QKV = r"""
    const int M = x_shape[0];
    const int K = wq_shape[1];
    const int Nq = wq_shape[0];
    const int Nk = wk_shape[0];
    int nb = blockIdx.y * 16;
    const __nv_bfloat16* w = wq;
    __nv_bfloat16* y = yq;
    int N = Nq;
    if (nb >= Nq + Nk) {
        w = wv;
        y = yv;
        N = wv_shape[0];
        nb -= Nq + Nk;
    } else if (nb >= Nq) {
        w = wk;
        y = yk;
        N = Nk;
        nb -= Nq;
    }
    const int n0 = nb;
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int g = lane >> 2;
    const int t = lane & 3;
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
"""

_HEADER = r"""
// One m16n8k16 product, bf16 in, fp32 accumulated in place: A is 16 w rows
// by 16 k (a0: row g, a1: row g + 8, a2 / a3 the same rows' next k pair),
// B is 16 k by 8 x rows (b0, b1: x row g).
__device__ __forceinline__ void kvtier_mma(
    float& c0, float& c1, float& c2, float& c3,
    unsigned a0, unsigned a1, unsigned a2, unsigned a3,
    unsigned b0, unsigned b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A 16-byte read of data used once: not kept in L1.
__device__ __forceinline__ uint4 kvtier_ld_stream(const uint4* p) {
  uint4 v;
  asm(
      "ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
"""

VARIANTS: dict[str, int] = {"quad": 32, "tile": 128}
"""The single-product kernels (:data:`KERNELS`) and the multiple of K each needs."""

variant = "tile"
"""The kernel :func:`few_row_product` runs (a module setting: the benchmark compares them)."""

min_rows = 2
"""The fewest input rows the kernel takes; fewer go to MLX's product.

NOTE: one row stays on MLX's gemv: on an H100 (``cuda_few_row.py``) the
kernel read the weights at 2.1 TB/s against the gemv's 2.5 at one row, and
kvtier's lone-row step took 7.43 vs 6.28 ms with it. A lone row's products
are then not those it gets beside others (as with MLX's own products,
gemv at one row, cuBLASLt above)."""

KERNELS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "quad": (_PROLOGUE + _QUAD + _EPILOGUE, ("x", "w"), ("y",)),
    "tile": (_PROLOGUE + _TILE + _EPILOGUE, ("x", "w"), ("y",)),
    "qkv": (_PROLOGUE_QKV + _TILE + _EPILOGUE, ("x", "wq", "wk", "wv"), ("yq", "yk", "yv")),
}
"""Every kernel handed to MLX: body, input names, output names (``tools/cuda_compile_check.py`` compiles each)."""

_kernels: dict[str, Callable[..., list[mx.array]]] = {}


def _launch(name: str, x: mx.array, weights: list[mx.array]) -> list[mx.array]:
    """Kernel ``name`` on ``x`` (rows x K) and ``weights``: one output a weight, a block per 16 weight rows."""
    kernel = _kernels.get(name)
    if kernel is None:
        source, inputs, outputs = KERNELS[name]
        kernel = cast(
            "Callable[..., list[mx.array]]",
            mx.fast.cuda_kernel(
                name=f"kvtier_few_row_{name}",
                input_names=list(inputs),
                output_names=list(outputs),
                source=source,
                header=_HEADER,
                ensure_row_contiguous=True,
            ),
        )
        _kernels[name] = kernel
    ns = [int(w.shape[0]) for w in weights]
    return kernel(
        inputs=[x, *weights],
        template=[("WARPS", _WARPS)],
        grid=(32, _WARPS * (sum(ns) // 16), 1),
        threadgroup=(32, _WARPS, 1),
        output_shapes=[(int(x.shape[0]), n) for n in ns],
        output_dtypes=[x.dtype] * len(ns),
    )


def _relative_error(y: mx.array, x: mx.array, w: mx.array) -> float:
    """The largest error of ``y`` against the fp32 ``x @ w.T``, relative to the reference's largest value."""
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    err = (mx.abs(y.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
    assert isinstance(err, float)
    return err


@functools.cache
def _cuda() -> bool:
    # NOTE: the engine thread's default device does not change once a model is loaded.
    return on_cuda()


def cuda_few_row_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVTIER_CUDA_FEW_ROW`` asks for the kernel (default: off, until measured served).

    Any on word asks for it, a variant's name (``quad``, ``tile``) too
    (:func:`requested_variant`).
    """
    return env_switch(CUDA_FEW_ROW_ENV, env, default=False)


def qkv_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVTIER_CUDA_FEW_ROW_QKV`` asks for one q|k|v launch a layer (default: off, not yet measured)."""
    return env_switch(CUDA_FEW_ROW_QKV_ENV, env, default=False)


def requested_variant(env: Mapping[str, str] | None = None) -> str:
    """The variant ``KVTIER_CUDA_FEW_ROW`` names, else the default (:data:`variant`)."""
    name = env_text(CUDA_FEW_ROW_ENV, env)
    return name if name in VARIANTS else variant


def use_variant(name: str) -> None:
    """Make ``name`` the kernel :func:`few_row_product` runs (at load, before any product is routed)."""
    global variant
    if name not in VARIANTS:
        raise ValueError(f"unknown few-row kernel {name!r}; known: {sorted(VARIANTS)}")
    variant = name


def fits(x: Any, w: Any, name: str | None = None) -> bool:
    """Whether :func:`few_row_product` takes ``x @ w.T`` itself (else it hands it to MLX)."""
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1] or not x.shape[-1]:
        return False
    rows = x.size // x.shape[-1]
    return (
        _cuda()
        and x.dtype == mx.bfloat16
        and w.dtype == mx.bfloat16
        and max(1, min_rows) <= rows <= MAX_ROWS
        and w.shape[1] % VARIANTS[name or variant] == 0
        and w.shape[0] % 16 == 0
    )


def few_row_product(x: mx.array, w: mx.array, name: str | None = None) -> mx.array:
    """``x @ w.T`` for ``x`` of shape ``(..., K)`` and ``w`` of ``(N, K)``; the kernel where :func:`fits`."""
    name = name or variant
    if not fits(x, w, name):
        return x @ w.T
    n, k = int(w.shape[0]), int(w.shape[1])
    (y,) = _launch(name, x.reshape(x.size // k, k), [w])
    return y.reshape(*x.shape[:-1], n)


def self_check() -> str | None:
    """Compile and run the chosen kernel once on random data; ``None`` if it agrees with MLX, else why not.

    Run at load before the model's products are routed (engine thread): a
    device whose compiler or instruction set refuses the kernel (the bf16
    ``mma`` needs compute capability 8.0) or a kernel that computes
    something else leaves MLX's products in place, with the reason logged,
    instead of failing the first decode step.
    """
    if not _cuda():
        return "CUDA is not the default device"
    name = variant
    k = VARIANTS[name] * 2
    w = mx.random.normal((32, k), key=mx.random.key(11)).astype(mx.bfloat16)
    x = mx.random.normal((MAX_ROWS, k), key=mx.random.key(12)).astype(mx.bfloat16)
    try:
        err = _relative_error(_launch(name, x, [w])[0], x, w)
    except (RuntimeError, ValueError) as exc:
        # NOTE: MLX raises RuntimeError for a compile or launch failure.
        return f"the {name!r} kernel did not run here: {exc}"
    if not err < 2e-2:
        return f"the {name!r} kernel disagrees with MLX's product (relative error {err})"
    return None


def self_check_qkv() -> str | None:
    """The one-launch q|k|v kernel on random data against fp32 references; ``None`` if all three agree."""
    if not _cuda():
        return "CUDA is not the default device"
    keys = mx.random.split(mx.random.key(13), 4)
    ws = tuple(
        mx.random.normal((n, 256), key=keys[i]).astype(mx.bfloat16)
        for i, n in enumerate((64, 32, 16))
    )
    x = mx.random.normal((MAX_ROWS, 1, 256), key=keys[3]).astype(mx.bfloat16)
    try:
        got = qkv_product(x, (ws[0], ws[1], ws[2]))
        errs = [_relative_error(y, x, w) for y, w in zip(got, ws, strict=True)]
    except (RuntimeError, ValueError) as exc:
        return f"the q|k|v kernel did not run here: {exc}"
    if not all(e < 2e-2 for e in errs):
        return f"the q|k|v kernel disagrees with MLX's products (relative errors {errs})"
    return None


def fits_qkv(x: Any, ws: tuple[Any, Any, Any]) -> bool:
    """Whether :func:`qkv_product` takes the three products in one launch (else one each)."""
    k = x.shape[-1] if x.ndim else 0
    return all(
        w.ndim == 2 and w.shape[1] == k and w.shape[0] % 16 == 0 and w.dtype == mx.bfloat16
        for w in ws
    ) and fits(x, ws[0], "tile")


def qkv_product(x: mx.array, ws: tuple[mx.array, mx.array, mx.array]) -> list[mx.array]:
    """``[x @ wq.T, x @ wk.T, x @ wv.T]``: one launch of the "tile" kernel where :func:`fits_qkv`."""
    if not fits_qkv(x, ws):
        return [few_row_product(x, w) for w in ws]
    k = int(x.shape[-1])
    ns = [int(w.shape[0]) for w in ws]
    outs = _launch("qkv", x.reshape(x.size // k, k), list(ws))
    return [y.reshape(*x.shape[:-1], n) for y, n in zip(outs, ns, strict=True)]


class _Qkv:
    """A layer's q, k and v weights and the three products of the current one-position input."""

    def __init__(self, weights: tuple[mx.array, mx.array, mx.array]) -> None:
        self.weights = weights
        self._x: mx.array | None = None
        self._ys: list[mx.array] = []
        self._left: set[int] = set()

    def take(self, index: int, x: mx.array) -> mx.array:
        if x.ndim < 2 or x.shape[-2] != 1:
            return x @ self.weights[index].T
        # NOTE: mlx-lm's attention calls q, k, v in turn on the same input
        # object; a new input, or a member asking twice, starts a new launch.
        if self._x is not x or index not in self._left:
            self._ys = qkv_product(x, self.weights)
            self._x = x
            self._left = {0, 1, 2}
        y = self._ys[index]
        self._left.discard(index)
        if not self._left:
            self._x = None
            self._ys = []
        return y


class QkvMember(_Module):  # type: ignore[misc]
    """One of q, k, v in a layer whose one-position products run as one launch (replaces its linear)."""

    def __init__(self, shared: _Qkv, index: int) -> None:
        super().__init__()
        self.weight = shared.weights[index]
        self._shared = shared
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._shared.take(self._index, x)


def apply_qkv(model: Any) -> int:
    """Join each layer's bf16 q, k, v (plain linears or few-row linears, no bias) into one launch; returns how many layers."""
    count = 0
    for layer in getattr(model, "layers", None) or []:
        attn = getattr(layer, "self_attn", None)
        members: list[Any] = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if attn is None or not all(
            type(m) in (_Linear, FewRowLinear)
            and "bias" not in m
            and m.weight.dtype == mx.bfloat16
            and m.weight.ndim == 2
            for m in members
        ):
            continue
        shared = _Qkv((members[0].weight, members[1].weight, members[2].weight))
        for i, n in enumerate(("q_proj", "k_proj", "v_proj")):
            setattr(attn, n, QkvMember(shared, i))
        count += 1
    return count
