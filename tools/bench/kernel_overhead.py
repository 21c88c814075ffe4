"""Per-step overhead of kvtier's generation kernel driven through the engine thread.

Measures, side by side in one process on the same model and prompt:

* ``EngineThread.run`` round trip of a no-op job (and ``sync_run``);
* ``mlx_lm.stream_generate`` in-process: TTFT and decode tok/s;
* kvtier's ``Generation`` stepped in-process (no thread hop);
* kvtier's ``Generation`` stepped one engine turn per call through
  ``EngineThread.run`` from an anyio event loop (what the gateway does).

EOS is disabled so every run decodes exactly ``--tokens`` tokens. Runs are
interleaved and repeated; medians are reported with ratios against
stream_generate. Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/kernel_overhead.py [--model DIR] [--tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from mlx_lm import stream_generate

from kernels import (
    EngineThread,
    Generation,
    SamplingParams,
    ensure_default_model,
    load_model,
    render_chat,
)

PROMPT = (
    "You are a careful assistant. Write a detailed, friendly explanation of how "
    "a bicycle's gears work, covering chains, sprockets, derailleurs, cadence "
    "and why riders shift before climbing a hill. Use several paragraphs."
)


def _time_stream_generate(model: Any, tok: Any, prompt: list[int], n: int, step: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = last = t0
    count = 0
    for _ in stream_generate(model, tok, prompt, max_tokens=n, prefill_step_size=step):
        last = time.perf_counter()
        if count == 0:
            first = last
        count += 1
    assert count == n, count
    return first - t0, (count - 1) / (last - first)


def _time_kernel_inline(model: Any, tok: Any, prompt: list[int], n: int, step: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    gen = Generation(model, tok, prompt, SamplingParams(max_tokens=n), prefill_step_size=step)
    while not gen.prefill_step():
        pass
    gen.decode_step()
    first = time.perf_counter()
    count = 1
    while gen.finish_reason is None:
        gen.decode_step()
        count += 1
    last = time.perf_counter()
    assert count == n, count
    return first - t0, (count - 1) / (last - first)


async def _time_kernel_engine(engine: EngineThread, model: Any, tok: Any, prompt: list[int], n: int, step: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    make = partial(Generation, prefill_step_size=step)
    gen: Generation = await engine.run(make, model, tok, prompt, SamplingParams(max_tokens=n))
    while not await engine.run(gen.prefill_step):
        pass
    await engine.run(gen.decode_step)
    first = time.perf_counter()
    count = 1
    while gen.finish_reason is None:
        await engine.run(gen.decode_step)
        count += 1
    last = time.perf_counter()
    assert count == n, count
    return first - t0, (count - 1) / (last - first)


async def _noop_roundtrip(engine: EngineThread, calls: int) -> float:
    def noop() -> None:
        return None

    for _ in range(100):
        await engine.run(noop)
    t0 = time.perf_counter()
    for _ in range(calls):
        await engine.run(noop)
    return (time.perf_counter() - t0) / calls


def _sync_roundtrip(engine: EngineThread, calls: int) -> float:
    def noop() -> None:
        return None

    t0 = time.perf_counter()
    for _ in range(calls):
        engine.sync_run(noop)
    return (time.perf_counter() - t0) / calls


async def _main(args: argparse.Namespace) -> None:
    path = Path(args.model) if args.model else ensure_default_model()
    async with EngineThread() as engine:
        # NOTE: the model is loaded on the engine thread; the in-process
        # baselines then also run there (via sync_run) so every MLX call
        # stays on one thread, as in the server.
        lm = await engine.run(load_model, path)
        tok = lm.tokenizer
        tok.eos_token_ids = []  # decode exactly --tokens tokens in every run
        prompt = render_chat(tok, [{"role": "user", "content": PROMPT}])
        n, step = args.tokens, args.prefill_step_size

        noop_async = await _noop_roundtrip(engine, args.noop_calls)
        noop_sync = await anyio.to_thread.run_sync(_sync_roundtrip, engine, args.noop_calls)

        sg_run: Callable[[], tuple[float, float]] = partial(_time_stream_generate, lm.model, tok, prompt, n, step)
        inline_run: Callable[[], tuple[float, float]] = partial(_time_kernel_inline, lm.model, tok, prompt, n, step)
        await engine.run(sg_run)  # warm-up (kernels, allocator)
        await engine.run(inline_run)
        results: dict[str, list[tuple[float, float]]] = {"stream_generate": [], "kernel inline": [], "kernel via EngineThread.run": []}
        for _ in range(args.repeats):
            results["stream_generate"].append(await engine.run(sg_run))
            results["kernel inline"].append(await engine.run(inline_run))
            results["kernel via EngineThread.run"].append(
                await _time_kernel_engine(engine, lm.model, tok, prompt, n, step)
            )

    print(f"model: {path.name}   prompt: {len(prompt)} tokens   decode: {n} tokens   repeats: {args.repeats}")
    print(f"EngineThread.run no-op round trip: {noop_async * 1e6:.1f} us   sync_run: {noop_sync * 1e6:.1f} us")
    base_ttft = statistics.median(r[0] for r in results["stream_generate"])
    base_tps = statistics.median(r[1] for r in results["stream_generate"])
    print(f"{'path':32s} {'TTFT ms':>9s} {'decode tok/s':>13s} {'TTFT ratio':>11s} {'tok/s ratio':>12s}")
    for name, runs in results.items():
        ttft = statistics.median(r[0] for r in runs)
        tps = statistics.median(r[1] for r in runs)
        print(f"{name:32s} {ttft * 1e3:9.1f} {tps:13.1f} {ttft / base_ttft:11.3f} {tps / base_tps:12.3f}")
    # NOTE: on a shared CPU the machine's load drifts between runs; ratios of
    # the back-to-back runs of one repeat cancel most of that drift.
    for name in ("kernel inline", "kernel via EngineThread.run"):
        pairs = zip(results[name], results["stream_generate"], strict=True)
        ratios = [(k[1] / b[1], k[0] / b[0]) for k, b in pairs]
        tps_r = statistics.median(r[0] for r in ratios)
        ttft_r = statistics.median(r[1] for r in ratios)
        print(f"paired median ratios, {name} / stream_generate: decode tok/s {tps_r:.3f}, TTFT {ttft_r:.3f}")
    print("all tok/s samples:", {k: [round(r[1], 1) for r in v] for k, v in results.items()})
    step_s = 1.0 / statistics.median(r[1] for r in results["kernel via EngineThread.run"])
    print(f"no-op round trip as a share of one decode step: {noop_async / step_s * 100:.2f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="mlx-lm model dir (default: kvtier's default model)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--noop-calls", type=int, default=2000)
    anyio.run(_main, parser.parse_args())


if __name__ == "__main__":
    main()
