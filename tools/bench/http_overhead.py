"""One client's decode rate through HTTP vs the in-process ``Engine``, side by side.

In one run, rounds interleaved, on the default model (or ``--model``):

1. ``Engine`` in process, configured like ``kvtier serve`` (``--max-batch``
   rows, SSD tier off, the default prompt cache), one streamed chat at a
   time, tokens counted as ``TokenEvent`` s arrive;
2. ``kvtier serve`` (subprocess, ``--ssd-cache off``, the same
   ``--max-batch``), one streamed OpenAI chat completion at a time through
   real HTTP (httpx), tokens counted as SSE content chunks arrive.

The two go first in turn (engine first in even rounds). Each request has a fresh prompt (a nonce first, so no prompt cache helps),
greedy, ``--max-tokens`` new tokens, ``ignore_eos`` unset (the default
model's answer runs to the cap for the question asked; the token counts are
printed so a short answer shows). Decode rate = tokens after the first per
second between the first and the last. Prints the medians, the per-round
HTTP / in-process ratio and its median (the issue's target: >= 0.9), and,
from the server's ``/stats``, the per-token write phase. ``--json`` writes
everything.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/http_overhead.py --rounds 5 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import _common  # noqa: E402

QUESTION = ("Write a long, detailed story about a lighthouse keeper who finds a map, "
            "in at least twenty paragraphs.")


def _messages(nonce: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request {nonce}. {QUESTION}"}]


def _rate(times: Sequence[float]) -> float:
    """Tokens after the first per second between the first and the last arrival."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])


async def _engine_sample(engine: Any, nonce: str, max_tokens: int) -> tuple[float, int, float]:
    from actors.engine import DoneEvent, GenerationParams, TokenEvent

    start = time.perf_counter()
    times: list[float] = []
    engine_rate = 0.0
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0)
    async with engine.chat(_messages(nonce), params) as stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                times.append(time.perf_counter())
            elif isinstance(event, DoneEvent) and event.timings.decode_s > 0:
                engine_rate = (len(times) - 1) / event.timings.decode_s
    if not times:
        raise RuntimeError("no token")
    return _rate(times), len(times), times[0] - start, engine_rate


_TIMELINE = re.compile(r"request\.timeline.*?decode_ms=([0-9.]+).*?tokens=([0-9]+)")


def server_engine_rates(log: Path) -> list[float]:
    """The engine-side decode rate of each request the server logged (``request.timeline``)."""
    out = []
    for m in _TIMELINE.finditer(log.read_text(errors="replace")):
        ms, tokens = float(m.group(1)), int(m.group(2))
        if ms > 0 and tokens > 1:
            out.append((tokens - 1) / (ms / 1e3))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the default model, fetched if missing)")
    p.add_argument("--rounds", type=int, default=5, help="requests per contender (default: 5)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default: 128)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="batch rows for both (default: 8, kvtier serve's default; 1 = serial lane)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from actors.engine import Engine
    from kernels import ensure_default_model

    model = args.model or ensure_default_model()
    rows: dict[str, list[tuple[float, int, float, float]]] = {"engine": [], "http": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-http-overhead-") as tmp:
        server = _common.start_kvtier(model, Path(tmp), "--ssd-cache", "off",
                                      "--max-batch", str(args.max_batch))
        try:
            name = _common.model_id(server.url)

            async def run() -> None:
                async with Engine(model, max_batch=args.max_batch) as engine:
                    await _engine_sample(engine, "warm", 8)
                    _common.stream_chat(server.url, _messages("warm"), name, max_tokens=8)
                    for r in range(args.rounds):
                        # NOTE: alternating contenders, so a load change on a
                        # shared machine hits both.
                        # NOTE: the order flips every round, so whatever the
                        # previous request leaves behind (spinning BLAS
                        # threads, a warm cache) favours neither contender.
                        for who in (("engine", "http") if r % 2 == 0 else ("http", "engine")):
                            if who == "engine":
                                rows["engine"].append(
                                    await _engine_sample(engine, f"e{r}", args.max_tokens))
                                continue
                            res = await anyio.to_thread.run_sync(
                                lambda r=r: _common.stream_chat(server.url, _messages(f"h{r}"), name,
                                                                max_tokens=args.max_tokens))
                            rows["http"].append((res.decode_tps, len(res.token_times), res.ttft_s, 0.0))
                        print(f"  round {r}: engine {rows['engine'][-1][0]:6.1f} tok/s "
                              f"({rows['engine'][-1][1]} tokens), http {rows['http'][-1][0]:6.1f} tok/s "
                              f"({rows['http'][-1][1]} chunks)", flush=True)

            anyio.run(run)
            import httpx

            stats = httpx.get(f"{server.url}/stats", timeout=30).json()
        finally:
            server.stop()
        # NOTE: the first logged request is the warm-up.
        inside = server_engine_rates(server.stderr)[1:]
    ratios = [h[0] / e[0] for e, h in zip(rows["engine"], rows["http"], strict=True) if e[0] > 0]
    med = {k: statistics.median(x[0] for x in v) for k, v in rows.items()}
    ttft = {k: statistics.median(x[2] for x in v) * 1e3 for k, v in rows.items()}
    print(f"{'':22}{'decode tok/s':>14}{'TTFT ms':>10}")
    print(f"{'Engine in process':22}{med['engine']:14.1f}{ttft['engine']:10.1f}")
    print(f"{'kvtier serve (HTTP)':22}{med['http']:14.1f}{ttft['http']:10.1f}")
    eng_inside = statistics.median(x[3] for x in rows["engine"])
    srv_inside = statistics.median(inside) if inside else float("nan")
    print(f"engine-side decode tok/s (decode time the engine reports): in process {eng_inside:.1f}, "
          f"inside the server {srv_inside:.1f}")
    print(f"HTTP / in-process decode: median of rounds {statistics.median(ratios):.3f} "
          f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}); target >= 0.9")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": _common.machine(), "args": {k: str(v) for k, v in vars(args).items()},
            "rows": rows, "ratios": ratios, "server_engine_tps": inside, "median_tps": med, "median_ttft_ms": ttft,
            "server_timeline": (stats.get("http") or {}).get("timeline")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
