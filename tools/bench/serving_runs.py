"""Several runs of ``serving.py`` side by side: per level, each run's figures, the median and the spread.

On the lent GPU every ``gpu_serving.sh run`` is one round in its own
process, so a median of three is three JSON files. This reads them, prints
one table per measure (output tok/s, TTFT p50 / p99, the agent trace) with
each run's kvtier / mlx_lm ratio and their median, and plots the ratios.

    python3 tools/bench/serving_runs.py A.json B.json C.json \\
        --label r0 --label r1 --label r2 --plot runs.png [--cold-peer r0]

A run may be a kvtier-only JSON paired with another run's peer, written
``KVTIER.json+PEER.json`` (``gpu_serving.sh runab`` makes such pairs: one
call runs both servers with one kvtier variant, then kvtier alone with the
other over the same round's prompts and the same constant rate); its
mlx_lm figures are the peer file's.

``--cold-peer LABEL`` marks a run whose peer ran first on a fresh machine
(MLX CUDA compiles its kernels on first use, so the first server of a fresh
machine pays it): that run's peer figures are shown but left out of the
medians of the peer-relative ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path
from typing import Any

MEASURES = (
    ("output_tps", "tok/s", True),
    ("ttft_p50", "TTFT p50 ms", False),
    ("ttft_p99", "TTFT p99 ms", False),
    ("itl_p50", "ITL p50 ms", False),
)


def _levels(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The summary's levels keyed by ``profile level`` (one run, one round).

    NOTE: a constant-rate level is keyed by its rate's rank, not the rate:
    each run derives its rate from that run's peer saturation.
    """
    out: dict[str, dict[str, Any]] = {}
    rank = 0
    for lv in doc["summary"]["levels"]:
        if lv["profile"] == "concurrent":
            out[f"concurrent {lv['level']:g}"] = lv
        else:
            out[f"{lv['profile']} #{rank}"] = lv
            rank += 1
    return out


def _agent(doc: dict[str, Any]) -> dict[str, float]:
    """The agent trace's TTFT p50 of turns 2+ per server (ms), where the run had one."""
    out: dict[str, float] = {}
    for rnd in doc.get("rounds", []):
        for who, run in rnd.items():
            agent = run.get("agent") if isinstance(run, dict) else None
            turns = agent.get("turns_list", []) if isinstance(agent, dict) else []
            later = [float(t["ttft_ms"]) for t in turns if int(t["turn"]) >= 2]
            if later:
                out[who] = statistics.median(later)
    return out


def _host_loops(doc: dict[str, Any]) -> dict[str, list[float]]:
    """Each server's host probe (``serving.py``'s ``host_loop_s``: seconds before it started, after
    it stopped), where the run recorded one."""
    out: dict[str, list[float]] = {}
    for rnd in doc.get("rounds", []):
        for who, run in rnd.items():
            probes = run.get("host_loop_s") if isinstance(run, dict) else None
            if probes:
                out[who] = [float(x) for x in probes]
    return out


def _page_cache(doc: dict[str, Any]) -> dict[str, list[float]]:
    """Each server's page cache in GiB (``serving.py``'s ``host_state``: ``Cached`` before it
    started, after it stopped), where the run recorded it."""
    out: dict[str, list[float]] = {}
    for rnd in doc.get("rounds", []):
        for who, run in rnd.items():
            states = run.get("host_state") if isinstance(run, dict) else None
            cached = [s["meminfo"]["Cached"] / (1 << 30) for s in states or []
                      if "Cached" in s.get("meminfo", {})]
            if cached:
                out[who] = cached
    return out


def _per_server(labels: list[str], runs: list[dict[str, list[float]]], fmt: str) -> str:
    """``LABEL who a/b, who a/b; ...`` for each run that recorded its servers' values."""
    return "; ".join(
        f"{lab} " + ", ".join(f"{who} {'/'.join(format(x, fmt) for x in vals[who])}" for who in sorted(vals))
        for lab, vals in zip(labels, runs, strict=True) if vals)


def with_peer(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """A kvtier-only run's document with ``peer``'s mlx_lm figures put beside its own (levels, agent)."""
    merged = copy.deepcopy(ours)
    theirs = _levels(peer)
    for key, lv in _levels(merged).items():
        if key in theirs and "mlx_lm" in theirs[key]:
            lv["mlx_lm"] = theirs[key]["mlx_lm"]
    for mine, other in zip(merged.get("rounds", []), peer.get("rounds", []), strict=False):
        if isinstance(other, dict) and "mlx_lm" in other:
            mine["mlx_lm"] = other["mlx_lm"]
    return merged


def load_run(spec: str) -> dict[str, Any]:
    """``FILE`` or ``KVTIER_FILE+PEER_FILE`` (see the module's docstring) as one run's document."""
    ours, plus, peer = spec.partition("+")
    doc: dict[str, Any] = json.loads(Path(ours).read_text())
    return with_peer(doc, json.loads(Path(peer).read_text())) if plus else doc


def main() -> None:
    """Print the side-by-side tables and write the plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="serving.py --json files, one per run (or KVTIER+PEER)")
    ap.add_argument("--label", action="append", default=[], help="a name per run, in order")
    ap.add_argument("--cold-peer", action="append", default=[], help="a run whose peer ran cold (see above)")
    ap.add_argument("--plot", type=Path, help="PNG of the kvtier / mlx_lm ratios per level")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    labels = args.label or [Path(p.partition("+")[0]).stem for p in args.runs]
    if len(labels) != len(args.runs):
        ap.error("one --label per run")
    docs = [load_run(p) for p in args.runs]
    per_run = [_levels(d) for d in docs]
    # NOTE: a level any run has; a run cut short (serving.py's JSON says
    # "complete": false) shows no figure for the levels it did not reach.
    keys: list[str] = []
    for runs in per_run:
        keys += [k for k in runs if k not in keys]
    for lab, doc in zip(labels, docs, strict=True):
        if doc.get("complete") is False:
            print(f"{lab}: cut short (every phase it finished is shown)")
    warm = [i for i, lab in enumerate(labels) if lab not in args.cold_peer]
    ratios: dict[str, dict[str, list[float | None]]] = {}
    for measure, name, _higher in MEASURES:
        print(f"\n{name}: " + " | ".join(f"{lab} mlx_lm / kvtier / ratio" for lab in labels) + " | median ratio (warm peer) [spread]")
        ratios[measure] = {}
        for key in keys:
            cells = []
            rs: list[float | None] = []
            for i, runs in enumerate(per_run):
                lv = runs.get(key)
                if lv is None or "mlx_lm" not in lv or "kvtier" not in lv:
                    rs.append(None)
                    cells.append(f"{'-':>8}  {'-':>8}   n/a")
                    continue
                peer, ours = lv["mlx_lm"][measure], lv["kvtier"][measure]
                r = ours / peer if peer else None
                rs.append(r)
                mark = "*" if labels[i] in args.cold_peer else ""
                cells.append(f"{peer:8.1f}{mark} {ours:8.1f} {r:5.2f}" if r is not None else f"{peer:8.1f} {ours:8.1f}   n/a")
            ok = [r for i, r in enumerate(rs) if r is not None and i in warm]
            med = f"{statistics.median(ok):5.2f} [{min(ok):.2f}..{max(ok):.2f}]" if ok else "n/a"
            ratios[measure][key] = rs
            print(f"  {key:>16} | " + " | ".join(cells) + f" | {med}")
    agents = [_agent(d) for d in docs]
    if any(agents):
        cells, rs2 = [], []
        for i, a in enumerate(agents):
            if "mlx_lm" in a and "kvtier" in a:
                r = a["kvtier"] / a["mlx_lm"]
                cells.append(f"{labels[i]} {a['mlx_lm']:.0f} / {a['kvtier']:.0f} = {r:.2f}")
                if i in warm:
                    rs2.append(r)
        med = f"median {statistics.median(rs2):.2f} [{min(rs2):.2f}..{max(rs2):.2f}]" if rs2 else ""
        print("\nagent TTFT p50 turns 2+ ms (mlx_lm / kvtier): " + "; ".join(cells) + f"; {med}")
    hosts = [_host_loops(d) for d in docs]
    if any(hosts):
        # NOTE: a host-bound step's time moves with the host's speed on a
        # shared host; the probe says which runs ran on a slower host.
        print("\nhost loop s (before / after each server): " + _per_server(labels, hosts, ".3f"))
    caches = [_page_cache(d) for d in docs]
    if any(caches):
        # NOTE: what the earlier calls on one machine left in its page cache
        # (their SSD-tier files among it), beside each run's figures.
        print("page cache GiB (before / after each server): " + _per_server(labels, caches, ".1f"))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, measure, name in ((axes[0], "output_tps", "output tok/s"), (axes[1], "ttft_p50", "TTFT p50")):
            x = list(range(len(keys)))
            for i, lab in enumerate(labels):
                ys = [ratios[measure][k][i] for k in keys]
                style = "x" if lab in args.cold_peer else "o"
                ax.plot(x, [y if y is not None else float("nan") for y in ys], style + "-", label=lab + (" (cold peer)" if style == "x" else ""))
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xticks(x)
            ax.set_xticklabels(keys, rotation=20, fontsize=8)
            ax.set_ylabel(f"kvtier / mlx_lm, {name}")
            ax.legend(fontsize=8)
        fig.suptitle(args.title or "serving runs: kvtier / mlx_lm.server")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
