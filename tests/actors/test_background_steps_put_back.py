"""``BackgroundSteps.put_back``: a step taken for a chain that closed before running it is registered again."""

from __future__ import annotations

from actors.engine_thread.steps import BackgroundSteps


def test_a_taken_one_shot_step_put_back_can_be_taken_and_settled_again() -> None:
    """put_back undoes take: the same callable is taken again, and its handle settles once run."""
    steps = BackgroundSteps()
    handle = steps.add("spill", lambda: 7)
    first = steps.take("spill")
    assert first is not None
    assert steps.take("spill") is None  # NOTE: running: not taken twice.
    steps.put_back("spill")
    again = steps.take("spill")
    assert again is not None
    steps.settle("spill", again(), None)
    assert handle.result() == 7
    assert steps.take("spill") is None
    assert len(steps) == 0


def test_a_standing_step_put_back_stays_registered_once() -> None:
    """A standing step stays registered through take and put_back (no second entry)."""
    steps = BackgroundSteps()
    steps.add("drain", lambda: None, standing=True)
    assert steps.take("drain") is not None
    steps.put_back("drain")
    assert len(steps) == 1
    assert steps.take("drain") is not None


def test_put_back_of_a_step_not_taken_changes_nothing() -> None:
    """An unknown or never-taken step id is ignored."""
    steps = BackgroundSteps()
    steps.add("x", lambda: None)
    steps.put_back("x")
    steps.put_back("nope")
    assert len(steps) == 1
