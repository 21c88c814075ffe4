"""The Engine's shutdown budget (``actors/engine/_shutdown.py``): the drain and the final flush share it."""

from __future__ import annotations

import anyio
import pytest

from actors.engine._shutdown import Shutdown
from actors.runtime import AskTimeout
from messages.durability import FlushResult

pytestmark = pytest.mark.anyio

_DURABLE = FlushResult(durable=True, pending=0, dropped=0, failed=0, uncovered=0)


async def test_the_budget_counts_down_from_begin_and_a_second_begin_keeps_the_first() -> None:
    """``left`` is the whole timeout before ``begin``, then what remains of it since the FIRST ``begin``."""
    shutdown = Shutdown(timeout=5.0)
    assert shutdown.left() == 5.0
    shutdown.begin()
    shutdown.began = anyio.current_time() - 2.0  # NOTE: as if begun two seconds ago
    shutdown.begin()
    assert shutdown.left() == pytest.approx(3.0, abs=0.5)
    shutdown.began = anyio.current_time() - 9.0
    assert shutdown.left() == 0.0


async def test_the_flush_gets_what_is_left_and_its_result_is_kept() -> None:
    """The flush is bounded by the budget left, and ``flushed`` is what it returned."""
    shutdown = Shutdown(timeout=5.0)
    shutdown.begin()
    shutdown.began = anyio.current_time() - 4.0
    given: list[float] = []

    async def flush(left: float) -> FlushResult:
        given.append(left)
        return _DURABLE

    await shutdown.final_flush(flush)
    assert len(given) == 1
    assert 0.0 < given[0] <= 1.0
    assert (shutdown.flushed, shutdown.error) == (_DURABLE, None)


async def test_a_spent_budget_runs_no_flush_and_says_why() -> None:
    """With nothing left, no flush runs; ``error`` says the timeout was spent."""
    shutdown = Shutdown(timeout=1.0)
    shutdown.begin()
    shutdown.began = anyio.current_time() - 2.0
    called: list[float] = []

    async def flush(left: float) -> FlushResult:
        called.append(left)
        return _DURABLE

    await shutdown.final_flush(flush)
    assert called == []
    assert shutdown.flushed is None
    assert shutdown.error == "the shutdown timeout was spent before the flush could run"


async def test_a_flush_that_times_out_leaves_no_result_and_the_reason() -> None:
    """A flush ask that times out is no result; ``error`` names the failure."""
    shutdown = Shutdown(timeout=5.0)

    async def flush(left: float) -> FlushResult:
        raise AskTimeout("durability", "durability.flush_all", left)

    await shutdown.final_flush(flush)
    assert shutdown.flushed is None
    assert shutdown.error == "the flush did not finish within the shutdown timeout (AskTimeout)"
