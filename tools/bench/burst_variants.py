"""The burst variants of ``gpu_serving.sh agent`` side by side: per variant and load, each round's TTFT, median and spread.

``gpu_serving.sh agent`` runs ``join_cost.py --burst`` once per variant
(``KVTIER_BATCH_ALIGN_SUFFIXES`` x ``KVTIER_BATCH_PREFILL_CLEAR``) and round,
and keeps each run's summary line prefixed with its switches in
``burst-align.txt``:

    align=1 clear=0 burst 8 x 40 tokens over a cached 5100, 8 rows decoding, ... TTFT p50 208.4 max 208.4 ms; ...

This reads that file, prints one line per variant and load (the rounds'
TTFT p50, their median and range, the median against the first variant's)
and plots the medians with their range.

    python3 tools/bench/burst_variants.py burst-align.txt --plot burst.png --title "H200, be8d971"
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

_LINE = re.compile(
    r"^align=(?P<align>\d) clear=(?P<clear>\d) burst .*?, (?P<decoding>\d+) rows decoding,.*?"
    r"TTFT p50 (?P<ttft>[0-9.]+)"
)


def parse(text: str) -> dict[tuple[str, int], list[float]]:
    """TTFT p50 (ms) of every round, keyed by (variant, rows decoding beside the burst), in file order."""
    out: dict[tuple[str, int], list[float]] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        variant = f"align={m['align']} clear={m['clear']}"
        out.setdefault((variant, int(m["decoding"])), []).append(float(m["ttft"]))
    return out


def table(runs: dict[tuple[str, int], list[float]]) -> list[str]:
    """One printed line per (variant, load): rounds, median [min..max], median over the first variant's."""
    variants = list(dict.fromkeys(v for v, _ in runs))
    loads = sorted({d for _, d in runs})
    lines = []
    for d in loads:
        base = statistics.median(runs[(variants[0], d)]) if (variants[0], d) in runs else None
        for v in variants:
            xs = runs.get((v, d))
            if not xs:
                continue
            med = statistics.median(xs)
            ratio = f"{med / base:.2f}" if base else "-"
            rounds = " / ".join(f"{x:.1f}" for x in xs)
            lines.append(
                f"{d:>2} rows decoding  {v:<16} TTFT p50 {rounds} ms: median {med:.1f} "
                f"[{min(xs):.1f}..{max(xs):.1f}], x {ratio} of {variants[0]}"
            )
    return lines


def plot(runs: dict[tuple[str, int], list[float]], path: Path, title: str) -> None:
    """Grouped bars: per load, each variant's median TTFT with its range as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(v for v, _ in runs))
    loads = sorted({d for _, d in runs})
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in enumerate(variants):
        xs = [i + k * width for i in range(len(loads))]
        meds, lo, hi = [], [], []
        for d in loads:
            vals = runs.get((v, d), [float("nan")])
            med = statistics.median(vals)
            meds.append(med)
            lo.append(med - min(vals))
            hi.append(max(vals) - med)
        ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=v)
    ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(loads))])
    ax.set_xticklabels([f"{d} rows decoding" for d in loads])
    ax.set_ylabel("burst TTFT p50, ms (median, range over rounds)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("txt", type=Path, help="burst-align.txt from gpu_serving.sh agent")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    p.add_argument("--title", default="burst TTFT by variant")
    args = p.parse_args()
    runs = parse(args.txt.read_text())
    if not runs:
        raise SystemExit(f"no burst lines in {args.txt}")
    for line in table(runs):
        print(line)
    if args.plot is not None:
        plot(runs, args.plot, args.title)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
