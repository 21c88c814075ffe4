"""tools/bench/served_steps.py: a round's engine figures are read once its last chain has ended."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tools._bench_modules import load_bench

served_steps = load_bench("served_steps")

pytestmark = pytest.mark.anyio


def _stats(steps: int, busy_s: float) -> dict[str, Any]:
    """The parts of an engine ``/stats`` body the tool reads."""
    return {
        "batch": {"batch": {"steps": {"run": steps}}},
        "gateway": {"token": {"batch_chains": {"granted": 1}}},
        "engine_thread": {"busy_s": busy_s},
    }


async def test_settled_waits_until_two_readings_agree() -> None:
    """A reading taken while the round's chain still counts steps is passed by; the first one repeated is returned."""
    readings = iter([_stats(10, 0.1), _stats(14, 0.2), _stats(16, 0.25), _stats(16, 0.25), _stats(99, 9.0)])
    calls = 0

    async def read() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return next(readings)

    settled = await served_steps._settled(read)
    assert served_steps._batch_counts(settled) == (16, 1)
    assert settled["engine_thread"]["busy_s"] == 0.25
    assert calls == 4
