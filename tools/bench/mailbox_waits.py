"""Where messages wait in a served process: time in each mailbox and each handler's time, per actor and kind.

A diagnosis for latency between actors (the 2026-12-06 22:00 entry of
docs/benchmarks.md found a burst's ``Generate`` waiting 59 ms p50 in the
gateway's mailbox this way). Run the server with per-message events on
and JSON logs (``serving.py --kvtier-env KVTIER_LOG_LEVEL=debug
--kvtier-env KVTIER_LOG_FORMAT=json --out DIR``), then read its log::

    python3 tools/bench/mailbox_waits.py DIR/kvtier-r0.stderr [--json out.json]

It prints, per (actor, message kind), how many were received, their time
in the mailbox (p50 / p90 / max, ms) and their handlers' time (p50 / p90 /
max / sum, ms), the largest waits first. Lines that are not JSON events
are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Per (actor, kind): received count, time in mailbox and handler time percentiles (ms)."""
    waits: dict[tuple[str, str], list[float]] = {}
    took: dict[tuple[str, str], list[float]] = {}
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        name = event.get("event")
        if name not in ("mailbox.received", "mailbox.handled"):
            continue
        key = (str(event.get("actor", "?")), str(event.get("kind", "?")))
        if name == "mailbox.received":
            waits.setdefault(key, []).append(float(event["time_in_mailbox"]) * 1e3)
        else:
            took.setdefault(key, []).append(float(event["duration"]) * 1e3)
    rows = []
    for key in set(waits) | set(took):
        w, t = waits.get(key, []), took.get(key, [])
        rows.append({
            "actor": key[0], "kind": key[1], "received": len(w),
            "wait_p50": _pct(w, 0.5) if w else 0.0, "wait_p90": _pct(w, 0.9) if w else 0.0,
            "wait_max": max(w) if w else 0.0, "wait_sum": sum(w),
            "handler_p50": _pct(t, 0.5) if t else 0.0, "handler_p90": _pct(t, 0.9) if t else 0.0,
            "handler_max": max(t) if t else 0.0, "handler_sum": sum(t),
        })
    rows.sort(key=lambda r: -r["wait_sum"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path, help="a server's stderr with JSON events (KVTIER_LOG_LEVEL=debug)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = summarize(args.log.read_text(errors="replace").splitlines())
    if not rows:
        print("no mailbox events (was the server run with KVTIER_LOG_LEVEL=debug and KVTIER_LOG_FORMAT=json?)")
        return 1
    print(f"{'actor':16s} {'kind':34s} {'n':>5s} | in mailbox ms p50 p90 max | handler ms p50 p90 max sum")
    for r in rows[: args.top]:
        print(f"{r['actor']:16s} {r['kind']:34s} {r['received']:5d} | {r['wait_p50']:7.2f} {r['wait_p90']:7.2f} "
              f"{r['wait_max']:7.2f} | {r['handler_p50']:6.2f} {r['handler_p90']:6.2f} {r['handler_max']:7.2f} "
              f"{r['handler_sum']:8.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
