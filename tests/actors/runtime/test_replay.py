"""The simulated runtime: seeded determinism, recording, replay and ``kvtier replay``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actors.runtime import SimulatedSystem, SimulationStalled, record_trace, replay_trace

from . import scenarios

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[3]
TRACE = REPO / "tests" / "data" / "runtime_demo_trace.jsonl"
DEMO = "tests.actors.runtime.demo:conversation"


async def test_same_seed_gives_byte_identical_traces() -> None:
    """Recording one scenario twice with one seed yields identical bytes."""
    first = await record_trace("tests.actors.runtime.scenarios:fan_in", seed=11)
    second = await record_trace("tests.actors.runtime.scenarios:fan_in", seed=11)
    assert "\n".join(first).encode() == "\n".join(second).encode()
    assert len(first) > 10


async def test_seeds_choose_different_interleavings() -> None:
    """Different seeds deliver the racing messages in different orders."""
    orders = set()
    for seed in range(6):
        lines = await record_trace("tests.actors.runtime.scenarios:fan_in", seed=seed)
        orders.add(tuple(json.loads(line)["msg_id"] for line in lines[1:-1]))
    assert len(orders) > 1


async def test_replay_reproduces_a_recording() -> None:
    """A fresh recording replays exactly under the forced order."""
    lines = await record_trace("tests.actors.runtime.scenarios:ask_chain", seed=3)
    report = await replay_trace(lines)
    assert report.ok, report


async def test_replay_reports_the_first_divergence() -> None:
    """A tampered delivery line is reported with its line number, expected and actual."""
    lines = await record_trace(DEMO, seed=1)
    target = next(i for i, line in enumerate(lines) if '"kind":"demo.total"' in line)
    tampered = list(lines)
    tampered[target] = tampered[target].replace('"count":', '"count":1')
    report = await replay_trace(tampered)
    assert not report.ok
    assert report.line == target + 1
    assert report.expected == tampered[target]
    assert report.actual == lines[target]


async def test_replay_detects_a_missing_delivery() -> None:
    """Dropping a recorded delivery is a divergence, not a silent pass."""
    lines = await record_trace(DEMO, seed=1)
    report = await replay_trace(lines[:5] + lines[6:])
    assert not report.ok
    assert report.line == 6


async def test_a_stalled_scenario_is_reported() -> None:
    """A scenario blocked with nothing deliverable raises ``SimulationStalled`` instead of hanging."""
    with pytest.raises(SimulationStalled):
        async with SimulatedSystem(seed=0) as system:
            await system.run(scenarios.stuck)


async def test_committed_trace_matches_a_fresh_recording() -> None:
    """The committed demo trace is what the current code records for its header's seed."""
    lines = TRACE.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    assert header["scenario"] == DEMO
    fresh = await record_trace(DEMO, seed=header["seed"], params=header["params"])
    assert fresh == lines
    assert {json.loads(line).get("receiver") for line in lines[1:-1]} >= {
        "counter",
        "worker-a",
        "worker-b",
        "coordinator",
    }


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_kvtier_replay_accepts_the_committed_trace() -> None:
    """``kvtier replay`` exits 0 on the committed multi-actor trace."""
    result = _kvtier("replay", str(TRACE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replay ok" in result.stdout


def test_kvtier_replay_rejects_a_tampered_trace(tmp_path: Path) -> None:
    """``kvtier replay`` exits non-zero and prints the first differing line."""
    lines = TRACE.read_text(encoding="utf-8").splitlines()
    bad_line = next(i for i, line in enumerate(lines) if '"kind":"demo.add"' in line)
    lines[bad_line] = lines[bad_line].replace('"amount":', '"amount":9')
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    result = _kvtier("replay", str(bad))
    assert result.returncode == 1
    assert f"diverged at line {bad_line + 1}" in result.stdout
    assert lines[bad_line] in result.stdout


async def test_a_replay_whose_run_fails_is_a_divergence() -> None:
    """A trace whose scenario now stalls is reported as diverging where deliveries stopped."""
    header = json.dumps(
        {"kvtier_trace": 1, "scenario": "tests.actors.runtime.scenarios:stuck", "seed": 0,
         "tick": 0.001, "params": {}}
    )
    report = await replay_trace([header, '{"end":true,"steps":0,"dead_letters":0}'])
    assert not report.ok
    assert report.line == 2
    assert report.actual is not None
    assert "SimulationStalled" in report.actual
