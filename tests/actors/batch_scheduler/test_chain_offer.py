"""Rows offered to a running step chain (``Chain.offer``): taken by its next step, or handed back once it closed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from actors.batch_scheduler.chain import Chain, run_chain
from actors.batch_scheduler.core import JoinRow, StepOut, TokenOut
from messages.gateway import Generate, GenerationParams


def _row(rid: str) -> JoinRow:
    return JoinRow(
        Generate(
            request_id=rid,
            prompt_tokens=(1, 2, 3),
            params=GenerationParams(max_tokens=4),
            stream_to=f"inbox.{rid}",
        )
    )


def _run(
    budget: int, during: Callable[[Chain, int], None], idle_after: int = 99
) -> tuple[Chain, list[tuple[tuple[str, ...], tuple[str, ...]]]]:
    """Run a chain of ``budget`` steps; ``during(chain, n)`` runs inside step ``n`` (the loop's
    offers arriving while the step computes); the batch is idle from step ``idle_after`` on.
    Returns the chain and what each step was given (join ids, cancels)."""
    loop = asyncio.new_event_loop()
    given: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    try:
        chain = Chain(1, loop, lambda: True, budget=budget)

        def step(joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
            given.append((tuple(j.request.request_id for j in joins), tuple(cancels)))
            chain.consumed = chain.steps + 1  # NOTE: never AHEAD of the loop here.
            during(chain, len(given))
            return StepOut(tokens=(TokenOut("a", 0, 7, "x"),), decode_rows=1)

        run_chain(chain, step, lambda: len(given) >= idle_after, (_row("a"),), ())
    finally:
        loop.close()
    return chain, given


def test_a_row_offered_during_a_step_joins_at_the_next_step_of_the_same_chain() -> None:
    """An offer made while step 2 runs is given to step 3, once; the chain runs on to its budget."""

    def during(chain: Chain, n: int) -> None:
        if n == 2:
            assert chain.offer((_row("b"),), ("a",))

    chain, given = _run(5, during)
    assert given == [(("a",), ()), ((), ()), (("b",), ("a",)), ((), ()), ((), ())]
    assert chain.returned == ((), ())


def test_an_offer_keeps_an_idle_chain_going() -> None:
    """A batch that went idle does not end the chain while a row was offered for the next step."""

    def during(chain: Chain, n: int) -> None:
        if n == 1:
            chain.offer((_row("b"),), ())

    _, given = _run(5, during, idle_after=1)
    assert given == [(("a",), ()), (("b",), ())]


@pytest.mark.parametrize("why", ["budget", "stop"])
def test_rows_offered_to_a_chain_that_ends_are_handed_back_and_later_offers_refused(why: str) -> None:
    """An offer made during the last step (budget used up, or the chain told to stop) is in
    ``returned`` after the job, and an offer after it closed is refused."""

    def during(chain: Chain, n: int) -> None:
        if why == "stop" and n == 2:
            chain.stop = True
        if n == 2:
            assert chain.offer((_row("b"),), ("c",))

    chain, given = _run(2 if why == "budget" else 5, during)
    assert len(given) == 2
    assert [j.request.request_id for j in chain.returned[0]] == ["b"]
    assert chain.returned[1] == ("c",)
    assert not chain.offer((_row("d"),), ())


def test_a_step_that_raises_hands_back_what_was_offered() -> None:
    """A step that raises ends the job; what was offered meanwhile is returned, later offers refused."""
    loop = asyncio.new_event_loop()
    try:
        chain = Chain(1, loop, lambda: True, budget=5)

        def step(joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
            chain.offer((_row("b"),), ())
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            run_chain(chain, step, lambda: False, (_row("a"),), ())
    finally:
        loop.close()
    assert [j.request.request_id for j in chain.returned[0]] == ["b"]
    assert not chain.offer((_row("c"),), ())
