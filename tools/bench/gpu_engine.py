"""kvtier's Engine on a GPU: decode/TTFT vs ``mlx_lm.stream_generate``, and prompt-cache TTFT.

Built for MLX's CUDA backend on the lent H200 (absolute times mean something
only there), and runnable on the CPU with ``--tiny`` as an end-to-end check.
No weights are downloaded: each model is a seeded random-weight mlx-lm
``llama`` of a real shape (Llama-3-8B, Llama-3.2-1B) in bf16, with the
default model's tokenizer (SmolLM2, vocab 49152; the shapes take that
vocabulary). Random weights give garbage text, which does not change the
work per token. EOS is switched off, so every request decodes exactly
``--max-tokens`` tokens.

Per shape, in one process:

1. *Decode*: the same token-id prompt, greedy, ``--max-tokens`` tokens,
   through ``mlx_lm.stream_generate`` (main thread) and through
   ``actors.engine.Engine`` (engine thread + actors, prompt cache off),
   interleaved rounds (the order alternates each round), medians. Target
   from issue #3: Engine decode >= 0.95 x stream_generate. A reference row
   runs stream_generate before the Engine starts, under MLX's own
   buffer-cache limit (the Engine sets kvtier's 16 MiB limit process-wide).
   The Engine runs decode bursts of ``--max-burst`` steps per turn;
   ``--with-single-step`` adds an ``Engine(max_burst=1)`` row (one gateway
   turn per token, the protocol before bursts) to the same rounds;
   ``--variants 32:512,32:2048`` adds Engines of other ``max_batch`` and
   ``prefill_step_size`` (32 rows: the batch lane ``kvtier serve`` uses on CUDA).
2. *Prompt cache*: TTFT of chat requests through an Engine with the RAM
   prompt cache on, over a ``--long-tokens`` system prompt: cold (fresh
   system prompt), shared-prefix (same system prompt, another user
   message), exact repeat. One full warm-up scenario first (CUDA kernels
   are compiled per shape), then ``--repeats`` fresh scenarios, medians;
   warm/cold ratios (issue #4 target <= 0.02). ``stream_generate``'s TTFT
   on the cold prompt is printed as the no-cache floor.

``--anatomy`` (diagnostic, instead of 1 and 2): wraps ``mx.async_eval``,
``MlxBackend.open/step``, ``CacheRegistry.materialize`` and
``kernels.render_chat`` with timers, then prints where the time of a decode
token goes (CPU time inside ``async_eval``, i.e. building and launching the
step; the Engine's step time and the hand-off gap between its steps) and a
timeline of cold / shared-prefix / repeat requests.

GPU (see docs/benchmarks/gpu.md for the two-call recipe)::

    PYTHONUNBUFFERED=1 python3 tools/bench/gpu_engine.py --tok-dir .gpu/tok --json $OUT/gpu_engine.json

CPU check::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/gpu_engine.py --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # NOTE: PYTHONPATH (a snapshot of the packages) wins

from actors.engine import DoneEvent, Engine, GenerationParams, TokenEvent  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "llama3.2-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    # NOTE: the default model's shape (SmolLM2-135M-Instruct), for CPU runs on a
    # machine the weights cannot be sent to (tools/bench/gpu_serving.sh cluster).
    "smollm2-135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
}

WORDS = (
    "policy",
    "ledger",
    "archive",
    "river",
    "lantern",
    "copper",
    "orchard",
    "signal",
    "harbor",
    "meadow",
    "quartz",
    "timber",
    "violet",
    "summit",
    "canyon",
    "beacon",
    "ember",
    "falcon",
    "glacier",
    "hollow",
    "island",
    "jasmine",
    "kettle",
    "lagoon",
)

DEFAULT_TOK_DIR = Path.home() / ".cache" / "kvtier" / "models" / "SmolLM2-135M-Instruct-fp32"


@dataclass
class Sample:
    """One request: time to first token and the decode rate after it."""

    ttft_s: float
    tokens: int
    decode_s: float
    cached_tokens: int = 0
    engine_ttft_s: float | None = None

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, per second of decoding."""
        return (self.tokens - 1) / self.decode_s if self.decode_s > 0 and self.tokens > 1 else 0.0


@dataclass
class ShapeResult:
    """Everything measured for one model shape (printed, and dumped with ``--json``)."""

    shape: str
    params_b: float
    build_s: float
    decode: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    cache: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)


class Report:
    """Prints lines and keeps them (so ``--json`` carries the text too)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def load_tokenizer(tok_dir: Path) -> Any:
    """mlx-lm's ``TokenizerWrapper`` from a folder with tokenizer.json/_config.json, EOS off."""
    from mlx_lm.tokenizer_utils import load

    tok = load(tok_dir)
    # NOTE: with random weights greedy decoding may hit an EOS id; without EOS
    # both contenders always decode exactly max_tokens tokens.
    tok.eos_token_ids = []
    return tok


def build_model(shape: str, vocab: int, seed: int, dtype: mx.Dtype) -> tuple[Any, float]:
    """A seeded random-weight mlx-lm llama of ``shape``; returns it and its parameter count (B)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        max_position_embeddings=131072,
        **SHAPES[shape],
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(dtype)
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    # NOTE: evaluate tensor by tensor so the float32 init never materializes whole.
    for _, p in params:
        mx.eval(p)
    n = sum(p.size for _, p in params)
    return model, n / 1e9


def filler_ids(tokenizer: Any, n: int, nonce: str) -> list[int]:
    """``n`` token ids of deterministic filler text tagged with ``nonce``."""
    words = [f"Note {nonce}."]
    i = 0
    ids: list[int] = []
    while len(ids) < n:
        words.extend(WORDS[(i * 7 + j) % len(WORDS)] for j in range(64))
        i += 1
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    return [int(t) for t in ids[:n]]


def system_text(tokenizer: Any, n: int, nonce: str) -> str:
    """A system prompt of about ``n`` tokens, unique per ``nonce``."""
    return str(tokenizer.decode(filler_ids(tokenizer, n, nonce)))


def stream_generate_sample(
    model: Any, tokenizer: Any, prompt: list[int], max_tokens: int
) -> Sample:
    """``mlx_lm.stream_generate`` on this thread: TTFT and decode time."""
    from mlx_lm import stream_generate

    start = time.perf_counter()
    first: float | None = None
    n = 0
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None, "stream_generate produced nothing"
    return Sample(first - start, n, end - first)


async def engine_sample(
    engine: Engine,
    params: GenerationParams,
    *,
    prompt: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
) -> Sample:
    """One Engine request (raw ids or chat): client-side TTFT, decode time, cache use."""
    stream = (
        engine.chat(messages, params)
        if messages is not None
        else engine.generate(prompt or [], params)
    )
    start = time.perf_counter()
    first: float | None = None
    n = 0
    done: DoneEvent | None = None
    async with stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                n += 1
                if first is None:
                    first = time.perf_counter()
            else:
                done = event
    end = time.perf_counter()
    assert first is not None, "the Engine produced no token"
    assert done is not None, "the Engine stream ended without a DoneEvent"
    return Sample(
        first - start,
        n,
        end - first,
        cached_tokens=done.usage.cached_tokens,
        engine_ttft_s=done.timings.ttft_s,
    )


def _med(samples: list[Sample], attr: str) -> float:
    return float(statistics.median(getattr(s, attr) for s in samples))


async def run_decode(
    model: Any,
    tok: Any,
    args: argparse.Namespace,
    res: ShapeResult,
    out: Report,
    default_cache_limit: int,
) -> None:
    """Part 1: stream_generate vs Engine decode tok/s and TTFT, interleaved rounds."""
    prompt = filler_ids(tok, args.decode_prompt_tokens, "decode")
    runs: dict[str, list[Sample]] = {
        "stream_generate (mlx cache limit)": [],
        "stream_generate": [],
        "engine": [],
    }
    if args.with_single_step:
        runs["engine max_burst=1"] = []
    variants = _variants(args.variants)
    for name in variants:
        runs[name] = []

    # NOTE: reference row under MLX's default buffer-cache limit; the Engine
    # below sets kvtier's limit for the whole process.
    mx.set_cache_limit(default_cache_limit)
    stream_generate_sample(model, tok, prompt, 8)
    for _ in range(args.ref_rounds):
        runs["stream_generate (mlx cache limit)"].append(
            stream_generate_sample(model, tok, prompt, args.max_tokens)
        )

    params = GenerationParams(max_tokens=args.max_tokens)
    async with contextlib.AsyncExitStack() as stack:
        engines: dict[str, Engine] = {}
        # NOTE: "engine" uses decode bursts (--max-burst); the optional
        # "engine max_burst=1" row is the one-gateway-turn-per-token protocol,
        # measured in the same rounds.
        configs = {
            "engine": (args.max_burst, 1, args.prefill_step_size),
            "engine max_burst=1": (1, 1, args.prefill_step_size),
            **{name: (args.max_burst, rows, step) for name, (rows, step) in variants.items()},
        }
        for name, (burst, rows, step) in configs.items():
            if name in runs:
                engines[name] = await stack.enter_async_context(
                    Engine.from_loaded(
                        model,
                        tok,
                        model_id=res.shape,
                        prompt_cache_bytes=0,
                        prefill_step_size=step,
                        max_queue=4,
                        max_burst=burst,
                        max_batch=rows,
                    )
                )
        for engine in engines.values():
            await engine_sample(engine, GenerationParams(max_tokens=8), prompt=prompt)
        stream_generate_sample(model, tok, prompt, 8)
        for r in range(args.rounds):
            names = ["stream_generate", *engines]
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                if name in engines:
                    runs[name].append(await engine_sample(engines[name], params, prompt=prompt))
                else:
                    runs[name].append(stream_generate_sample(model, tok, prompt, args.max_tokens))

    out(
        f"## {res.shape}: decode, prompt {len(prompt)} tokens, {args.max_tokens} new tokens, "
        f"greedy, medians of {args.rounds} interleaved rounds"
    )
    out(f"{'contender':<36}{'decode tok/s':>13}{'ms/token':>10}{'TTFT ms':>10}{'tokens':>8}")
    for name, samples in runs.items():
        tps = _med(samples, "decode_tps")
        out(
            f"{name:<36}{tps:>13.1f}{1e3 / tps:>10.3f}{_med(samples, 'ttft_s') * 1e3:>10.2f}"
            f"{int(_med(samples, 'tokens')):>8d}"
        )
        res.decode[name] = [asdict(s) | {"decode_tps": s.decode_tps} for s in samples]
    sg, en = runs["stream_generate"], runs["engine"]
    ratio = _med(en, "decode_tps") / _med(sg, "decode_tps")
    per_token_us = (1 / _med(en, "decode_tps") - 1 / _med(sg, "decode_tps")) * 1e6
    ttft_ratio = _med(en, "ttft_s") / _med(sg, "ttft_s")
    res.summary |= {
        "engine_decode_tps": _med(en, "decode_tps"),
        "stream_generate_decode_tps": _med(sg, "decode_tps"),
        "decode_ratio": ratio,
        "engine_overhead_us_per_token": per_token_us,
        "engine_ttft_ms": _med(en, "ttft_s") * 1e3,
        "stream_generate_ttft_ms": _med(sg, "ttft_s") * 1e3,
        "ttft_ratio": ttft_ratio,
    }
    # NOTE: per-round ratios show the spread the medians hide.
    per_round = [e.decode_tps / s.decode_tps for e, s in zip(en, sg, strict=True)]
    out(
        f"ratio Engine / stream_generate decode: {ratio:.3f} (target >= 0.95); "
        f"per round {min(per_round):.3f}..{max(per_round):.3f}"
    )
    out(f"Engine extra time per token: {per_token_us:.0f} µs")
    if "engine max_burst=1" in runs:
        single = runs["engine max_burst=1"]
        single_ratio = _med(single, "decode_tps") / _med(sg, "decode_tps")
        res.summary["decode_ratio_max_burst_1"] = single_ratio
        out(f"ratio Engine max_burst=1 / stream_generate decode: {single_ratio:.3f} (the same rounds)")
    out(f"ratio Engine / stream_generate TTFT: {ttft_ratio:.3f}")
    out()


async def run_prompt_cache(
    model: Any, tok: Any, args: argparse.Namespace, res: ShapeResult, out: Report, rows: int = 1
) -> None:
    """Part 2: cold / shared-prefix / exact-repeat TTFT through the Engine's RAM prompt cache.

    ``rows`` is the Engine's ``max_batch`` (> 1: the batch lane, as ``kvtier
    serve`` runs); its figures are keyed with a `` rows=N`` suffix then.
    """
    tag = "" if rows == 1 else f" rows={rows}"
    params = GenerationParams(max_tokens=args.cache_max_tokens)
    cap = int(args.prompt_cache_gb * 1e9)
    runs: dict[str, list[Sample]] = {
        "cold": [],
        "shared": [],
        "repeat": [],
        "stream_generate cold": [],
    }
    burst_name = f"shared x{args.cache_burst} at once"
    if args.cache_burst > 1:
        runs[burst_name] = []
    prompt_len = 0
    async with Engine.from_loaded(
        model,
        tok,
        model_id=res.shape,
        prompt_cache_bytes=cap,
        prefill_step_size=args.prefill_step_size,
        max_queue=max(4, args.cache_burst + 2),
        max_batch=rows,
    ) as engine:
        for r in range(args.repeats + 1):
            system = system_text(tok, args.long_tokens, f"{res.shape}-{r}-{time.time_ns()}")
            first = [
                {"role": "system", "content": system},
                {"role": "user", "content": "Summarize rule 3."},
            ]
            second = [
                {"role": "system", "content": system},
                {"role": "user", "content": "What is rule 7?"},
            ]
            cold = await engine_sample(engine, params, messages=first)
            shared = await engine_sample(engine, params, messages=second)
            repeat = await engine_sample(engine, params, messages=second)
            burst: list[Sample] = []
            if args.cache_burst > 1:
                # NOTE: the agent trace's later turns: several conversations over
                # the same cached system prompt arrive together, each with its
                # own short suffix (served, they waited 400-590 ms on the H200).
                async def one(asked: list[dict[str, str]], into: list[Sample]) -> None:
                    into.append(await engine_sample(engine, params, messages=asked))

                async with anyio.create_task_group() as tg:
                    for i in range(args.cache_burst):
                        asked = [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Question {i}: what does rule {i} say?"}]
                        tg.start_soon(one, asked, burst)
            ids = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
            ids = [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) else ids)]
            prompt_len = len(ids)
            # NOTE: mlx-lm's own cold TTFT on the same prompt: the no-cache floor.
            floor = stream_generate_sample(model, tok, ids, args.cache_max_tokens)
            if r == 0:
                continue  # warm-up: compiles the kernels of every shape used below
            for name, s in (
                ("cold", cold),
                ("shared", shared),
                ("repeat", repeat),
                ("stream_generate cold", floor),
            ):
                runs[name].append(s)
            if burst:
                runs[burst_name] += burst
        stats = (await engine.stats()).get("prompt_cache", {})

    out(
        f"## {res.shape}: prompt cache, Engine max_batch {rows}, chat prompt {prompt_len} tokens, "
        f"prefill chunk {args.prefill_step_size}, cap {args.prompt_cache_gb:g} GB, medians of {args.repeats}"
    )
    out(f"{'request':<24}{'TTFT ms':>10}{'engine TTFT ms':>16}{'cached tokens':>15}")
    for name, samples in runs.items():
        eng = [s.engine_ttft_s for s in samples if s.engine_ttft_s is not None]
        eng_ms = f"{statistics.median(eng) * 1e3:>16.2f}" if eng else f"{'-':>16}"
        out(
            f"{name:<24}{_med(samples, 'ttft_s') * 1e3:>10.2f}{eng_ms}{int(_med(samples, 'cached_tokens')):>15d}"
        )
        res.cache[name + tag] = [asdict(s) for s in samples]
    cold_ms = _med(runs["cold"], "ttft_s")
    shared_r = _med(runs["shared"], "ttft_s") / cold_ms
    repeat_r = _med(runs["repeat"], "ttft_s") / cold_ms
    floor_r = cold_ms / _med(runs["stream_generate cold"], "ttft_s")
    res.summary |= {
        key + tag.replace(" ", "_"): value for key, value in {
            "cache_prompt_tokens": prompt_len,
            "cold_ttft_ms": cold_ms * 1e3,
            "shared_ttft_ms": _med(runs["shared"], "ttft_s") * 1e3,
            "repeat_ttft_ms": _med(runs["repeat"], "ttft_s") * 1e3,
            "shared_over_cold": shared_r,
            "repeat_over_cold": repeat_r,
            "engine_cold_over_stream_generate_cold": floor_r,
        }.items()
    }
    out(
        f"shared/cold {shared_r:.4f}, repeat/cold {repeat_r:.4f} (target <= 0.02); "
        f"Engine cold / stream_generate cold {floor_r:.3f}"
    )
    if stats:
        keep = {k: v for k, v in stats.items() if isinstance(v, int | float)}
        out(f"prompt cache stats: {json.dumps(keep, sort_keys=True)}")
    out()


class _Timers:
    """Diagnostic instrumentation: timestamps and durations around named calls."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, str]] = []
        self.durations: dict[str, list[float]] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, name: str, *, marks: bool = True) -> None:
        original = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            if marks:
                self.marks.append((t0, name + ">"))
            try:
                return original(*a, **k)
            finally:
                t1 = time.perf_counter()
                self.durations.setdefault(name, []).append(t1 - t0)
                if marks:
                    self.marks.append((t1, name + "<"))

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def reset(self) -> None:
        self.marks.clear()
        self.durations.clear()

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def _ms(xs: list[float], q: float = 0.5) -> str:
    if not xs:
        return "-"
    ys = sorted(xs)
    return f"{ys[min(len(ys) - 1, int(q * len(ys)))] * 1e3:.3f}"


async def run_anatomy(
    model: Any, tok: Any, args: argparse.Namespace, res: ShapeResult, out: Report
) -> None:
    """Diagnostic: per-token CPU launch cost and Engine hand-off gaps; warm-request timeline."""
    import kernels
    from actors.backend import mlx as _backend

    timers = _Timers()
    timers.wrap(mx, "async_eval", "async_eval", marks=False)
    timers.wrap(_backend.MlxBackend, "open", "open")
    timers.wrap(_backend.MlxBackend, "step", "step")
    timers.wrap(kernels.CacheRegistry, "materialize", "materialize")
    timers.wrap(kernels, "render_chat", "render")
    try:
        prompt = filler_ids(tok, args.decode_prompt_tokens, "decode")
        n = args.max_tokens
        out(f"## {res.shape}: anatomy of a decode token ({n} tokens; medians, p90 in brackets, ms)")
        stream_generate_sample(model, tok, prompt, 8)
        timers.reset()
        sg = stream_generate_sample(model, tok, prompt, n)
        ae = list(timers.durations.get("async_eval", []))
        out(
            f"stream_generate   per token {1e3 / sg.decode_tps:.3f}   async_eval call {_ms(ae)} [{_ms(ae, 0.9)}]"
        )
        params = kernels.SamplingParams(max_tokens=n)
        kernels.run_generation(kernels.Generation(model, tok, prompt, params))
        timers.reset()
        t0 = time.perf_counter()
        kernels.run_generation(kernels.Generation(model, tok, prompt, params))
        direct = (time.perf_counter() - t0) / n
        ae = list(timers.durations.get("async_eval", []))
        out(
            f"Generation loop   per token {direct * 1e3:.3f}   async_eval call {_ms(ae)} [{_ms(ae, 0.9)}]"
        )
        async with Engine.from_loaded(
            model,
            tok,
            model_id=res.shape,
            prompt_cache_bytes=int(args.prompt_cache_gb * 1e9),
            prefill_step_size=args.prefill_step_size,
            max_queue=4,
        ) as engine:
            gp = GenerationParams(max_tokens=n)
            await engine_sample(engine, GenerationParams(max_tokens=8), prompt=prompt)
            timers.reset()
            en = await engine_sample(engine, gp, prompt=[*prompt, 7])
            ae = list(timers.durations.get("async_eval", []))
            steps = timers.durations.get("step", [])[2:]
            ends = [t for t, m in timers.marks if m == "step<"]
            starts = [t for t, m in timers.marks if m == "step>"]
            gaps = [b - a for a, b in zip(ends[1:], starts[2:], strict=False)]
            out(
                f"Engine            per token {1e3 / en.decode_tps:.3f}   async_eval call {_ms(ae)} [{_ms(ae, 0.9)}]"
                f"   step {_ms(steps)} [{_ms(steps, 0.9)}]   hand-off gap {_ms(gaps)} [{_ms(gaps, 0.9)}]"
            )
            out()
            out(
                f"## {res.shape}: request timeline, {args.long_tokens}-token system prompt "
                "(ms from the client's call; last of 2 rounds)"
            )
            cp = GenerationParams(max_tokens=args.cache_max_tokens)
            for r in range(2):
                system = system_text(tok, args.long_tokens, f"anatomy-{res.shape}-{r}")
                first = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "Summarize rule 3."},
                ]
                second = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "What is rule 7?"},
                ]
                for label, msgs in (("cold", first), ("shared", second), ("repeat", second)):
                    timers.reset()
                    t0 = time.perf_counter()
                    sample = await engine_sample(engine, cp, messages=msgs)
                    if r == 0:
                        continue
                    line = " ".join(f"{m}@{(t - t0) * 1e3:.1f}" for t, m in timers.marks[:14])
                    out(
                        f"{label:<7} TTFT {sample.ttft_s * 1e3:.1f} (engine {1e3 * (sample.engine_ttft_s or 0):.1f}), "
                        f"cached {sample.cached_tokens}: {line}"
                    )
    finally:
        timers.restore()
    out()


def _device_line() -> str:
    try:
        info = mx.device_info()
    except Exception as exc:  # noqa: BLE001 - informational only
        info = {"error": repr(exc)}
    name = info.get("device_name") or info.get("architecture") or "?"
    mem = info.get("memory_size")
    mem_s = f", {int(mem) / 2**30:.0f} GiB" if isinstance(mem, int | float) else ""
    return f"{mx.default_device()} ({name}{mem_s})"


def _variants(spec: str) -> dict[str, tuple[int, int]]:
    """``--variants``' Engines: name -> (max_batch, prefill_step_size)."""
    out: dict[str, tuple[int, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        rows, _, step = item.partition(":")
        out[f"engine {rows} rows, step {step}"] = (int(rows), int(step))
    return out


def main() -> int:
    """Measure every requested shape; print tables and ratios; optionally dump JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shape, short runs (CPU check)")
    parser.add_argument(
        "--shapes", default="llama3-8b,llama3.2-1b", help=f"comma list of {sorted(SHAPES)}"
    )
    parser.add_argument("--tok-dir", type=Path, default=DEFAULT_TOK_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ref-rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--decode-prompt-tokens", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-max-tokens", type=int, default=4)
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--prompt-cache-gb", type=float, default=16.0)
    parser.add_argument("--skip-cache", action="store_true")
    parser.add_argument(
        "--cache-burst", type=int, default=1,
        help="part 2 also sends this many shared-prefix requests at once (each its own user "
             "message) and reports their TTFT (1: none)",
    )
    parser.add_argument(
        "--cache-rows", default="1",
        help="part 2 once per value, comma list: the Engine's max_batch (32: the batch lane "
             "kvtier serve runs on CUDA)",
    )
    parser.add_argument("--max-burst", type=int, default=64, help="decode steps per engine turn")
    parser.add_argument(
        "--with-single-step",
        action="store_true",
        help="also run an Engine with max_burst=1 (one gateway turn per token) in the same rounds",
    )
    parser.add_argument(
        "--variants", default="",
        help="more Engines in the same rounds, ROWS:STEP each (max_batch, prefill_step_size; "
             "ROWS > 1 is the batch lane, which kvtier serve uses), e.g. 32:512,32:2048,1:512",
    )
    parser.add_argument(
        "--anatomy", action="store_true", help="diagnostic timers instead of the benchmark"
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="write every sample and the text here"
    )
    args = parser.parse_args()
    if args.tiny:
        args.shapes = "tiny"
        args.rounds, args.ref_rounds, args.max_tokens = 3, 2, 32
        args.long_tokens, args.repeats, args.prompt_cache_gb = 768, 2, 0.5

    out = Report()
    from importlib.metadata import version

    default_cache_limit = int(mx.set_cache_limit(0))
    mx.set_cache_limit(default_cache_limit)
    out(
        f"# kvtier gpu_engine bench: mlx {version('mlx')}, mlx-lm {version('mlx-lm')}, "
        f"device {_device_line()}, MLX default cache limit {default_cache_limit / 2**30:.1f} GiB"
    )
    import actors

    out(
        f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; kvtier from {Path(actors.__file__).parent.parent}; "
        f"argv: {' '.join(sys.argv[1:])}"
    )
    tok = load_tokenizer(args.tok_dir)
    vocab = len(tok)
    dtype = getattr(mx, args.dtype)
    results: list[ShapeResult] = []
    for shape in args.shapes.split(","):
        t0 = time.perf_counter()
        model, params_b = build_model(shape, vocab, args.seed, dtype)
        res = ShapeResult(shape=shape, params_b=params_b, build_s=time.perf_counter() - t0)
        out(
            f"# {shape}: {params_b:.2f} B parameters ({args.dtype}, vocab {vocab}), "
            f"built in {res.build_s:.1f} s, active memory {mx.get_active_memory() / 2**30:.1f} GiB"
        )
        try:
            if args.anatomy:
                anyio.run(run_anatomy, model, tok, args, res, out)
            else:
                anyio.run(run_decode, model, tok, args, res, out, default_cache_limit)
            if not args.skip_cache and not args.anatomy:
                for rows in (int(r) for r in args.cache_rows.split(",") if r.strip()):
                    anyio.run(run_prompt_cache, model, tok, args, res, out, rows)
        except Exception as exc:  # noqa: BLE001 - keep the other shapes' figures
            out(f"!! {shape} failed: {exc!r}")
            res.summary["failed"] = 1.0
        out(f"# {shape}: peak memory {mx.get_peak_memory() / 2**30:.1f} GiB")
        results.append(res)
        del model
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        if args.json is not None:
            doc = {"lines": out.lines, "results": [asdict(r) for r in results]}
            args.json.write_text(json.dumps(doc, indent=1))
    out("# summary " + json.dumps({r.shape: r.summary for r in results}, sort_keys=True))
    return 0 if all("failed" not in r.summary for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
