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

More than two variants (``gpu_serving.sh agentmx``): the runs are named
``runI-NAME.json`` for any variant name; each variant gets its median and
range, and its ratio to ``--baseline`` (default ``off``). ``--schedule
SPEC`` prints that call's run order instead: ``SPEC`` is ``|``-separated
variants, each ``NAME`` or ``NAME:ASSIGNMENTS`` (space-separated
``KEY=VALUE`` for kvtier's process), and cycle ``c`` runs them rotated by
``c`` (two variants give off on on off off on ...):

    python3 tools/bench/agent_ab.py --schedule "off|pair:MLX_CUDA_USE_CUDNN_SDPA=0 MLX_USE_CUDA_GRAPHS=0" --cycles 4
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

_NAME = re.compile(r"run(\d+)-([A-Za-z0-9_]+)\.json$")
_VARIANT = re.compile(r"[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Run:
    """One server's agent trace: which run, which variant, its figures (ms)."""

    name: str
    order: int
    variant: str
    turn1_p50: float
    later_p50: float
    later_step_p50: float


def _index(path: Path) -> int:
    m = _NAME.search(path.name)
    assert m is not None
    return int(m.group(1))


def _files(paths: Sequence[Path]) -> list[Path]:
    """The ``runI-VARIANT.json`` files named or inside the folders named; a folder's by run number."""
    out: list[Path] = []
    for p in paths:
        found = [f for f in (p.glob("run*-*.json") if p.is_dir() else [p]) if _NAME.search(f.name)]
        # NOTE: by the number, not the name: run10 comes after run9.
        out.extend(sorted(found, key=_index) if p.is_dir() else found)
    return out


def schedule(spec: str, cycles: int) -> list[tuple[int, str, list[str]]]:
    """The runs of ``spec`` over ``cycles`` cycles: (index, variant, its assignments), cycle ``c`` rotated by ``c``."""
    variants: list[tuple[str, list[str]]] = []
    for part in spec.split("|"):
        name, _, assigns = part.strip().partition(":")
        if not _VARIANT.fullmatch(name):
            raise ValueError(f"variant name {name!r}: letters, digits and _ only")
        if name in (n for n, _ in variants):
            raise ValueError(f"variant {name!r} twice")
        pairs = assigns.split()
        bad = [a for a in pairs if "=" not in a or a.startswith("=")]
        if bad:
            raise ValueError(f"variant {name!r}: not KEY=VALUE: {' '.join(bad)}")
        variants.append((name, pairs))
    out: list[tuple[int, str, list[str]]] = []
    for c in range(cycles):
        for k in range(len(variants)):
            name, pairs = variants[(k + c) % len(variants)]
            out.append((len(out), name, pairs))
    return out


def load_run(path: Path, order: int) -> Run:
    """One JSON of ``serving.py`` (kvtier alone, the agent trace) as a :class:`Run`."""
    m = _NAME.search(path.name)
    if m is None:
        raise ValueError(f"{path}: not a runI-VARIANT.json")
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
    """Per variant (in order of first appearance): median, min and max of the runs' turns 2+ TTFT p50, and how many runs."""
    out: dict[str, dict[str, float]] = {}
    for variant in dict.fromkeys(r.variant for r in runs):
        vals = [r.later_p50 for r in runs if r.variant == variant and r.name not in skip]
        if vals:
            out[variant] = {"median": statistics.median(vals), "min": min(vals),
                            "max": max(vals), "runs": float(len(vals))}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("paths", nargs="*", type=Path, help="runI-VARIANT.json files or folders of them")
    p.add_argument("--baseline", default="off", help="the variant the others are divided by (default off)")
    p.add_argument("--schedule", default=None, metavar="SPEC",
                   help="print the run order of SPEC (see above) over --cycles and exit")
    p.add_argument("--cycles", type=int, default=4, help="with --schedule: how many cycles (default 4)")
    p.add_argument("--skip", action="append", default=[], help="a run left out of the medians (DIR/runI-VAR)")
    p.add_argument("--label-on", default="on", help="what 'on' switched, for the printout and plot")
    p.add_argument("--title", default="", help="the plot's title")
    p.add_argument("--plot", type=Path, default=None, help="write the PNG here")
    args = p.parse_args(argv)
    if args.schedule is not None:
        try:
            plan = schedule(args.schedule, args.cycles)
        except ValueError as e:
            p.error(str(e))
        for i, name, pairs in plan:
            print(i, name, *pairs)
        return 0
    runs = [load_run(f, i) for i, f in enumerate(_files(args.paths))]
    if not runs:
        p.error("no runI-VARIANT.json found")
    skip = set(args.skip)
    print(f"{'run':24s} {'variant':8s} {'turn 1 p50':>11s} {'turns 2+ p50':>13s} {'their step p50':>15s}")
    for r in runs:
        mark = "  (left out)" if r.name in skip else ""
        print(f"{r.name:24s} {r.variant:8s} {r.turn1_p50:9.0f} ms {r.later_p50:11.0f} ms "
              f"{r.later_step_p50:13.0f} ms{mark}")
    summary = summarize(runs, skip)
    for variant, s in summary.items():
        label = args.label_on if variant == "on" else variant
        print(f"{label}: turns 2+ TTFT p50, median of {s['runs']:.0f} runs {s['median']:.0f} ms "
              f"(range {s['min']:.0f}-{s['max']:.0f})")
    base = summary.get(args.baseline)
    for variant, s in summary.items():
        if base is not None and variant != args.baseline:
            print(f"{variant} / {args.baseline}, medians: {s['median'] / base['median']:.2f}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        palette = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"]
        names = list(dict.fromkeys(r.variant for r in runs))
        if args.baseline in names:
            names.remove(args.baseline)
            names.insert(0, args.baseline)
        marked = False
        for variant, color in zip(names, palette * len(names), strict=False):
            pts = [r for r in runs if r.variant == variant]
            ax.scatter([r.order for r in pts], [r.later_p50 for r in pts], color=color,
                       label=args.label_on if variant == "on" else variant,
                       marker="o")
            left = [r for r in pts if r.name in skip]
            ax.scatter([r.order for r in left], [r.later_p50 for r in left], facecolors="none",
                       edgecolors="red", s=120, label="left out" if left and not marked else None)
            marked = marked or bool(left)
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
