"""Both lanes' running requests count in every check before a prefill (the guard's growth ledger)."""

from __future__ import annotations

from typing import Any

import pytest

from actors.engine_thread import StepResult
from actors.engine_thread.memory_guard import Footprint, MemoryGauge, MemoryGuard
from actors.errors import MemoryShortAtStart
from actors.gateway.engine_work import EngineWork, Opening
from messages.gateway import Generate, GenerationParams

KV_PER_TOKEN = 1000


def _request(rid: str, max_tokens: int) -> Generate:
    return Generate(request_id=rid, prompt_tokens=tuple(range(10)),
                    params=GenerationParams(max_tokens=max_tokens), stream_to=f"inbox.{rid}")


def _guard(budget: int) -> MemoryGuard:
    return MemoryGuard(budget=budget,
                       footprint=Footprint(kv_bytes_at=lambda n: n * KV_PER_TOKEN, chunk=64),
                       gauge=MemoryGauge(lambda: 0))


class _Backend:
    """Opens instantly; every step is a finished prefill."""

    def open(self, request: Generate, handle: str | None, cached_tokens: int, *,
             staging_id: str | None = None) -> Any:
        """A generation stand-in."""
        return _Opened(cached_tokens)

    def step(self, gen: Any) -> StepResult:
        """One prefill step."""
        return StepResult(phase="prefill", prefill_complete=True)

    def end_turn(self) -> None:
        """Nothing to end."""

    def discard(self, gen: Any) -> None:
        """Nothing to free."""


class _Opened:
    def __init__(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens


def test_a_check_before_a_prefill_counts_every_lanes_growth() -> None:
    """A request whose own demand fits (512k of 1,000k) is refused beside 600k of another lane's
    growth still to come, and passes once that growth is gone."""
    guard = _guard(1000 * KV_PER_TOKEN)
    guard.ahead.publish("batch", 600 * KV_PER_TOKEN)
    with pytest.raises(MemoryShortAtStart):
        guard.before_prefill(_request("r", 10), cached_tokens=0)
    guard.ahead.publish("batch", 0)
    assert guard.before_prefill(_request("r", 10), cached_tokens=0) == 512 * KV_PER_TOKEN


def test_the_serial_lane_reports_its_open_requests_growth() -> None:
    """Once the serial lane opened a request of 600 tokens to come, it publishes that request's KV
    still to come (768k - 256k); a check that fits alone (768k of 1,100k) is refused beside it;
    dropped, the request's growth is gone."""
    guard = _guard(1100 * KV_PER_TOKEN)
    work = EngineWork(_Backend(), keep_entries=False, guard=guard)  # type: ignore[arg-type]
    assert guard.ahead.total() == 0
    work.step("a", Opening(_request("a", 600), cached_tokens=0))
    assert guard.ahead.snapshot() == {"serial": 512 * KV_PER_TOKEN}
    assert guard.footprint.at_prefill(10, 300) <= guard.budget
    with pytest.raises(MemoryShortAtStart):
        guard.before_prefill(_request("b", 300), cached_tokens=0)
    work.drop("a", keep=False)
    assert guard.ahead.snapshot() == {"serial": 0}
