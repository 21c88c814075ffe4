"""Several choices of one prompt through ``kvtier serve``: one request with ``n``, against ``n`` requests.

Three ways to get ``n`` answers to one new prompt, interleaved over fresh
prompts (a nonce first, so nothing is cached), each timed to its last byte:

- ``one``: a single request with ``n: 1`` (the cost of one answer);
- ``n``: one request with ``n: N`` (the choices share the prompt's prefill:
  the first takes the prompt snapshot, the others wait for it);
- ``separate``: ``N`` concurrent requests with ``n: 1`` (what a client does
  on a server without ``n``; each prefills the prompt).

Both endpoints: ``/v1/completions`` (raw prompts) and ``/v1/chat/completions``.
Prints the medians and the ratios ``n / one`` and ``separate / n``; writes
JSON and a PNG.

    python tools/bench/choices.py --n 4 --prompt-words 400 --rounds 3 \\
        --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import in_threads, loadavg, machine, start_kvtier

ENDPOINTS = ("completions", "chat")
WAYS = ("one", "n", "separate")


def _body(endpoint: str, prompt: str, n: int, max_tokens: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"n": n, "max_tokens": max_tokens, "temperature": 0}
    if endpoint == "chat":
        return {**fields, "messages": [{"role": "user", "content": prompt}]}
    return {**fields, "prompt": prompt}


def _post(url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(f"{url}{path}", json=body, timeout=600)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def _timed(url: str, endpoint: str, way: str, prompt: str, n: int, max_tokens: int) -> float:
    """Seconds until every answer of ``way`` is in."""
    t = time.perf_counter()
    if way == "one":
        _post(url, endpoint, _body(endpoint, prompt, 1, max_tokens))
    elif way == "n":
        answer = _post(url, endpoint, _body(endpoint, prompt, n, max_tokens))
        if len(answer["choices"]) != n:
            raise RuntimeError(f"{len(answer['choices'])} choices, asked for {n}")
    else:

        def one(_: int) -> None:
            _post(url, endpoint, _body(endpoint, prompt, 1, max_tokens))

        in_threads(one, n)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the default model)")
    p.add_argument("--n", type=int, default=4, help="choices per prompt")
    p.add_argument("--prompt-words", type=int, default=400, help="words of each new prompt")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per answer")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a fresh prompt each)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--plot", type=Path, default=None, help="write the PNG here")
    args = p.parse_args()
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    info = {**machine(), "load_start": loadavg(), "argv": sys.argv[1:]}
    print(json.dumps(info))
    times: dict[str, dict[str, list[float]]] = {e: {w: [] for w in WAYS} for e in ENDPOINTS}
    words = " ".join(f"word{i}" for i in range(args.prompt_words))
    with tempfile.TemporaryDirectory() as tmp:
        server = start_kvtier(args.model, Path(tmp), "--max-tokens", str(args.max_tokens))
        try:
            url = server.url
            _timed(url, "completions", "one", "warm up " + words, args.n, args.max_tokens)
            for r in range(args.rounds):
                for endpoint in ENDPOINTS:
                    for way in WAYS:
                        prompt = f"round {r} {endpoint} {way}: {words}"
                        dt = _timed(url, endpoint, way, prompt, args.n, args.max_tokens)
                        times[endpoint][way].append(dt)
                        print(f"round {r} {endpoint:11s} {way:8s} {dt:7.2f} s", flush=True)
        finally:
            server.stop()
    summary: dict[str, dict[str, float]] = {}
    for endpoint in ENDPOINTS:
        med = {w: statistics.median(times[endpoint][w]) for w in WAYS}
        summary[endpoint] = {**med, "n_over_one": med["n"] / med["one"],
                             "separate_over_n": med["separate"] / med["n"]}
        print(f"{endpoint:11s} medians: one {med['one']:.2f} s, n={args.n} {med['n']:.2f} s, "
              f"{args.n} separate {med['separate']:.2f} s | n / one "
              f"{summary[endpoint]['n_over_one']:.2f}, separate / n "
              f"{summary[endpoint]['separate_over_n']:.2f}")
    info["load_end"] = loadavg()
    print(f"load average: start {info['load_start']}, end {info['load_end']}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "times": times, "summary": summary},
                                        indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.25
        for i, way in enumerate(WAYS):
            xs = [j + (i - 1) * width for j in range(len(ENDPOINTS))]
            ax.bar(xs, [summary[e][way] for e in ENDPOINTS], width,
                   label={"one": "one answer", "n": f"one request, n={args.n}",
                          "separate": f"{args.n} separate requests"}[way])
        ax.set_xticks(range(len(ENDPOINTS)), [f"/v1/{e}" if e == "completions"
                                              else "/v1/chat/completions" for e in ENDPOINTS])
        ax.set_ylabel("seconds to the last answer (median)")
        ax.set_title(f"{args.n} answers to one new {args.prompt_words}-word prompt "
                     f"({info['commit']}, load {info['load_start']})", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
