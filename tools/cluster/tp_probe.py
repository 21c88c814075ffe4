"""Decode tok/s and TTFT of one running kvtier server: N greedy streamed chat requests, one at a time.

    python tools/cluster/tp_probe.py URL [N] [MAX_TOKENS]

Used for the tensor-parallel figures (docs/tensor-parallel.md): the same
probe against a 1-rank and a 2-rank server. A request's decode rate is
(chunks - 1) / (time from the first content chunk to the end).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def probe(url: str, n: int, max_tokens: int) -> tuple[float, float]:
    """Median TTFT (s) and median decode rate (tok/s) of ``n`` requests; prints each one."""
    rates: list[float] = []
    ttfts: list[float] = []
    for i in range(n):
        body = {"model": "default", "stream": True, "temperature": 0, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Tell me a story about a robot number {i}."}]}
        t0 = time.perf_counter()
        first: float | None = None
        count = 0
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    count += 1
                    first = first or time.perf_counter()
        end = time.perf_counter()
        if first is None or count < 2:
            raise RuntimeError(f"request {i}: {count} content chunks")
        ttfts.append(first - t0)
        rates.append((count - 1) / (end - first))
        print(f"request {i}: TTFT {ttfts[-1]:.3f} s, decode {rates[-1]:.2f} tok/s ({count} chunks)",
              flush=True)
    ttft, rate = statistics.median(ttfts), statistics.median(rates)
    print(f"median: TTFT {ttft:.3f} s, decode {rate:.2f} tok/s")
    return ttft, rate


def main() -> None:
    """Parse ``URL [N] [MAX_TOKENS]`` and probe."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("n", nargs="?", type=int, default=3, help="requests, one at a time (default 3)")
    parser.add_argument("max_tokens", nargs="?", type=int, default=24,
                        help="new tokens per request (default 24)")
    args = parser.parse_args()
    probe(args.url, args.n, args.max_tokens)


if __name__ == "__main__":
    main()
