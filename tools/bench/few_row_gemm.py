"""What a few-row matrix product that reads each weight once would give a CPU decode step (probe, not product code).

Why: on the CPU a batch decode step of the default model is ~70 % matrix
products, and OpenBLAS's ``sgemm`` reads the fp32 weights at ~11 GB/s for
1-8 input rows (it packs each weight panel first), where the memory
streams faster. Issue #10's CPU line (aggregate ≥ 1.1 × ``mlx_lm.server``
at 4 and 8 clients) would need that time to shrink, and MLX has no way to
plug a CPU kernel into its graph from Python. This probe answers the first
question only: how fast a plain AVX2 kernel is (one weight row at a time,
one 8-lane accumulator per input row in blocks of up to 4 rows over
L2-sized tiles of weight rows, so every output element is summed in the
same order whatever the row count), against MLX's product (``x @ w.T``) on
the same data, for the default model's decode shapes.

Each shape is timed over ``--copies`` distinct weight matrices (like the
layers of a step), so the weights come from memory, not the cache; best of
``--reps``. Prints GB/s of weights read and, per row count, the products
of one decode step of the default model (30 layers: q|k|v, o, gate|up,
down; the tied LM head) added up for both. The kernel is C, compiled here
with the system compiler into a temporary directory (``-O3 -mavx2
-mfma``); without a compiler or AVX2 the probe says so and stops.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/few_row_gemm.py
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stddef.h>

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

/* y[m, n] = sum_k x[m, k] * w[n, k] for MM input rows (a compile-time count, so the
   accumulators can stay in registers) and weight rows n in [n0, n1). Each output
   element is one 8-lane accumulator over k in order, then a fixed horizontal sum:
   the same order whatever MM, the tile or the thread split. */
#define ROWS(MM)                                                                       \
static void rows##MM(const float* restrict x, const float* restrict w, float* restrict y, \
                     int K, int N, int n0, int n1) {                                   \
  for (int n = n0; n < n1; n++) {                                                      \
    const float* wr = w + (size_t)n * K;                                               \
    __m256 acc[MM];                                                                    \
    _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();  \
    int k = 0;                                                                         \
    for (; k + 8 <= K; k += 8) {                                                       \
      __m256 wv = _mm256_loadu_ps(wr + k);                                             \
      _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++)                             \
        acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)m * K + k), wv, acc[m]);  \
    }                                                                                  \
    _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) {                             \
      float s = hsum(acc[m]);                                                          \
      for (int kk = k; kk < K; kk++) s += x[(size_t)m * K + kk] * wr[kk];              \
      y[(size_t)m * N + n] = s;                                                        \
    }                                                                                  \
  }                                                                                    \
}
ROWS(1) ROWS(2) ROWS(3) ROWS(4)

typedef void (*rows_fn)(const float*, const float*, float*, int, int, int, int);
static const rows_fn FNS[5] = {0, rows1, rows2, rows3, rows4};

typedef struct { const float* x; const float* w; float* y; int M, K, N, n0, n1; } job;

/* Weight rows in tiles of TILE (fits the L2 cache): every block of 4 input rows
   reads the tile, so the weights come from memory once. */
#define TILE 32
static void* run(void* a) {
  job* j = a;
  for (int t0 = j->n0; t0 < j->n1; t0 += TILE) {
    int t1 = t0 + TILE < j->n1 ? t0 + TILE : j->n1;
    for (int m0 = 0; m0 < j->M; m0 += 4) {
      int mm = j->M - m0 < 4 ? j->M - m0 : 4;
      FNS[mm](j->x + (size_t)m0 * j->K, j->w, j->y + (size_t)m0 * j->N, j->K, j->N, t0, t1);
    }
  }
  return 0;
}

void few_row_matmul(const float* x, const float* w, float* y, int M, int K, int N, int threads) {
  if (threads > 16) threads = 16;
  if (threads <= 1) { job j = {x, w, y, M, K, N, 0, N}; run(&j); return; }
  pthread_t t[16];
  job j[16];
  int per = (N + threads - 1) / threads;
  for (int i = 0; i < threads; i++) {
    int a = i * per > N ? N : i * per, b = a + per > N ? N : a + per;
    j[i] = (job){x, w, y, M, K, N, a, b};
    if (i) pthread_create(&t[i], 0, run, &j[i]);
  }
  run(&j[0]);
  for (int i = 1; i < threads; i++) pthread_join(t[i], 0);
}
"""

# (name, out features N, in features K, products of this shape per decode step)
SHAPES: tuple[tuple[str, int, int, int], ...] = (
    ("q|k|v", 960, 576, 30),
    ("o", 576, 576, 30),
    ("gate|up", 3072, 576, 30),
    ("down", 576, 1536, 30),
    ("LM head", 49152, 576, 1),
)


def build(tmp: Path) -> ctypes.CDLL | None:
    """Compile the kernel; ``None`` (with the reason printed) where it cannot run here."""
    cc = shutil.which("cc") or shutil.which("gcc")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if cc is None or " avx2" not in flags or " fma" not in flags:
        print("no C compiler or no AVX2/FMA here: nothing to measure")
        return None
    src = tmp / "few_row.c"
    lib = tmp / "libfew_row.so"
    src.write_text(SOURCE)
    subprocess.run(
        [cc, "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-o", str(lib), str(src), "-lpthread"],
        check=True,
    )
    dll = ctypes.CDLL(str(lib))
    dll.few_row_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    dll.few_row_matmul.restype = None
    return dll


def best_ms(fn: Callable[[], object], reps: int, copies: int) -> float:
    """Best wall time of ``fn`` over ``reps`` calls, per weight matrix (ms)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best / copies * 1e3


def measure(
    dll: ctypes.CDLL, ws: list[np.ndarray], wm: list[mx.array], m: int, threads: int, reps: int
) -> tuple[float, float, float, float]:
    """MLX ms, kernel ms on 1 and ``threads`` threads (per matrix), and the largest difference to MLX."""
    n, k = ws[0].shape
    x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
    xm = mx.array(x)
    y = np.zeros((m, n), np.float32)

    def ours(count: int) -> None:
        for w in ws:
            dll.few_row_matmul(x.ctypes.data, w.ctypes.data, y.ctypes.data, m, k, n, count)

    ours(1)
    dll.few_row_matmul(x.ctypes.data, ws[0].ctypes.data, y.ctypes.data, m, k, n, 1)
    err = float(np.abs(y - np.asarray(xm @ wm[0].T)).max())

    def theirs() -> None:
        for w in wm:
            mx.eval(xm @ w.T)

    t_mlx = best_ms(theirs, reps, len(ws))
    t_one = best_ms(lambda: ours(1), reps, len(ws))
    t_many = best_ms(lambda: ours(threads), reps, len(ws))
    return t_mlx, t_one, t_many, err


def main() -> int:
    """Time both products per shape and row count; print the table and the per-step sums."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--copies", type=int, default=30, help="distinct weight matrices per shape")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        if dll is None:
            return 0
        rng = np.random.default_rng(0)
        step: dict[tuple[str, int], float] = {}
        for name, n, k, per_step in SHAPES:
            copies = 1 if n * k > 10_000_000 else args.copies
            ws = [rng.standard_normal((n, k), dtype=np.float32) for _ in range(copies)]
            wm = [mx.array(w) for w in ws]
            mx.eval(wm)
            for m in rows:
                t_mlx, t_one, t_many, err = measure(dll, ws, wm, m, args.threads, args.reps)
                mb = n * k * 4 / 1e6
                t_best = min(t_one, t_many)
                step[("mlx", m)] = step.get(("mlx", m), 0.0) + t_mlx * per_step
                step[("ours", m)] = step.get(("ours", m), 0.0) + t_best * per_step
                print(
                    f"{name:8s} {n}x{k} rows {m}: MLX {t_mlx:.3f} ms ({mb / t_mlx:.1f} GB/s), "
                    f"kernel 1 thread {t_one:.3f} ms ({mb / t_one:.1f} GB/s), "
                    f"{args.threads} threads {t_many:.3f} ms ({mb / t_many:.1f} GB/s), "
                    f"max |diff| {err:.1e}",
                    flush=True,
                )
        for m in rows:
            a, b = step[("mlx", m)], step[("ours", m)]
            print(
                f"one decode step's products at {m} rows: MLX {a:.1f} ms, kernel {b:.1f} ms "
                f"(MLX / kernel {a / b:.2f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
