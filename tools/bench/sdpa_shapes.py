"""Prefill attention when every step's shape is new: MLX's fused path against kvtier's folded products.

MLX's CUDA backend runs a query of two or more positions through cuDNN's
fused attention, and keeps one cuDNN graph per exact shape (query, key and
value shapes and strides, the mask's shape: ``MLX_CUDA_SDPA_CACHE_SIZE``
graphs, 256 by default). A served batch lane rarely repeats a shape: every
join has its own group size, suffix length and cached length. This tool
times one model step's attention calls (``--layers`` calls of one shape, as
a model's layers make them) per shape, in one process, interleaved:

- ``fused-new``: ``mx.fast.scaled_dot_product_attention`` with a shape it
  has not seen (the cached length one longer each timing), so each timing
  pays the graph's build;
- ``fused-warm``: the same shape every timing (after one untimed call);
- ``folded-new``: ``kernels.model.masked_attention`` (the same attention as
  two batched products) under the same masks, a new shape each timing.

Masks are the batch lane's: one row under ``"causal"`` (bottom-right
aligned), several rows under an additive ``(B, 1, L, T)`` mask with each row
left-padded by a seeded amount. Keys and values are slices of a buffer
allocated in steps of 256 tokens, as mlx-lm's caches are. Prints
milliseconds per step (median of ``--repeats``) and the largest difference
of ``folded`` from ``fused``.

    # on the GPU:
    python3 tools/bench/sdpa_shapes.py --json out.json
    # on the CPU (a check that it runs; MLX's CPU path has no graph cache):
    .venv/bin/python tools/bench/sdpa_shapes.py --shapes 1x8x64,2x8x64 --dtype float32 --layers 2 --repeats 2
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

DEFAULT_SHAPES = "1x24x5124,8x24x5124,8x160x5300,1x515x540,8x515x540,3x514x540,1x2048x2048,4x2048x4096"
"""ROWSxQUERYxKEYS: the agent turn's joins (a lone row and 8 rows over a cached
~5.1k), guidellm's ~515-token prompts in groups, 2,048-token chunks."""


def _shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        b, q, t = (int(x) for x in part.strip().split("x"))
        out.append((b, q, t))
    return out


def case(b: int, length: int, t: int, dtype: Any, seed: int) -> dict[str, Any]:
    """Queries ``(B, 32, L, 128)``, keys/values sliced to ``t`` from a 256-step buffer, and the batch lane's mask."""
    import mlx.core as mx

    rng = random.Random(seed)
    mx.random.seed(seed)
    cap = (t + 255) // 256 * 256
    q = mx.random.normal((b, 32, length, 128)).astype(dtype)
    kbuf = mx.random.normal((b, 8, cap, 128)).astype(dtype)
    vbuf = mx.random.normal((b, 8, cap, 128)).astype(dtype)
    k = kbuf[..., :t, :]
    v = vbuf[..., :t, :]
    if b == 1:
        mask: Any = "causal"
        rows = mx.arange(length)[:, None] + (t - length)
        boolean = (mx.arange(t)[None, :] <= rows)[None, None]
    else:
        # NOTE: each row left-padded (its first keys hidden) and causal over
        # the rest, bottom-right aligned, as BatchKVCache.make_mask makes it.
        pads = mx.array([rng.randrange(0, max(1, (t - length) // 2)) for _ in range(b)])
        cols = mx.arange(t)[None, None, :]
        rows = mx.arange(length)[None, :, None] + (t - length)
        boolean = ((cols <= rows) & (cols >= pads[:, None, None]))[:, None]
        mask = mx.where(boolean, mx.array(0.0, dtype=dtype), mx.array(-mx.inf, dtype=dtype))
    mx.eval(q, kbuf, vbuf, boolean)
    if not isinstance(mask, str):
        mx.eval(mask)
    return {"q": q, "k": k, "v": v, "mask": mask, "boolean": boolean, "scale": 128**-0.5}


def step_ms(fn: Any, c: dict[str, Any], layers: int) -> float:
    """One step's attention (``layers`` calls of one shape), synchronized, in milliseconds."""
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    outs = [fn(c) for _ in range(layers)]
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def plot(doc: dict[str, Any], path: Path) -> None:
    """Milliseconds per step per shape: fused new / fused warm / folded new, side by side (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["shapes"]
    names = [f"{r['rows']}x{r['query']}x{r['keys']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.27
    for i, (label, key) in enumerate(
        [("fused, new shape", "fused-new"), ("fused, warm", "fused-warm"), ("folded, new shape", "folded-new")]
    ):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [r["median_ms"][key] for r in rows],
               width, label=label)
    ax.set_xticks(range(len(rows)), names, rotation=20, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(f"ms per step ({doc['layers']} calls)")
    ax.set_xlabel("rows x query positions x keys")
    ax.set_title(f"Prefill attention, {doc['device']}, MLX {doc['mlx']}: a new shape's cuDNN graph build")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Time the contenders per shape and print milliseconds per step."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="ROWSxQUERYxKEYS, comma separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--layers", type=int, default=32, help="attention calls per step (a model's layers)")
    p.add_argument("--repeats", type=int, default=5, help="timings per contender, interleaved")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="a PNG of the figures")
    p.add_argument("--replot", type=Path, default=None, help="plot this --json document and exit")
    args = p.parse_args(argv)
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return 0

    import mlx.core as mx

    from kernels.model import masked_attention

    dtype = getattr(mx, args.dtype)

    def fused(c: dict[str, Any]) -> Any:
        return mx.fast.scaled_dot_product_attention(c["q"], c["k"], c["v"], scale=c["scale"], mask=c["mask"])

    def folded(c: dict[str, Any]) -> Any:
        return masked_attention(c["q"], c["k"], c["v"], scale=c["scale"], mask=c["boolean"])

    doc: dict[str, Any] = {
        "device": str(mx.default_device()), "mlx": mx.__version__, "layers": args.layers,
        "repeats": args.repeats, "dtype": args.dtype, "shapes": [],
    }
    # NOTE: every "new" timing gets a cached length no call has used yet
    # (one longer each time, over all shapes), so no graph is reused.
    bump = 0
    for b, length, t in _shapes(args.shapes):
        warm = case(b, length, t, dtype, seed=1)
        fused(warm)
        mx.eval(fused(warm))
        times: dict[str, list[float]] = {"fused-new": [], "fused-warm": [], "folded-new": []}
        for r in range(args.repeats):
            bump += 1
            fresh = case(b, length, t + bump, dtype, seed=100 + r)
            times["fused-new"].append(step_ms(fused, fresh, args.layers))
            times["fused-warm"].append(step_ms(fused, warm, args.layers))
            bump += 1
            other = case(b, length, t + bump, dtype, seed=200 + r)
            times["folded-new"].append(step_ms(folded, other, args.layers))
        diff = mx.abs(fused(warm).astype(mx.float32) - folded(warm).astype(mx.float32)).max().item()
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"rows": b, "query": length, "keys": t, "ms": times, "median_ms": med, "max_abs_diff": diff}
        doc["shapes"].append(row)
        print(
            f"{b:>2} rows x {length:>5} queries over {t:>5} keys: "
            f"fused new {med['fused-new']:8.2f} warm {med['fused-warm']:7.2f} | "
            f"folded new {med['folded-new']:7.2f} ms/step ({args.layers} calls) | "
            f"folded/fused-warm {med['folded-new'] / med['fused-warm']:.2f} "
            f"| max |diff| {diff:.3g}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
