"""Attention of short queries under an array mask: MLX's own path against kvtier's folded products.

The batch lane's decode step hands attention an array mask (rows are
left-padded). MLX's CUDA backend has no fused kernel for that case and runs
its generic fallback; ``kernels.model.masked_attention`` computes the same
attention with the query heads folded per key head (see its module). This
tool times, per shape, in one process, interleaved:

- ``mlx``: ``mx.fast.scaled_dot_product_attention`` with the boolean mask;
- ``mlx-additive``: the same with the mask as an additive one per row
  (``(B, 1, L, T)`` in the queries' dtype, built inside the timed call);
- ``cudnn-2q``: a one-position query doubled to two with that additive
  mask, so MLX's CUDA backend takes cuDNN's fused attention (its
  one-position paths refuse a mask), the first position kept;
- ``folded``: ``kernels.model.masked_attention`` with the same mask;
- ``kernel`` (CUDA only): the candidate kernel of ``_decode_kernel.py``
  (one-position queries; longer ones are MLX's);
- ``unmasked``: ``mx.fast.scaled_dot_product_attention`` without a mask (the
  fused kernel where one exists: a lower bound, not the same attention);

over keys and values that are slices of a cache-like buffer (allocated in
steps of 256 tokens, as mlx-lm's caches are), Llama-3-8B's heads (32 query,
8 key/value, 128 wide), each row left-padded by a seeded amount up to half
the keys. Prints microseconds per call (median of ``--repeats`` timings of
``--iters`` calls each), the ratios, and the largest difference of
``folded`` from ``mlx`` (must be within the dtype's rounding).

    # on the GPU:
    python3 tools/bench/masked_attention.py --json out.json
    # on the CPU (MLX's CPU path; a check that it runs):
    .venv/bin/python tools/bench/masked_attention.py --shapes 1x640x1,8x640x1 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

DEFAULT_SHAPES = "1x640x1,8x640x1,32x640x1,8x5156x1,32x5156x1,64x640x1,8x5156x56"


def _shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        b, t, q = (int(x) for x in part.strip().split("x"))
        out.append((b, t, q))
    return out


def case(b: int, t: int, length: int, dtype: Any, seed: int) -> dict[str, Any]:
    """Queries, sliced keys/values and a left-padding mask (with causal positions for ``length`` > 1)."""
    import mlx.core as mx

    mx.random.seed(seed)
    alloc = (t + 255) // 256 * 256
    q = mx.random.normal((b, 32, length, 128)).astype(dtype)
    kbuf = mx.random.normal((b, 8, alloc, 128)).astype(dtype)
    vbuf = mx.random.normal((b, 8, alloc, 128)).astype(dtype)
    k, v = kbuf[..., :t, :], vbuf[..., :t, :]
    rng = random.Random(seed)
    pads = [0] + [rng.randrange(0, t // 2) for _ in range(b - 1)]
    pad = mx.array(pads)[:, None, None, None]
    kpos = mx.arange(t)[None, None, None, :]
    qpos = (mx.arange(length) + (t - length))[None, None, :, None]
    mask = (kpos >= pad) & (kpos <= qpos)
    mx.eval(q, kbuf, vbuf, mask)
    return {"q": q, "k": k, "v": v, "mask": mask, "pads": pads}


def contenders() -> dict[str, Any]:
    """Name -> callable(q, k, v, scale, mask)."""
    import mlx.core as mx

    from kernels.model import masked_attention

    def additive(q: Any, k: Any, v: Any, s: float, m: Any) -> Any:
        # NOTE: the same mask as an additive one in the queries' dtype, one per
        # row (B, 1, L, T): MLX then skips its boolean-to-additive conversion,
        # which materializes a (B, H, L, T) mask for the cuDNN path.
        add = mx.where(m, mx.array(0, dtype=q.dtype), mx.array(-mx.inf, dtype=q.dtype))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=add)

    def two_queries(q: Any, k: Any, v: Any, s: float, m: Any) -> Any:
        # NOTE: a one-position query doubled: MLX 0.32's CUDA backend sends a
        # masked query of more than one position to cuDNN's fused attention
        # (the one-position path refuses masks); the first position's output
        # is the answer. Longer queries pass through unchanged.
        if q.shape[2] != 1:
            return additive(q, k, v, s, m)
        q2 = mx.concatenate([q, q], axis=2)
        m2 = mx.concatenate([m, m], axis=2) if m.shape[2] == 1 else m
        return additive(q2, k, v, s, m2)[:, :, :1]

    out: dict[str, Any] = {
        "mlx": lambda q, k, v, s, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=m),
        "mlx-additive": additive,
        "cudnn-2q": two_queries,
        "folded": lambda q, k, v, s, m: masked_attention(q, k, v, scale=s, mask=m),
        "unmasked": lambda q, k, v, s, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=s),
    }
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        from _decode_kernel import decode_attention

        def kernel(q: Any, k: Any, v: Any, s: float, m: Any) -> Any:
            # NOTE: one-position queries only; longer ones are MLX's.
            if q.shape[2] != 1:
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=m)
            return decode_attention(q, k, v, scale=s, mask=m)

        out["kernel"] = kernel
    return out


def time_calls(fn: Any, c: dict[str, Any], iters: int) -> float:
    """Microseconds per call over ``iters`` calls evaluated one by one (as a model's layers are)."""
    import mlx.core as mx

    scale = 128 ** -0.5
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn(c["q"], c["k"], c["v"], scale, c["mask"]))
    mx.synchronize()
    return 1e6 * (time.perf_counter() - t0) / iters


def plot(doc: dict[str, Any], path: Path) -> None:
    """Microseconds per call, per shape and contender (log scale), from a ``--json`` document."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = doc["records"]
    names = [n for n in ("mlx", "mlx-additive", "cudnn-2q", "folded", "kernel", "unmasked")
             if any(n in r["us"] for r in records)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j, r in enumerate(records) if name in r["us"]]
        ys = [r["us"][name] for r in records if name in r["us"]]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(records))])
    ax.set_xticklabels([f"{r['rows']}x{r['keys']}x{r['query']}" for r in records])
    ax.set_yscale("log")
    ax.set_ylabel("us per call (one layer)")
    ax.set_xlabel("rows x keys x query positions")
    ax.set_title(f"Attention under a padding mask, {doc['device']}, MLX {doc['mlx']}, {doc['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Parse, time every shape, print, write ``--json``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="ROWSxKEYSxQUERY, comma separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=32, help="calls per timing (a model's layers)")
    p.add_argument("--repeats", type=int, default=5, help="timings per contender, interleaved")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="a PNG of the figures")
    p.add_argument("--replot", type=Path, default=None, help="plot this --json document and exit")
    args = p.parse_args(argv)
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return 0

    import mlx.core as mx

    dtype = getattr(mx, args.dtype)
    fns = contenders()
    records = []
    print(f"# masked attention: mlx {mx.__version__}, device {mx.default_device()}, {args.dtype}, "
          f"{args.iters} calls per timing, median of {args.repeats}", flush=True)
    print(f"{'rows x keys x query':<20} {'mlx us':>9} {'additive us':>12} {'cudnn-2q us':>12} "
          f"{'folded us':>10} {'unmasked us':>12} {'mlx/folded':>11} {'max |diff|':>11} "
          f"{'2q |diff|':>10}", flush=True)
    for b, t, length in _shapes(args.shapes):
        c = case(b, t, length, dtype, seed=b * 7919 + t)
        scale = 128 ** -0.5
        ref = fns["mlx"](c["q"], c["k"], c["v"], scale, c["mask"]).astype(mx.float32)
        got = fns["folded"](c["q"], c["k"], c["v"], scale, c["mask"]).astype(mx.float32)
        diff = float(mx.max(mx.abs(ref - got)).item())
        got2 = fns["cudnn-2q"](c["q"], c["k"], c["v"], scale, c["mask"]).astype(mx.float32)
        diff2 = float(mx.max(mx.abs(ref - got2)).item())
        diffk = None
        if "kernel" in fns:
            try:
                gotk = fns["kernel"](c["q"], c["k"], c["v"], scale, c["mask"]).astype(mx.float32)
                diffk = float(mx.max(mx.abs(ref - gotk)).item())
            except (RuntimeError, ValueError) as exc:
                # NOTE: the candidate kernel was written without a GPU at hand:
                # a compile or launch failure is printed and the contender
                # dropped, so the other contenders' figures still come out.
                print(f"# kernel contender failed, dropped: {exc}", flush=True)
                del fns["kernel"]
        for fn in fns.values():  # NOTE: warm-up (kernel compilation, buffers).
            time_calls(fn, c, 2)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                times[name].append(time_calls(fn, c, args.iters))
        med = {name: statistics.median(v) for name, v in times.items()}
        rec = {"rows": b, "keys": t, "query": length, "us": med, "us_all": times,
               "mlx_over_folded": med["mlx"] / med["folded"], "max_abs_diff": diff,
               "max_abs_diff_2q": diff2, "max_abs_diff_kernel": diffk}
        records.append(rec)
        print(f"{f'{b} x {t} x {length}':<20} {med['mlx']:9.1f} {med['mlx-additive']:12.1f} "
              f"{med['cudnn-2q']:12.1f} {med['folded']:10.1f} "
              f"{med['unmasked']:12.1f} {rec['mlx_over_folded']:11.2f} {diff:11.2e} {diff2:10.2e}"
              + (f"  kernel {med['kernel']:.1f} us, |diff| {diffk:.2e}" if diffk is not None else ""),
              flush=True)
    doc = {"device": str(mx.default_device()), "mlx": mx.__version__, "dtype": args.dtype,
           "records": records}
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2))
    if args.plot is not None:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
