"""The answer times of soak runs side by side: one plot, one JSON.

Each ``--run LABEL=SUMMARY.json`` is a ``tools/load/soak.py --json`` summary;
runs that share a label (one per seed, say) are one variant. Prints, per
variant and kind (``greedy``, ``agent_turn``), each run's p50 / p90 / p99 and
the median of each over the runs; writes them (``--json``) and a PNG
(``--plot``): one panel per kind, a bar per run and percentile.

    .venv/bin/python tools/bench/soak_compare.py \\
        --run held=a7.json --run held=a8.json --run back=b7.json --run back=b8.json \\
        --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

KINDS = ("greedy", "agent_turn")
QUANTILES = ("p50", "p90", "p99")


def _runs(specs: list[str]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Variant label -> [(file name, summary)], in the order given."""
    variants: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for spec in specs:
        label, _, path = spec.partition("=")
        if not label or not path:
            raise SystemExit(f"--run wants LABEL=PATH, got {spec!r}")
        summary = json.loads(Path(path).read_text())
        if "latency_ms" not in summary:
            raise SystemExit(f"{path}: no latency_ms (a soak summary from before answer times)")
        variants.setdefault(label, []).append((Path(path).name, summary))
    return variants


def compare(variants: dict[str, list[tuple[str, dict[str, Any]]]]) -> dict[str, Any]:
    """Each variant's runs and the median of each percentile over them, per kind."""
    out: dict[str, Any] = {}
    for label, runs in variants.items():
        per_kind: dict[str, Any] = {}
        for kind in KINDS:
            figures = [run["latency_ms"].get(kind, {}) for _, run in runs]
            per_kind[kind] = {
                "runs": [{q: f.get(q) for q in ("n", *QUANTILES)} for f in figures],
                "median": {q: statistics.median(f[q] for f in figures if f.get(q) is not None)
                           for q in QUANTILES if any(f.get(q) is not None for f in figures)},
            }
        per_kind["violations"] = sum(len(run["violations"]) for _, run in runs)
        per_kind["files"] = [name for name, _ in runs]
        per_kind["serve_args"] = runs[0][1].get("serve_args")
        out[label] = per_kind
    return out


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    """One panel per kind: bars of each run's p50 / p90 / p99 (seconds), grouped by variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(KINDS), figsize=(6 * len(KINDS), 4.2))
    colours = ("tab:blue", "tab:orange", "tab:red")
    for ax, kind in zip(axes, KINDS, strict=True):
        x, ticks, labels = 0.0, [], []
        for label, figures in result.items():
            for i, run in enumerate(figures[kind]["runs"]):
                for j, q in enumerate(QUANTILES):
                    value = run.get(q)
                    if value is not None:
                        ax.bar(x + j * 0.25, value / 1e3, width=0.25, color=colours[j],
                               label=q if (x == 0.0) else None)
                ticks.append(x + 0.25)
                labels.append(f"{label}\n#{i + 1}")
                x += 1.0
            x += 0.5
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.set_ylabel("answer time (s)")
        ax.set_title(kind)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", default=[], required=True,
                   help="LABEL=SUMMARY.json (repeatable; a label per variant)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--title", default="soak: answer times")
    args = p.parse_args()
    result = compare(_runs(args.run))
    for label, figures in result.items():
        for kind in KINDS:
            runs = " | ".join(" / ".join(f"{r[q] / 1e3:.1f}" if r.get(q) is not None else "-"
                                         for q in QUANTILES) for r in figures[kind]["runs"])
            med = figures[kind]["median"]
            print(f"{label:12s} {kind:11s} p50/p90/p99 s: {runs}   median "
                  + " / ".join(f"{med[q] / 1e3:.1f}" for q in QUANTILES if q in med))
        print(f"{label:12s} violations {figures['violations']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot is not None:
        plot(result, args.plot, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
