"""``run_chain`` runs its ``after_step`` hook (the heap trim's RSS reading) after steps that change the batch and every ``HEAP_CHECK_EVERY``-th plain decode step."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from actors.batch_scheduler.chain import HEAP_CHECK_EVERY, Chain, run_chain
from actors.batch_scheduler.core import ExitOut, JoinRow, StepOut, TokenOut


def _plain(index: int) -> StepOut:
    return StepOut(tokens=(TokenOut("r1", index, 7, "x", None, None),), decode_rows=1)


def _run(outs: list[StepOut]) -> list[int]:
    """Run a chain over ``outs``; the (1-based) steps after which the hook ran."""
    loop = asyncio.new_event_loop()
    try:
        chain = Chain(1, loop, lambda: True, budget=len(outs))
        chain.consumed = len(outs)  # NOTE: never AHEAD of the loop in this test.
        ran: list[int] = []
        it = iter(outs)

        def step(joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
            return next(it)

        run_chain(chain, step, lambda: False, (), (), after_step=lambda: ran.append(chain.steps))
    finally:
        loop.close()
    return ran


def test_plain_decode_steps_run_the_hook_every_heap_check_every_steps() -> None:
    """Only plain decode steps: the hook runs after every ``HEAP_CHECK_EVERY``-th of them."""
    n = 2 * HEAP_CHECK_EVERY + 3
    assert _run([_plain(i) for i in range(n)]) == [HEAP_CHECK_EVERY, 2 * HEAP_CHECK_EVERY]


def test_a_step_that_changes_the_batch_runs_the_hook_and_restarts_the_count() -> None:
    """A prefill, a join, an exit each run the hook at once; plain steps count again from there."""
    prefill = StepOut(prefill_tokens=64, joined=(("r1", 0),), prefilled=("r1",))
    exit_ = StepOut(
        tokens=(TokenOut("r2", 9, 7, "x", None, "length"),),
        exits=(ExitOut("r2", "length", 10, None),),
        decode_rows=2,
    )
    outs = [prefill] + [_plain(i) for i in range(3)] + [exit_]
    outs += [_plain(i) for i in range(HEAP_CHECK_EVERY)]
    assert _run(outs) == [1, 5, 5 + HEAP_CHECK_EVERY]
