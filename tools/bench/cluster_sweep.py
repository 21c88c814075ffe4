"""The load sweep of ``tools/bench/cluster.py``: TTFT against the load (agents, or conversations a second), per policy.

    for n in 1 2 4 6; do
        flock /tmp/bench.lock python tools/bench/cluster.py --replicas 2 --concurrency $n \\
            --conversations $((2 * n)) --tool-s 2 --threads 1 --pin ... --out /tmp/sweep/c$n
    done
    python tools/bench/cluster_sweep.py /tmp/sweep/c*/cluster.json --out /tmp/sweep/sweep.png

Each ``cluster.json`` is one load point (one run of ``cluster.py``: the
policies side by side on the same replicas, in that run's order). This
script reads them, prints per point and policy the TTFT p50 / p90 / p99,
the cached share, the throughput, the requests in flight and the TTFT p50
of round-robin over each other policy, and draws TTFT p50 (p90 dashed) and
that ratio against the load, one line per policy: the number of agents
for closed-loop runs, the arrival rate (conversations a second) where
every run is open loop (``--arrival-rate``). A load point run more than
once shows each run as a dot and its median as the line. It runs nothing
itself.

    python tools/bench/cluster_sweep.py /tmp/cl/r*/cluster.json --out open-sweep.png
"""

from __future__ import annotations

import argparse
import json
import statistics
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
        rate = float(trace.get("arrival_rate") or 0.0)
        for policy, entry in run["policies"].items():
            s = entry["summary"]
            rows.append({
                "path": str(path), "run": path.parent.name, "agents": int(trace["concurrency"]),
                "rate": rate, "in_flight_mean": s.get("requests_in_flight_mean"),
                "conversations": int(trace["conversations"]), "tool_s": trace.get("tool_s", 0.0),
                "policy": policy, "order": order.index(policy), "replicas": run["replicas"],
                "load_before": run.get("load_before"), "load_after": entry.get("load_after"),
                "ttft_p50_s": s["ttft_p50_s"], "ttft_p90_s": s["ttft_p90_s"],
                "ttft_p99_s": s["ttft_p99_s"], "cached_share": s["cached_share"],
                "prompt_tokens_per_s": s["prompt_tokens_per_s"], "per_replica": s["per_replica"],
                "rr_over_this_p50": (base["ttft_p50_s"] / s["ttft_p50_s"]) if base else None,
            })
    open_loop = bool(rows) and all(r["rate"] > 0 for r in rows)
    for r in rows:
        # NOTE: rates to 3 decimals: a rate measured from a capacity (--arrival-rate-fraction)
        # and the same rate given again (--arrival-rate) are one load point.
        r["x"] = round(r["rate"], 3) if open_loop else r["agents"]
        r["open_loop"] = open_loop
    return sorted(rows, key=lambda r: (r["x"], r["run"], r["order"]))


def x_label(rows: list[dict[str, Any]]) -> str:
    """What the rows' load axis counts: conversations a second (open loop) or agents (closed)."""
    return "conversations a second" if rows and rows[0]["open_loop"] else "concurrent agents"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    head = "conversations / s" if x_label(rows) == "conversations a second" else "agents"
    out = [(f"| {head} | run | policy (order) | TTFT p50 | p90 | p99 | round-robin p50 / this | "
            "cached share | prompt tok/s | requests in flight (mean) | requests per replica | load after |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r["rr_over_this_p50"] is None else f"{r['rr_over_this_p50']:.2f} ×"
        flight = "" if r["in_flight_mean"] is None else f"{r['in_flight_mean']:.1f}"
        out.append(
            f"| {r['x']:g} | {r['run']} | {r['policy']} ({r['order'] + 1}) | {r['ttft_p50_s']:.2f} s | "
            f"{r['ttft_p90_s']:.2f} s | {r['ttft_p99_s']:.2f} s | {ratio} | "
            f"{r['cached_share']:.3f} | {r['prompt_tokens_per_s']:.0f} | {flight} | "
            f"{' / '.join(str(x) for x in r['per_replica'])} | {'; '.join(r['load_after'] or [])} |")
    return "\n".join(out)


def medians(rows: list[dict[str, Any]]) -> str:
    """Per load point and policy: the median over its runs of TTFT p50 and of round-robin's p50 over it, with the range."""
    out = ["| load | policy | runs | TTFT p50, median [range] | round-robin p50 / this, median [range] |",
           "|---|---|---|---|---|"]
    for x in sorted({r["x"] for r in rows}):
        for policy in sorted({r["policy"] for r in rows if r["x"] == x}):
            mine = [r for r in rows if r["x"] == x and r["policy"] == policy]
            p50 = [r["ttft_p50_s"] for r in mine]
            ratio = [r["rr_over_this_p50"] for r in mine if r["rr_over_this_p50"] is not None]
            rtxt = (f"{statistics.median(ratio):.2f} × [{min(ratio):.2f}..{max(ratio):.2f}]"
                    if ratio and policy != "round_robin" else "")
            out.append(f"| {x:g} | {policy} | {len(mine)} | {statistics.median(p50):.3f} s "
                       f"[{min(p50):.3f}..{max(p50):.3f}] | {rtxt} |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT p50 (p90 dashed) per policy against the load; round-robin's p50 over each policy's (medians joined)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(21, 4.8))
    # NOTE: the fourth panel's x is how queued round-robin was in each run (its
    # requests in flight, mean): one offered rate meets a different share of
    # the replicas' capacity when the host's speed moves between runs.
    rr_flight = {r["path"]: r["in_flight_mean"] for r in rows if r["policy"] == "round_robin"}
    policies = sorted({r["policy"] for r in rows})
    for k, policy in enumerate(policies):
        mine = [r for r in rows if r["policy"] == policy]
        xs = sorted({r["x"] for r in mine})
        color = f"C{k}"

        def median(key: str, x: float, of: list[dict[str, Any]] = mine) -> float:
            vals = [float(r[key]) for r in of if r["x"] == x and r[key] is not None]
            return statistics.median(vals) if vals else float("nan")

        # NOTE: a load point run more than once shows every run as a dot; the
        # line joins the runs' medians.
        ax[0].scatter([r["x"] for r in mine], [r["ttft_p50_s"] for r in mine], color=color)
        ax[0].plot(xs, [median("ttft_p50_s", x) for x in xs], color=color, label=f"{policy} p50")
        ax[0].plot(xs, [median("ttft_p90_s", x) for x in xs], ls="--", color=color, alpha=0.6,
                   label=f"{policy} p90")
        if policy != "round_robin":
            ax[1].scatter([r["x"] for r in mine], [r["rr_over_this_p50"] for r in mine],
                          color=color)
            ax[1].plot(xs, [median("rr_over_this_p50", x) for x in xs], color=color, label=policy)
        ax[2].scatter([r["x"] for r in mine], [r["prompt_tokens_per_s"] for r in mine],
                      color=color)
        ax[2].plot(xs, [median("prompt_tokens_per_s", x) for x in xs], color=color, label=policy)
        if policy != "round_robin":
            pts = [(rr_flight.get(r["path"]), r["rr_over_this_p50"]) for r in mine]
            pts = [(f, v) for f, v in pts if f is not None and v is not None]
            ax[3].scatter([f for f, _ in pts], [v for _, v in pts], color=color, label=policy)
    axis = x_label(rows)
    ax[0].set_title(f"TTFT (s) against {axis}")
    ax[0].set_yscale("log")
    ax[1].axhline(3.0, color="k", ls=":", label="3 × (#24's line)")
    ax[1].set_title("TTFT p50: round-robin / policy")
    ax[2].set_title("throughput (prompt tokens / s)")
    ax[3].axhline(3.0, color="k", ls=":", label="3 ×")
    ax[3].set_title("round-robin / policy TTFT p50, each run")
    for a in ax[:3]:
        a.set_xlabel(axis)
    ax[3].set_xlabel("round-robin's requests in flight (mean) in that run")
    for a in ax:
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
    print()
    print(medians(rows))
    first = rows[0]
    title = args.title or (f"{first['replicas']} CPU replicas, agent trace, tool time "
                           f"{first['tool_s']} s mean")
    plot(rows, args.out, title)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
