"""Where the event loop's time goes in a served process: its busy iterations, callback by callback.

A diagnosis for the ``admit`` phase that grows with the streams (a new
request's Generate waits for the gateway while the gateway is idle:
docs/benchmarks.md, 2026-12-06 19:28). Two parts:

``site DIR`` writes ``DIR/sitecustomize.py``: put DIR first on a server's
``PYTHONPATH`` (``serving.py --kvtier-env PYTHONPATH=DIR``) and every loop
iteration whose callbacks ran more than ``LOOP_TRACE_MS`` (default 4) ms
in all is written to ``$LOOP_TRACE_DIR/iters-PID.jsonl`` (default DIR):
its start, its length (select's wait included), the callbacks' work and
the longest callbacks by name (a task by its coroutine, an anyio task by
its name, e.g. ``actor:gateway``). Once a second it also writes the
running totals of every iteration: their time, the callbacks' time, and
the selects asked with timeout 0 (callbacks were ready): such a select
returns at once unless the loop's thread waits to get the GIL back from
another thread (or for a core), so their time is that wait.
``LOOP_TRACE_SWITCH_S`` sets ``sys.setswitchinterval`` in the process. ``--chain FILE`` runs another
sitecustomize first (``served_steps.py --stand-in``'s).

``summary FILE ...`` prints the iterations' work (p50 / p90 / max, the
share of the traced time) and the callbacks that took the most of it::

    python3 tools/bench/loop_trace.py site /tmp/lt
    python3 tools/bench/serving.py --servers kvtier --concurrency 32 ... \\
        --kvtier-env PYTHONPATH=/tmp/lt
    python3 tools/bench/loop_trace.py summary /tmp/lt/iters-*.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SITE = '''# Written by tools/bench/loop_trace.py: traces the event loop's busy iterations.
import os as _os, sys as _sys
_chain = {chain!r}
if _chain:
    exec(compile(open(_chain).read(), _chain, "exec"))
import asyncio.base_events as _be, asyncio.events as _ev, json as _json, time as _time

_lt_dir = _os.environ.get("LOOP_TRACE_DIR") or {site!r}
_lt_min = float(_os.environ.get("LOOP_TRACE_MS") or 4.0) / 1000
if _os.environ.get("LOOP_TRACE_SWITCH_S"):
    _sys.setswitchinterval(float(_os.environ["LOOP_TRACE_SWITCH_S"]))
_lt_out = None
_lt_cur = []
_lt_run = _ev.Handle._run
# NOTE: every iteration counts here, not only the busy ones: a select with
# timeout 0 (callbacks were ready) returns at once unless the thread waits
# to get the GIL back (or for a core), so its time is that wait.
_lt_tot = {{"iterations": 0, "iter_s": 0.0, "work_s": 0.0, "ready_selects": 0, "ready_select_s": 0.0,
           "ready_select_max_s": 0.0, "ready_selects_over_1ms": 0, "ready_selects_over_5ms": 0,
           "switch_interval_s": _sys.getswitchinterval()}}
_lt_flushed = [0.0]


def _lt_out_file():
    global _lt_out
    if _lt_out is None:
        _lt_out = open(_os.path.join(_lt_dir, "iters-%d.jsonl" % _os.getpid()), "a", buffering=1)
    return _lt_out


def _lt_wrap_select(selector):
    inner = selector.select

    def select(timeout=None):
        t = _time.monotonic()
        try:
            return inner(timeout)
        finally:
            if timeout is not None and timeout <= 0:
                d = _time.monotonic() - t
                _lt_tot["ready_selects"] += 1
                _lt_tot["ready_select_s"] += d
                _lt_tot["ready_select_max_s"] = max(_lt_tot["ready_select_max_s"], d)
                _lt_tot["ready_selects_over_1ms"] += d > 0.001
                _lt_tot["ready_selects_over_5ms"] += d > 0.005

    selector.select = select
    selector._lt_wrapped = True


def _lt_name(cb):
    owner = getattr(cb, "__self__", None)
    get_coro = getattr(owner, "get_coro", None)
    if get_coro is None:
        return getattr(cb, "__qualname__", None) or type(cb).__name__
    coro = get_coro()
    name = getattr(coro, "__qualname__", None) or type(coro).__name__
    if name.endswith("_run_coro"):
        # NOTE: anyio's own task wrapper: its TaskHandle knows the task's name.
        frame = getattr(coro, "cr_frame", None)
        handle = frame.f_locals.get("self") if frame is not None else None
        name = "anyio:" + str(getattr(handle, "_name", "?"))[:80]
    return name


def _lt_handle_run(self):
    t = _time.monotonic()
    try:
        return _lt_run(self)
    finally:
        _lt_cur.append((_time.monotonic() - t, self._callback))


_lt_once = _be.BaseEventLoop._run_once


def _lt_run_once(self):
    if not getattr(self._selector, "_lt_wrapped", False):
        _lt_wrap_select(self._selector)
    _lt_cur.clear()
    t = _time.monotonic()
    _lt_once(self)
    end = _time.monotonic()
    work = sum(d for d, _ in _lt_cur)
    _lt_tot["iterations"] += 1
    _lt_tot["iter_s"] += end - t
    _lt_tot["work_s"] += work
    if end - _lt_flushed[0] > 1.0:
        # NOTE: the running totals, once a second; the last line of a file is its process's total.
        _lt_flushed[0] = end
        _lt_out_file().write(_json.dumps({{"totals": {{k: round(v, 6) for k, v in _lt_tot.items()}}}}) + "\\n")
    if work < _lt_min:
        return
    top = sorted(_lt_cur, key=lambda x: -x[0])[:8]
    _lt_out_file().write(_json.dumps({{"t": round(t, 6), "iter_ms": round((_time.monotonic() - t) * 1e3, 3),
                              "work_ms": round(work * 1e3, 3), "callbacks": len(_lt_cur),
                              "top": [[round(d * 1e3, 3), _lt_name(cb)] for d, cb in top]}}) + "\\n")


_ev.Handle._run = _lt_handle_run
_be.BaseEventLoop._run_once = _lt_run_once
'''


def write_site(site: Path, chain: Path | None) -> Path:
    """Write the tracing ``sitecustomize.py`` into ``site``; returns its path."""
    site.mkdir(parents=True, exist_ok=True)
    path = site / "sitecustomize.py"
    path.write_text(SITE.format(chain=str(chain.resolve()) if chain else "", site=str(site.resolve())))
    return path


def read(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every traced iteration of ``paths`` (JSON lines; a torn last line and the totals lines are skipped)."""
    out: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "totals" not in row:
                out.append(row)
    return out


def read_totals(paths: Iterable[Path]) -> dict[str, float]:
    """Every iteration's totals (each file's last totals line, summed over the files; maxima kept as maxima)."""
    out: dict[str, float] = {}
    for path in paths:
        last: dict[str, float] | None = None
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "totals" in row:
                last = row["totals"]
        for key, value in (last or {}).items():
            keep = max if key.endswith("max_s") or key == "switch_interval_s" else (lambda a, b: a + b)
            out[key] = keep(out.get(key, 0.0), float(value))
    return out


def summary(iterations: list[dict[str, Any]], top: int = 12) -> dict[str, Any]:
    """The traced iterations' work and the callbacks that took most of it (by name, summed)."""
    if not iterations:
        return {"iterations": 0}
    work = sorted(float(i["work_ms"]) for i in iterations)
    span_ms = (max(i["t"] for i in iterations) - min(i["t"] for i in iterations)) * 1e3
    by_name: collections.Counter[str] = collections.Counter()
    longest: dict[str, float] = {}
    for it in iterations:
        for ms, name in it["top"]:
            by_name[name] += float(ms)
            longest[name] = max(longest.get(name, 0.0), float(ms))
    return {
        "iterations": len(work),
        "work_ms_p50": round(statistics.median(work), 2),
        "work_ms_p90": round(work[int(0.9 * (len(work) - 1))], 2),
        "work_ms_max": round(work[-1], 2),
        "work_ms_sum": round(sum(work), 1),
        "span_ms": round(span_ms, 1),
        "callbacks": [{"name": n, "ms": round(ms, 1), "longest_ms": round(longest[n], 1)}
                      for n, ms in by_name.most_common(top)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("site", help="write the tracing sitecustomize.py into DIR")
    s.add_argument("dir", type=Path)
    s.add_argument("--chain", type=Path, default=None, help="another sitecustomize.py to run first")
    m = sub.add_parser("summary", help="summarize iters-*.jsonl files")
    m.add_argument("files", type=Path, nargs="+")
    m.add_argument("--top", type=int, default=12)
    m.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.cmd == "site":
        print(write_site(args.dir, args.chain))
        return 0
    result = summary(read(args.files), args.top)
    totals = read_totals(args.files)
    if totals:
        result["totals"] = totals
        n = int(totals.get("ready_selects", 0))
        print(f"all {int(totals['iterations'])} iterations: {totals['iter_s']:.2f} s in all, callbacks "
              f"{totals['work_s']:.2f} s; {n} selects with callbacks ready took "
              f"{totals['ready_select_s'] * 1e3:.0f} ms in all (mean "
              f"{totals['ready_select_s'] / max(n, 1) * 1e3:.3f} ms, max {totals['ready_select_max_s'] * 1e3:.1f} ms,"
              f" {int(totals['ready_selects_over_1ms'])} over 1 ms, {int(totals['ready_selects_over_5ms'])} over 5 ms;"
              f" switch interval {totals['switch_interval_s'] * 1e3:g} ms)")
    if result["iterations"] == 0:
        print("no traced iteration")
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    print(f"{result['iterations']} iterations with work over the threshold in {result['span_ms']:.0f} ms: "
          f"work p50 {result['work_ms_p50']} p90 {result['work_ms_p90']} max {result['work_ms_max']} ms, "
          f"{result['work_ms_sum']:.0f} ms in all")
    for row in result["callbacks"]:
        print(f"  {row['ms']:9.1f} ms  longest {row['longest_ms']:7.1f}  {row['name']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
