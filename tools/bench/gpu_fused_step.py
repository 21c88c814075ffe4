"""Decode-step time of an 8B-shaped model with and without kvtier's fused projections (GPU).

Why: on the H200 a batch decode step of the 8B shape at 8 rows takes ~9 ms
where reading the weights takes ~3.5 ms, so the step is bound by the host
building and launching its kernels, not by the device. Fusing q|k|v and
gate|up (``kernels.model.fuse_projections``: one product per group, 4 per
layer instead of 7) builds fewer nodes per step. The fusion keeps a row
count fused only where the load-time probe finds the fused product
bitwise equal to the separate ones, so this tool also prints which row
counts the probe split on this device.

Per round and row count, two models built from the same seed (one plain,
one fused) each run: a prefill of ``--prompt-tokens`` random tokens per row
into a plain batch KV cache, then ``--steps`` greedy decode steps pipelined
the way mlx-lm's generators run them (the next step's forward is queued
with ``mx.async_eval`` before the current token is read). Figures: median
wall time per step, median host time to build one step's graph (the model
call, before any evaluation), and whether both models chose the same
tokens. Rounds alternate which model runs first.

GPU (the two-call recipe of docs/benchmarks/gpu.md)::

    PYTHONUNBUFFERED=1 python3 tools/bench/gpu_fused_step.py --json $OUT/fused_step.json

CPU check of the script itself (numbers mean nothing there)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/gpu_fused_step.py --shape tiny --rows 2,4 --steps 8 --prompt-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import SHAPES, build_model

from kernels.model import fuse_projections


class GateUpMLP:
    """An MLP whose gate and up projections are one product (always, whatever the row count); no weight views."""

    def __init__(self, mlp: Any) -> None:
        self.w = mx.concatenate([mlp.gate_proj.weight, mlp.up_proj.weight], axis=0)
        self.split = int(mlp.gate_proj.weight.shape[0])
        self.down_proj = mlp.down_proj
        mx.eval(self.w)

    def __call__(self, x: mx.array) -> mx.array:
        from mlx_lm.models.activations import swiglu

        y = x @ self.w.T
        out: mx.array = self.down_proj(swiglu(y[..., : self.split], y[..., self.split :]))
        return out


def fuse_gate_up(model: Any) -> int:
    """Replace every layer's MLP by :class:`GateUpMLP` (in place); returns how many."""
    for layer in model.layers:
        layer.mlp = GateUpMLP(layer.mlp)
    return len(model.layers)


def decode(model: Any, rows: int, prompt_tokens: int, steps: int, seed: int) -> dict[str, Any]:
    """Prefill ``rows`` random prompts, then ``steps`` pipelined greedy steps: timings and tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (rows, prompt_tokens), key=mx.random.key(seed))
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y, [c.state for c in cache])

    builds: list[float] = []

    def step(tokens: mx.array) -> mx.array:
        t = time.perf_counter()
        out = mx.argmax(model(tokens[:, None], cache=cache)[:, -1, :], axis=-1)
        builds.append(time.perf_counter() - t)
        return out

    chosen: list[list[int]] = []
    walls: list[float] = []
    nxt = step(y)
    mx.async_eval(nxt)
    last = time.perf_counter()
    for _ in range(steps):
        cur = nxt
        nxt = step(cur)
        mx.async_eval(nxt)
        chosen.append(cur.tolist())
        now = time.perf_counter()
        walls.append(now - last)
        last = now
    mx.eval(nxt)
    return {
        "step_ms": statistics.median(walls) * 1e3,
        "step_mean_ms": statistics.fmean(walls) * 1e3,
        "build_ms": statistics.median(builds) * 1e3,
        "tokens": chosen,
    }


def main() -> int:
    """Build both models, run the rounds, print the figures."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="8,32")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument(
        "--variant",
        choices=("probe", "gate-up"),
        default="probe",
        help="probe: kvtier's fuse_projections (bit-checked per row count); gate-up: gate|up as one product always",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dtype = mx.bfloat16 if args.shape != "tiny" else mx.float32
    plain, params_b = build_model(args.shape, args.vocab, 0, dtype)
    fused, _ = build_model(args.shape, args.vocab, 0, dtype)
    t = time.perf_counter()
    if args.variant == "gate-up":
        n = fuse_gate_up(fused)
        report = None
        print(
            f"{args.shape} ({params_b:.2f} B params): gate|up fused in {n} layers, always",
            flush=True,
        )
    else:
        report = fuse_projections(fused)
        print(
            f"{args.shape} ({params_b:.2f} B params) on {mx.default_device()}: fused {report.groups} groups "
            f"in {time.perf_counter() - t:.2f} s; rows computed separately {report.split_rows}; "
            f"skipped {report.skipped!r}",
            flush=True,
        )
    rows = [int(x) for x in args.rows.split(",")]
    out: dict[str, Any] = {
        "shape": args.shape,
        "device": str(mx.default_device()),
        "variant": args.variant,
        "split_rows": [list(x) for x in report.split_rows] if report is not None else [],
        "groups": report.groups if report is not None else 0,
        "records": [],
    }
    for b in rows:
        for r in range(args.rounds + 1):
            order = [("plain", plain), ("fused", fused)]
            if r % 2:
                order.reverse()
            rec: dict[str, Any] = {"rows": b, "round": r - 1}
            for name, model in order:
                rec[name] = decode(model, b, args.prompt_tokens, args.steps, seed=1000 * b + r)
                mx.clear_cache()
            same = rec["plain"]["tokens"] == rec["fused"]["tokens"]
            for name in ("plain", "fused"):
                del rec[name]["tokens"]
            rec["same_tokens"] = same
            if r == 0:
                continue  # NOTE: warm-up: kernels compile per shape.
            rec["ratio"] = rec["plain"]["step_ms"] / rec["fused"]["step_ms"]
            out["records"].append(rec)
            print(
                f"B={b} round {r - 1}: plain {rec['plain']['step_ms']:.2f} ms/step "
                f"(build {rec['plain']['build_ms']:.2f} ms), fused {rec['fused']['step_ms']:.2f} ms/step "
                f"(build {rec['fused']['build_ms']:.2f} ms), plain/fused {rec['ratio']:.3f}, "
                f"same tokens {same}",
                flush=True,
            )
        recs = [x for x in out["records"] if x["rows"] == b]
        ratios = [x["ratio"] for x in recs]
        print(
            f"B={b}: plain/fused step time median {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}..{max(ratios):.3f}], plain {statistics.median(x['plain']['step_ms'] for x in recs):.2f} ms, "
            f"fused {statistics.median(x['fused']['step_ms'] for x in recs):.2f} ms",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
