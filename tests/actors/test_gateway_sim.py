"""The gateway's turn protocol in the simulated runtime: invariants over seeds, record and replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actors.runtime import record_trace, replay_trace

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "data" / "gateway_trace.jsonl"
SCENARIO = "tests.actors.gateway_scenarios:token_protocol"


@pytest.mark.parametrize("seed", range(12))
async def test_token_invariants_hold_for_every_interleaving(seed: int) -> None:
    """For 12 seeded interleavings the scenario's checks pass: one turn at a time, background only when no request is active, a request arriving mid-background-step runs next, every stream ends with one DoneEvent."""
    lines = await record_trace(SCENARIO, seed=seed)
    kinds = [json.loads(line)["body"]["kind"] for line in lines[1:-1]]
    assert "gateway.run_turn" in kinds
    assert "gateway.turn_done" in kinds


async def test_interleavings_differ_across_seeds() -> None:
    """Different seeds admit, cancel and grant in different orders (the scenario really races)."""
    orders = set()
    for seed in range(4):
        lines = await record_trace(SCENARIO, seed=seed)
        turns = tuple(
            json.loads(line)["body"].get("ident")
            for line in lines[1:-1]
            if '"kind":"gateway.run_turn"' in line
        )
        orders.add(turns)
    assert len(orders) > 1


async def test_turns_and_stream_events_carry_their_requests_correlation_id() -> None:
    """Whatever message the gateway handled when it granted a turn, the turn and its stream events keep the request's correlation id."""
    checked = 0
    for seed in range(6):
        lines = await record_trace(SCENARIO, seed=seed)
        records = [json.loads(line) for line in lines[1:-1]]
        origin = {
            r["body"]["request_id"]: r["correlation_id"]
            for r in records
            if r["body"]["kind"] == "gateway.generate"
        }
        assert len(set(origin.values())) == len(origin)
        for r in records:
            body = r["body"]
            if body["kind"] == "gateway.run_turn" and body["owner"] == "request":
                rid = body["ident"]
            elif body["kind"] in ("gateway.token", "gateway.done", "gateway.end_request"):
                rid = body["request_id"]
            else:
                continue
            assert r["correlation_id"] == origin[rid], (seed, r)
            checked += 1
    assert checked > 100


async def test_committed_gateway_trace_replays_and_matches_a_fresh_recording() -> None:
    """The committed trace replays exactly and equals what the current code records for its seed."""
    lines = TRACE.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    assert header["scenario"] == SCENARIO
    report = await replay_trace(lines)
    assert report.ok, report
    fresh = await record_trace(SCENARIO, seed=header["seed"], params=header["params"])
    assert fresh == lines
    bodies = [json.loads(line)["body"] for line in lines[1:-1]]
    assert any(b["kind"] == "gateway.done" and b["finish_reason"] == "cancelled" for b in bodies)
    assert any(b["kind"] == "gateway.admission" and not b["accepted"] for b in bodies)


def test_kvtier_replay_accepts_the_gateway_trace() -> None:
    """``kvtier replay tests/data/gateway_trace.jsonl`` exits 0."""
    result = subprocess.run(
        [sys.executable, "-m", "actors.cli", "replay", str(TRACE)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
