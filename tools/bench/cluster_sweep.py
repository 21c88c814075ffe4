"""The load sweep of ``tools/bench/cluster.py``: TTFT against the number of agents, per policy.

    for n in 1 2 4 6; do
        flock /tmp/bench.lock python tools/bench/cluster.py --replicas 2 --concurrency $n \\
            --conversations $((2 * n)) --tool-s 2 --threads 1 --pin ... --out /tmp/sweep/c$n
    done
    python tools/bench/cluster_sweep.py /tmp/sweep/c*/cluster.json --out /tmp/sweep/sweep.png

Each ``cluster.json`` is one load point (one run of ``cluster.py``: the
policies side by side on the same replicas, in that run's order). This
script reads them, prints per point and policy the TTFT p50 / p90 / p99,
the cached share, the throughput and the TTFT p50 of round-robin over each
other policy, and draws TTFT p50 (p90 dashed) and that ratio against the
number of agents, one line per policy. It runs nothing itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))


def points(paths: list[Path]) -> list[dict[str, Any]]:
    """One row per (run, policy): agents, policy, the summary figures and the run's facts."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        run = json.loads(path.read_text())
        trace = run["trace"]
        order = list(run["policies"])
        base = run["policies"].get("round_robin", {}).get("summary")
        for policy, entry in run["policies"].items():
            s = entry["summary"]
            rows.append({
                "path": str(path), "run": path.parent.name, "agents": int(trace["concurrency"]),
                "conversations": int(trace["conversations"]), "tool_s": trace.get("tool_s", 0.0),
                "policy": policy, "order": order.index(policy), "replicas": run["replicas"],
                "load_before": run.get("load_before"), "load_after": entry.get("load_after"),
                "ttft_p50_s": s["ttft_p50_s"], "ttft_p90_s": s["ttft_p90_s"],
                "ttft_p99_s": s["ttft_p99_s"], "cached_share": s["cached_share"],
                "prompt_tokens_per_s": s["prompt_tokens_per_s"], "per_replica": s["per_replica"],
                "rr_over_this_p50": (base["ttft_p50_s"] / s["ttft_p50_s"]) if base else None,
            })
    return sorted(rows, key=lambda r: (r["agents"], r["run"], r["order"]))


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    out = [("| agents | run | policy (order) | TTFT p50 | p90 | p99 | round-robin p50 / this | "
            "cached share | prompt tok/s | requests per replica | load after |"),
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r["rr_over_this_p50"] is None else f"{r['rr_over_this_p50']:.2f} ×"
        out.append(
            f"| {r['agents']} | {r['run']} | {r['policy']} ({r['order'] + 1}) | {r['ttft_p50_s']:.2f} s | "
            f"{r['ttft_p90_s']:.2f} s | {r['ttft_p99_s']:.2f} s | {ratio} | "
            f"{r['cached_share']:.3f} | {r['prompt_tokens_per_s']:.0f} | "
            f"{' / '.join(str(x) for x in r['per_replica'])} | {'; '.join(r['load_after'] or [])} |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT p50 (p90 dashed) per policy against agents; round-robin's p50 over each policy's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    policies = sorted({r["policy"] for r in rows})
    for k, policy in enumerate(policies):
        mine = [r for r in rows if r["policy"] == policy]
        xs = sorted({r["agents"] for r in mine})
        color = f"C{k}"

        def mean(key: str, x: int, of: list[dict[str, Any]] = mine) -> float:
            vals = [float(r[key]) for r in of if r["agents"] == x and r[key] is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        # NOTE: a load point run more than once shows every run as a dot; the
        # line joins the runs' means.
        ax[0].scatter([r["agents"] for r in mine], [r["ttft_p50_s"] for r in mine], color=color)
        ax[0].plot(xs, [mean("ttft_p50_s", x) for x in xs], color=color, label=f"{policy} p50")
        ax[0].plot(xs, [mean("ttft_p90_s", x) for x in xs], ls="--", color=color, alpha=0.6,
                   label=f"{policy} p90")
        if policy != "round_robin":
            ax[1].scatter([r["agents"] for r in mine], [r["rr_over_this_p50"] for r in mine],
                          color=color)
            ax[1].plot(xs, [mean("rr_over_this_p50", x) for x in xs], color=color, label=policy)
        ax[2].scatter([r["agents"] for r in mine], [r["prompt_tokens_per_s"] for r in mine],
                      color=color)
        ax[2].plot(xs, [mean("prompt_tokens_per_s", x) for x in xs], color=color, label=policy)
    ax[0].set_title("TTFT (s) against concurrent agents")
    ax[0].set_yscale("log")
    ax[1].axhline(3.0, color="k", ls=":", label="3 × (#24's line)")
    ax[1].set_title("TTFT p50: round-robin / policy")
    ax[2].set_title("throughput (prompt tokens / s)")
    for a in ax:
        a.set_xlabel("concurrent agents")
        a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    """Read the runs, print the table, draw the plot."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="cluster.json of each load point")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write (and .json beside it)")
    p.add_argument("--title", default="")
    args = p.parse_args()
    rows = points(args.runs)
    print(table(rows))
    first = rows[0]
    title = args.title or (f"{first['replicas']} CPU replicas, agent trace, tool time "
                           f"{first['tool_s']} s mean")
    plot(rows, args.out, title)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
