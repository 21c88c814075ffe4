"""Prompt-cache memory honesty: peak RSS of ``kvtier serve`` under a byte cap.

Sends N distinct ~512-token chat prompts (no shared prefix) to a server
started with ``--prompt-cache CAP_GB`` and records the process's peak RSS
(VmHWM) after each request. The cap is honest when the growth of peak RSS
from the first request to the last stays within ``1.15 x cap``: entries are
billed at the buffers they retain, evicted ones are freed, and MLX's buffer
cache is bounded (``kernels.configure_mlx_memory``). Run:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python tools/bench/prompt_cache_memory.py [--requests 40] [--cap-gb 0.1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_cache import start_kvtier, system_prompt, ttft


def main() -> int:
    """Run the workload and print peak-RSS growth against the cap."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--cap-gb", type=float, default=0.1)
    args = parser.parse_args()
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    cap = int(args.cap_gb * 1e9)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_kvtier(args.model, Path(tmp), "--prompt-cache", str(args.cap_gb))
        try:
            model_id = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            peaks: list[int] = []
            for i in range(args.requests):
                messages = [
                    {"role": "system", "content": system_prompt(args.tokens, f"m{i}-distinct")},
                    {"role": "user", "content": f"Question {i}: what is rule {i % 9}?"},
                ]
                ttft(server.url, messages, model_id, max_tokens=8)
                peaks.append(server.peak_rss_bytes())
                if i in (0, args.requests - 1) or i % 10 == 9:
                    print(f"request {i + 1:>3}: peak RSS {peaks[-1] / 1e6:8.1f} MB")
            stats = httpx.get(f"{server.url}/stats", timeout=10)
            cache_stats = stats.json()["engine"].get("prompt_cache") if stats.status_code == 200 else None
        finally:
            server.stop()
    growth = peaks[-1] - peaks[0]
    print(f"cap {cap / 1e6:.1f} MB; peak-RSS growth first->last {growth / 1e6:.1f} MB "
          f"= {growth / cap:.3f} x cap (target <= 1.15)")
    if cache_stats is not None:
        print(f"prompt cache stats: {cache_stats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
