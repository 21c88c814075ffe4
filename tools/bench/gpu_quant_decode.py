"""What the CUDA contiguous-operand copy costs a decode step over a long quantized KV cache.

On MLX's CUDA backend kvtier hands mlx-lm's quantized attention row-contiguous
keys and values (``kernels/cache/_contiguous_attention.py``): each decode
step whose offset is not a multiple of the cache's 256-token step copies the
valid part of every layer's quantized keys and values. This script builds a
random-weight model of a real shape, prefills ``--tokens`` tokens (2,048-token
chunks, converted to ``--bits``-bit KV like the engine), then per round:

- ``step``: ``--steps`` greedy decode steps, each evaluated on its own (the
  product's path, copy included);
- ``copy``: the same number of rounds of only the copies a step makes
  (``mx.contiguous`` of every layer's sliced quantized keys and values);
- ``bf16 step``: decode steps of the same model over a bf16 cache of the
  same length, for scale.

Prints per-round medians (ms per step) and the copy's share of a step.

Usage: python tools/bench/gpu_quant_decode.py --shape llama3-8b --tokens 32768
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_cold_tier import prefill
from gpu_engine import SHAPES, build_model

from kernels.cache import resolve_kv_scheme


def decode_steps(model: Any, cache: list[Any], token: int, steps: int) -> list[float]:
    times = []
    y = mx.array([[token]])
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(y, cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1)[None]
        mx.eval(y)
        times.append(time.perf_counter() - t)
        y = y.reshape(1, 1)
    return times


def copy_rounds(cache: list[Any], steps: int) -> list[float]:
    """The copies one step's attention makes: every layer's quantized K and V sliced to the offset."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = []
        for c in cache:
            off = c.offset
            for part in (c.keys, c.values):
                out.extend(mx.contiguous(x[..., :off, :]) for x in part)
        mx.eval(out)
        times.append(time.perf_counter() - t)
        del out
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    model, n = build_model(args.shape, args.vocab, 0, mx.bfloat16)
    print(f"{args.shape}: {n:.2f}B params, device {mx.default_device()}, mlx {mx.__version__}", flush=True)
    tokens = [(i * 7919) % args.vocab for i in range(args.tokens)]
    scheme = resolve_kv_scheme(str(args.bits), group_size=64)
    q_cache = prefill(model, tokens, scheme)
    b_cache = prefill(model, tokens, None)
    decode_steps(model, q_cache, 1, 4)  # NOTE: warm-up: kernel compilation, first-step allocations.
    decode_steps(model, b_cache, 1, 4)
    copy_rounds(q_cache, 2)
    med: dict[str, list[float]] = {"step": [], "copy": [], "bf16 step": []}
    for r in range(args.rounds):
        step = statistics.median(decode_steps(model, q_cache, 1, args.steps))
        copy = statistics.median(copy_rounds(q_cache, args.steps))
        bf16 = statistics.median(decode_steps(model, b_cache, 1, args.steps))
        med["step"].append(step)
        med["copy"].append(copy)
        med["bf16 step"].append(bf16)
        print(
            f"round {r + 1}: {args.bits}-bit step {step * 1e3:.2f} ms, its copies {copy * 1e3:.2f} ms "
            f"({copy / step:.1%}), bf16 step {bf16 * 1e3:.2f} ms; offset {q_cache[0].offset}",
            flush=True,
        )
    for name, values in med.items():
        print(f"{name}: median {statistics.median(values) * 1e3:.2f} ms "
              f"(min {min(values) * 1e3:.2f}, max {max(values) * 1e3:.2f})")
    share = [c / s for c, s in zip(med["copy"], med["step"], strict=True)]
    print(f"copy share of a {args.bits}-bit step: median {statistics.median(share):.1%} "
          f"({min(share):.1%}-{max(share):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
