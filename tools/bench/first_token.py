"""TTFT under staggered arrivals with the batch lane's first-token-first rule on and off, through HTTP.

A row whose prefill completes in one engine turn gets its first token from
the next turn's decode; unless the rule holds that turn's prefill back, the
token also waits for the next joiner's prefill chunk
(``kernels/engine/_batch.py``, "First token first";
``KVTIER_BATCH_FIRST_TOKEN_FIRST``). This tool starts ``kvtier serve`` with
the rule on and with it off (``--ssd-cache off`` for both: the scheduling is
what is measured), in alternating order per round, and sends each the same
open-loop arrivals: ``--requests`` streamed chat requests with distinct
prompts of about ``--prompt-tokens`` tokens, greedy, ``--max-tokens`` new
tokens, one every ``--gap`` seconds (each on its own thread, so arrivals
land while earlier answers decode), plus the agent pattern when
``--pairs`` > 0: pairs of requests over one shared ~``--system-tokens``
system prompt (cached after a warm-up), the second ``--pair-gap`` seconds
after the first. Prints TTFT p50 / p90 / max per mode and round, the
on/off ratios side by side, and each mode's output tokens per second over
the whole arrival run (the rule must not cost throughput). ``--json`` and
``--plot`` write everything.

CPU (default model)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/first_token.py --rounds 3 --json /tmp/ft.json --plot /tmp/ft.png

``--switch KVTIER_READ_FIRST`` turns read first (``kernels.read_first_setting``:
on the CPU a decode step computes its own tokens before it builds the next
forward) on and off instead of the first-token-first rule.

``--base COMMIT`` compares trees instead of a switch: ``on`` is this tree,
``off`` the commit's (``git archive``, run from its own directory with it
first on ``PYTHONPATH``), every switch at its default in both.

``--smoke``: one round of 3 short requests and one pair (an end-to-end check).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

MODES = ("on", "off")
"""``on``: the switch set to 1 (kvtier serve's default for both switches); ``off``: set to 0."""

SWITCHES = ("KVTIER_BATCH_FIRST_TOKEN_FIRST", "KVTIER_READ_FIRST")
"""The switches ``--switch`` may name: each changes only when a row's tokens leave."""


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def arrivals(
    url: str, model: str, prompts: list[str], gap: float, max_tokens: int
) -> tuple[list[float], float, int, list[float]]:
    """Open loop: request ``i`` sent at ``i * gap`` on its own thread; TTFTs (s), wall time, tokens out, answer times (s: sent to last token)."""
    results: list[_common.ChatResult | None] = [None] * len(prompts)
    start = time.perf_counter()

    def send(i: int) -> None:
        delay = start + i * gap - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        with httpx.Client(timeout=900) as client:
            results[i] = _common.stream_chat(url, [{"role": "user", "content": prompts[i]}], model,
                                             max_tokens, client=client)

    _common.in_threads(send, len(prompts))
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    answers = [r.token_times[-1] for r in done if r.token_times]
    return [r.ttft_s for r in done], wall, sum(len(r.token_times) for r in done), answers


def pairs(url: str, model: str, system: str, n: int, gap: float, max_tokens: int, tag: str) -> list[float]:
    """``n`` pairs over the cached ``system`` prompt, the second request ``gap`` s after the first; TTFTs (s)."""
    out: list[float] = []
    for k in range(n):
        got: list[float] = [math.nan, math.nan]

        def send(i: int, k: int = k, got: list[float] = got) -> None:
            if i:
                time.sleep(gap)
            msgs = [{"role": "system", "content": system},
                    {"role": "user", "content": f"{tag} pair {k} side {i}: {_common.system_prompt(24, f'{tag}{k}{i}')}"}]
            with httpx.Client(timeout=900) as client:
                got[i] = _common.stream_chat(url, msgs, model, max_tokens, client=client).ttft_s

        _common.in_threads(send, 2)
        out.extend(got)
    return out


def run_mode(mode: str, model: Path, workdir: Path, args: argparse.Namespace, rnd: int,
             base: Path | None = None) -> dict[str, Any]:
    """One server with the rule ``mode`` (with ``base``: ``off`` runs that tree): warm-up, the arrivals, the pairs."""
    name = f"kvtier-ft-{mode}-r{rnd}"
    if base is None:
        server = _common.start_kvtier(model, workdir, "--ssd-cache", "off", name=name,
                                      env={args.switch: "1" if mode == "on" else "0"})
    elif mode == "off":
        server = _common.start_kvtier(model, workdir, "--ssd-cache", "off", name=name,
                                      env={"PYTHONPATH": str(base)}, cwd=base)
    else:
        server = _common.start_kvtier(model, workdir, "--ssd-cache", "off", name=name)
    try:
        served = _common.model_id(server.url)
        system = _common.system_prompt(args.system_tokens, f"sys-r{rnd}")
        # NOTE: warm-up: the first forwards' allocations, and the pairs' system prompt cached.
        _common.stream_chat(server.url, [{"role": "system", "content": system},
                                         {"role": "user", "content": "warm up"}], served, 4)
        prompts = [_common.system_prompt(args.prompt_tokens, f"r{rnd}-{i}") for i in range(args.requests)]
        ttfts, wall, tokens, answers = arrivals(server.url, served, prompts, args.gap, args.max_tokens)
        pair_ttfts = pairs(server.url, served, system, args.pairs, args.pair_gap, args.max_tokens, f"r{rnd}")
    finally:
        server.stop()
    rec = {
        "mode": mode, "round": rnd, "ttft_s": ttfts, "wall_s": wall, "tokens": tokens,
        "tps": tokens / wall, "pair_ttft_s": pair_ttfts,
        "ttft_p50_ms": pct(ttfts, 0.5) * 1e3, "ttft_p90_ms": pct(ttfts, 0.9) * 1e3,
        "ttft_max_ms": max(ttfts) * 1e3, "answer_s": answers,
        "answer_p50_ms": pct(answers, 0.5) * 1e3, "answer_p90_ms": pct(answers, 0.9) * 1e3,
        "pair_ttft_p50_ms": pct(pair_ttfts, 0.5) * 1e3 if pair_ttfts else math.nan,
        "pair_second_p50_ms": pct(pair_ttfts[1::2], 0.5) * 1e3 if pair_ttfts else math.nan,
        "pair_first_p50_ms": pct(pair_ttfts[0::2], 0.5) * 1e3 if pair_ttfts else math.nan,
    }
    print(f"round {rnd} {mode:>3}: arrivals TTFT p50 {rec['ttft_p50_ms']:7.0f} p90 {rec['ttft_p90_ms']:7.0f} "
          f"max {rec['ttft_max_ms']:7.0f} ms, answer p50 {rec['answer_p50_ms']:7.0f} p90 "
          f"{rec['answer_p90_ms']:7.0f} ms, {rec['tps']:6.1f} tok/s | pairs TTFT first "
          f"{rec['pair_first_p50_ms']:6.0f} second {rec['pair_second_p50_ms']:6.0f} ms  "
          f"(load {_common.loadavg()})", flush=True)
    return rec


def plot(doc: dict[str, Any], path: Path) -> None:
    """TTFT p50 / p90 of the arrivals and the pairs' p50 per round, on vs off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    base = doc["args"].get("base")
    labels = {"on": "this tree", "off": str(base)} if base else {m: f"rule {m}" for m in MODES}
    for ax, key, title in zip(axes, ("ttft_p50_ms", "ttft_p90_ms", "pair_ttft_p50_ms"),
                              ("arrivals TTFT p50", "arrivals TTFT p90", "pairs TTFT p50"), strict=True):
        for mode in MODES:
            recs = [r for r in doc["runs"] if r["mode"] == mode]
            ax.plot([r["round"] for r in recs], [r[key] for r in recs], "o-", label=labels[mode])
        ax.set_title(title)
        ax.set_xticks(sorted({r["round"] for r in doc["runs"]}))
        ax.set_xlabel("round")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    switch = doc["args"].get("switch", SWITCHES[0])
    if doc["args"].get("base"):
        switch = f"this tree vs {doc['args']['base']}"
    else:
        switch = f"{switch} on / off"
    fig.suptitle(f"kvtier serve, {switch} ({doc['machine'].get('cpus', '?')} CPUs, "
                 f"{doc['args']['requests']} arrivals every {doc['args']['gap']} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds; print and write the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: kvtier's default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=12, help="arrivals per round")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between arrivals")
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--pairs", type=int, default=4, help="agent-like pairs per round (0: none)")
    p.add_argument("--pair-gap", type=float, default=0.2, help="seconds between a pair's two requests")
    p.add_argument("--system-tokens", type=int, default=1500, help="the pairs' shared system prompt")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--replot", type=Path, default=None, help="plot this --json document and exit")
    p.add_argument("--smoke", action="store_true", help="one round, 3 short arrivals, one pair")
    p.add_argument("--base", default=None,
                   help="compare this tree (on) with this commit's (off) instead of a switch")
    p.add_argument("--switch", choices=SWITCHES, default=SWITCHES[0],
                   help="the switch turned on and off (default: first token first; KVTIER_READ_FIRST: "
                        "a CPU decode step computes its tokens before it queues the next forward)")
    args = p.parse_args(argv)
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return 0
    if args.smoke:
        args.rounds, args.requests, args.prompt_tokens, args.max_tokens = 1, 3, 64, 8
        args.pairs, args.system_tokens = 1, 200
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    doc: dict[str, Any] = {"machine": _common.machine(), "args": {k: str(v) if isinstance(v, Path) else v
                                                                   for k, v in vars(args).items()},
                           "runs": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-first-token-") as tmp:
        base = _common.extract_commit(args.base, Path(tmp))[1] if args.base else None
        for rnd in range(args.rounds):
            order = MODES if rnd % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                doc["runs"].append(run_mode(mode, args.model, Path(tmp), args, rnd, base))
    summary: dict[str, Any] = {}
    for key in ("ttft_p50_ms", "ttft_p90_ms", "answer_p50_ms", "answer_p90_ms", "pair_ttft_p50_ms",
                "pair_second_p50_ms", "tps"):
        on = [r[key] for r in doc["runs"] if r["mode"] == "on"]
        off = [r[key] for r in doc["runs"] if r["mode"] == "off"]
        paired = [a / b for a, b in zip(on, off, strict=True) if b]
        summary[key] = {"on_median": statistics.median(on), "off_median": statistics.median(off),
                        "on_over_off_paired": paired,
                        "on_over_off_median": statistics.median(paired) if paired else math.nan}
        print(f"{key:>20}: on {summary[key]['on_median']:8.1f}  off {summary[key]['off_median']:8.1f}  "
              f"on/off paired {', '.join(f'{x:.2f}' for x in paired)} (median "
              f"{summary[key]['on_over_off_median']:.2f})", flush=True)
    doc["summary"] = summary
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
