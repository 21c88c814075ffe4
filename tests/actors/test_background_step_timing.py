"""Background steps time themselves: a slow one is logged with its callable's name when it settles."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from actors.engine_thread import BackgroundSteps
from actors.engine_thread.steps import SLOW_STEP_S


def _slow_read_back() -> str:
    time.sleep(SLOW_STEP_S * 2)
    return "bytes"


def _quick() -> int:
    return 7


def test_a_slow_step_is_logged_with_its_name_and_time_when_it_settles() -> None:
    """A step that runs past SLOW_STEP_S logs one engine.background_step_slow line naming its
    callable and time, and counts as slow; a quick one logs nothing; both handles get their values."""
    steps = BackgroundSteps()
    slow = steps.add("s1", _slow_read_back)
    quick = steps.add("s2", _quick)
    with capture_logs() as logs:
        for step_id in ("s1", "s2"):
            fn = steps.take(step_id)
            assert fn is not None
            steps.settle(step_id, fn(), None)
    lines = [e for e in logs if e["event"] == "engine.background_step_slow"]
    assert len(lines) == 1, logs
    assert lines[0]["step_id"] == "s1"
    assert lines[0]["fn"] == "_slow_read_back"
    assert lines[0]["ms"] >= SLOW_STEP_S * 2e3
    assert steps.slow == 1
    assert steps.longest_s >= SLOW_STEP_S * 2
    assert slow.result() == "bytes"
    assert quick.result() == 7


def test_a_step_that_raises_is_timed_and_its_error_reaches_the_handle() -> None:
    """The timing wrapper re-raises the step's error unchanged and still records the run."""
    steps = BackgroundSteps()

    def boom() -> None:
        time.sleep(SLOW_STEP_S * 1.5)
        raise OSError("read-back failed")

    handle = steps.add("b", boom)
    fn = steps.take("b")
    assert fn is not None
    with pytest.raises(OSError) as raised:
        fn()
    steps.settle("b", None, raised.value)
    assert steps.slow == 1
    with pytest.raises(OSError, match="read-back failed"):
        handle.result()
