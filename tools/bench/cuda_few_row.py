"""The CUDA few-row product (kernels.model._cuda_few_row) against MLX's own products: numbers, then speed (GPU).

Three parts, one process, one seeded random-weight model of ``--shape``:

1. **check**: for each projection shape of the model and 1-8 rows, the
   kernel's ``x @ w.T`` against an fp32 reference (max error relative to the
   reference's largest value) beside MLX's bf16 product's error; and whether
   each row's output is bit for bit the same alone and beside the others
   (batch invariance). Exits 1 if the kernel's error is over 4 x MLX's or
   a row differs.
2. **products**: the model's projections alone, chained through the layers
   (``decode_step_parts.products``), MLX's product vs the kernel, at each
   row count: ms per pass and the weights' GB/s.
3. **steps**: the model's decode step (plain cache, pipelined; and kvtier's
   batch kernel) with one-position products through the kernel vs MLX's,
   rounds alternating which goes first.

GPU::

    PYTHONUNBUFFERED=1 python3 tools/bench/cuda_few_row.py --tok-dir .gpu/tok --json $OUT/few_row.json
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

from _common import machine
from decode_step_parts import ideal, kernel, projection_weights
from gpu_engine import DEFAULT_TOK_DIR, SHAPES, build_model, load_tokenizer

from kernels.model import _cuda_few_row, apply_few_row
from kernels.model._cuda_few_row import VARIANTS, few_row_product

ENABLED = True


def switched(x: mx.array, w: mx.array) -> mx.array:
    """The kernel while :data:`ENABLED`, else MLX's product (the same call a plain Linear makes)."""
    return few_row_product(x, w) if ENABLED else x @ w.T


def check(weights: dict[str, mx.array], variant: str) -> tuple[list[dict[str, Any]], bool]:
    """Errors and batch invariance per shape and row count, for one kernel variant."""
    out: list[dict[str, Any]] = []
    ok = True
    for name, w in weights.items():
        k = int(w.shape[1])
        x8 = mx.random.normal((8, k), key=mx.random.key(k)).astype(mx.bfloat16)
        alone = [few_row_product(x8[i : i + 1], w, variant) for i in range(8)]
        mx.eval(alone)
        for rows in range(1, 9):
            x = x8[:rows]
            ref = x.astype(mx.float32) @ w.astype(mx.float32).T
            got = few_row_product(x, w, variant)
            mlx = x @ w.T
            mx.eval(ref, got, mlx)
            scale = mx.abs(ref).max().item()
            err = (mx.abs(got.astype(mx.float32) - ref).max().item()) / scale
            err_mlx = (mx.abs(mlx.astype(mx.float32) - ref).max().item()) / scale
            same = all(mx.array_equal(got[i : i + 1], alone[i]).item() for i in range(rows))
            rec = {
                "variant": variant,
                "name": name,
                "shape": [int(s) for s in w.shape],
                "rows": rows,
                "err": err,
                "err_mlx": err_mlx,
                "rows_same_alone": same,
            }
            out.append(rec)
            if err > 4 * max(err_mlx, 1e-3) or not same:
                ok = False
        worst = max(r["err"] for r in out if r["name"] == name)
        worst_mlx = max(r["err_mlx"] for r in out if r["name"] == name)
        print(
            f"check {variant} {name} {tuple(w.shape)}: max rel error {worst:.2e} (MLX's bf16 product "
            f"{worst_mlx:.2e}); rows alone == rows together: "
            f"{all(r['rows_same_alone'] for r in out if r['name'] == name)}",
            flush=True,
        )
    return out, ok


def chain(weights: list[dict[str, mx.array]], rows: int, reps: int, variant: str | None) -> float:
    """ms per pass of every layer's seven projections at ``rows`` rows (``variant`` None: MLX's products)."""
    hidden = int(weights[0]["q_proj"].shape[1])
    x0 = mx.random.normal((rows, hidden), key=mx.random.key(rows)).astype(mx.bfloat16)

    def mm(x: mx.array, w: mx.array) -> mx.array:
        return few_row_product(x, w, variant) if variant is not None else x @ w.T

    def one_pass() -> list[mx.array]:
        x = x0
        keep: list[mx.array] = []
        for w in weights:
            q = mm(x, w["q_proj"])
            keep += [mm(x, w["k_proj"]), mm(x, w["v_proj"])]
            o = mm(q, w["o_proj"])
            x = mm(mm(o, w["gate_proj"]) * mm(o, w["up_proj"]), w["down_proj"])
        keep.append(x)
        return keep

    mx.eval(one_pass())
    walls: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(one_pass())
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls) * 1e3


def main() -> int:
    """Check, then time; print and write the figures."""
    global ENABLED
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--step-rows", default="1,8")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tok-dir", type=Path, default=DEFAULT_TOK_DIR)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from kernels.model import transform_for_device

    tok = load_tokenizer(args.tok_dir)
    model, _ = build_model(args.shape, len(tok.get_vocab()), 0, mx.bfloat16)
    weights = projection_weights(model)
    lm_head = getattr(model, "lm_head", None)
    shapes = {name: weights[0][name] for name in ("q_proj", "k_proj", "gate_proj", "down_proj")}
    if lm_head is not None:
        shapes["lm_head"] = lm_head.weight
    out: dict[str, Any] = {
        "shape": args.shape,
        "machine": machine(),
        "args": vars(args) | {"tok_dir": str(args.tok_dir), "json": str(args.json)},
    }
    t = time.perf_counter()
    out["check"] = []
    ok = True
    # NOTE: the kernel's own numbers at every row count, one row included
    # (served, one row stays on MLX's gemv: _cuda_few_row.min_rows).
    served_min_rows = _cuda_few_row.min_rows
    _cuda_few_row.min_rows = 1
    for v in VARIANTS:
        recs, good = check(shapes, v)
        out["check"] += recs
        ok = ok and good
    print(
        f"check took {time.perf_counter() - t:.1f} s (kernel compiles included); ok {ok}",
        flush=True,
    )
    if not ok:
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2))
        return 1
    rows = [int(x) for x in args.rows.split(",")]
    prod: list[dict[str, Any]] = []
    nbytes = sum(w.nbytes for layer in weights for w in layer.values())
    contenders: list[str | None] = [None, *VARIANTS]
    for r in range(args.rounds):
        for b in rows:
            rec: dict[str, Any] = {"round": r, "rows": b}
            order = contenders if r % 2 == 0 else list(reversed(contenders))
            for v in order:
                rec[v or "mlx"] = chain(weights, b, 8, v)
            prod.append(rec)
            print(
                f"products round {r} rows {b}: "
                + ", ".join(
                    f"{v or 'mlx'} {rec[v or 'mlx']:.2f} ms ({nbytes / rec[v or 'mlx'] / 1e6:.0f} GB/s)"
                    for v in contenders
                ),
                flush=True,
            )
    out["products"] = prod
    _cuda_few_row.min_rows = served_min_rows
    best = min(
        VARIANTS, key=lambda v: statistics.median(x[v] for x in prod if x["rows"] == max(rows))
    )
    _cuda_few_row.variant = best
    out["variant"] = best
    print(f"steps with the {best!r} kernel (fastest at {max(rows)} rows)", flush=True)
    report = transform_for_device(model, few_row=False)
    routed = apply_few_row(model, switched, dtype=mx.bfloat16)
    joined = _cuda_few_row.apply_qkv(model) if best == "tile" else 0
    launch = _cuda_few_row.qkv_product
    qkv_refused = _cuda_few_row.self_check_qkv() if joined else "not tried"
    out["qkv_self_check"] = qkv_refused
    print(
        f"forward: {'as built' if report is None else f'{report.groups} fused groups'}; "
        f"{routed} products routed through the switch; q|k|v joined in {joined} layers "
        f"(self-check: {qkv_refused or 'passed'})",
        flush=True,
    )

    def separate(x: mx.array, ws: tuple[mx.array, mx.array, mx.array]) -> list[mx.array]:
        return [switched(x, w) for w in ws]

    # NOTE: three contenders on one model: MLX's products, the kernel a
    # product, and the kernel with q|k|v as one launch (when it checked out).
    contenders = ["mlx", "kernel"] + (["qkv"] if joined and qkv_refused is None else [])
    steps: list[dict[str, Any]] = []
    for r in range(args.rounds + 1):
        for b in [int(x) for x in args.step_rows.split(",")]:
            rec = {"round": r - 1, "rows": b}
            for key in contenders if r % 2 == 0 else list(reversed(contenders)):
                ENABLED = key != "mlx"
                _cuda_few_row.qkv_product = launch if key == "qkv" else separate  # type: ignore[assignment]
                rec[key] = ideal(model, b, args.prompt_tokens, args.steps, seed=10 * r + b)
                rec[key + "_lane"] = kernel(
                    model, tok, b, args.prompt_tokens, args.steps, f"f{r}-{b}-{key}"
                )
                mx.clear_cache()
            ENABLED = True
            _cuda_few_row.qkv_product = launch  # type: ignore[assignment]
            if r == 0:
                continue  # NOTE: warm-up: kernels compile per shape.
            steps.append(rec)
            print(
                f"steps round {r - 1} rows {b}: plain cache "
                + " / ".join(f"{k} {rec[k]['step_ms']:.2f}" for k in contenders)
                + " ms; kvtier's lane "
                + " / ".join(f"{k} {rec[k + '_lane']['step_ms']:.2f}" for k in contenders)
                + " ms",
                flush=True,
            )
    out["steps"] = steps
    for b in sorted({x["rows"] for x in steps}):
        recs = [x for x in steps if x["rows"] == b]
        for part in ("", "_lane"):
            for key in contenders[1:]:
                ratios = [x["mlx" + part]["step_ms"] / x[key + part]["step_ms"] for x in recs]
                print(
                    f"rows {b}{' (kvtier lane)' if part else ' (plain cache)'}: MLX / {key} step "
                    f"{statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}], "
                    f"MLX {statistics.median(x['mlx' + part]['step_ms'] for x in recs):.2f} ms, "
                    f"{key} {statistics.median(x[key + part]['step_ms'] for x in recs):.2f} ms",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
