"""A burst of arrivals through HTTP: where admission's and joining's time goes, server variants side by side.

Each round starts ``kvtier serve`` (the default model, ``--ssd-cache off``)
once per variant, in alternating order, and sends it ``--bursts`` bursts of
``--clients`` distinct ~``--prompt-tokens``-token chats released together
(one new token each, a fresh ``httpx`` client per thread made before the
clock starts). It reads the servers' ``request.timeline`` lines and prints
per variant the admission phase (arrival to the scheduler's admission: body
parsing, the prompt's render and tokenizing, the admission ask), the lookup
and join phases and the client's TTFT, then the ratios of the medians.

Variants: ``--variant LABEL=ARGS`` (repeatable), ``kvtier serve`` arguments
per server; the default pair is ``--render-threads 40`` (the default: anyio's
shared worker pool's bound, what admission used before ``render_threads``)
against ``--render-threads 2``. E.g. the idle lane's gather window:

    python3 tools/bench/admission_burst.py --clients 32 --bursts 2 --rounds 2 \\
        --variant "gather 0.05=--batch-gather 0.05" --variant "gather 0.3=--batch-gather 0.3" \\
        --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from _common import in_threads, loadavg, machine, model_id, start_kvtier, stream_chat, system_prompt
from serving import Dist, timeline_phases

PHASES = ("admission", "lookup", "join", "first_step")


def run_variant(model: Path, work: Path, label: str, serve_args: list[str], args: argparse.Namespace,
                tag: str) -> dict[str, Any]:
    """One server with ``serve_args``: its bursts' client TTFTs and timeline phases."""
    work.mkdir(parents=True, exist_ok=True)
    server = start_kvtier(model, work, "--ssd-cache", "off", "--max-batch", str(args.clients),
                          *serve_args, name="kvtier")
    rids: list[str] = []
    ttfts: list[float] = []
    try:
        url = server.url
        mid = model_id(url)
        clients = [httpx.Client(timeout=600) for _ in range(args.clients)]
        try:
            # NOTE: a warm-up chat: the first one also probes the chat template.
            stream_chat(url, [{"role": "user", "content": "hello"}], mid, 1, client=clients[0])
            for burst in range(args.bursts):
                gate = threading.Barrier(args.clients)
                results: list[Any] = [None] * args.clients

                def one(i: int, burst: int = burst, gate: threading.Barrier = gate,
                        results: list[Any] = results) -> None:
                    text = system_prompt(args.prompt_tokens, f"{tag}-b{burst}-c{i}")
                    gate.wait()
                    results[i] = stream_chat(url, [{"role": "user", "content": text}], mid, 1,
                                             client=clients[i])

                in_threads(one, args.clients)
                ttfts += [r.ttft_s * 1e3 for r in results]
                rids += [r.request_id for r in results]
        finally:
            for c in clients:
                c.close()
    finally:
        server.stop()
    phases = timeline_phases([work / "kvtier.stderr"])
    missing = [r for r in rids if r not in phases]
    if missing:
        raise RuntimeError(f"{len(missing)} requests have no request.timeline line")
    return {"variant": label, "serve_args": serve_args, "ttft_ms": ttfts,
            "phases_ms": {p: [phases[r][p] for r in rids] for p in PHASES}}


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per variant, over every round: p50 / p90 / max of each phase and of the client TTFT."""
    out: dict[str, dict[str, float]] = {}
    for label in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == label]
        row: dict[str, float] = {}
        series = {p: [v for r in mine for v in r["phases_ms"][p]] for p in PHASES}
        series["ttft"] = [v for r in mine for v in r["ttft_ms"]]
        for name, values in series.items():
            dist = Dist.of(values)
            row[f"{name}_p50"], row[f"{name}_p90"], row[f"{name}_max"] = dist.p50, dist.p90, dist.max
        out[label] = row
    return out


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    """Each variant's admission phase, sorted, per round (ms against the request's rank in its burst)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors: dict[str, str] = {}
    for r in runs:
        color = colors.setdefault(r["variant"], f"C{len(colors)}")
        for ax, phase in zip(axes, ("admission", "join"), strict=True):
            values = sorted(r["phases_ms"][phase])
            ax.plot(range(1, len(values) + 1), values, color=color, alpha=0.6,
                    label=r["variant"] if ax is axes[0] else None)
    for ax, phase in zip(axes, ("admission", "join"), strict=True):
        ax.set_xlabel("request (sorted)")
        ax.set_ylabel(f"{phase} phase (ms)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    seen: dict[str, Any] = {}
    for h, label in zip(handles, labels, strict=True):
        seen.setdefault(label, h)
    axes[0].legend(seen.values(), seen.keys())
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model directory (default: kvtier's default model)")
    p.add_argument("--clients", type=int, default=32, help="requests released together in a burst")
    p.add_argument("--bursts", type=int, default=3, help="bursts per server")
    p.add_argument("--rounds", type=int, default=3, help="servers per variant, order alternating")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--variant", action="append", default=None, metavar="LABEL=ARGS",
                   help="a server variant: its label and its kvtier serve arguments (repeatable; "
                        "default: render_threads 40 against 2)")
    p.add_argument("--work", type=Path, default=Path("/tmp/kvtier-bench-admission"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    if args.model is None:
        from kernels import ensure_default_model

        args.model = ensure_default_model()
    model = args.model
    specs = args.variant or ["render_threads 40=--render-threads 40", "render_threads 2=--render-threads 2"]
    variants: list[tuple[str, list[str]]] = []
    for spec in specs:
        label, sep, rest = spec.partition("=")
        if not sep or not label:
            raise SystemExit(f"--variant wants LABEL=ARGS, got {spec!r}")
        variants.append((label, shlex.split(rest)))
    facts = {**machine(), "loadavg_start": loadavg(), "argv": sys.argv[1:]}
    print(json.dumps(facts))
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for i, (label, serve_args) in enumerate(order):
            run = run_variant(model, args.work / f"r{rnd}-v{i}", label, serve_args, args, f"r{rnd}v{i}")
            run["round"] = rnd
            runs.append(run)
            ph = run["phases_ms"]
            print(f"round {rnd} {label}: admission p50 "
                  f"{statistics.median(ph['admission']):6.1f} max {max(ph['admission']):6.1f} ms, "
                  f"join p50 {statistics.median(ph['join']):6.1f}, "
                  f"TTFT p50 {statistics.median(run['ttft_ms']):8.1f} ms", flush=True)
    summary = summarize(runs)
    print(f"\n{args.clients} arrivals at once, {args.bursts} bursts x {args.rounds} servers per variant (ms)")
    width = max(len(label) for label, _ in variants)
    print(f"{'variant':>{width}} | " + " | ".join(f"{n + ' p50/p90/max':>26}" for n in (*PHASES, "ttft")))
    for label, row in summary.items():
        cells = [f"{row[f'{n}_p50']:8.1f} {row[f'{n}_p90']:8.1f} {row[f'{n}_max']:8.1f}" for n in (*PHASES, "ttft")]
        print(f"{label:>{width}} | " + " | ".join(cells))
    if len(variants) == 2:
        a, b = (label for label, _ in variants)
        for n in (*PHASES, "ttft"):
            ra, rb = summary[a][f"{n}_p50"], summary[b][f"{n}_p50"]
            print(f"{n:>10} p50: {b} / {a} = {rb / ra:.2f}" if ra > 0 else f"{n:>10}: -")
    facts["loadavg_end"] = loadavg()
    doc = {"facts": facts, "runs": runs, "summary": summary}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"json: {args.json}")
    if args.plot:
        plot(runs, args.plot, f"{args.clients} arrivals at once, {facts.get('commit', '')}")
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
