"""What a shape MLX has not run before costs, op by op: a matmul, a model forward, its attention.

Served joins rarely repeat a shape; on MLX's CUDA backend a lone row's
24-token join over a cached 5,100 took ~110 ms with every shape new against
~20 ms with shapes repeated (``join_cost.py --new-shapes``). This tool
times, synchronized, each of these with a query length never used before
(``new``) and with one used just before (``warm``):

- ``matmul``: ``(L, hidden) @ (hidden, intermediate)`` in the model's dtype;
- ``forward``: the model over ``L`` tokens with a fresh cache (no prefix);
- ``forward+cache``: the model over ``L`` tokens after a cached prefix of
  ``--prefix`` tokens (the served join);
- with ``--parts``, that join's pieces in the first layer, each alone: the
  whole block, its attention module (projections, rope, the cache's update,
  attention), the attention call by itself (``sdpa``: ``L`` queries over
  ``prefix + L`` keys, causal), the MLP, a norm, and the output projection
  over ``L`` positions: which of them a new length makes slow.

    python3 tools/bench/shape_costs.py --model DIR --json OUT.json
    python3 tools/bench/shape_costs.py --plot OUT.png default=A.json graphs-off=B.json ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))


def _timed(fn: Any) -> float:
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def plot(out: Path, runs: list[str]) -> None:
    """Bars of the median ms per call, new shape and warm, per op, for each ``LABEL=JSON`` run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = []
    for run in runs:
        label, _, path = run.partition("=")
        docs.append((label, json.loads(Path(path).read_text())))
    ops = list(docs[0][1]["results"])
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 4.2), squeeze=False)
    width = 0.38
    for ax, op in zip(axes[0], ops, strict=True):
        xs = range(len(docs))
        new = [statistics.median(d["results"][op]["new_ms"]) for _, d in docs]
        warm = [statistics.median(d["results"][op]["warm_ms"]) for _, d in docs]
        ax.bar([x - width / 2 for x in xs], new, width, label="new query length", color="tab:red")
        ax.bar([x + width / 2 for x in xs], warm, width, label="same length again", color="tab:blue")
        for x, (n, w) in enumerate(zip(new, warm, strict=True)):
            ax.text(x - width / 2, n, f"{n:.1f}", ha="center", va="bottom", fontsize=8)
            ax.text(x + width / 2, w, f"{w:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [label for label, _ in docs], fontsize=8)
        ax.set_title(op)
        ax.set_ylabel("ms per call (median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"a new query length's cost, op by op (prefix {docs[0][1]['prefix']} for forward+cache)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def _parts(model: Any, base: Any, hidden: int, dtype: Any) -> dict[str, Any]:
    """The first layer's pieces of a join over ``base`` (layer 0's prefix cache), each a ``length -> call``."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layer = model.layers[0]
    attn = layer.self_attn
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    head_dim = hidden // heads
    # NOTE: the prefix alone (the cache's buffer may run past its offset).
    keys = base.keys[..., : base.offset, :]
    values = base.values[..., : base.offset, :]
    mx.eval(keys, values)

    def lent() -> Any:
        # NOTE: a copy of layer 0's prefix cache per call, as forward+cache copies all layers.
        cache = KVCache()
        cache.keys, cache.values = mx.array(keys), mx.array(values)
        cache.offset = base.offset
        return cache

    def x(n: int) -> Any:
        return mx.ones((1, n, hidden), dtype=dtype)

    def sdpa(n: int) -> Any:
        q = mx.ones((1, heads, n, head_dim), dtype=dtype)
        k = mx.concatenate([keys, mx.ones((1, kv_heads, n, head_dim), dtype=dtype)], axis=2)
        v = mx.concatenate([values, mx.ones((1, kv_heads, n, head_dim), dtype=dtype)], axis=2)
        mx.eval(q, k, v)
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask="causal")

    def head(n: int) -> Any:
        out = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear
        return lambda: out(x(n))

    # NOTE: the block and its attention get mask="causal", what a lone row's
    # prefill passes them (mlx-lm's create_attention_mask for L > 1).
    return {
        "layer": lambda n: (lambda: layer(x(n), mask="causal", cache=lent())),
        "attention": lambda n: (lambda: attn(x(n), mask="causal", cache=lent())),
        "sdpa": sdpa,
        "mlp": lambda n: (lambda: layer.mlp(x(n))),
        "norm": lambda n: (lambda: layer.input_layernorm(x(n))),
        "lm_head": head,
    }


def main(argv: list[str] | None = None) -> int:
    """Print milliseconds per call, new shape against warm, per contender (or plot saved runs)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="plot the LABEL=JSON runs given and exit")
    p.add_argument("runs", nargs="*", help="with --plot: LABEL=JSON of earlier --json runs")
    p.add_argument("--length", type=int, default=24, help="the first new query length")
    p.add_argument("--prefix", type=int, default=5100, help="forward+cache: the cached prefix")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--parts", action="store_true",
                   help="also time the first layer's pieces of forward+cache, each alone")
    p.add_argument("--attention-buckets", action="store_true",
                   help="prefill attention at bucketed shapes (kvtier's KVTIER_CUDA_ATTENTION_BUCKETS)")
    p.add_argument("--suffix-fold", action="store_true",
                   help="short prefills over a cached prefix folded over keys padded to 256 "
                        "(kvtier's KVTIER_CUDA_SUFFIX_FOLD)")
    args = p.parse_args(argv)
    if args.plot is not None:
        plot(args.plot, args.runs)
        return 0
    if args.model is None:
        p.error("--model is required (or --plot)")

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kernels.model import load_model

    loaded = load_model(args.model)
    model = loaded.model
    if args.attention_buckets or args.suffix_fold:
        from kernels.model import bind_masked_attention

        bind_masked_attention(model, buckets=args.attention_buckets, suffix_fold=args.suffix_fold)
    args_m = model.args
    hidden, inter = args_m.hidden_size, args_m.intermediate_size
    dtype = model.layers[0].mlp.down_proj.weight.dtype
    w = mx.random.normal((hidden, inter)).astype(dtype)
    mx.eval(w)
    prefix = mx.array([[i % 1000 + 10 for i in range(args.prefix)]])
    base = make_prompt_cache(model)
    for at in range(0, args.prefix, 2048):
        model(prefix[:, at : at + 2048], cache=base)
    mx.eval([c.state for c in base])

    def cached(length: int) -> Any:
        # NOTE: a copy of the prefix's cache each call (the served lease copies too).
        cache = make_prompt_cache(model)
        for c, b in zip(cache, base, strict=True):
            c.state = [mx.array(x) for x in b.state]
            c.offset = b.offset
        return model(mx.array([[7] * length]), cache=cache)

    contenders = {
        "matmul": lambda n: (lambda: mx.ones((n, hidden), dtype=dtype) @ w),
        "forward": lambda n: (lambda: model(mx.array([[5] * n]))),
        "forward+cache": lambda n: (lambda: cached(n)),
    }
    if args.parts:
        contenders.update(_parts(model, base[0], hidden, dtype))
    length = args.length
    for fn in contenders.values():  # NOTE: one untimed call of each (first kernels)
        _timed(fn(length))
    doc: dict[str, Any] = {"model": str(args.model), "prefix": args.prefix, "results": {}}
    for name, fn in contenders.items():
        new, warm = [], []
        for _ in range(args.repeats):
            length += 1
            new.append(_timed(fn(length)))
            warm.append(_timed(fn(length)))
        doc["results"][name] = {"new_ms": new, "warm_ms": warm}
        print(f"{name:>14}: new shape {statistics.median(new):8.2f} ms  warm {statistics.median(warm):8.2f} ms"
              f"  (new {', '.join(f'{x:.1f}' for x in new)})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
