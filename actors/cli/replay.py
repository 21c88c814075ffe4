"""``kvtier replay TRACE.jsonl``: replay a recorded trace and compare it.

Two kinds of trace: a simulated scenario's (``--record module:function``),
rebuilt and rerun in a ``SimulatedSystem``; and a live trace written by
``kvtier serve --record-trace FILE`` (its header says ``"live": true``),
whose every recorded core call is fed through the same core and whose
effects must match. Exit status 0 when the replay reproduces every line
(a truncated live trace, or one without its end line, says so), 1 (printing
the first differing line) otherwise, 2 when the trace cannot be read.
``kvtier replay --record module:function --seed N -o TRACE.jsonl`` records one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import anyio

from actors.runtime import is_live_trace, record_trace, replay_core_trace, replay_trace

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvtier replay``."""
    parser.add_argument(
        "trace", type=Path, nargs="?",
        help="the JSONL trace to replay: a simulated run's (--record) or a live one "
             "(kvtier serve --record-trace)")
    parser.add_argument(
        "--record",
        metavar="MODULE:FUNCTION",
        help="record this scenario instead of replaying (writes to -o or stdout)",
    )
    parser.add_argument("--seed", type=int, default=0, help="scheduling seed when recording")
    parser.add_argument(
        "--params", default="{}", help="JSON object of scenario keyword arguments when recording"
    )
    parser.add_argument("-o", "--output", type=Path, help="where --record writes the trace")
    parser.add_argument(
        "--path",
        action="append",
        default=[],
        help="extra import path for scenario modules (the current directory is always added)",
    )


def run(args: argparse.Namespace) -> int:
    """Replay (or record) and report; returns the exit status."""
    # NOTE: like `python -m`, resolve scenario modules from the current
    # directory, so scenarios living under tests/ load from the repo root.
    for entry in [*args.path, os.getcwd()]:
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if args.record:
        params = json.loads(args.params)
        if not isinstance(params, dict):
            print("kvtier replay: --params must be a JSON object", file=sys.stderr)
            return 2
        lines = anyio.run(_record, args.record, args.seed, params)
        text = "".join(line + "\n" for line in lines)
        if args.output is None:
            sys.stdout.write(text)
        else:
            args.output.write_text(text, encoding="utf-8")
            print(f"recorded {len(lines)} lines to {args.output}")
        return 0
    if args.trace is None:
        print("kvtier replay: give a TRACE.jsonl (or --record)", file=sys.stderr)
        return 2
    try:
        lines = args.trace.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        print(f"kvtier replay: cannot read {args.trace}: {exc}", file=sys.stderr)
        return 2
    if lines and is_live_trace(lines[0]):
        report = replay_core_trace(lines)
    else:
        report = anyio.run(replay_trace, lines)
    if report.ok:
        print(f"replay ok: {report.lines} lines reproduced ({args.trace})")
        if report.note:
            print(f"note: {report.note}")
        return 0
    print(f"replay diverged at line {report.line} of {args.trace}")
    print(f"- expected: {report.expected}")
    print(f"+ actual:   {report.actual}")
    return 1


async def _record(scenario: str, seed: int, params: dict[str, object]) -> list[str]:
    return await record_trace(scenario, seed=seed, params=params)
