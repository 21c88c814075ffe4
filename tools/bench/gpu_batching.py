"""kvtier's batch lane against mlx-lm's ``BatchGenerator`` driven directly (issue #10, GPU part).

The issue's GPU target: on the H200, with an 8B-shaped model, 512-token
prompts and 128 new tokens, kvtier's aggregate tok/s at 8 and 32 rows is at
least mlx-lm's ``BatchGenerator`` driven directly (measured there before:
524 and 618 tok/s).

Per round and per row count ``B`` (rounds alternate which contender runs
first):

- ``BatchGenerator``: ``B`` distinct prompts inserted at once, greedy,
  ``next_generated()`` until every row finished; the wall time from insert
  to the last token.
- ``kvtier``: an ``Engine.from_loaded(..., max_batch=B)`` (the actors, the
  engine thread, the batch scheduler, the RAM prompt cache on as a user
  runs it), ``B`` concurrent ``Engine.generate`` calls of the same
  prompts; the wall time from the first submit to the last ``DoneEvent``.

Both figures are generated tokens / wall time, so the prefill of the ``B``
prompts counts for both. Prompts are distinct per round and contender (no
prompt-cache hit can help kvtier). The model is a seeded random-weight
mlx-lm ``llama`` of the shape (``gpu_engine.SHAPES``) with EOS off, so
every row decodes exactly ``--max-tokens`` tokens. A warm-up of each
contender at each ``B`` runs first (CUDA kernels compile per shape).

Beside the figure each run records the time until every row had its first
token (the rest is decode), GC pauses, and for kvtier the Engine's batch
steps, chains, engine-thread busy time, heap trims, memory-guard counters
and cached prompt tokens. Diagnosis options: ``--trace-steps`` (every step
of kvtier's kernel timed: median, p90, max, the gaps between steps),
``--rounds-per-engine N`` (later rounds on the same Engine, reported beside
the first), ``--distinct-first-token`` (no prompt shares even its first
token with an earlier one), ``--switch-interval S`` (the Engine once more
per round under another ``sys.setswitchinterval``).

GPU (the two-call recipe of docs/benchmarks/gpu.md)::

    PYTHONUNBUFFERED=1 python3 tools/bench/gpu_batching.py --tok-dir .gpu/tok --json $OUT/gpu_batching.json

CPU check of the script itself (numbers mean nothing there)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/gpu_batching.py --shape tiny --rows 2,4 --max-tokens 8 --prompt-tokens 32
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import StepTimer
from gpu_engine import DEFAULT_TOK_DIR, SHAPES, build_model, filler_ids, load_tokenizer

from actors.engine import DoneEvent, Engine, GenerationParams, TokenEvent


class GcClock:
    """Wall time spent in Python's garbage collector, summed over every generation (any thread)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.collections = 0
        self._start = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._start
            self.collections += 1

    def read(self) -> tuple[float, int]:
        """(seconds, collections) so far."""
        return self.total_s, self.collections


GC = GcClock()


class StepTrace(StepTimer):
    """Start and end of every ``BatchGeneration.step`` (kvtier's kernel, any thread), per run.

    NOTE: tells a slow run made of slow steps (device or the step's own host
    work) from one made of gaps between steps (the actor path).
    """

    def take(self) -> dict[str, float]:
        """Figures of the steps since the last call (ms), then forget them."""
        spans = self.take_spans()
        if not spans:
            return {}
        lengths = sorted(b - a for a, b in spans)
        gaps = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
        return {
            "step_median_ms": statistics.median(lengths) * 1e3,
            "step_p90_ms": lengths[int(0.9 * (len(lengths) - 1))] * 1e3,
            "step_max_ms": lengths[-1] * 1e3,
            "gaps_ms": sum(gaps) * 1e3,
            "gap_max_ms": max(gaps, default=0.0) * 1e3,
        }


TRACE: StepTrace | None = None


def batch_generator_run(
    model: Any, prompts: list[list[int]], max_tokens: int, step: int
) -> tuple[float, int, float]:
    """mlx-lm's ``BatchGenerator`` on this thread: (wall s, generated tokens, s until every row's first token)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        max_tokens=max_tokens,
        completion_batch_size=len(prompts),
        prefill_step_size=step,
    )
    try:
        t0 = time.perf_counter()
        gen.insert(prompts, [max_tokens] * len(prompts))
        n = 0
        seen: set[int] = set()
        first_all = 0.0
        while responses := gen.next_generated():
            n += len(responses)
            if len(seen) < len(prompts):
                seen.update(r.uid for r in responses)
                if len(seen) == len(prompts):
                    first_all = time.perf_counter() - t0
        wall = time.perf_counter() - t0
    finally:
        gen.close()
    return wall, n, first_all


def kernel_run(
    model: Any, tok: Any, prompts: list[list[int]], max_tokens: int, step: int
) -> tuple[float, int, float]:
    """kvtier's batch kernel (``BatchGeneration``) driven directly on this thread, no actors.

    NOTE: with the BLAS thread tuning the Engine's batch lane gives its kernel
    (CPU with OpenBLAS, ``KVTIER_BATCH_BLAS_TUNE`` not off; ``None`` on a GPU),
    a fresh one per run as each round's fresh Engine has: the Engine's own
    kernel, so the ratio between them is the actor path's.
    """
    from kernels.engine import BatchGeneration, SamplingParams, blas_tune_enabled, make_blas_tuning

    tuning = make_blas_tuning() if blas_tune_enabled() else None
    gen = BatchGeneration(model, tok, max_rows=len(prompts), prefill_step_size=step, tuning=tuning)
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            gen.join(f"r{i}", p, SamplingParams(max_tokens=max_tokens))
        n = 0
        seen: set[str] = set()
        first_all = 0.0
        while not gen.idle:
            toks = gen.step().tokens
            n += len(toks)
            if len(seen) < len(prompts):
                seen.update(t.row_id for t in toks)
                if len(seen) == len(prompts):
                    first_all = time.perf_counter() - t0
        wall = time.perf_counter() - t0
    finally:
        gen.close()
    return wall, n, first_all


async def _one(
    engine: Engine, prompt: list[int], max_tokens: int, counts: list[int], firsts: list[float]
) -> None:
    n = 0
    done: DoneEvent | None = None
    async with engine.generate(prompt, GenerationParams(max_tokens=max_tokens)) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                if n == 0:
                    firsts.append(time.perf_counter())
                n += 1
            else:
                done = event
    assert done is not None, "the Engine stream ended without a DoneEvent"
    counts.append(n)


async def kvtier_run(
    engine: Engine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, int, float]:
    """``len(prompts)`` concurrent requests through the Engine: (wall s, generated tokens, s until every row's first token)."""
    counts: list[int] = []
    firsts: list[float] = []
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for p in prompts:
            tg.start_soon(_one, engine, p, max_tokens, counts, firsts)
    return time.perf_counter() - t0, sum(counts), max(firsts) - t0


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every round of every row count; returns the raw records."""
    tok = load_tokenizer(args.tok_dir)
    dtype = mx.bfloat16 if args.shape != "tiny" else mx.float32
    model, params_b = build_model(args.shape, len(tok.get_vocab()), 0, dtype)
    # NOTE: kvtier runs the forward its loader makes for this device
    # (kernels.model.transform_for_device: on CUDA gate|up as one product),
    # on a second copy of the same weights; BatchGenerator runs mlx-lm's.
    kv_model = model
    transform = "none (--plain-forward)"
    if not args.plain_forward:
        from kernels.model import transform_for_device

        kv_model, _ = build_model(args.shape, len(tok.get_vocab()), 0, dtype)
        report = transform_for_device(kv_model, few_row=False)
        transform = "none" if report is None else f"{report.groups} fused groups"
    print(f"kvtier's forward: {transform}", flush=True)
    rows = [int(x) for x in args.rows.split(",")]
    out: dict[str, Any] = {
        "shape": args.shape,
        "params_b": params_b,
        "kvtier_forward": transform,
        "device": str(mx.default_device()),
        "rows": rows,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "records": [],
    }
    seq = 0

    def prompts(b: int, tag: str) -> list[list[int]]:
        nonlocal seq
        seq += 1
        ps = [filler_ids(tok, args.prompt_tokens, f"{tag}-{seq}-{i}") for i in range(b)]
        if args.distinct_first_token:
            # NOTE: no prompt shares even its first token with an earlier one, so
            # the prompt cache can serve nothing (not even the filler's "Note").
            ps = [[1000 + (seq * b + i) % 30000, *p[1:]] for i, p in enumerate(ps)]
        return ps

    for b in rows:
        # NOTE: one Engine per row count, opened around its own runs only: the
        # engine thread owns the model while it is open, BatchGenerator runs
        # on this thread while no Engine is open.
        async def engine_runs(b: int, label: str, rounds: int) -> list[dict[str, Any]]:
            res: list[dict[str, Any]] = []
            async with Engine.from_loaded(
                kv_model,
                tok,
                model_id=args.shape,
                max_batch=b,
                max_queue=b,
                prefill_step_size=args.kvtier_prefill_step_size,
                prompt_cache_bytes=int(args.prompt_cache_gb * 1024**3),
            ) as engine:
                for _ in range(rounds):
                    before = await engine.stats()
                    gc0 = GC.read()
                    if TRACE is not None:
                        TRACE.take()
                    wall, n, first_all = await kvtier_run(
                        engine, prompts(b, label), args.max_tokens
                    )
                    gc1 = GC.read()
                    steps_seen = TRACE.take() if TRACE is not None else {}
                    after = await engine.stats()
                    batch = after["batch"]["batch"]
                    # NOTE: the figure is only the batch lane's if every request ran there.
                    assert (
                        batch["requests"]["finished_length"]
                        - before["batch"]["batch"]["requests"]["finished_length"]
                        == b
                    ), batch
                    mem0, mem1 = before.get("memory", {}), after.get("memory", {})
                    res.append(
                        {
                            "wall_s": wall,
                            "tokens": n,
                            "tps": n / wall,
                            "first_all_s": first_all,
                            "widest_decode": int(batch["steps"]["max_rows_decoded"]),
                            "steps": batch["steps"]["run"]
                            - before["batch"]["batch"]["steps"]["run"],
                            "heap_trims": mem1.get("heap_trims", 0) - mem0.get("heap_trims", 0),
                            "heap_trim_s": mem1.get("heap_trim_s", 0.0)
                            - mem0.get("heap_trim_s", 0.0),
                            "gc_s": gc1[0] - gc0[0],
                            "gc_n": gc1[1] - gc0[1],
                            "cached_tokens": batch["cached_tokens"]
                            - before["batch"]["batch"]["cached_tokens"],
                            "memory_counts": {
                                k: v - mem0.get(k, 0)
                                for k, v in mem1.items()
                                if isinstance(v, int) and not k.endswith("bytes")
                            },
                            "memory_end": {k: v for k, v in mem1.items() if k.endswith("bytes")},
                            # NOTE: a chain that ends early (AHEAD, a stop) costs a turn
                            # round trip; engine busy time against the wall says whether
                            # the engine thread waited for the loop.
                            "chains": after["gateway"]["token"]["batch_chains"]["granted"]
                            - before["gateway"]["token"]["batch_chains"]["granted"],
                            "engine_busy_s": after["engine_thread"]["busy_s"]
                            - before["engine_thread"]["busy_s"],
                            "engine_jobs": after["engine_thread"]["jobs_run"]
                            - before["engine_thread"]["jobs_run"],
                            **steps_seen,
                        }
                    )
            return res

        def timed(fn: Any) -> dict[str, Any]:
            gc0 = GC.read()
            wall, n, first_all = fn()
            gc1 = GC.read()
            return {
                "wall_s": wall,
                "tokens": n,
                "tps": n / wall,
                "first_all_s": first_all,
                "gc_s": gc1[0] - gc0[0],
                "gc_n": gc1[1] - gc0[1],
            }

        # Warm-up: compile the shapes of both contenders at this B.
        batch_generator_run(
            model, prompts(b, "warm-bg"), min(args.max_tokens, 16), args.bg_prefill_step_size
        )
        await engine_runs(b, "warm-kv", 1)
        contenders = ["bg", "kvtier"]
        if args.with_kernel:
            kernel_run(
                kv_model,
                tok,
                prompts(b, "warm-k"),
                min(args.max_tokens, 16),
                args.kvtier_prefill_step_size,
            )
            contenders.append("kernel")
        if args.switch_interval is not None:
            contenders.append("kvtier_si")
        for r in range(args.rounds):
            order = contenders if r % 2 == 0 else contenders[::-1]
            rec: dict[str, Any] = {"rows": b, "round": r}
            for who in order:
                if who == "bg":
                    rec[who] = timed(
                        lambda b=b: batch_generator_run(
                            model, prompts(b, "bg"), args.max_tokens, args.bg_prefill_step_size
                        )
                    )
                elif who == "kernel":
                    rec[who] = timed(
                        lambda b=b: kernel_run(
                            kv_model,
                            tok,
                            prompts(b, "k"),
                            args.max_tokens,
                            args.kvtier_prefill_step_size,
                        )
                    )
                elif who == "kvtier_si":
                    # NOTE: the same Engine run with another interpreter switch
                    # interval: whether the engine thread waits for the GIL.
                    default_si = sys.getswitchinterval()
                    sys.setswitchinterval(args.switch_interval)
                    try:
                        rec[who] = (await engine_runs(b, "kvsi", 1))[0]
                    finally:
                        sys.setswitchinterval(default_si)
                else:
                    # NOTE: the first round of a fresh Engine is the figure (as
                    # before); later rounds on the same Engine show whether a
                    # fresh engine thread costs anything (--rounds-per-engine).
                    runs = await engine_runs(b, "kv", args.rounds_per_engine)
                    rec[who] = runs[0]
                    if len(runs) > 1:
                        rec["kvtier_reused"] = runs[1:]
                mx.clear_cache()
            rec["ratio"] = rec["kvtier"]["tps"] / rec["bg"]["tps"]
            if "kernel" in rec:
                rec["kernel_ratio"] = rec["kernel"]["tps"] / rec["bg"]["tps"]
            if "kvtier_reused" in rec:
                rec["reused_ratio"] = rec["kvtier_reused"][-1]["tps"] / rec["bg"]["tps"]
            out["records"].append(rec)

            def part(x: dict[str, Any]) -> str:
                return (
                    f"{x['tps']:.1f} tok/s (first tokens {x['first_all_s']:.3f} s, decode "
                    f"{x['wall_s'] - x['first_all_s']:.3f} s, gc {x['gc_n']}/{x['gc_s'] * 1e3:.1f} ms"
                    + (
                        f", steps {x['steps']}, chains {x['chains']}, jobs {x['engine_jobs']}, "
                        + (
                            f"step ms median {x['step_median_ms']:.2f} p90 {x['step_p90_ms']:.2f} "
                            f"max {x['step_max_ms']:.1f}, gaps {x['gaps_ms']:.1f} ms, "
                            if "step_median_ms" in x
                            else ""
                        )
                        + f"engine busy {x['engine_busy_s']:.3f} s, cached {x['cached_tokens']}, "
                        f"trims {x['heap_trims']}/{x['heap_trim_s'] * 1e3:.1f} ms"
                        f", memory { ({k: v for k, v in x['memory_counts'].items() if v}) }"
                        if "steps" in x
                        else ""
                    )
                    + ")"
                )

            line = (
                f"B={b} round {r}: BatchGenerator {part(rec['bg'])}; kvtier {part(rec['kvtier'])} "
                f"ratio {rec['ratio']:.3f}"
            )
            for x in rec.get("kvtier_reused", []):
                line += f"; same Engine again {part(x)} ratio {x['tps'] / rec['bg']['tps']:.3f}"
            if "kernel" in rec:
                line += f"; kernel alone {part(rec['kernel'])} ratio {rec['kernel_ratio']:.3f}"
            if "kvtier_si" in rec:
                line += (
                    f"; switch interval {args.switch_interval} {part(rec['kvtier_si'])} "
                    f"ratio {rec['kvtier_si']['tps'] / rec['bg']['tps']:.3f}"
                )
            print(line, flush=True)
    return out


def summarize(out: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Medians per row count and the median of per-round ratios with its spread."""
    summary: dict[int, dict[str, float]] = {}
    for b in out["rows"]:
        recs = [r for r in out["records"] if r["rows"] == b]
        ratios = [r["ratio"] for r in recs]
        summary[b] = {
            "bg_tps": statistics.median(r["bg"]["tps"] for r in recs),
            "kvtier_tps": statistics.median(r["kvtier"]["tps"] for r in recs),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        # NOTE: every later round of an Engine against its round's BatchGenerator.
        reused = [x["tps"] / r["bg"]["tps"] for r in recs for x in r.get("kvtier_reused", [])]
        if reused:
            summary[b]["reused_ratio"] = statistics.median(reused)
            summary[b]["reused_min"] = min(reused)
            summary[b]["reused_max"] = max(reused)
            summary[b]["reused_n"] = len(reused)
        kernel = [r["kernel_ratio"] for r in recs if "kernel_ratio" in r]
        if kernel:
            summary[b]["kernel_ratio"] = statistics.median(kernel)
    return summary


def plot(out: dict[str, Any], path: Path) -> None:
    """Aggregate tok/s per row count, both contenders, every round as a dot and the median as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(out)
    rows = out["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.38
    for k, (who, label) in enumerate(
        (("bg", "mlx-lm BatchGenerator"), ("kvtier", "kvtier Engine"))
    ):
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        ax.bar(xs, [summary[b][f"{who}_tps"] for b in rows], width, label=label)
        for i, b in enumerate(rows):
            pts = [r[who]["tps"] for r in out["records"] if r["rows"] == b]
            ax.plot([xs[i]] * len(pts), pts, "k.", markersize=4)
    ax.set_xticks(range(len(rows)), [f"{b} rows" for b in rows])
    ax.set_ylabel("generated tok/s (prefill included)")
    ax.set_title(
        f"{out['shape']}, {out['prompt_tokens']}-token prompts, {out['max_tokens']} new tokens"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(out: dict[str, Any]) -> None:
    """The summary table on stdout."""
    for b, s in summarize(out).items():
        print(
            f"B={b}: BatchGenerator median {s['bg_tps']:.1f} tok/s, kvtier median {s['kvtier_tps']:.1f} tok/s, "
            f"ratio median {s['ratio']:.3f} [{s['ratio_min']:.3f}..{s['ratio_max']:.3f}] (target >= 1.0)"
            + (
                f"; later rounds of an Engine {s['reused_ratio']:.3f} "
                f"[{s['reused_min']:.3f}..{s['reused_max']:.3f}] (n={s['reused_n']})"
                if "reused_ratio" in s
                else ""
            )
            + (f"; kernel alone {s['kernel_ratio']:.3f}" if "kernel_ratio" in s else "")
        )


def main() -> int:
    """Run (or re-plot from ``--from-json``) and print the figures."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="8,32")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--bg-prefill-step-size", type=int, default=2048, help="BatchGenerator's default"
    )
    p.add_argument("--kvtier-prefill-step-size", type=int, default=2048)
    p.add_argument("--prompt-cache-gb", type=float, default=4.0)
    p.add_argument(
        "--plain-forward",
        action="store_true",
        help="kvtier runs mlx-lm's forward as built (not the one its loader makes for this device)",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="also run the Engine under this sys.setswitchinterval (seconds) each round",
    )
    p.add_argument(
        "--trace-steps",
        action="store_true",
        help="time every step of kvtier's batch kernel (median, p90, max, gaps between steps)",
    )
    p.add_argument(
        "--distinct-first-token",
        action="store_true",
        help="every prompt starts with its own token, so no prompt-cache hit of any length",
    )
    p.add_argument(
        "--rounds-per-engine",
        type=int,
        default=1,
        help="timed kvtier rounds per fresh Engine (the first is the figure; the rest are reported beside it)",
    )
    p.add_argument(
        "--with-kernel",
        action="store_true",
        help="also drive kvtier's BatchGeneration directly (no actors): where the gap is",
    )
    p.add_argument("--tok-dir", type=Path, default=DEFAULT_TOK_DIR)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--from-json", type=Path, default=None, help="re-plot and report a recorded run")
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    if args.from_json is not None:
        out = json.loads(args.from_json.read_text())
    else:
        global TRACE
        if args.trace_steps:
            TRACE = StepTrace()
        out = anyio.run(measure, args)
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2))
    report(out)
    if args.plot is not None:
        plot(out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
