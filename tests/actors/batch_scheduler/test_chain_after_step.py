"""``run_chain``'s ``after_step`` hook: the engine's heap trim runs between the steps of one chain job."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from actors.batch_scheduler.chain import Chain, run_chain
from actors.batch_scheduler.core import JoinRow, StepOut


def test_after_step_runs_after_every_step_once_its_output_is_handed_over() -> None:
    """Three steps, three hook calls, each after that step's output is in ``results``."""
    loop = asyncio.new_event_loop()
    try:
        chain = Chain(1, loop, lambda: True, budget=3)
        seen: list[tuple[str, int]] = []

        def step(joins: Sequence[JoinRow], cancels: Sequence[str]) -> StepOut:
            seen.append(("step", len(chain.results)))
            return StepOut()

        run_chain(chain, step, lambda: False, (), (),
                  after_step=lambda: seen.append(("after", len(chain.results))))
    finally:
        loop.close()
    assert seen == [("step", 0), ("after", 1), ("step", 1), ("after", 2), ("step", 2),
                    ("after", 3)]
