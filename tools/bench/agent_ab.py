"""The agent line's A/B (``gpu_serving.sh agentab``): each run's figures, each variant's median and spread.

``agentab`` runs ``serving.py --servers kvtier --skip-loadgen`` several times,
a fresh server each, with and without one environment switch, in the order
off, on, on, off, ... and names each JSON ``runI-off.json`` / ``runI-on.json``.
This reads them (files, or folders holding them), prints per run the TTFT
p50 of turn 1 and of turns 2+ and the median batch step a turn 2+ joined
in, then per variant the median of the runs and their range, and the
on / off ratio of the medians; ``--plot`` draws each run's turns 2+ TTFT
p50 in run order.

    python3 tools/bench/agent_ab.py DIR_OR_JSON... [--skip run0-off] \\
        [--label-on "cuDNN SDPA off + bucket 32"] [--plot ab.png]

``--skip NAME`` leaves a run out of the medians (shown, marked): the first
run of a fresh machine pays MLX's first compiles.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAME = re.compile(r"run(\d+)-(on|off)\.json$")


@dataclass(frozen=True)
class Run:
    """One server's agent trace: which run, which variant, its figures (ms)."""

    name: str
    order: int
    variant: str
    turn1_p50: float
    later_p50: float
    later_step_p50: float


def _files(paths: Sequence[Path]) -> list[Path]:
    """The ``runI-(on|off).json`` files named or inside the folders named, in path order."""
    out: list[Path] = []
    for p in paths:
        found = sorted(p.glob("run*-o*.json")) if p.is_dir() else [p]
        out.extend(f for f in found if _NAME.search(f.name))
    return out


def load_run(path: Path, order: int) -> Run:
    """One JSON of ``serving.py`` (kvtier alone, the agent trace) as a :class:`Run`."""
    m = _NAME.search(path.name)
    if m is None:
        raise ValueError(f"{path}: not a runI-on/off.json")
    doc: dict[str, Any] = json.loads(path.read_text())
    turns: list[dict[str, Any]] = []
    for rnd in doc.get("rounds", []):
        agent = rnd.get("kvtier", {}).get("agent") or {}
        turns.extend(agent.get("turns_list", []))
    first = [float(t["ttft_ms"]) for t in turns if int(t["turn"]) == 1]
    later = [t for t in turns if int(t["turn"]) >= 2]
    if not first or not later:
        raise ValueError(f"{path}: no agent turns")
    steps = [float(t["join_step"]["step_ms"]) for t in later if t.get("join_step")]
    return Run(
        name=f"{path.parent.name}/run{m.group(1)}-{m.group(2)}",
        order=order,
        variant=m.group(2),
        turn1_p50=statistics.median(first),
        later_p50=statistics.median(float(t["ttft_ms"]) for t in later),
        later_step_p50=statistics.median(steps) if steps else float("nan"),
    )


def summarize(runs: Sequence[Run], skip: set[str]) -> dict[str, dict[str, float]]:
    """Per variant: median, min and max of the runs' turns 2+ TTFT p50, and how many runs."""
    out: dict[str, dict[str, float]] = {}
    for variant in ("off", "on"):
        vals = [r.later_p50 for r in runs if r.variant == variant and r.name not in skip]
        if vals:
            out[variant] = {"median": statistics.median(vals), "min": min(vals),
                            "max": max(vals), "runs": float(len(vals))}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="runI-on/off.json files or folders of them")
    p.add_argument("--skip", action="append", default=[], help="a run left out of the medians (DIR/runI-VAR)")
    p.add_argument("--label-on", default="on", help="what 'on' switched, for the printout and plot")
    p.add_argument("--title", default="", help="the plot's title")
    p.add_argument("--plot", type=Path, default=None, help="write the PNG here")
    args = p.parse_args(argv)
    runs = [load_run(f, i) for i, f in enumerate(_files(args.paths))]
    if not runs:
        p.error("no runI-on/off.json found")
    skip = set(args.skip)
    print(f"{'run':24s} {'variant':8s} {'turn 1 p50':>11s} {'turns 2+ p50':>13s} {'their step p50':>15s}")
    for r in runs:
        mark = "  (left out)" if r.name in skip else ""
        print(f"{r.name:24s} {r.variant:8s} {r.turn1_p50:9.0f} ms {r.later_p50:11.0f} ms "
              f"{r.later_step_p50:13.0f} ms{mark}")
    summary = summarize(runs, skip)
    for variant, s in summary.items():
        label = args.label_on if variant == "on" else "off"
        print(f"{label}: turns 2+ TTFT p50, median of {s['runs']:.0f} runs {s['median']:.0f} ms "
              f"(range {s['min']:.0f}-{s['max']:.0f})")
    if "on" in summary and "off" in summary:
        print(f"on / off, medians: {summary['on']['median'] / summary['off']['median']:.2f}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for variant, color in (("off", "tab:gray"), ("on", "tab:blue")):
            pts = [r for r in runs if r.variant == variant]
            ax.scatter([r.order for r in pts], [r.later_p50 for r in pts], color=color,
                       label=args.label_on if variant == "on" else "off",
                       marker="o")
            left = [r for r in pts if r.name in skip]
            ax.scatter([r.order for r in left], [r.later_p50 for r in left], facecolors="none",
                       edgecolors="red", s=120, label="left out" if variant == "off" and left else None)
            if variant in summary:
                ax.axhline(summary[variant]["median"], color=color, linestyle="--", linewidth=1)
        ax.set_xlabel("run, in order")
        ax.set_ylabel("agent turns 2+ TTFT p50 (ms)")
        ax.set_title(args.title or "agent line A/B")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
