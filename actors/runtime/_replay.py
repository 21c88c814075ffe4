"""Recording a simulated run as a JSONL trace, and replaying one to compare.

A trace is: a header line naming how to rebuild the system
(``{"kvtier_trace": 1, "scenario": "module:function", "seed": N, "tick": T,
"params": {...}}``), one line per delivery, and an ``{"end": ...}`` line.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ._errors import ReplayDiverged
from ._sim import Scenario, SimulatedSystem

__all__ = ["TRACE_VERSION", "ReplayReport", "load_scenario", "record_trace", "replay_trace"]

TRACE_VERSION = 1


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """The outcome of a replay: ``ok``, or the first differing line (1-based).

    ``note``: what an ``ok`` replay could not cover (a truncated live trace,
    one without its end line).
    """

    ok: bool
    lines: int
    line: int | None = None
    expected: str | None = None
    actual: str | None = None
    note: str | None = None


def load_scenario(reference: str) -> Scenario:
    """Import ``"package.module:function"`` and return the scenario function."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"scenario must be 'module:function', got {reference!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"scenario {reference!r} is not callable")
    return cast("Scenario", target)


def _header(scenario: str, seed: int, tick: float, params: Mapping[str, Any]) -> str:
    return json.dumps(
        {
            "kvtier_trace": TRACE_VERSION,
            "scenario": scenario,
            "seed": seed,
            "tick": tick,
            "params": dict(params),
        },
        separators=(",", ":"),
    )


async def _run(
    scenario: str,
    seed: int,
    tick: float,
    params: Mapping[str, Any],
    expected: list[str] | None,
) -> list[str]:
    function = load_scenario(scenario)
    system = SimulatedSystem(seed=seed, tick=tick, expected=expected)
    try:
        async with system:
            await system.run(function, params)
    except ReplayDiverged:
        raise
    except Exception as exc:
        if expected is None:
            raise
        # NOTE: a replay whose run fails (the scenario's own checks, a stall)
        # diverged where it stopped producing deliveries.
        done = len(system.lines)
        want = expected[done] if done < len(expected) else "(end of trace)"
        raise ReplayDiverged(
            done + 2, want, f"(the run failed: {type(exc).__name__}: {exc})"
        ) from exc
    return [*system.lines, system.end_line()]


async def record_trace(
    scenario: str,
    *,
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
    tick: float = 0.001,
) -> list[str]:
    """Run scenario ``"module:function"`` in a ``SimulatedSystem``; header line first.

    ``params`` (JSON values) are passed to the scenario as keyword arguments
    and stored in the header. Write the result with ``"\\n"`` after each line.
    """
    params = dict(params or {})
    body = await _run(scenario, seed, tick, params, None)
    return [_header(scenario, seed, tick, params), *body]


async def replay_trace(lines: Sequence[str]) -> ReplayReport:
    """Rebuild the system from the header, force the recorded order, compare lines."""
    lines = [line for line in lines if line.strip()]
    if not lines:
        return ReplayReport(False, 0, 1, "(a trace header)", "(empty file)")
    try:
        header = json.loads(lines[0])
        if not isinstance(header, dict) or header.get("kvtier_trace") != TRACE_VERSION:
            raise ValueError("not a kvtier trace header")
        scenario = str(header["scenario"])
        seed = int(header["seed"])
        tick = float(header.get("tick", 0.001))
        params = dict(header.get("params") or {})
    except (ValueError, KeyError, TypeError) as exc:
        return ReplayReport(False, len(lines), 1, "(a kvtier trace header)", f"{lines[0]} ({exc})")
    recorded = list(lines[1:])
    deliveries = recorded[:-1] if recorded and recorded[-1].startswith('{"end"') else recorded
    try:
        produced = await _run(scenario, seed, tick, params, deliveries)
    except ReplayDiverged as exc:
        return ReplayReport(False, len(lines), exc.line, exc.expected, exc.actual)
    for index, (want, got) in enumerate(zip(recorded, produced, strict=False)):
        if want != got:
            return ReplayReport(False, len(lines), index + 2, want, got)
    if len(recorded) != len(produced):
        index = min(len(recorded), len(produced))
        want = recorded[index] if index < len(recorded) else "(end of trace)"
        got = produced[index] if index < len(produced) else "(end of replay)"
        return ReplayReport(False, len(lines), index + 2, want, got)
    return ReplayReport(True, len(lines))
