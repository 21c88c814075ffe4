"""Background steps lent to a running step chain (``Chain.lend``): run between two steps, or handed back once it closed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from actors.batch_scheduler.chain import Chain, run_chain
from actors.batch_scheduler.core import JoinRow, StepOut, TokenOut


def _run(
    budget: int, during: Callable[[Chain, int, list[str]], None], *, raise_at: int = 0
) -> tuple[Chain, list[str]]:
    """Run a chain of ``budget`` steps; ``during(chain, n, events)`` runs inside step ``n``.

    ``events`` records each step (``step N``) and each lent step's run, in order.
    """
    loop = asyncio.new_event_loop()
    events: list[str] = []
    try:
        chain = Chain(1, loop, lambda: True, budget=budget)

        def step(joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
            n = sum(e.startswith("step") for e in events) + 1
            events.append(f"step {n}")
            chain.consumed = chain.steps + 1  # NOTE: never AHEAD of the loop here.
            during(chain, n, events)
            if n == raise_at:
                raise RuntimeError("the step failed")
            return StepOut(tokens=(TokenOut("a", 0, 7, "x"),), decode_rows=1)

        try:
            run_chain(chain, step, lambda: False, (), ())
        except RuntimeError:
            pass
    finally:
        loop.close()
    return chain, events


def test_a_step_lent_during_a_step_runs_before_the_next_and_the_chain_goes_on() -> None:
    """Lent while step 2 runs, the step runs right after step 2; its outcome and time are read by the loop; the chain runs to its budget."""

    def during(chain: Chain, n: int, events: list[str]) -> None:
        def spill() -> int:
            events.append("spill")
            return 42

        if n == 2:
            assert chain.lend("spill", spill)

    chain, events = _run(4, during)
    assert events == ["step 1", "step 2", "spill", "step 3", "step 4"]
    (run,) = chain.lent_runs()
    assert (run.step_id, run.value, run.error) == ("spill", 42, None)
    assert run.held_s >= 0.0
    assert chain.lent_runs() == []
    assert chain.returned_lent == ()


def test_a_lent_step_that_raises_hands_its_error_back_and_the_chain_goes_on() -> None:
    """A lent step's exception is its outcome (for its asker), not the chain's."""

    def boom() -> None:
        raise ValueError("no such handle")

    def during(chain: Chain, n: int, events: list[str]) -> None:
        if n == 1:
            chain.lend("bad", boom)

    chain, events = _run(3, during)
    assert events == ["step 1", "step 2", "step 3"]
    (run,) = chain.lent_runs()
    assert isinstance(run.error, ValueError)


@pytest.mark.parametrize("why", ["budget", "failed step"])
def test_steps_lent_to_a_chain_that_ends_are_handed_back_and_later_ones_refused(why: str) -> None:
    """A step lent when no step follows is still run if the last step succeeded; one lent to a chain whose step raised is handed back; after the close, lending is refused."""

    def during(chain: Chain, n: int, events: list[str]) -> None:
        if n == 2:
            chain.lend("late", lambda: events.append("late"))

    chain, events = _run(2, during, raise_at=2 if why == "failed step" else 0)
    if why == "budget":
        # NOTE: lent steps run after every step's output, the last one's too.
        assert events == ["step 1", "step 2", "late"]
        assert chain.returned_lent == ()
    else:
        assert events == ["step 1", "step 2"]
        assert chain.returned_lent == ("late",)
    assert not chain.lend("later", lambda: None)
