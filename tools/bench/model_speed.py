"""Prefill and decode speed of the default model, fp32 vs 4-bit, side by side.

Usage (Linux: preload OpenBLAS, as the Makefile does)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/model_speed.py [--prompt-tokens 256] [--decode-tokens 32]

Prefill: one forward pass over the prompt into a fresh KV cache. Decode:
greedy single-token steps, each evaluated before the next (what a server
does). Each figure is the median of --repeats runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kernels import ensure_default_model, load_model


def _prompt(tokenizer: Any, n: int) -> list[int]:
    text = (Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity_paragraph.txt").read_text()
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(tokenizer.encode(text))
    return ids[:n]


def _run(model: Any, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = model(mx.array([ids]), cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(token)
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
    decode_s = time.perf_counter() - t1
    return len(ids) / prefill_s, decode_tokens / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    results: dict[str, tuple[float, float]] = {}
    for label, deq in (("fp32", True), ("q4", False)):
        loaded = load_model(ensure_default_model(dequantize=deq))
        ids = _prompt(loaded.tokenizer, args.prompt_tokens)
        _run(loaded.model, ids[:32], 4)  # warm-up
        runs = [_run(loaded.model, ids, args.decode_tokens) for _ in range(args.repeats)]
        prefill = statistics.median(r[0] for r in runs)
        decode = statistics.median(r[1] for r in runs)
        results[label] = (prefill, decode)
        print(f"{label:5s} prefill {prefill:8.1f} tok/s ({args.prompt_tokens} tokens)   "
              f"decode {decode:6.1f} tok/s ({args.decode_tokens} tokens)")
    (pf, df), (pq, dq) = results["fp32"], results["q4"]
    print(f"fp32/q4 ratio: prefill {pf / pq:.1f}x, decode {df / dq:.1f}x")


if __name__ == "__main__":
    main()
