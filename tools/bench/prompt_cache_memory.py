"""Prompt-cache memory honesty: peak RSS of ``kvtier serve`` under a byte cap.

Sends N distinct ~512-token chat prompts (no shared prefix) to a server
started with ``--prompt-cache CAP_GB`` and records the process's peak RSS
(VmHWM) after each request. The cap is honest when the growth of peak RSS
from the first request to the last stays within ``1.15 x cap``: entries are
billed at the buffers they retain, evicted ones are freed, and MLX's buffer
cache is bounded (``kernels.configure_mlx_memory``). Run:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python tools/bench/prompt_cache_memory.py [--requests 40] [--cap-gb 0.1]

With the batch lane (issue #10: caps hold while rows are active):
``--concurrency 8 --max-batch 8 --spill-queue-gb 0.1`` sends the requests
in waves of 8 at once (8 rows decode together); the bound then is the
prompt-cache cap plus the spill queue's cap, plus the same 15 %.

``--trace-memory`` prints after every wave where the server's resident
memory is (``_memtrace.py``: anonymous vs file-backed, glibc's main heap and
per-thread arenas, thread stacks, MLX's active / cache / peak memory from
``/stats``, the tiers' bytes) and the same split at the highest RSS seen
(polled every 0.1 s). ``--env NAME=VALUE`` (repeatable) sets the server's
environment for A/B runs (``MALLOC_ARENA_MAX=2``, ``KVTIER_SSD_WRITEBEHIND=0``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _memtrace import PeakWatch, sample
from prompt_cache import start_kvtier, system_prompt, ttft


def main() -> int:
    """Run the workload and print peak-RSS growth against the cap."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--cap-gb", type=float, default=0.1)
    parser.add_argument("--concurrency", type=int, default=1, help="requests sent at once")
    parser.add_argument("--max-batch", type=int, default=1, help="kvtier serve --max-batch")
    parser.add_argument(
        "--spill-queue-gb", type=float, default=None, help="kvtier serve --ssd-spill-queue"
    )
    parser.add_argument("--no-ssd", action="store_true", help="kvtier serve --ssd-cache off")
    parser.add_argument("--trace-memory", action="store_true",
                        help="print where resident memory is after every wave and at the peak")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the server's environment (repeatable)")
    args = parser.parse_args()
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    cap = int(args.cap_gb * 1e9)
    extra = ["--prompt-cache", str(args.cap_gb), "--max-batch", str(args.max_batch)]
    if args.spill_queue_gb is not None:
        extra += ["--ssd-spill-queue", str(args.spill_queue_gb)]
        # NOTE: the spill queue's clones are host memory too: the bound adds its cap.
        cap += int(args.spill_queue_gb * 1e9)
    if args.no_ssd:
        extra += ["--ssd-cache", "off"]
    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_kvtier(args.model, Path(tmp), *extra, env=env or None)
        try:
            model_id = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            peaks: list[int] = []
            pid = server.proc.pid
            if args.trace_memory:
                print(sample(pid, server.url, "idle").line(), flush=True)

            def one(i: int) -> None:
                messages = [
                    {"role": "system", "content": system_prompt(args.tokens, f"m{i}-distinct")},
                    {"role": "user", "content": f"Question {i}: what is rule {i % 9}?"},
                ]
                ttft(server.url, messages, model_id, max_tokens=8)

            wave = max(1, args.concurrency)
            watch = PeakWatch(pid, server.url) if args.trace_memory else contextlib.nullcontext()
            with ThreadPoolExecutor(max_workers=wave) as pool, watch:
                for start in range(0, args.requests, wave):
                    ids = range(start, min(start + wave, args.requests))
                    list(pool.map(one, ids))
                    peaks.append(server.peak_rss_bytes())
                    done = ids[-1] + 1
                    if args.trace_memory:
                        print(sample(pid, server.url, f"after {done:>3}").line(), flush=True)
                    elif start == 0 or done == args.requests or done % (10 * wave) < wave:
                        print(f"request {done:>3}: peak RSS {peaks[-1] / 1e6:8.1f} MB", flush=True)
            if isinstance(watch, PeakWatch) and watch.best is not None:
                print(watch.best.line(), flush=True)
            stats = httpx.get(f"{server.url}/stats", timeout=10)
            engine = stats.json()["engine"] if stats.status_code == 200 else {}
            cache_stats = engine.get("prompt_cache")
            if args.trace_memory:
                print(f"memory stats: {engine.get('memory')}", flush=True)
        finally:
            server.stop()
    growth = peaks[-1] - peaks[0]
    print(f"caps {cap / 1e6:.1f} MB; peak-RSS growth first->last {growth / 1e6:.1f} MB "
          f"= {growth / cap:.3f} x cap (target <= 1.15)")
    if cache_stats is not None:
        print(f"prompt cache stats: {cache_stats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
