"""Anatomy of a warm prompt-cache hit's first token on one device (diagnostic).

Builds a random-weight model of a real shape, prefills a long prompt once
(the donor), then times what a warm hit does before its first token, in
variants: the materialized cache as zero-copy views of the donor (today),
landed into step-rounded buffers with slack (one copy at materialize), and
the cost of that copy alone; each variant's first step (forward of the
uncached suffix + sampling + the queued next forward) is split out.

Usage: python tools/bench/warm_hit.py [--shape llama3-8b] [--tokens 8000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import SHAPES, build_model
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kernels import clone_caches
from kernels.engine import Generation
from messages.gateway import GenerationParams


class _Tok:
    eos_token_ids: list[int] = []  # noqa: RUF012

    class _Detok:
        def reset(self) -> None: ...
        def add_token(self, t: int) -> None: ...
        def finalize(self) -> None: ...
        last_segment = ""
        text = ""

    detokenizer = _Detok()


def _slack(views: list[KVCache], step: int = 256) -> list[KVCache]:
    out = []
    for c in views:
        n = c.offset
        cap = ((n + step) // step) * step
        b, h, _, d = c.keys.shape
        k = mx.zeros((b, h, cap, d), c.keys.dtype)
        v = mx.zeros((b, h, cap, c.values.shape[3]), c.values.dtype)
        k[..., :n, :] = c.keys
        v[..., :n, :] = c.values
        nc = KVCache()
        nc.keys, nc.values, nc.offset = k, v, n
        out.append(nc)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--suffix", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    model, nb = build_model(a.shape, 49152, 0, mx.bfloat16)
    print(f"# {a.shape}: {nb:.2f} B params, device {mx.default_device()}, mlx {mx.__version__}")
    prompt = [(i * 7919) % 49000 + 10 for i in range(a.tokens + a.suffix)]
    donor = make_prompt_cache(model)
    for s in range(0, a.tokens, 2048):
        model(mx.array(prompt[s : min(s + 2048, a.tokens)])[None], cache=donor)
        mx.eval([c.state for c in donor])
    params = GenerationParams(max_tokens=4, temperature=0.0)
    rows: dict[str, list[float]] = {}

    def rec(k: str, v: float) -> None:
        rows.setdefault(k, []).append(v * 1e3)

    for _ in range(a.rounds):
        for variant in ("views", "slack", "views_sync_first"):
            t0 = time.perf_counter()
            cache = clone_caches(donor, a.tokens)
            if variant == "slack":
                cache = _slack(cache)
                mx.eval([c.keys for c in cache] + [c.values for c in cache])
            t1 = time.perf_counter()
            gen = Generation(model, _Tok(), prompt, params, cache=cache, cached_tokens=a.tokens)
            while not gen.prefill_step():
                pass
            t2 = time.perf_counter()
            if variant == "views_sync_first":
                # the suffix forward alone, synchronously (no queued next forward)
                c2 = clone_caches(donor, a.tokens)
                t3 = time.perf_counter()
                logits = model(mx.array(prompt[a.tokens :])[None], cache=c2)
                mx.eval(logits)
                rec("suffix forward alone (views)", time.perf_counter() - t3)
                t3 = time.perf_counter()
                logits = model(mx.array(prompt[a.tokens + 1 :])[None], cache=c2)
                mx.eval(logits)
                rec("next 1-token forward (views, written)", time.perf_counter() - t3)
                c3 = _slack(clone_caches(donor, a.tokens))
                mx.eval([c.keys for c in c3])
                t3 = time.perf_counter()
                logits = model(mx.array(prompt[a.tokens :])[None], cache=c3)
                mx.eval(logits)
                rec("suffix forward alone (slack)", time.perf_counter() - t3)
                c4 = clone_caches(donor, a.tokens)
                t3 = time.perf_counter()
                mx.eval([mx.concatenate([c.keys, mx.zeros((1, c.keys.shape[1], 256, c.keys.shape[3]), c.keys.dtype)], axis=2) for c in c4])
                rec("concat copy of prefix alone", time.perf_counter() - t3)
                del c2, c3, c4, logits
            out = gen.decode_step()
            t4 = time.perf_counter()
            _ = gen.decode_step()
            t5 = time.perf_counter()
            rec(f"{variant}: materialize", t1 - t0)
            rec(f"{variant}: first token after open", t4 - t2 if variant != "views_sync_first" else float("nan"))
            rec(f"{variant}: materialize -> first token", (t1 - t0) + (t4 - t2) if variant != "views_sync_first" else float("nan"))
            rec(f"{variant}: second token", t5 - t4)
            del gen, cache, out
            mx.clear_cache()
    for k, v in rows.items():
        v2 = [x for x in v if x == x]
        if v2:
            print(f"{k:45s} median {statistics.median(v2):8.2f} ms  [{min(v2):.2f}..{max(v2):.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
