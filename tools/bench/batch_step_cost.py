"""What the Engine's batch path costs per step beyond its kernel, with the kernel replaced by a timed stand-in.

The batch lane's engine-thread half (``BatchEngine``) is swapped for a
stand-in whose step holds the GIL for ``--build-ms`` (Python building the
step's graph) and then sleeps ``--compute-ms`` with the GIL released (the
device computing), and hands back one token per decoding row, every row
ending after ``--max-tokens``. Everything else is the product: the
``Engine`` API, the gateway and its engine-turn token, the batch
scheduler's core and shell, the step chains, the prompt cache's lookups,
``B`` concurrent ``engine.generate`` streams consumed with ``async for``.
The same stand-in steps driven in a plain loop on one thread (no actors)
are the floor.

Per row count it prints, medians over ``--rounds``:

- wall of the Engine and of the floor, their ratio, and the difference per
  step (what the actor path adds to a step);
- the event loop's CPU time per step (``time.thread_time`` of the loop
  thread over the run: token delivery, the scheduler, the consumers);
- the engine thread's gap between two steps (from one step's end to the
  next step's start: handing the output over, the heap check, a new job).

No model compute happens, so the figures hardly move with other load on
the box; the ``--build-ms`` / ``--compute-ms`` split models a fast device
(H200: the engine thread's Python is the critical path) or a slow one.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/batch_step_cost.py --rows 8,32 --tok-dir /work/main/.gpu/tok
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import DEFAULT_TOK_DIR, build_model, load_tokenizer

import actors.batch_scheduler.wiring as batch_wiring
from actors.batch_scheduler.core import ExitOut, JoinRow, StepOut, TokenOut
from actors.batch_scheduler.engine import BatchEngine
from actors.engine import Engine, GenerationParams, TokenEvent


def _hold_gil(seconds: float) -> None:
    """Busy Python for ``seconds`` (the GIL held, as while building a step's graph)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StandIn(BatchEngine):
    """``BatchEngine`` with a timed stand-in for the kernel (engine thread)."""

    build_s = 0.002
    compute_s = 0.002
    gaps: ClassVar[list[float]] = []
    last_end: ClassVar[float | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rows_left: dict[str, list[int]] = {}  # rid -> [tokens emitted, max_tokens]

    def idle(self) -> bool:
        return not self._rows_left

    def blas_stats(self) -> dict[str, int] | None:
        return None

    def step(self, joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
        began = time.perf_counter()
        if StandIn.last_end is not None:
            StandIn.gaps.append(began - StandIn.last_end)
        out = run_step(self._rows_left, joins, cancels)
        StandIn.last_end = time.perf_counter()
        return out


def run_step(
    rows: dict[str, list[int]], joins: Sequence[JoinRow], cancels: Sequence[str]
) -> StepOut:
    """One stand-in step over ``rows`` (updated in place): cancel, join (prefill), decode."""
    exits: list[ExitOut] = []
    for rid in cancels:
        if (left := rows.pop(rid, None)) is not None:
            exits.append(ExitOut(rid, "cancelled", left[0]))
    decoding = list(rows)
    joined = tuple((j.request.request_id, 0) for j in joins)
    prefill = sum(len(j.request.prompt_tokens) for j in joins)
    for j in joins:
        rows[j.request.request_id] = [0, j.request.params.max_tokens]
    _hold_gil(StandIn.build_s)
    time.sleep(StandIn.compute_s)
    tokens: list[TokenOut] = []
    for rid in decoding:
        row = rows[rid]
        index = row[0]
        row[0] += 1
        done = row[0] >= row[1]
        tokens.append(TokenOut(rid, index, 7, "x", None, "length" if done else None))
        if done:
            del rows[rid]
            exits.append(ExitOut(rid, "length", row[0]))
    return StepOut(
        tokens=tuple(tokens),
        exits=tuple(exits),
        joined=joined,
        prefilled=tuple(rid for rid, _ in joined),
        decode_rows=len(decoding),
        prefill_tokens=prefill,
    )


def floor_run(b: int, max_tokens: int, prompt_tokens: int) -> float:
    """The stand-in steps for ``b`` rows in a plain loop on this thread: wall seconds."""
    from messages.gateway import Generate

    joins = [
        JoinRow(
            Generate(
                request_id=f"r{i}",
                prompt_tokens=tuple(range(1, prompt_tokens + 1)),
                params=GenerationParams(max_tokens=max_tokens),
                stream_to="none",
            )
        )
        for i in range(b)
    ]
    rows: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    run_step(rows, joins, ())
    while rows:
        run_step(rows, (), ())
    return time.perf_counter() - t0


async def engine_run(
    engine: Engine, b: int, max_tokens: int, prompt_tokens: int, seq: int
) -> tuple[float, float, int]:
    """``b`` concurrent streams: (wall seconds, loop CPU seconds, tokens)."""
    counts: list[int] = []

    async def one(i: int) -> None:
        n = 0
        prompt = [1 + (seq * 131 + i * 7 + k) % 5000 for k in range(prompt_tokens)]
        async with engine.generate(prompt, GenerationParams(max_tokens=max_tokens)) as stream:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    n += 1
        counts.append(n)

    StandIn.gaps.clear()
    StandIn.last_end = None
    c0, t0 = time.thread_time(), time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(b):
            tg.start_soon(one, i)
    return time.perf_counter() - t0, time.thread_time() - c0, sum(counts)


async def measure(args: argparse.Namespace) -> None:
    """Every round of every row count, interleaving the floor and the Engine."""
    StandIn.build_s = args.build_ms / 1000
    StandIn.compute_s = args.compute_ms / 1000
    batch_wiring.BatchEngine = StandIn  # type: ignore[misc]
    tok = load_tokenizer(args.tok_dir)
    model, _ = build_model("tiny", len(tok.get_vocab()), 0, mx.float32)
    print(
        f"stand-in step: {args.build_ms} ms GIL held + {args.compute_ms} ms GIL free; "
        f"{args.max_tokens} tokens, {args.prompt_tokens}-token prompts; "
        f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms; thread {threading.get_ident()}"
    )
    seq = 0
    for b in (int(x) for x in args.rows.split(",")):
        recs: list[dict[str, float]] = []
        async with Engine.from_loaded(
            model, tok, model_id="tiny", max_batch=b, max_queue=b
        ) as engine:
            seq += 1
            await engine_run(engine, b, 8, args.prompt_tokens, seq)  # warm-up
            for _ in range(args.rounds):
                floor = floor_run(b, args.max_tokens, args.prompt_tokens)
                seq += 1
                wall, loop_cpu, n = await engine_run(
                    engine, b, args.max_tokens, args.prompt_tokens, seq
                )
                assert n == b * args.max_tokens, (n, b)
                steps = args.max_tokens + 1
                gaps = sorted(StandIn.gaps)
                recs.append(
                    {
                        "ratio": floor / wall,
                        "extra_ms_per_step": 1e3 * (wall - floor) / steps,
                        "loop_cpu_ms_per_step": 1e3 * loop_cpu / steps,
                        "gap_median_us": 1e6 * gaps[len(gaps) // 2],
                        "gap_p90_us": 1e6 * gaps[int(len(gaps) * 0.9)],
                        "gap_sum_ms": 1e3 * sum(gaps),
                        "wall_s": wall,
                        "floor_s": floor,
                    }
                )
            stats = (await engine.stats())["batch"]["batch"]
        med = {k: statistics.median(r[k] for r in recs) for k in recs[0]}
        lo = min(r["ratio"] for r in recs)
        hi = max(r["ratio"] for r in recs)
        print(
            f"B={b}: Engine/floor {med['ratio']:.3f} [{lo:.3f}..{hi:.3f}], "
            f"+{med['extra_ms_per_step']:.3f} ms/step; loop CPU {med['loop_cpu_ms_per_step']:.3f} ms/step; "
            f"engine-thread gap median {med['gap_median_us']:.0f} us, p90 {med['gap_p90_us']:.0f} us, "
            f"sum {med['gap_sum_ms']:.1f} ms/run; "
            f"Engine {med['wall_s']:.3f} s, floor {med['floor_s']:.3f} s; steps run {stats['steps']['run']}",
            flush=True,
        )


def main() -> int:
    """Parse the options and run."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--build-ms", type=float, default=2.0)
    p.add_argument("--compute-ms", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tok-dir", type=Path, default=DEFAULT_TOK_DIR)
    anyio.run(measure, p.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
