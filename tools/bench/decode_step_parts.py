"""Where a batch decode step's time goes at 1, 8 and 32 rows (GPU diagnosis, no target).

Why: served, kvtier's ITL at 8 streams is ~1.6 x its lone row's (11.9 vs
7.3 ms on an H100, docs/benchmarks.md), and the 8- and 32-stream lines of
issue 20 are bound by the decode step (TTFT + 127 ITL predicts them). This
tool splits one step at each row count into parts measured on the same
model in one process, so the difference between 1 and 8 rows can be placed:

- ``products``: the weights' products alone, the seven projections of
  every layer chained (each layer's input is the previous down
  projection's output), evaluated synchronously: how fast the device reads
  the weights at M rows (MLX runs M = 1 through its gemv kernel, M > 1
  through cuBLASLt). Printed with the weights' bytes per second.
- ``ideal``: the model's step with a plain KV cache (every row the same
  length, no mask), pipelined the way mlx-lm's generators run it (the next
  step queued before the current token is read): wall time per step, and
  the host time to build one step's graph (the model call).
- ``sync``: the same step not pipelined: build, then ``mx.eval`` (encode,
  launch, run and wait).
- ``kernel``: kvtier's batch kernel (``BatchGeneration``, the served
  lane's code, no actors) over the same row count, every row joined at
  once: its decode steps timed one by one once every row has its first
  token.

The model is a seeded random-weight mlx-lm llama of ``--shape`` with the
forward kvtier's loader makes for the device (``transform_for_device``).
Rounds alternate the parts' order. MLX's CUDA switches
(``MLX_MAX_OPS_PER_BUFFER``, ``MLX_USE_CUDA_GRAPHS``) are read once a
process: run the tool once per setting (``gpu_serving.sh stepparts``).

GPU::

    PYTHONUNBUFFERED=1 python3 tools/bench/decode_step_parts.py --tok-dir .gpu/tok --json $OUT/parts.json

CPU check of the script itself (numbers mean nothing there)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/decode_step_parts.py --shape tiny --rows 1,4 --steps 8 \\
        --prompt-tokens 32 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine
from gpu_engine import DEFAULT_TOK_DIR, SHAPES, build_model, filler_ids, load_tokenizer

PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


def projection_weights(model: Any) -> list[dict[str, mx.array]]:
    """Every layer's seven projection weights (taken before any fusion)."""
    return [
        {name: getattr(getattr(layer, part), name).weight for part, name in PROJECTIONS}
        for layer in model.layers
    ]


def products(weights: list[dict[str, mx.array]], rows: int, reps: int) -> dict[str, float]:
    """The projections alone at ``rows`` rows, chained through the layers: ms per pass and GB/s of weights."""
    hidden = int(weights[0]["q_proj"].shape[1])
    nbytes = sum(w.nbytes for layer in weights for w in layer.values())
    x0 = mx.random.normal((rows, hidden), key=mx.random.key(rows)).astype(
        weights[0]["q_proj"].dtype
    )
    mx.eval(x0)

    def one_pass() -> list[mx.array]:
        x = x0
        keep: list[mx.array] = []
        for w in weights:
            q = x @ w["q_proj"].T
            keep += [x @ w["k_proj"].T, x @ w["v_proj"].T]
            o = q @ w["o_proj"].T
            g = o @ w["gate_proj"].T
            u = o @ w["up_proj"].T
            # NOTE: no activation: only the products are timed; the values
            # may overflow, which costs a product nothing.
            x = (g * u) @ w["down_proj"].T
        keep.append(x)
        return keep

    mx.eval(one_pass())  # NOTE: warm-up: kernels and cuBLASLt plans per shape.
    walls: list[float] = []
    builds: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = one_pass()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        walls.append(t2 - t0)
    ms = statistics.median(walls) * 1e3
    return {
        "ms": ms,
        "build_ms": statistics.median(builds) * 1e3,
        "gb_s": nbytes / (ms / 1e3) / 1e9,
        "weights_gb": nbytes / 1e9,
    }


def ideal(model: Any, rows: int, prompt_tokens: int, steps: int, seed: int) -> dict[str, float]:
    """Plain-cache steps at ``rows`` rows: pipelined wall and build, then synchronous build and eval."""
    from mlx_lm.models.cache import make_prompt_cache

    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (rows, prompt_tokens), key=mx.random.key(seed))
    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y, [c.state for c in cache])
    builds: list[float] = []

    def step(tokens: mx.array) -> mx.array:
        t = time.perf_counter()
        out = mx.argmax(model(tokens[:, None], cache=cache)[:, -1, :], axis=-1)
        builds.append(time.perf_counter() - t)
        return out

    walls: list[float] = []
    nxt = step(y)
    mx.async_eval(nxt)
    last = time.perf_counter()
    for _ in range(steps):
        cur = nxt
        nxt = step(cur)
        mx.async_eval(nxt)
        cur.tolist()
        now = time.perf_counter()
        walls.append(now - last)
        last = now
    mx.eval(nxt)
    pipelined_build = statistics.median(builds)
    builds.clear()
    evals: list[float] = []
    cur = nxt
    for _ in range(steps):
        cur = step(cur)
        t = time.perf_counter()
        mx.eval(cur)
        evals.append(time.perf_counter() - t)
    return {
        "step_ms": statistics.median(walls) * 1e3,
        "build_ms": pipelined_build * 1e3,
        "sync_build_ms": statistics.median(builds) * 1e3,
        "sync_eval_ms": statistics.median(evals) * 1e3,
    }


def kernel(
    model: Any, tok: Any, rows: int, prompt_tokens: int, steps: int, tag: str
) -> dict[str, float]:
    """kvtier's ``BatchGeneration`` at ``rows`` rows joined at once: its decode steps' wall times."""
    from kernels.engine import BatchGeneration, SamplingParams

    gen = BatchGeneration(model, tok, max_rows=rows, prefill_step_size=2048, tuning=None)
    try:
        for i in range(rows):
            ids = filler_ids(tok, prompt_tokens, f"{tag}-{i}")
            gen.join(f"r{i}", ids, SamplingParams(max_tokens=steps + 8))
        seen: set[str] = set()
        while len(seen) < rows:
            seen.update(t.row_id for t in gen.step().tokens)
        walls: list[float] = []
        last = time.perf_counter()
        for _ in range(steps):
            n = len(gen.step().tokens)
            now = time.perf_counter()
            if n == rows:
                walls.append(now - last)
            last = now
    finally:
        gen.close()
    return {"step_ms": statistics.median(walls) * 1e3, "steps": float(len(walls))}


def main() -> int:
    """Build the model, run the rounds, print and write the figures."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", default="products,ideal,kernel")
    p.add_argument("--tok-dir", type=Path, default=DEFAULT_TOK_DIR)
    p.add_argument(
        "--label", default="default", help="names this process's MLX settings in the output"
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from kernels.model import transform_for_device

    tok = load_tokenizer(args.tok_dir)
    dtype = mx.bfloat16 if args.shape != "tiny" else mx.float32
    t = time.perf_counter()
    model, params_b = build_model(args.shape, len(tok.get_vocab()), 0, dtype)
    weights = projection_weights(model)
    report = transform_for_device(model, few_row=False)
    env = {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "KVTIER_"))}
    print(
        f"{args.shape} ({params_b:.2f} B params) on {mx.default_device()} built in "
        f"{time.perf_counter() - t:.1f} s; forward: "
        f"{'as built' if report is None else f'{report.groups} fused groups'}; label {args.label}; env {env}",
        flush=True,
    )
    parts = args.parts.split(",")
    rows = [int(x) for x in args.rows.split(",")]
    out: dict[str, Any] = {
        "shape": args.shape,
        "label": args.label,
        "env": env,
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "records": [],
    }
    for r in range(args.rounds + 1):
        for b in rows:
            rec: dict[str, Any] = {"round": r - 1, "rows": b}
            order = parts if r % 2 == 0 else list(reversed(parts))
            for part in order:
                if part == "products":
                    rec[part] = products(weights, b, reps=8)
                elif part == "ideal":
                    rec[part] = ideal(model, b, args.prompt_tokens, args.steps, seed=100 * r + b)
                elif part == "kernel":
                    rec[part] = kernel(model, tok, b, args.prompt_tokens, args.steps, f"k{r}-{b}")
                else:
                    raise SystemExit(f"unknown part {part!r}")
                mx.clear_cache()
            if r == 0:
                continue  # NOTE: warm-up round: kernels compile per shape.
            out["records"].append(rec)
            line = [f"round {r - 1} rows {b:>2}:"]
            if "products" in rec:
                x = rec["products"]
                line.append(
                    f"products {x['ms']:.2f} ms ({x['gb_s']:.0f} GB/s, build {x['build_ms']:.2f})"
                )
            if "ideal" in rec:
                x = rec["ideal"]
                line.append(
                    f"ideal {x['step_ms']:.2f} ms/step (build {x['build_ms']:.2f}; "
                    f"sync build {x['sync_build_ms']:.2f} + eval {x['sync_eval_ms']:.2f})"
                )
            if "kernel" in rec:
                line.append(f"kvtier kernel {rec['kernel']['step_ms']:.2f} ms/step")
            print("  ".join(line), flush=True)
    summary: dict[str, dict[str, float]] = {}
    for b in rows:
        recs = [x for x in out["records"] if x["rows"] == b]
        s: dict[str, float] = {}
        for part, key in (
            ("products", "ms"),
            ("products", "gb_s"),
            ("ideal", "step_ms"),
            ("ideal", "build_ms"),
            ("ideal", "sync_build_ms"),
            ("ideal", "sync_eval_ms"),
            ("kernel", "step_ms"),
        ):
            vals = [x[part][key] for x in recs if part in x]
            if vals:
                s[f"{part}.{key}"] = statistics.median(vals)
                s[f"{part}.{key}.min"] = min(vals)
                s[f"{part}.{key}.max"] = max(vals)
        summary[str(b)] = s
        print(
            f"[{args.label}] rows {b:>2} median: "
            + ", ".join(f"{k} {v:.2f}" for k, v in s.items() if not k.endswith((".min", ".max"))),
            flush=True,
        )
    out["summary"] = summary
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
