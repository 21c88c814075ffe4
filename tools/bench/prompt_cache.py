"""Prompt-cache TTFT: kvtier serve vs mlx_lm.server, side by side in one run.

A ~3.4k-token system prompt, three requests per server, each measured as the
time from sending a streaming chat request to its first content chunk:

- cold:          a system prompt neither server has seen (a fresh nonce);
- shared-prefix: the same system prompt with a different user question;
- exact-repeat:  the shared-prefix request again, byte for byte.

Servers run one after the other (never together: the CPU is shared), both on
the default model directory. Prints TTFTs, warm/cold ratios and kvtier/mlx_lm
ratios. Run:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python tools/bench/prompt_cache.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
# NOTE: re-exported: prompt_cache_memory.py imports these from here.
from _common import (
    REPO,
    WORDS,
    Server,
    start_kvtier,
    start_mlx_lm,
    system_prompt,
    ttft,
)

__all__ = ["REPO", "WORDS", "Server", "start_kvtier", "start_mlx_lm", "system_prompt", "ttft"]


def run_scenarios(url: str, model: str, tokens: int, repeats: int, tag: str) -> dict[str, float]:
    """Median TTFT of cold / shared-prefix / exact-repeat over ``repeats`` fresh prompts."""
    cold: list[float] = []
    shared: list[float] = []
    repeat: list[float] = []
    ttft(url, [{"role": "user", "content": "warm up"}], model)
    for r in range(repeats):
        system = system_prompt(tokens, f"{tag}-{r}-{time.time_ns()}")
        first = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize rule 3."}]
        second = [{"role": "system", "content": system}, {"role": "user", "content": "What is rule 7?"}]
        cold.append(ttft(url, first, model))
        shared.append(ttft(url, second, model))
        repeat.append(ttft(url, second, model))
    return {
        "cold": statistics.median(cold),
        "shared": statistics.median(shared),
        "repeat": statistics.median(repeat),
    }


def main() -> int:
    """Run both servers and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model dir (default model if unset)")
    parser.add_argument("--tokens", type=int, default=3400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-mlx-lm", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = start_kvtier(args.model, work, "--prompt-cache", "2")
        try:
            model_id = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            results["kvtier"] = run_scenarios(server.url, model_id, args.tokens, args.repeats, "kv")
        finally:
            server.stop()
        if not args.skip_mlx_lm:
            server = start_mlx_lm(args.model, work)
            try:
                results["mlx_lm.server"] = run_scenarios(
                    server.url, str(args.model), args.tokens, args.repeats, "ml"
                )
            finally:
                server.stop()
    print(f"system prompt ~{args.tokens} tokens, median of {args.repeats}, TTFT in ms")
    print(f"{'server':<14}{'cold':>10}{'shared':>10}{'repeat':>10}{'shared/cold':>13}{'repeat/cold':>13}")
    for name, r in results.items():
        print(
            f"{name:<14}{r['cold'] * 1e3:>10.1f}{r['shared'] * 1e3:>10.1f}{r['repeat'] * 1e3:>10.1f}"
            f"{r['shared'] / r['cold']:>13.4f}{r['repeat'] / r['cold']:>13.4f}"
        )
    if "mlx_lm.server" in results:
        k, m = results["kvtier"], results["mlx_lm.server"]
        for key in ("cold", "shared", "repeat"):
            print(f"kvtier/mlx_lm {key:<7} TTFT ratio: {k[key] / m[key]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
