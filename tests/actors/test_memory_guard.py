"""The memory-pressure guard: the pure decision, the footprint arithmetic, the in-turn check.

The end-to-end behaviour (a low budget refuses a large request with 503, the
next small one runs, LRU entries are persisted and dropped first) is in
``test_memory_guard_engine.py``.
"""

from __future__ import annotations

import pytest

from actors.engine_thread.memory_guard import (
    KV_STEP,
    Fits,
    Footprint,
    MemoryGauge,
    MemoryGuard,
    Refuse,
    Relieve,
    decide,
)
from actors.errors import MemoryPressure
from messages.gateway import Generate, GenerationParams

PER_TOKEN = 100


def _kv(tokens: int) -> int:
    return tokens * PER_TOKEN


def _footprint(**shape: int) -> Footprint:
    return Footprint(kv_bytes_at=_kv, chunk=shape.pop("chunk", 512), **shape)


def test_decide_fits_when_active_plus_demand_is_within_the_budget() -> None:
    """At or under the budget the request fits, whatever could be reclaimed."""
    assert decide(active=60, demand=40, budget=100, reclaimable=0) == Fits(headroom=0)
    assert decide(active=10, demand=40, budget=100, reclaimable=50) == Fits(headroom=50)


def test_decide_relieves_first_and_refuses_only_when_nothing_can_be_reclaimed() -> None:
    """Over the budget: reclaim while RAM entries could give bytes back, else refuse with the figures."""
    assert decide(active=90, demand=40, budget=100, reclaimable=1) == Relieve(need=30)
    refused = decide(active=90, demand=40, budget=100, reclaimable=0)
    assert refused == Refuse(need=30, active=90, demand=40, budget=100)
    assert isinstance(refused, Refuse)
    assert "memory budget" in refused.message()


def test_decide_rejects_negative_figures() -> None:
    """A negative reading is a bug upstream, not a verdict."""
    with pytest.raises(ValueError, match=">= 0"):
        decide(active=-1, demand=0, budget=1, reclaimable=0)


def test_footprint_counts_kv_in_buffer_steps_the_copy_overlap_and_one_chunk() -> None:
    """Before prefill: the final KV (rounded up to the 256-token buffer step), the prompt's KV
    again for the copy a growing buffer makes, and one chunk's activations."""
    f = _footprint(hidden=10, intermediate=20, heads=2, dtype_bytes=2, chunk=64)
    per_token = (8 * 10 + 3 * 20) * 2 + 2 * 300 * 4
    expected = _kv(2 * KV_STEP) + _kv(2 * KV_STEP) + 64 * per_token
    assert f.at_prefill(300, 100) == expected
    assert f.workspace(10, 10) == 10 * ((8 * 10 + 3 * 20) * 2 + 2 * 10 * 4)


def test_footprint_in_decode_is_the_kv_still_to_come_plus_one_copy() -> None:
    """During decode: what the KV will still grow by, plus a copy of the buffer it holds."""
    f = _footprint()
    assert f.in_decode(300, 700) == (_kv(768) - _kv(512)) + _kv(512)
    assert f.in_decode(700, 700) == _kv(768)


def _request(prompt: int, max_tokens: int) -> Generate:
    return Generate(request_id="r", prompt_tokens=tuple(range(1, prompt + 1)),
                    params=GenerationParams(max_tokens=max_tokens), stream_to="s")


def test_the_in_turn_guard_reads_memory_and_raises_memory_pressure_when_over() -> None:
    """Inside a turn nothing can be reclaimed: over the budget raises MemoryPressure (counted),
    within it passes; every check takes a fresh reading."""
    reading = [0]
    gauge = MemoryGauge(lambda: reading[0])
    f = _footprint()
    demand = f.at_prefill(10, 10)
    guard = MemoryGuard(budget=demand + 1000, footprint=f, gauge=gauge)
    guard.before_prefill(_request(10, 10), cached_tokens=0)
    reading[0] = 1001
    with pytest.raises(MemoryPressure, match="not enough memory"):
        guard.before_prefill(_request(10, 10), cached_tokens=5)
    reading[0] = 0
    guard.during_decode(_request(10, 10), tokens_now=15)
    assert (guard.checks, guard.refused, gauge.samples) == (3, 1, 3)
    assert gauge.active_bytes == 0
