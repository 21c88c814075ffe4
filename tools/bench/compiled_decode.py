"""A batch decode step as one ``mx.compile``d function against the step kvtier and mlx-lm build each token.

A lone row's decode on MLX's CUDA backend is host-bound: the 8B shape's
token takes 7.2-14.1 ms by the lent host's CPU where its weights' read is
~3.4 ms (H200), and building the step's graph in Python alone costs
3.8-5.0 ms on this box's CPU (printed per batch size, last). A
compiled step replays a traced graph instead of building one, and fuses
its element-wise operations.

The compiled step (``kernels/model/_compiled_decode.py`` says how) keeps
the cache in its inputs and outputs, so one trace serves every step of a
256-position window at a batch size.

Contenders, each over the same prefix (random keys and values, the same
for all) and the same first tokens, pipelined as mlx-lm's generation is
(the next step is built before the last one's token is read):

- ``mlx-lm``: mlx-lm's model (``mlx_lm.utils.load``) and ``BatchKVCache``;
- ``kvtier``: the model as ``kernels.load_model`` transforms it, same cache;
- ``compiled``: kvtier's model through ``kernels.model.CompiledDecode``
  (what ``KVTIER_COMPILED_DECODE=1`` runs), same cache.

Printed: ms per token, median over ``--repeats`` with the range, per batch
size; whether each contender's greedy tokens equal ``kvtier``'s; and how
far one more step's peak memory rose above the memory in use before it
(``step_peak_mb``): a step that writes the token into the caches' buffers
in place holds only its activations, one that copies a layer's buffers
holds that layer's keys and values twice (the compiled step's in-place
writes are a test on the CPU; this checks them on any device). A
diagnosis of the step alone, not a served figure.

    python3 tools/bench/compiled_decode.py --model DIR --batches 1,8,32 --json OUT.json
    python3 tools/bench/compiled_decode.py --plot OUT.png cpu=A.json h100=B.json
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
sys.path.insert(0, str(HERE.parents[1]))


def _prefix(model: Any, batch: int, prefix: int, span: int, seed: int) -> list[tuple[Any, Any]]:
    import mlx.core as mx

    mx.random.seed(seed)
    out = []
    for layer in model.layers:
        attn = layer.self_attn
        heads = attn.n_kv_heads
        dim = attn.head_dim if hasattr(attn, "head_dim") else model.args.hidden_size // attn.n_heads
        dtype = attn.o_proj.weight.dtype if hasattr(attn.o_proj, "weight") else mx.float32
        k = mx.zeros((batch, heads, span, dim), dtype)
        v = mx.zeros((batch, heads, span, dim), dtype)
        k[..., :prefix, :] = (mx.random.normal((batch, heads, prefix, dim)) * 0.5).astype(dtype)
        v[..., :prefix, :] = mx.random.normal((batch, heads, prefix, dim)).astype(dtype)
        out.append((k, v))
    mx.eval(out)
    return out


def _run(model: Any, bufs: list[tuple[Any, Any]], left: list[int], prefix: int,
         first: Any, steps: int, compiled: Any = None) -> tuple[float, float, list[list[int]], float]:
    """One contender over copies of ``bufs``: ms per token, ms of the first step, every step's tokens, and one more step's peak MB over the memory in use before it."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    caches = []
    for k, v in bufs:
        c = BatchKVCache(left)
        c.keys, c.values = mx.array(k), mx.array(v)
        c._idx = prefix
        c.offset = mx.array([prefix - p for p in left])
        caches.append(c)

    def step(y: Any) -> Any:
        if compiled is not None:
            assert compiled.applies(y, caches)
            logits = compiled.forward(y, caches)[:, -1, :]
        else:
            logits = model(y, cache=caches)[:, -1, :]
        return mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]

    ms, first_ms, tokens = _loop(step, first, steps)
    # NOTE: one step more, alone: its peak over what was in use before it.
    y = mx.array(tokens[-1], dtype=mx.int32)
    mx.eval(y)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(step(y))
    mx.synchronize()
    peak_mb = (mx.get_peak_memory() - before) / 2**20
    return ms, first_ms, tokens, peak_mb


def _loop(step: Any, first: Any, steps: int) -> tuple[float, float, list[list[int]]]:
    import mlx.core as mx

    tokens: list[list[int]] = []
    mx.synchronize()
    t0 = time.perf_counter()
    y = step(first)
    mx.async_eval(y)
    # NOTE: the first step (a trace, for the compiled one) is timed apart.
    tokens.append(y.tolist())
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = step(y)
        mx.async_eval(nxt)
        y = nxt
        tokens.append(y.tolist())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps, first_ms, tokens


def build_only(model: Any, batch: int) -> float:
    """Median ms to build (not run) one decode step's graph through mlx-lm's cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    caches = [BatchKVCache([0] * batch) for _ in model.layers]
    model(mx.zeros((batch, 16), dtype=mx.int32), cache=caches)
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        model(mx.zeros((batch, 1), dtype=mx.int32), cache=caches)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def plot(out: Path, runs: list[str]) -> None:
    """Bars of ms per token (median, range as error bars) per contender and batch size, one panel per ``LABEL=JSON`` run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        label, _, path = run.partition("=")
        doc = json.loads(Path(path).read_text())
        batches = list(doc["batches"])
        # NOTE: the contenders are the dict entries (build_ms and layer_kv_mb are figures of the batch size).
        names = [n for n, v in doc["batches"][batches[0]].items() if isinstance(v, dict)]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            med = [doc["batches"][b][name]["ms_per_token"] for b in batches]
            lo = [m - doc["batches"][b][name]["range"][0] for m, b in zip(med, batches, strict=True)]
            hi = [doc["batches"][b][name]["range"][1] - m for m, b in zip(med, batches, strict=True)]
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(batches))]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=name)
        ax.set_xticks(range(len(batches)), [f"{b} rows" for b in batches])
        ax.set_ylabel("ms per decode token (median, range)")
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Print ms per decode token per contender and batch size, and token parity against kvtier's step."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="plot the LABEL=JSON runs given and exit")
    p.add_argument("runs", nargs="*", help="with --plot: LABEL=JSON of earlier --json runs")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prefix", type=int, default=600)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--contenders", default="mlx-lm,kvtier,compiled")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.plot is not None:
        plot(args.plot, args.runs)
        return 0
    if args.model is None:
        p.error("--model is required (or --plot)")

    import mlx.core as mx
    from mlx_lm.utils import load as mlx_load

    from kernels.model import CompiledDecode, load_model

    names = args.contenders.split(",")
    models: dict[str, Any] = {}
    if "mlx-lm" in names:
        models["mlx-lm"] = mlx_load(str(args.model))[0]
    if "kvtier" in names or "compiled" in names:
        models["kvtier"] = load_model(args.model).model
    fn = CompiledDecode(models["kvtier"]) if "compiled" in names else None
    print(f"device {mx.default_device()}, mlx {mx.__version__}", flush=True)

    results: dict[str, Any] = {"batches": {}, "prefix": args.prefix, "steps": args.steps}
    for batch in [int(b) for b in args.batches.split(",")]:
        span = -(-(args.prefix + args.steps + 2) // 256) * 256
        # NOTE: rows of different lengths, as a served batch has (left padding up to 64).
        left = [(7 * r) % 64 for r in range(batch)]
        left[0] = 0
        bufs = _prefix(models["kvtier"], batch, args.prefix, span, seed=batch)
        first = mx.array([[(31 * r + 11) % 1000 + 5] for r in range(batch)], dtype=mx.int32)
        per: dict[str, list[float]] = {n: [] for n in names}
        toks: dict[str, list[list[int]]] = {}
        firsts: dict[str, list[float]] = {}
        peaks: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            # NOTE: contenders rotate, so none always runs first.
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                model = models["kvtier" if name == "compiled" else name]
                ms, first_ms, t, peak_mb = _run(model, bufs, left, args.prefix, first, args.steps,
                                                compiled=fn if name == "compiled" else None)
                per[name].append(ms)
                peaks.setdefault(name, []).append(peak_mb)
                firsts.setdefault(name, []).append(first_ms)
                toks[name] = t
        row = {}
        for name in names:
            v = per[name]
            same = toks[name] == toks.get("kvtier", toks[name])
            row[name] = {"ms_per_token": statistics.median(v), "range": [min(v), max(v)],
                         "first_step_ms": firsts[name], "tokens_equal_kvtier": same,
                         "step_peak_mb": max(peaks[name])}
            print(f"B={batch:3d} {name:9s} {statistics.median(v):7.2f} ms/token [{min(v):.2f}..{max(v):.2f}]"
                  f"  first step {', '.join(f'{f:.0f}' for f in firsts[name])} ms"
                  f"  tokens = kvtier's: {same}  step peak +{max(peaks[name]):.1f} MB", flush=True)
        base = row.get("kvtier", {}).get("ms_per_token")
        if base and "compiled" in row:
            print(f"B={batch:3d} compiled / kvtier {row['compiled']['ms_per_token'] / base:.2f}", flush=True)
        layer_mb = sum(k.nbytes + v.nbytes for k, v in bufs[:1]) / 2**20
        print(f"B={batch:3d} one layer's keys and values: {layer_mb:.1f} MB (a step that copies them peaks at least this much higher)",
              flush=True)
        row["layer_kv_mb"] = layer_mb
        row["build_ms"] = build_only(models["kvtier"], batch)
        print(f"B={batch:3d} building one step's graph (kvtier's model): {row['build_ms']:.2f} ms", flush=True)
        results["batches"][str(batch)] = row
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
