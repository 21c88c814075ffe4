"""kvtier's fixed per-token hand-off cost: one gateway turn per token vs decode bursts, side by side.

On a tiny random-weight model (a step costs ~0.5 ms on the CPU, so the
hand-off is visible) measures, rounds interleaved in ONE process:

1. the direct kernel loop (``kernels.run_generation``, no threads, no actors),
2. ``Engine(max_burst=1)``: one gateway round trip and one engine job per token
   (the protocol before bursts),
3. ``Engine(max_burst=N)``: decode bursts chained on the engine thread.

Per contender: wall time per token, and for the Engines the engine thread's
*gap* (end of one decode step to the start of the next: the hand-off on the
critical path) and the step time itself. Medians. EOS is off, so every
request decodes exactly ``--tokens`` tokens. Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/turn_gap.py [--tokens 300] [--rounds 5] [--max-burst 64]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import kernels  # noqa: E402
from actors.backend import mlx as _backend  # noqa: E402
from actors.engine import Engine, GenerationParams  # noqa: E402

_marks: list[tuple[float, float]] = []
_step = _backend.MlxBackend.step


def _timed_step(self: _backend.MlxBackend, gen: Any) -> Any:
    # NOTE: bench-only instrumentation: stamps each step on the engine thread.
    t0 = time.perf_counter()
    result = _step(self, gen)
    _marks.append((t0, time.perf_counter()))
    return result


async def _bench(tokens: int, rounds: int, max_burst: int) -> dict[str, dict[str, list[float]]]:
    from tests.kernels.test_generation import lively_llama, tiny_tokenizer

    _backend.MlxBackend.step = _timed_step  # type: ignore[method-assign]
    tok = tiny_tokenizer()
    model = lively_llama(len(tok))
    prompt = kernels.encode_prompt(tok, "the cat in the hat")
    params = kernels.SamplingParams(max_tokens=tokens, stop_token_ids=())
    tok.eos_token_ids = []
    out: dict[str, dict[str, list[float]]] = {}
    names = ["direct", "Engine max_burst=1", f"Engine max_burst={max_burst}"]
    for name in names:
        out[name] = {"per_token": [], "gap": [], "step": []}
    kernels.run_generation(kernels.Generation(model, tok, prompt, params))
    async with (
        Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0, max_burst=1) as single,
        Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0, max_burst=max_burst) as burst,
    ):
        engines = {names[1]: single, names[2]: burst}
        for engine in engines.values():
            await engine.complete_prompt(prompt, GenerationParams(max_tokens=8))
        for r in range(rounds):
            t0 = time.perf_counter()
            done = kernels.run_generation(kernels.Generation(model, tok, prompt, params))
            out["direct"]["per_token"].append((time.perf_counter() - t0) / len(done) * 1e6)
            order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
            for name, engine in order:
                _marks.clear()
                t0 = time.perf_counter()
                c = await engine.complete_prompt(prompt, GenerationParams(max_tokens=tokens))
                out[name]["per_token"].append((time.perf_counter() - t0) / len(c.token_ids) * 1e6)
                steady = _marks[2:]  # NOTE: skip the prefill chunk and the first decode step
                out[name]["gap"] += [(b[0] - a[1]) * 1e6 for a, b in itertools.pairwise(steady)]
                out[name]["step"] += [(e - s) * 1e6 for s, e in steady]
    return out


def main() -> int:
    """Run the contenders interleaved and print medians side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-burst", type=int, default=64)
    args = parser.parse_args()
    out = anyio.run(_bench, args.tokens, args.rounds, args.max_burst)
    direct = statistics.median(out["direct"]["per_token"])
    print(f"# turn_gap: tiny model, {args.tokens} tokens x {args.rounds} rounds (medians, µs)")
    print(f"{'contender':<24} {'per token':>10} {'overhead':>9} {'step':>7} {'gap':>7} {'gap p90':>8}")
    for name, figures in out.items():
        per = statistics.median(figures["per_token"])
        if figures["gap"]:
            gap = statistics.median(figures["gap"])
            p90 = statistics.quantiles(figures["gap"], n=10)[-1]
            step = statistics.median(figures["step"])
            print(f"{name:<24} {per:>10.0f} {per - direct:>9.0f} {step:>7.0f} {gap:>7.0f} {p90:>8.0f}")
        else:
            print(f"{name:<24} {per:>10.0f} {0:>9.0f} {'-':>7} {'-':>7} {'-':>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
