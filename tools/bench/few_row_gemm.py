"""kvtier's few-row product against MLX's on the default model's decode shapes (the kernel alone, no MLX primitive).

Why: on the CPU a batch decode step of the default model is ~70 % matrix
products, and OpenBLAS's ``sgemm`` reads the fp32 weights at ~11 GB/s for
1-8 input rows (it packs each weight panel first), where the memory
streams faster. Issue #10's CPU line (aggregate ≥ 1.1 × ``mlx_lm.server``
at 4 and 8 clients) would need that time to shrink, and MLX has no way to
plug a CPU kernel into its graph from Python. This probe answered the first
question: how fast a plain AVX2 kernel is (one weight row at a time,
one 8-lane accumulator per input row in blocks of up to 4 rows over
L2-sized tiles of weight rows, so every output element is summed in the
same order whatever the row count), against MLX's product (``x @ w.T``) on
the same data, for the default model's decode shapes.

Each shape is timed over ``--copies`` distinct weight matrices (like the
layers of a step), so the weights come from memory, not the cache; best of
``--reps``. Prints GB/s of weights read and, per row count, the products
of one decode step of the default model (30 layers: q|k|v, o, gate|up,
down; the tied LM head) added up for both. The kernel is the product's own
C file (``kernels/native/src/few_row.c``), compiled here with the system
compiler into a temporary directory (``-O3 -mavx2 -mfma``); without a
compiler or AVX2 the probe says so and stops.

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

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "native" / "src" / "few_row.c"
"""The product's own kernel (``kvtier_few_row_matmul``), compiled here without the MLX primitive."""

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
    lib = tmp / "libfew_row.so"
    subprocess.run(
        [
            cc,
            "-O3",
            "-std=gnu11",
            "-mavx2",
            "-mfma",
            "-shared",
            "-fPIC",
            "-o",
            str(lib),
            str(SOURCE),
            "-lpthread",
        ],
        check=True,
    )
    dll = ctypes.CDLL(str(lib))
    dll.kvtier_few_row_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    dll.kvtier_few_row_matmul.restype = ctypes.c_int
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
            dll.kvtier_few_row_matmul(x.ctypes.data, w.ctypes.data, y.ctypes.data, m, k, n, count)

    ours(1)
    dll.kvtier_few_row_matmul(x.ctypes.data, ws[0].ctypes.data, y.ctypes.data, m, k, n, 1)
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
