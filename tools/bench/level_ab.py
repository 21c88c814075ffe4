"""Two variants of kvtier side by side from ``serving.py`` runs: per level, each run, the median and the spread.

For A/B runs of kvtier alone (``gpu_serving.sh loadab`` on the GPU, or
``serving.py --servers kvtier`` from two trees in alternation here): each
variant is a list of ``serving.py --json`` files, one per run. It prints,
per concurrency level, each run's output tok/s, TTFT p50 / p99 and the
timeline's phases (p50), then each variant's median [spread] and the
ratio of the medians (B / A), and plots tok/s, TTFT p50 and the
``admission`` and ``lookup`` phases per run::

    python3 tools/bench/level_ab.py --a base-*.json --b new-*.json \\
        --label-a before --label-b after --plot ab.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

MEASURES = ("output_tps", "ttft_p50", "ttft_p99")
PHASES = ("admission", "lookup", "join", "first_step")


def levels(path: Path) -> dict[float, dict[str, float]]:
    """Per concurrent level of one run: kvtier's measures and phase p50s (ms)."""
    data = json.loads(path.read_text())
    out: dict[float, dict[str, float]] = {}
    for row in data["summary"]["levels"]:
        if row["profile"] != "concurrent":
            continue
        figures = {k: float(row["kvtier"][k]) for k in MEASURES}
        out[float(row["level"])] = figures
    for rnd in data.get("rounds", []):
        for lv in rnd.get("kvtier", {}).get("levels", []):
            level = float(lv.get("level", math.nan))
            phases = lv.get("phases_ms") or {}
            if level in out:
                out[level].update({p: float(phases[p]) for p in PHASES if p in phases})
    return out


def table(runs: dict[str, list[Path]]) -> dict[str, Any]:
    """Each variant's runs per level and measure, with the median and the spread."""
    result: dict[str, Any] = {}
    for label, paths in runs.items():
        per_level: dict[float, dict[str, list[float]]] = {}
        for path in paths:
            for level, figures in levels(path).items():
                for key, value in figures.items():
                    per_level.setdefault(level, {}).setdefault(key, []).append(value)
        result[label] = {
            level: {key: {"runs": vals, "median": statistics.median(vals), "min": min(vals), "max": max(vals)}
                    for key, vals in measures.items()}
            for level, measures in per_level.items()
        }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, nargs="+", required=True, help="variant A's serving.py JSON files")
    p.add_argument("--b", type=Path, nargs="+", required=True, help="variant B's serving.py JSON files")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--title", default="")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = table({args.label_a: args.a, args.label_b: args.b})
    a, b = result[args.label_a], result[args.label_b]
    for level in sorted(set(a) & set(b)):
        print(f"{level:g} streams")
        for key in (*MEASURES, *PHASES):
            if key not in a[level] or key not in b[level]:
                continue
            ra, rb = a[level][key], b[level][key]
            runs_a = " ".join(f"{v:.1f}" for v in ra["runs"])
            runs_b = " ".join(f"{v:.1f}" for v in rb["runs"])
            ratio = rb["median"] / ra["median"] if ra["median"] else math.nan
            print(f"  {key:11s} {args.label_a}: {runs_a} | median {ra['median']:.1f} "
                  f"[{ra['min']:.1f}..{ra['max']:.1f}]   {args.label_b}: {runs_b} | median "
                  f"{rb['median']:.1f} [{rb['min']:.1f}..{rb['max']:.1f}]   {args.label_b}/{args.label_a} "
                  f"{ratio:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({str(k): v for k, v in result.items()}, indent=1, default=str))
    if args.plot is not None:
        plot(result, args.label_a, args.label_b, args.plot, args.title)
        print(f"plot: {args.plot}")
    return 0


def plot(result: dict[str, Any], label_a: str, label_b: str, path: Path, title: str) -> None:
    """Per measure a panel: each run's figure as a dot, the median as a bar, per level and variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("output_tps", "ttft_p50", "admission", "lookup")
    names = {"output_tps": "output tok/s", "ttft_p50": "TTFT p50 (ms)",
             "admission": "admission phase p50 (ms)", "lookup": "lookup phase p50 (ms)"}
    levels_all = sorted(set(result[label_a]) & set(result[label_b]))
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6))
    for ax, key in zip(axes, keys, strict=True):
        for i, level in enumerate(levels_all):
            for j, (label, color) in enumerate(((label_a, "tab:gray"), (label_b, "tab:blue"))):
                entry = result[label][level].get(key)
                if entry is None:
                    continue
                x = i * 3 + j
                ax.bar(x, entry["median"], color=color, alpha=0.5, label=label if i == 0 else None)
                ax.plot([x] * len(entry["runs"]), entry["runs"], "o", color=color, markersize=4)
        ax.set_xticks([i * 3 + 0.5 for i in range(len(levels_all))])
        ax.set_xticklabels([f"{lv:g} streams" for lv in levels_all])
        ax.set_title(names[key], fontsize=10)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
