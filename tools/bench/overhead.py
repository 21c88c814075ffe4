"""kvtier's serving overhead, side by side, on the default model.

Measures decode tokens/s and time to first token (TTFT) for, in one run:

1. ``mlx_lm.stream_generate`` in-process (the floor),
2. kvtier's ``Engine`` API in-process,
3. ``mlx_lm.server`` (subprocess, OpenAI streaming over HTTP),
4. ``kvtier serve`` (subprocess, OpenAI streaming over HTTP),

rounds interleaved (every contender once per round) and reported as medians,
with the ratios the targets name: Engine decode / stream_generate (target
>= 0.95) and kvtier HTTP decode / mlx_lm.server decode (target >= 1.0).

Every request uses a fresh prompt (a per-request nonce first) so prompt
caches cannot shorten TTFT; generation is greedy with ``max_tokens`` tokens.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/overhead.py [--rounds 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import running_server  # noqa: E402

import kernels  # noqa: E402
from actors.engine import Engine, GenerationParams, TokenEvent  # noqa: E402

QUESTION = "Explain in a few sentences why the sky is blue, then list three colours of a sunset."


@dataclass
class Sample:
    """One request: time to first token and decode rate after it."""

    ttft_s: float
    tokens: int
    decode_s: float

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, per second of decoding."""
        return (self.tokens - 1) / self.decode_s if self.decode_s > 0 and self.tokens > 1 else 0.0


def _messages(nonce: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request {nonce}. {QUESTION}"}]


def _http_sample(base: str, model: str, nonce: int, max_tokens: int) -> Sample:
    body = {
        "model": model,
        "messages": _messages(nonce),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage_tokens = obj["usage"].get("completion_tokens")
            for choice in obj.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None, "no content streamed"
    tokens = usage_tokens if usage_tokens else chunks
    return Sample(first - start, tokens, end - first)


def _stream_generate_sample(model: object, tokenizer: object, nonce: int, max_tokens: int) -> Sample:
    from mlx_lm import stream_generate

    prompt = kernels.render_chat(tokenizer, _messages(nonce))
    start = time.perf_counter()
    first: float | None = None
    n = 0
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):  # type: ignore[arg-type]
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return Sample(first - start, n, end - first)


async def _engine_sample(engine: Engine, nonce: int, max_tokens: int) -> Sample:
    start = time.perf_counter()
    first: float | None = None
    n = 0
    async with engine.chat(_messages(nonce), GenerationParams(max_tokens=max_tokens)) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                n += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return Sample(first - start, n, end - first)


async def _tiny_overhead(tokens: int, rounds: int) -> tuple[float, float]:
    """Per-token wall time (µs) of a tiny model: the direct kernel loop vs the Engine.

    The tiny model's step costs little, so the difference is kvtier's fixed
    per-token cost (turn hand-off, mailboxes, streaming), independent of how
    fast the CPU runs the real model.
    """
    from tests.kernels.test_generation import lively_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    model = lively_llama(len(tok))
    prompt = kernels.encode_prompt(tok, "the cat in the hat")
    params = kernels.SamplingParams(max_tokens=tokens, stop_token_ids=())
    direct: list[float] = []
    engine_us: list[float] = []
    eos = list(tok.eos_token_ids)
    # NOTE: no EOS for the tiny model, so every run produces exactly `tokens` tokens.
    tok.eos_token_ids = []
    try:
        kernels.run_generation(kernels.Generation(model, tok, prompt, params))
        async with Engine.from_loaded(model, tok, model_id="tiny", prompt_cache_bytes=0) as engine:
            await engine.complete_prompt(prompt, GenerationParams(max_tokens=8))
            for _ in range(rounds):
                t0 = time.perf_counter()
                out = kernels.run_generation(kernels.Generation(model, tok, prompt, params))
                direct.append((time.perf_counter() - t0) / len(out) * 1e6)
                t0 = time.perf_counter()
                c = await engine.complete_prompt(prompt, GenerationParams(max_tokens=tokens))
                engine_us.append((time.perf_counter() - t0) / len(c.token_ids) * 1e6)
    finally:
        tok.eos_token_ids = eos
    return statistics.median(direct), statistics.median(engine_us)


def _summary(samples: list[Sample]) -> tuple[float, float, int]:
    return (
        statistics.median(s.decode_tps for s in samples),
        statistics.median(s.ttft_s for s in samples),
        int(statistics.median(s.tokens for s in samples)),
    )


def main() -> int:
    """Run every contender ``--rounds`` times, interleaved; print medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-http", action="store_true", help="in-process contenders only")
    args = parser.parse_args()

    model_dir = kernels.ensure_default_model()
    loaded = kernels.load_model(model_dir)
    results: dict[str, list[Sample]] = {k: [] for k in ("stream_generate", "engine", "mlx_lm.server", "kvtier serve")}
    nonce = iter(range(10_000))

    async def in_process(rounds: int) -> None:
        # NOTE: the Engine loads its own copy on its engine thread; the
        # stream_generate copy stays on this (main) thread, like mlx-lm users.
        async with Engine(model_dir, prompt_cache_bytes=0) as engine:
            await _engine_sample(engine, next(nonce), 8)  # warm-up
            _stream_generate_sample(loaded.model, loaded.tokenizer, next(nonce), 8)
            for _ in range(rounds):
                results["stream_generate"].append(
                    _stream_generate_sample(loaded.model, loaded.tokenizer, next(nonce), args.max_tokens)
                )
                results["engine"].append(await _engine_sample(engine, next(nonce), args.max_tokens))

    anyio.run(in_process, args.rounds)

    tiny_direct, tiny_engine = anyio.run(_tiny_overhead, 400, max(3, args.rounds))

    if not args.skip_http:
        py = sys.executable
        kv_argv = [py, "-m", "actors.cli", "serve", "--model", str(model_dir),
                   "--prompt-cache", "0", "--log-level", "warning"]
        mlx_argv = [py, "-m", "mlx_lm", "server", "--model", str(model_dir)]
        with (
            tempfile.TemporaryDirectory(prefix="kvtier-overhead-") as tmp,
            running_server(kv_argv, Path(tmp), "kvtier") as kv_base,
            running_server(mlx_argv, Path(tmp), "mlx_lm") as mlx_base,
        ):
            contenders: list[tuple[str, Callable[[int, int], Sample]]] = [
                ("mlx_lm.server", lambda n, m: _http_sample(mlx_base, str(model_dir), n, m)),
                ("kvtier serve", lambda n, m: _http_sample(kv_base, str(model_dir), n, m)),
            ]
            for _, fn in contenders:
                fn(next(nonce), 8)  # warm-up
            for _ in range(args.rounds):
                for name, fn in contenders:
                    results[name].append(fn(next(nonce), args.max_tokens))

    print(f"# overhead: default model {loaded.identity.name}, max_tokens={args.max_tokens}, "
          f"rounds={args.rounds} (medians)")
    print(f"{'contender':<18} {'decode tok/s':>12} {'TTFT ms':>9} {'tokens':>7}")
    summary: dict[str, tuple[float, float, int]] = {}
    for name, samples in results.items():
        if not samples:
            continue
        summary[name] = _summary(samples)
        tps, ttft, toks = summary[name]
        print(f"{name:<18} {tps:>12.1f} {ttft * 1000:>9.1f} {toks:>7d}")
    if "engine" in summary:
        print(f"ratio Engine / stream_generate decode: {summary['engine'][0] / summary['stream_generate'][0]:.3f} (target >= 0.95)")
        print(f"ratio Engine / stream_generate TTFT:   {summary['engine'][1] / summary['stream_generate'][1]:.3f}")
    print(f"tiny model per token: direct kernel loop {tiny_direct:.0f} µs, Engine {tiny_engine:.0f} µs "
          f"-> kvtier overhead {tiny_engine - tiny_direct:.0f} µs/token")
    if "kvtier serve" in summary and "mlx_lm.server" in summary:
        print(f"ratio kvtier HTTP / mlx_lm.server decode: {summary['kvtier serve'][0] / summary['mlx_lm.server'][0]:.3f} (target >= 1.0)")
        print(f"ratio kvtier HTTP / mlx_lm.server TTFT:   {summary['kvtier serve'][1] / summary['mlx_lm.server'][1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
