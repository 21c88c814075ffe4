"""The cold tier in the simulated runtime: a spill -> store -> restart -> restore trace replays."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.runtime import record_trace, replay_trace

pytestmark = pytest.mark.anyio

SCENARIO = "tests.actors.ssd_writer.scenarios:spill_store_restart_restore"


async def test_a_recorded_cold_tier_run_replays_exactly(tmp_path: Path) -> None:
    """Recording the scenario and replaying it under the forced order gives the same trace."""
    params = {"root": str(tmp_path / "kv")}
    lines = await record_trace(SCENARIO, seed=7, params=params)
    text = "\n".join(lines)
    for kind in (
        "spill_queue.enqueue",
        "ssd_writer.store",
        "ssd_writer.reserve",
        "ssd_writer.entry_written",
        "ssd_writer.store_result",
        "ssd_writer.find_result",
        "ssd_writer.read_entry",
        "ssd_writer.restore_result",
    ):
        assert f'"{kind}"' in text, kind
    report = await replay_trace(lines)
    assert report.ok, report
