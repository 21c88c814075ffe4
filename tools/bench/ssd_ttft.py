"""TTFT of sequential distinct requests with the SSD tier on vs ``--ssd-cache off``.

Starts ``kvtier serve`` twice on the same model (the default model unless
``--model``): once with the SSD tier on (the default, write-behind on, in a
temporary ``--ssd-cache`` directory) and once with ``--ssd-cache off``. Each
server gets one warm-up request, then ``--requests`` streamed chat requests
one after the other, each with a distinct prompt of about
``--prompt-tokens`` tokens (so none hits a cache and each leaves an entry
that the SSD tier writes behind while the next one arrives), greedy,
``--max-tokens`` new tokens, the next sent as soon as the previous answer
ended. Prints TTFT p50/p99/max per mode and the on/off ratio side by side,
plus the server's own timeline phases (``/stats`` ``http.timeline``:
admission, queue, lookup, join, first step, write; p50/p99) so the extra
time's phase is visible. ``--json`` and ``--plot`` write everything.

CPU (default model)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/ssd_ttft.py --json /tmp/ssd_ttft.json \\
        --plot docs/benchmarks/ssd_ttft_cpu.png

``--smoke`` runs 3 requests of ~64 tokens per mode (a quick end-to-end check).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
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
"""``on``: the SSD tier in a temporary directory (kvtier serve's default); ``off``: ``--ssd-cache off``."""


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


_PHASES = re.compile(r"request\.timeline.*?phases_ms=(\{[^}]*\})")


def server_phases(log: Path) -> list[dict[str, float]]:
    """Each recorded request's phases (ms) from the server's ``request.timeline`` log lines, in order.

    NOTE: the console log prints the phases as a Python dict literal; the
    warm-up request is the first line and is dropped.
    """
    rows = [ast.literal_eval(m.group(1)) for m in _PHASES.finditer(log.read_text(errors="replace"))]
    return rows[1:]


def run_mode(mode: str, model: Path, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One server in ``mode``: warm-up, the sequential requests, its timeline phases."""
    extra = [*args.serve_arg]
    if mode == "off":
        extra += ["--ssd-cache", "off"]
    else:
        extra += ["--ssd-cache", str(workdir / "kv")]
    # NOTE: --on-env reaches the SSD-on server only (a variant of the tier against the same off server).
    server = _common.start_kvtier(model, workdir, *extra, name=f"kvtier-ssd-{mode}",
                                  env=args.on_env if mode == "on" else None)
    try:
        name = _common.model_id(server.url)
        warm = [{"role": "user", "content": _common.system_prompt(args.prompt_tokens, "warm")}]
        _common.stream_chat(server.url, warm, name, max_tokens=args.max_tokens)
        if args.settle > 0:
            time.sleep(args.settle)
        ttfts: list[float] = []
        tps: list[float] = []
        for i in range(args.requests):
            # NOTE: the nonce opens the prompt, so no two prompts share a
            # prefix beyond the chat template's own opening.
            text = _common.system_prompt(args.prompt_tokens, f"{mode}-{args.seed}-{i}")
            result = _common.stream_chat(
                server.url, [{"role": "user", "content": text}], name, max_tokens=args.max_tokens
            )
            ttfts.append(result.ttft_s * 1e3)
            tps.append(result.decode_tps)
            print(f"  {mode} #{i:02d} ttft {result.ttft_s * 1e3:8.1f} ms  "
                  f"decode {result.decode_tps:6.1f} tok/s", flush=True)
        stats = httpx.get(f"{server.url}/stats", timeout=30).json()
        timeline = (stats.get("http") or {}).get("timeline") or {}
        token = (((stats.get("engine") or {}).get("gateway") or {}).get("token")) or {}
    finally:
        server.stop()
    joins = server_phases(server.stderr)
    return {
        "mode": mode,
        "ttft_ms": ttfts,
        "decode_tps": tps,
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p99_ms": pct(ttfts, 0.99),
        "ttft_max_ms": max(ttfts) if ttfts else math.nan,
        "decode_tps_p50": statistics.median(tps) if tps else math.nan,
        "timeline_phases_ms": timeline.get("phases_ms", {}),
        "background": {
            "grants": (token.get("grants") or {}).get("background"),
            "held_s": (token.get("held_s") or {}).get("background"),
        },
        "server_phases_ms": joins,
    }


def summary_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The side-by-side table: TTFT per mode and on/off ratio, then the timeline phases."""
    on, off = runs["on"], runs["off"]
    lines = [f"{'':16}{'ssd on':>12}{'ssd off':>12}{'on/off':>9}"]
    for key, label in (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
                       ("ttft_max_ms", "TTFT max ms"), ("decode_tps_p50", "decode tok/s")):
        ratio = on[key] / off[key] if off[key] else math.nan
        lines.append(f"{label:16}{on[key]:12.1f}{off[key]:12.1f}{ratio:9.2f}")
    phases = on["timeline_phases_ms"]
    if phases:
        lines.append("server timeline (ms, p50 / p99), on | off:")
        for phase in phases:
            a = phases[phase]
            b = off["timeline_phases_ms"].get(phase, {})
            lines.append(f"  {phase:12} {a.get('p50', math.nan):8.1f} / {a.get('p99', math.nan):8.1f}"
                         f"  | {b.get('p50', math.nan):8.1f} / {b.get('p99', math.nan):8.1f}")
    lines.append(f"background turns (on): {on['background']}")
    for mode in MODES:
        rows = runs[mode]["server_phases_ms"]
        if rows:
            waits = [r.get("join", 0.0) + r.get("lookup", 0.0) for r in rows]
            lines.append(f"{mode}: lookup + join per request (ms): max {max(waits):.1f}, "
                         f"p50 {pct(waits, 0.5):.1f}")
    return lines


def plot(runs: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Two panels: TTFT per request for both modes; p50/p99 bars with the on/off ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    colors = {"on": "tab:orange", "off": "tab:blue"}
    for mode in MODES:
        ys = runs[mode]["ttft_ms"]
        left.plot(range(1, len(ys) + 1), ys, "-o", ms=3, color=colors[mode],
                  label=f"--ssd-cache {'<dir>' if mode == 'on' else 'off'}")
    left.set_xlabel("request (sequential, distinct prompts)")
    left.set_ylabel("TTFT ms (client)")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    names = ["p50", "p99", "max"]
    for j, mode in enumerate(MODES):
        vals = [runs[mode][f"ttft_{n}_ms"] for n in names]
        bars = right.bar([i + (j - 0.5) * 0.4 for i in range(3)], vals, 0.4,
                         color=colors[mode], label=f"SSD {mode}")
        right.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ratios = [runs["on"][f"ttft_{n}_ms"] / runs["off"][f"ttft_{n}_ms"] for n in names]
    right.set_xticks(range(3), [f"{n}\non/off {r:.2f}x" for n, r in zip(names, ratios, strict=True)])
    right.set_ylabel("TTFT ms")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="model directory (default: the default model, fetched if missing)")
    p.add_argument("--requests", type=int, default=20, help="sequential requests per mode (default: 20)")
    p.add_argument("--prompt-tokens", type=int, default=500,
                   help="approximate prompt length in tokens (default: 500)")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per request (default: 48)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds to wait after the warm-up request (default: 1.0; 0 = none)")
    p.add_argument("--seed", type=int, default=0, help="prompt nonce, so runs do not repeat (default: 0)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="an extra argument for both servers (repeatable, e.g. --serve-arg=--max-batch=1)")
    p.add_argument("--smoke", action="store_true",
                   help="3 requests of ~64 prompt tokens, 8 new tokens per mode")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    p.add_argument("--repeats", type=int, default=1,
                   help="pairs of servers, the modes' order alternating (off, on, on, off, ...), "
                        "each pair on its own prompts; prints every pair's on/off ratios and their "
                        "median and spread (default: 1)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma list of on,off (default both); one mode prints its own figures "
                        "only (a profiler attached to its server, or a variant set by environment)")
    p.add_argument("--on-env", action="append", default=[], metavar="KVTIER_NAME=VALUE",
                   help="an environment variable for the SSD-on server only (repeatable): a "
                        "variant of the tier against the same off server, e.g. "
                        "--on-env KVTIER_CUDA_HOST_READ=host")
    args = p.parse_args(argv)
    on_env: dict[str, str] = {}
    for item in args.on_env:
        name, eq, value = item.partition("=")
        if not eq or not name.startswith("KVTIER_"):
            p.error(f"--on-env takes KVTIER_NAME=VALUE, got {item!r}")
        on_env[name] = value
    args.on_env = on_env
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes takes a comma list of {', '.join(MODES)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.repeats > 1 and len(args.modes) < len(MODES):
        p.error("--repeats pairs the two modes: leave --modes at on,off")
    if args.smoke:
        args.requests, args.prompt_tokens, args.max_tokens, args.settle = 3, 64, 8, 0.0
    return args


RATIO_KEYS = ("ttft_p99_ms", "ttft_p50_ms", "decode_tps_p50")
"""The figures each pair's on/off ratio is printed for (p99 first: the issue's line)."""


def pair_ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """On/off ratio of each of :data:`RATIO_KEYS` for one pair of servers."""
    return {key: runs["on"][key] / runs["off"][key] if runs["off"][key] else math.nan
            for key in RATIO_KEYS}


def repeat_lines(pairs: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Every pair's ratios, then the median and spread of each."""
    lines = []
    ratios = [pair_ratios(runs) for runs in pairs]
    for i, r in enumerate(ratios):
        lines.append(f"pair {i}: " + ", ".join(f"{key} on/off {r[key]:.2f}" for key in RATIO_KEYS))
    for key in RATIO_KEYS:
        xs = [r[key] for r in ratios]
        lines.append(f"{key} on/off: median {statistics.median(xs):.2f} "
                     f"[{min(xs):.2f}..{max(xs):.2f}] over {len(xs)} pairs")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    info = _common.machine()
    pairs: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-ssd-ttft-") as tmp:
        for r in range(args.repeats):
            # NOTE: off, on, then on, off, ...: drift over the run falls on both
            # modes alike; each pair has prompts of its own (the seed).
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            pair_args = argparse.Namespace(**{**vars(args), "seed": args.seed * 1000 + r})
            pair: dict[str, dict[str, Any]] = {}
            for mode in order:
                if mode not in args.modes:
                    continue
                print(f"SSD tier {mode}" + (f", pair {r}" if args.repeats > 1 else "") + ":",
                      flush=True)
                workdir = Path(tmp) / f"pair-{r}-{mode}"
                workdir.mkdir()
                pair[mode] = run_mode(mode, args.model, workdir, pair_args)
            pairs.append(pair)
    runs = pairs[0]
    if len(pairs) > 1:
        # NOTE: the pair whose p99 ratio is the median stands for the run in
        # the table and the plot; every pair is in the JSON.
        by_p99 = sorted(pairs, key=lambda x: pair_ratios(x)["ttft_p99_ms"])
        runs = by_p99[len(by_p99) // 2]
    if len(runs) < len(MODES):
        mode, run = next(iter(runs.items()))
        lines = [f"SSD tier {mode}: " + ", ".join(
            f"{key} {run[key]:.1f}" for key in ("ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms", "decode_tps_p50"))]
        print("\n".join(lines))
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                             "runs": runs, "summary": lines}, indent=2))
        return 0
    lines = summary_lines(runs)
    if len(pairs) > 1:
        lines += repeat_lines(pairs)
    print("\n".join(lines))
    title = (f"kvtier serve TTFT, {args.requests} sequential distinct ~{args.prompt_tokens}-token "
             f"prompts, {args.max_tokens} new tokens; SSD tier on vs off\n"
             f"{info['date']}, commit {info['commit']}, {info['cpus']} CPUs, mlx {info['mlx']}")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": runs, "pairs": pairs,
                                         "ratios": [pair_ratios(x) for x in pairs],
                                         "summary": lines}, indent=2))
    if args.plot:
        plot(runs, args.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
