"""The batch lane reports the prefill of steps that joined SSD hits (their joins left out), so the
restore-or-recompute estimator learns prefill speed on a restarted server whose rows all come from disk."""

from __future__ import annotations

from actors.batch_scheduler.core import (
    Admit,
    Effect,
    LookupAnswered,
    ObservePrefill,
    StepFinished,
    StepOut,
)
from tests.actors.batch_scheduler.test_core_rows import SSD_HIT, Core, gen, of


def _restored_step(
    join_s: float, *, prefill_tokens: int = 58, restore_failed: bool = False
) -> list[Effect]:
    """One SSD-hit row granted at 1.0, its joining step finished at 1.5 with ``join_s`` of joins."""
    core = Core()
    core.state.observe_prefill = True
    core.handle(Admit(gen("a", 64), "c-a", 0.0))
    core.handle(LookupAnswered("a", SSD_HIT, 0.1))
    core.grant(1.0)
    rows = ("a",)
    out = StepOut(
        joined=(("a", 0 if restore_failed else SSD_HIT.cached_tokens),),
        prefill_tokens=prefill_tokens,
        restored=() if restore_failed else rows,
        restore_failed=rows if restore_failed else (),
        join_s=join_s,
    )
    return core.handle(StepFinished(1, out, 1.5))


def test_a_step_that_joined_an_ssd_hit_reports_the_prefill_after_the_landing() -> None:
    """0.5 s step with a 0.3 s landing, 58 suffix tokens forwarded: 58 tokens in 0.2 s."""
    [observed] = of(_restored_step(0.3), ObservePrefill)
    assert (observed.tokens, round(observed.seconds, 9)) == (58, 0.2)


def test_a_failed_landing_is_left_out_too() -> None:
    """A row whose landing failed joins cold: its whole prompt is prefilled, the failed landing's time left out."""
    [observed] = of(_restored_step(0.1, restore_failed=True), ObservePrefill)
    assert (observed.tokens, round(observed.seconds, 9)) == (58, 0.4)


def test_joins_that_took_the_whole_step_report_nothing() -> None:
    """Joins as long as the step leave no prefill time to report."""
    assert of(_restored_step(0.5), ObservePrefill) == []
