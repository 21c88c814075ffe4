"""CPU attention with the native softmax against MLX's own: prefill and decode of the default model, side by side.

MLX's CPU backend on x86 computes a softmax one element at a time with the C
library's ``expf`` (~13 ns an element on the 2-core box); in a long
prefill's attention that is most of the time. kvtier's native softmax
(``kernels/native/src/softmax.c``, ``KVTIER_NATIVE_SOFTMAX``) runs every
float32 attention call on the CPU as folded products with an 8-lane exp.

For each contender of ``--contenders`` (``mlx``: mlx-lm's attention;
``native``: kvtier's dispatch with the native softmax as kvtier binds it,
its rows split across the few-row product's threads; ``native1``: the same
on one thread), interleaved over ``--rounds``:

- prefill: a prompt of ``--prompt-tokens`` in chunks of each ``--chunks``
  size, the cache evaluated after every chunk (as the engine does), seconds
  and tokens per second;
- decode: one step of ``--rows`` rows over ``--context`` cached tokens
  (random keys and values), ms per step;
- batch prefill (``--batch-prefill``): ``--rows`` left-padded rows of up to
  ``--batch-tokens`` tokens prefilled together through mlx-lm's
  ``BatchKVCache`` (a boolean mask array: the batch lane's joins), seconds.

``native-where`` is ``native`` with a mask array applied by MLX's ``where``
before the plain rows (the path before the masked rows).

Prints the medians and native/mlx ratios, writes JSON and a PNG.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/cpu_attention.py --plot docs/benchmarks/cpu_attention.png
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def _prefill_s(model: Any, tokens: int, chunk: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array([[i % 1000 + 10 for i in range(tokens)]])
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for at in range(0, tokens, chunk):
        model(ids[:, at : at + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def _decode_ms(model: Any, rows: int, context: int, steps: int = 8) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    a = model.args
    head = a.hidden_size // a.num_attention_heads
    cache = make_prompt_cache(model)
    for c in cache:
        kv = mx.random.normal((rows, a.num_key_value_heads, context, head))
        c.keys, c.values, c.offset = kv, kv, context
    mx.eval([c.keys for c in cache])
    x = mx.array([[5]] * rows)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        if i >= 2:  # NOTE: the first two steps warm the kernels up
            times.append(time.perf_counter() - t0)
        for c in cache:
            c.offset -= 1
    return statistics.median(times) * 1e3


def _batch_prefill_s(model: Any, rows: int, tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    # NOTE: rows of tokens, tokens - 37, tokens - 74, ...: left padding under a mask array.
    pads = [min(i * 37, tokens - 1) for i in range(rows)]
    ids = mx.array([[0] * p + [(i * 13 + j) % 1000 + 10 for j in range(tokens - p)]
                    for i, p in enumerate(pads)])
    cache = [BatchKVCache(pads) for _ in model.layers]
    t0 = time.perf_counter()
    mx.eval(model(ids, cache=cache))
    mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def _contender(model: Any, name: str) -> None:
    from kernels.model import bind_masked_attention, unbind_masked_attention
    from kernels.native import causal_softmax_op, load_extension, masked_softmax_op, softmax_op

    unbind_masked_attention(model)
    if name == "mlx":
        return
    # NOTE: as kvtier binds it on the CPU: the plain rows, the causal and the masked ones.
    op, causal, masked = softmax_op(), causal_softmax_op(), masked_softmax_op()
    if op is None or causal is None or masked is None:
        raise SystemExit("the native softmax does not run here")
    if name == "native1":
        ext = load_extension()
        op = functools.partial(ext.softmax, threads=1)
        causal = functools.partial(ext.softmax_causal, threads=1)
        masked = functools.partial(ext.softmax_masked, threads=1)
    elif name == "native-where":
        masked = None
    elif name != "native":
        raise SystemExit(f"no contender {name!r} (mlx, native, native1, native-where)")
    bind_masked_attention(model, cpu_softmax=op, cpu_causal=causal, cpu_masked=masked)


def plot(doc: dict[str, Any], out: Path) -> None:
    """Panels: prefill tok/s per chunk size, decode ms per step, the masked batch prefill's seconds (when run); one bar per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = any(doc.get("batch_prefill_s", {}).values())
    fig, axes = plt.subplots(1, 3 if batch else 2, figsize=(15 if batch else 10, 4.2))
    left, right = axes[0], axes[1]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    chunks = [str(c) for c in doc["chunks"]]
    names = list(doc["decode_ms"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        tps = [doc["prompt_tokens"] / statistics.median(doc["prefill_s"][name][c]) for c in chunks]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(chunks))]
        left.bar(xs, tps, width, label=name)
        for x, v in zip(xs, tps, strict=True):
            left.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    left.set_xticks(range(len(chunks)), chunks)
    left.set_xlabel("prefill chunk (tokens)")
    left.set_ylabel(f"prefill tok/s, {doc['prompt_tokens']}-token prompt (median)")
    left.legend()
    ms = [statistics.median(doc["decode_ms"][n]) for n in names]
    right.bar(names, ms, color=colors[: len(names)])
    for x, v in enumerate(ms):
        right.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    right.set_ylabel(f"ms per decode step, {doc['rows']} rows x {doc['context']} cached (median)")
    if batch:
        secs = [statistics.median(doc["batch_prefill_s"][n]) for n in names]
        axes[2].bar(names, secs, color=colors[: len(names)])
        for x, v in enumerate(secs):
            axes[2].text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        axes[2].set_ylabel(f"s, batch prefill of {doc['rows']} left-padded rows x "
                           f"{doc.get('batch_tokens')} (median)")
    fig.suptitle(f"CPU attention: MLX's softmax vs kvtier's native one ({doc['machine']})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main(argv: list[str] | None = None) -> int:
    """Run both contenders interleaved; print medians and ratios."""
    import platform

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model dir (default model if unset)")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--chunks", default="128,256,512", help="prefill chunk sizes (comma list)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=1152)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--contenders", default="mlx,native",
                   help="comma list of mlx, native, native1, native-where")
    p.add_argument("--batch-prefill", action="store_true", help="also time a masked batch prefill")
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)

    from kernels.model import default_model_dir, load_model

    model = load_model(args.model or default_model_dir()).model
    chunks = [int(c) for c in args.chunks.split(",")]
    names = args.contenders.split(",")
    doc: dict[str, Any] = {
        "machine": f"{platform.machine()} {platform.system()}",
        "prompt_tokens": args.prompt_tokens,
        "chunks": chunks,
        "rows": args.rows,
        "batch_tokens": args.batch_tokens,
        "context": args.context,
        "prefill_s": {n: {str(c): [] for c in chunks} for n in names},
        "decode_ms": {n: [] for n in names},
        "batch_prefill_s": {n: [] for n in names},
    }
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            _contender(model, name)
            for c in chunks:
                s = _prefill_s(model, args.prompt_tokens, c)
                doc["prefill_s"][name][str(c)].append(s)
                print(f"round {r} {name:>6} prefill chunk {c:>4}: {s:6.2f} s ({args.prompt_tokens / s:5.0f} tok/s)",
                      flush=True)
            if args.batch_prefill:
                s = _batch_prefill_s(model, args.rows, args.batch_tokens)
                doc["batch_prefill_s"][name].append(s)
                print(f"round {r} {name:>6} batch prefill {args.rows} rows x {args.batch_tokens}: "
                      f"{s:6.2f} s", flush=True)
            ms = _decode_ms(model, args.rows, args.context)
            doc["decode_ms"][name].append(ms)
            print(f"round {r} {name:>6} decode {args.rows} rows x {args.context}: {ms:6.1f} ms", flush=True)
    print()
    first = names[0]
    for c in chunks:
        med = {k: statistics.median(doc["prefill_s"][k][str(c)]) for k in names}
        print(f"prefill {args.prompt_tokens} tokens, chunk {c:>4}: "
              + ", ".join(f"{k} {v:6.2f} s ({med[first] / v:4.2f} x {first})" for k, v in med.items()))
    if args.batch_prefill:
        med = {k: statistics.median(doc["batch_prefill_s"][k]) for k in names}
        print(f"batch prefill {args.rows} rows x {args.batch_tokens} (left-padded, masked): "
              + ", ".join(f"{k} {v:6.2f} s ({med[first] / v:4.2f} x)" for k, v in med.items()))
    med = {k: statistics.median(doc["decode_ms"][k]) for k in names}
    print(f"decode {args.rows} rows x {args.context}: "
          + ", ".join(f"{k} {v:6.1f} ms ({med[first] / v:4.2f} x)" for k, v in med.items()))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
