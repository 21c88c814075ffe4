"""A candidate CUDA kernel for the batch lane's masked decode attention (a benchmark contender, not wired in).

MLX 0.32's CUDA backend has no fused kernel for a one-position query under
an array mask; ``kernels.model.masked_attention`` folds the query heads
into two batched products (five or six kernels a layer). This is the
flash-decoding shape of the same attention in one pass plus a small
combine, written with ``mx.fast.cuda_kernel``:

- pass 1, one block per (row, key head, key chunk): ``BN`` warps walk the
  chunk's keys, each warp one key at a time, its 32 lanes holding 4 of the
  128 head dimensions; the ``REP`` query heads that share the key head are
  scored against each key read once; a key the mask hides is skipped (the
  mask is read per key, so any boolean ``(B, 1, 1, T)`` mask works, not only
  left padding); each warp keeps an online softmax per query head, and the
  warps' partial results combine in shared memory into the chunk's
  unnormalized output, its running maximum and its sum;
- pass 2, one block per (row, query head): the chunks combined and
  normalized (a row whose every key is hidden, a reused slot's hole, gets
  zeros).

NOTE: the body compiles with NVRTC inside ``mlx::core::cu`` after MLX's
device ``utils.cuh`` (``-inf`` is its ``Limits<float>::min()``: NVRTC has no
``INFINITY`` macro). Keys and values are read in place through their strides (slices of the
cache's buffer). ``masked_attention.py`` times it as ``kernel`` beside MLX's
path and the folded products, and prints its largest difference from MLX.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["decode_attention"]

_PASS1 = r"""
    const int b = blockIdx.x / (HKV * SPLIT);
    const int h = (blockIdx.x / SPLIT) % HKV;
    const int split = blockIdx.x % SPLIT;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int T = k_shape[2];
    const int chunk = (T + SPLIT - 1) / SPLIT;
    const int t0 = split * chunk;
    const int t1 = T < t0 + chunk ? T : t0 + chunk;
    const float sc = scale[0];

    float qv[REP][4];
    float o[REP][4];
    float m[REP];
    float l[REP];
    for (int r = 0; r < REP; ++r) {
        const int hq = h * REP + r;
        const int64_t qoff = b * q_strides[0] + hq * q_strides[1];
        for (int i = 0; i < 4; ++i) {
            qv[r][i] = static_cast<float>(q[qoff + (lane * 4 + i) * q_strides[3]]) * sc;
            o[r][i] = 0.0f;
        }
        m[r] = Limits<float>::min();
        l[r] = 0.0f;
    }
    const int64_t kbase = b * k_strides[0] + h * k_strides[1];
    const int64_t vbase = b * v_strides[0] + h * v_strides[1];
    const int64_t mbase = b * mask_strides[0];
    for (int t = t0 + warp; t < t1; t += BN) {
        if (!mask[mbase + t * mask_strides[3]]) {
            continue;
        }
        float kv[4];
        float vv[4];
        for (int i = 0; i < 4; ++i) {
            kv[i] = static_cast<float>(k[kbase + t * k_strides[2] + (lane * 4 + i) * k_strides[3]]);
            vv[i] = static_cast<float>(v[vbase + t * v_strides[2] + (lane * 4 + i) * v_strides[3]]);
        }
        for (int r = 0; r < REP; ++r) {
            float s = qv[r][0] * kv[0] + qv[r][1] * kv[1] + qv[r][2] * kv[2] + qv[r][3] * kv[3];
            for (int off = 16; off > 0; off >>= 1) {
                s += __shfl_xor_sync(0xffffffff, s, off);
            }
            const float mn = fmaxf(m[r], s);
            const float f = expf(m[r] - mn);
            const float p = expf(s - mn);
            l[r] = l[r] * f + p;
            for (int i = 0; i < 4; ++i) {
                o[r][i] = o[r][i] * f + p * vv[i];
            }
            m[r] = mn;
        }
    }
    // NOTE: shared layout: per warp, REP maxima, REP sums, REP x 128 outputs.
    extern __shared__ float smem[];
    float* sm = smem;
    float* sl = smem + BN * REP;
    float* so = smem + 2 * BN * REP;
    for (int r = 0; r < REP; ++r) {
        if (lane == 0) {
            sm[warp * REP + r] = m[r];
            sl[warp * REP + r] = l[r];
        }
        for (int i = 0; i < 4; ++i) {
            so[(warp * REP + r) * 128 + lane * 4 + i] = o[r][i];
        }
    }
    __syncthreads();
    // NOTE: the block's threads combine the warps: thread j < REP * 128 owns
    // query head j / 128, dimension j % 128.
    for (int j = threadIdx.x; j < REP * 128; j += blockDim.x) {
        const int r = j / 128;
        const int d = j % 128;
        float M = Limits<float>::min();
        for (int w = 0; w < BN; ++w) {
            M = fmaxf(M, sm[w * REP + r]);
        }
        float L = 0.0f;
        float O = 0.0f;
        if (M != Limits<float>::min()) {
            for (int w = 0; w < BN; ++w) {
                const float e = expf(sm[w * REP + r] - M);
                L += sl[w * REP + r] * e;
                O += so[(w * REP + r) * 128 + d] * e;
            }
        }
        const int hq = h * REP + r;
        const int64_t row = (int64_t(b) * (HKV * REP) + hq) * SPLIT + split;
        o_part[row * 128 + d] = O;
        if (d == 0) {
            m_part[row] = M;
            l_part[row] = L;
        }
    }
"""

_PASS2 = r"""
    const int bh = blockIdx.x;
    const int d = threadIdx.x;
    float M = Limits<float>::min();
    for (int s = 0; s < SPLIT; ++s) {
        M = fmaxf(M, m_part[bh * SPLIT + s]);
    }
    float L = 0.0f;
    float O = 0.0f;
    if (M != Limits<float>::min()) {
        for (int s = 0; s < SPLIT; ++s) {
            const float e = expf(m_part[bh * SPLIT + s] - M);
            L += l_part[bh * SPLIT + s] * e;
            O += o_part[(bh * SPLIT + s) * 128 + d] * e;
        }
    }
    out[bh * 128 + d] = static_cast<T>(L > 0.0f ? O / L : 0.0f);
"""

BN = 8
"""Warps per block of pass 1 (each walks every BN-th key of the chunk)."""


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import mlx.core as mx

    shared = 4 * (2 * BN * 8 + BN * 8 * 128)  # NOTE: room for REP up to 8.
    pass1 = mx.fast.cuda_kernel(
        name="kvtier_masked_decode_pass1",
        input_names=["q", "k", "v", "mask", "scale"],
        output_names=["o_part", "m_part", "l_part"],
        source=_PASS1,
        ensure_row_contiguous=False,
        shared_memory=shared,
    )
    pass2 = mx.fast.cuda_kernel(
        name="kvtier_masked_decode_pass2",
        input_names=["o_part", "m_part", "l_part"],
        output_names=["out"],
        source=_PASS2,
    )
    return pass1, pass2


def _splits(blocks: int, keys: int) -> int:
    """Key chunks per (row, key head): enough blocks for the GPU's ~132 SMs, chunks of 256 keys or more."""
    want = max(1, -(-264 // blocks))
    return max(1, min(want, keys // 256 or 1))


def decode_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any) -> Any:
    """Attention of ``q`` ``(B, H, 1, 128)`` over ``k``/``v`` ``(B, Hkv, T, 128)`` under a boolean ``(B, 1, 1, T)`` mask."""
    import mlx.core as mx

    b, h, length, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if length != 1 or d != 128 or h % hkv or h // hkv > 8:
        raise ValueError(f"unsupported shape: q {q.shape}, k {k.shape}")
    if mask.dtype != mx.bool_:
        raise ValueError("the kernel takes a boolean mask")
    while mask.ndim < 4:
        mask = mask[None]
    mask = mx.broadcast_to(mask, (b, 1, 1, t))
    rep = h // hkv
    split = _splits(b * hkv, t)
    pass1, pass2 = _kernels()
    o_part, m_part, l_part = pass1(
        inputs=[q, k, v, mask, mx.array([scale], dtype=mx.float32)],
        template=[("REP", rep), ("HKV", hkv), ("SPLIT", split), ("BN", BN)],
        grid=(b * hkv * split * BN * 32, 1, 1),
        threadgroup=(BN * 32, 1, 1),
        output_shapes=[(b * h * split, 128), (b * h * split,), (b * h * split,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    (out,) = pass2(
        inputs=[o_part, m_part, l_part],
        template=[("SPLIT", split), ("T", q.dtype)],
        grid=(b * h * 128, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(b, h, 1, 128)],
        output_dtypes=[q.dtype],
    )
    return out
