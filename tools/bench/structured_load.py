"""Concurrent constrained requests (``response_format`` json_object) served by several commits.

Each ``--commit`` is extracted with ``git archive`` and served from its own
tree (``kvtier serve``, default model, prompt cache off), every server up at
once. Each round sends ``--concurrency`` streaming chat requests at once to
one server (distinct prompts, greedy, ``--max-tokens``, a JSON-object
grammar), then to the next, the order rotated every round. Reported per
commit: the round's aggregate rate (completion tokens of all its answers /
the time until the last one ended), the median time to first token and the
median answer time, their medians over rounds, and the median of the
per-round ratios to the first commit (pairs measured seconds apart). Every
answer must parse as a JSON object (a ``length`` answer is counted apart).

NOTE: what it shows: before grammar requests became batch rows, constrained
requests were served on the serial lane one at a time; now they decode
together.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/structured_load.py --commit BEFORE --commit HEAD \\
        [--concurrency 4] [--rounds 5] [--max-tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from _common import extract_commit, running_server  # noqa: E402

import kernels  # noqa: E402

_READY_S = 180.0
_TOPICS = ["a weather report", "a train ticket", "a book review", "a pizza order", "a bank transfer",
           "a hotel booking", "a flight status", "a recipe", "a doctor's appointment", "a parcel"]


async def _one(client: httpx.AsyncClient, url: str, nonce: int, max_tokens: int) -> dict[str, Any]:
    """One streamed constrained chat: TTFT, total time, completion tokens, finish, whether JSON."""
    topic = _TOPICS[nonce % len(_TOPICS)]
    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": f"Request {nonce}: describe {topic} as a JSON object."}]}
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    finish: str | None = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("error"):
                raise RuntimeError(f"error event: {obj['error']}")
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - start
                    text.append(piece)
                finish = ch.get("finish_reason") or finish
    total = time.perf_counter() - start
    parsed = False
    if finish == "stop":
        parsed = isinstance(json.loads("".join(text)), dict)
    return {"ttft_s": first if first is not None else total, "total_s": total,
            "tokens": int(usage.get("completion_tokens", 0)), "finish": finish, "json": parsed}


async def _round(url: str, first_nonce: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
        began = time.perf_counter()
        answers = await asyncio.gather(*(_one(client, url, first_nonce + i, max_tokens)
                                         for i in range(concurrency)))
        wall = time.perf_counter() - began
    tokens = sum(a["tokens"] for a in answers)
    return {"wall_s": wall, "tok_s": tokens / wall, "answers": answers,
            "ttft_p50_s": statistics.median(a["ttft_s"] for a in answers),
            "total_p50_s": statistics.median(a["total_s"] for a in answers)}


def plot(result: dict[str, Any], path: Path) -> None:
    """Aggregate rate per round and the median TTFT / answer time per commit, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        ax[0].plot(result["summary"][name]["tok_s"], marker="o", label=name)
    ax[0].set_title("completion tok/s per round (all answers / last one's end)")
    ax[0].set_xlabel("round")
    ax[0].legend()
    x = range(len(names))
    ax[1].bar([i - 0.2 for i in x], [result["summary"][n]["ttft_p50_s_median"] for n in names], 0.4,
              label="TTFT p50")
    ax[1].bar([i + 0.2 for i in x], [result["summary"][n]["total_p50_s_median"] for n in names], 0.4,
              label="answer p50")
    ax[1].set_xticks(list(x), names)
    ax[1].set_ylabel("s")
    ax[1].legend()
    fig.suptitle(f"{result['concurrency']} concurrent json_object requests, "
                 f"{result['max_tokens']} tokens each (default model, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    """Serve every commit at once, interleave the rounds, print medians and paired ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", action="append", default=[],
                        help="a commit to serve (repeat; the first is the reference of the ratios)")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    parser.add_argument("--replot", type=Path, default=None,
                        help="only plot an earlier run's --json into --plot")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return 0
    if not args.commit:
        parser.error("--commit is required")

    model_dir = str(kernels.ensure_default_model())
    rounds: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-structured-") as tmp, contextlib.ExitStack() as stack:
        bases: dict[str, str] = {}
        for commit in args.commit:
            short, tree = extract_commit(commit, Path(tmp))
            argv = [sys.executable, "-m", "actors.cli", "serve", "--model", model_dir,
                    "--prompt-cache", "0", "--log-level", "warning"]
            bases[short] = stack.enter_context(running_server(
                argv, Path(tmp), short, cwd=tree, env={"PYTHONPATH": str(tree)}, timeout=_READY_S))
        names = list(bases)
        nonce = 0
        for name in names:  # NOTE: warm-up: the grammar's tokenizer view, first shapes.
            asyncio.run(_round(bases[name], nonce, 1, 8))
            nonce += 1
        rounds = {name: [] for name in names}
        for r in range(args.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                nonce += args.concurrency
                rounds[name].append(asyncio.run(_round(bases[name], nonce, args.concurrency, args.max_tokens)))
            print(f"round {r}: " + "  ".join(
                f"{n} {rounds[n][-1]['tok_s']:.1f} tok/s in {rounds[n][-1]['wall_s']:.1f} s" for n in names),
                flush=True)

    ref = names[0]
    summary: dict[str, Any] = {}
    print(f"\n# structured_load: concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"rounds {args.rounds}, load {os.getloadavg()[0]:.1f}; ratios: medians of per-round pairs to {ref}")
    for name in names:
        rs = rounds[name]
        answers = [a for r in rs for a in r["answers"]]
        ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(rs, rounds[ref], strict=True)]
        summary[name] = {
            "tok_s_median": statistics.median(r["tok_s"] for r in rs),
            "tok_s": [r["tok_s"] for r in rs],
            "ttft_p50_s_median": statistics.median(r["ttft_p50_s"] for r in rs),
            "total_p50_s_median": statistics.median(r["total_p50_s"] for r in rs),
            "over_ref_median": statistics.median(ratios),
            "over_ref": ratios,
            "answers": len(answers),
            "json_ok": sum(a["json"] for a in answers),
            "length": sum(a["finish"] == "length" for a in answers),
        }
        s = summary[name]
        print(f"{name:<10} {s['tok_s_median']:6.1f} tok/s (rounds {min(s['tok_s']):.1f}-{max(s['tok_s']):.1f})  "
              f"TTFT p50 {s['ttft_p50_s_median']:.2f} s  answer p50 {s['total_p50_s_median']:.2f} s  "
              f"/ {ref} {s['over_ref_median']:.2f}  JSON {s['json_ok']}/{s['answers']} "
              f"(length {s['length']})", flush=True)
    result = {"concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "summary": summary, "rounds": rounds}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot is not None:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
