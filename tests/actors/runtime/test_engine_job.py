"""The engine job record both lanes share (``actors.runtime.EngineJob``): its step rules and wakes."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine_thread import AHEAD, EngineJob


def test_may_go_on_stops_at_budget_stop_and_ahead() -> None:
    """Another step may run only within the budget, without ``stop``, and fewer than AHEAD steps ahead."""
    loop = asyncio.new_event_loop()
    try:
        job: EngineJob[int] = EngineJob(1, loop, lambda: True, budget=AHEAD + 2)
        for i in range(AHEAD - 1):
            job.hand_over(i)
            assert job.may_go_on()
        job.hand_over(AHEAD)
        assert not job.may_go_on()  # NOTE: AHEAD outputs not taken yet.
        job.consumed = 2
        assert job.may_go_on()
        job.stop = True
        assert not job.may_go_on()
        job.stop = False
        job.hand_over(0)
        job.hand_over(0)
        assert job.steps == job.budget
        assert not job.may_go_on()
        assert list(job.results) == [0, 1, 2, AHEAD, 0, 0]
    finally:
        loop.close()


@pytest.mark.anyio
async def test_one_wake_at_most_is_pending_and_settling_records_the_value() -> None:
    """Outputs handed over before the owner drains post one wake; the job's end records its value and wakes again."""
    posted: list[int] = []

    def post() -> bool:
        posted.append(1)
        return True

    loop = asyncio.get_running_loop()
    job: EngineJob[str] = EngineJob(7, loop, post, budget=3)
    job.hand_over("a")
    job.hand_over("b")
    await asyncio.sleep(0)
    assert len(posted) == 1
    assert job.wake_pending
    job.wake_pending = False  # NOTE: the owner clears the flag before draining.
    future: asyncio.Future[str] = loop.create_future()
    future.set_result("kept")
    job.settled(future)
    assert (job.ended, job.error, job.value, len(posted)) == (True, None, "kept", 2)


@pytest.mark.anyio
async def test_a_failed_job_records_its_error() -> None:
    """A job whose future raised ends with that error and no value."""
    loop = asyncio.get_running_loop()
    job: EngineJob[str] = EngineJob(2, loop, lambda: True)
    future: asyncio.Future[str] = loop.create_future()
    future.set_exception(RuntimeError("boom"))
    job.settled(future)
    assert job.ended
    assert isinstance(job.error, RuntimeError)
    assert job.value is None
