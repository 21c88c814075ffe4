"""A decode step of the default model with every one-token product run eagerly by ``few_row_gemm``'s kernel (probe).

Companion of ``few_row_gemm.py``: MLX gives Python no way to put a CPU
kernel of ours inside its lazy graph, so the only route without a C++
extension is eager. Here every ``nn.Linear`` of the default model (fp32,
unfused) and its tied LM head is replaced, for one-token inputs, by: evaluate
the input, hand its buffer to the kernel, wrap the result in a new array.
Longer inputs (the prefill) keep MLX's product. Per round and row count,
the plain and the replaced model each prefill 64 random tokens per row and
run ``--steps`` greedy steps; prints the median step time of each and how
many steps chose the same tokens.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/eager_native_step.py
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from few_row_gemm import build

from kernels.model import default_model_dir, load_model


class EagerLinear(nn.Module):  # type: ignore[misc]
    """``x @ w.T``; one-token inputs go through the C kernel, eagerly."""

    def __init__(self, weight: mx.array, dll: ctypes.CDLL, threads: int) -> None:
        super().__init__()
        self.weight = weight
        self._w = np.asarray(weight)
        self._dll = dll
        self._threads = threads

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim != 3 or x.shape[1] != 1:
            return x @ self.weight.T
        mx.eval(x)
        xn = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).reshape(-1, x.shape[-1])
        m, k = xn.shape
        n = self._w.shape[0]
        y = np.empty((m, n), np.float32)
        self._dll.kvtier_few_row_matmul(
            xn.ctypes.data, self._w.ctypes.data, y.ctypes.data, m, k, n, self._threads
        )
        return mx.array(y).reshape(x.shape[0], 1, n)


class EagerHead(nn.Embedding):  # type: ignore[misc]
    """The tied embedding, with its ``as_linear`` (the LM head) through :class:`EagerLinear`."""

    def __init__(self, weight: mx.array, dll: ctypes.CDLL, threads: int) -> None:
        super().__init__(weight.shape[0], weight.shape[1])
        self.weight = weight
        self._head = EagerLinear(weight, dll, threads)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._head(x)


def replace_products(model: Any, dll: ctypes.CDLL, threads: int) -> None:
    """Every projection of every layer, and the tied head, through the kernel (in place)."""
    groups = (
        ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
        ("mlp", ("gate_proj", "up_proj", "down_proj")),
    )
    for layer in model.layers:
        for part, names in groups:
            parent = getattr(layer, part)
            for name in names:
                setattr(parent, name, EagerLinear(getattr(parent, name).weight, dll, threads))
    model.model.embed_tokens = EagerHead(model.model.embed_tokens.weight, dll, threads)


def decode(model: Any, rows: int, steps: int, seed: int) -> tuple[float, list[list[int]]]:
    """Median ms per greedy step after a 64-token prefill per row, and the tokens chosen."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, model.args.vocab_size, (rows, 64), key=mx.random.key(seed))
    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    times: list[float] = []
    chosen: list[list[int]] = []
    for _ in range(steps):
        t = time.perf_counter()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        chosen.append(y.tolist())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, chosen


def main() -> int:
    """Run the rounds and print the figures."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        if dll is None:
            return 0
        path = default_model_dir()
        plain = load_model(path, fuse=False).model
        eager = load_model(path, fuse=False).model
        replace_products(eager, dll, args.threads)
        for r in range(args.rounds):
            for b in (int(x) for x in args.rows.split(",")):
                a, ta = decode(plain, b, args.steps, r)
                e, te = decode(eager, b, args.steps, r)
                same = sum(x == y for x, y in zip(ta, te, strict=True))
                print(
                    f"round {r} rows {b}: plain {a:.1f} ms/step, eager kernel {e:.1f} ms/step, "
                    f"plain / eager {a / e:.2f}, same tokens in {same}/{len(ta)} steps",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
