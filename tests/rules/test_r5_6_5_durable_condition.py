"""R5.6-5: ``durable`` only when nothing of the flush was pending, dropped, failed or uncovered.

A dropped or failed write usually also leaves its prefix uncovered, so
``pending`` hides a missing ``dropped == 0`` / ``failed == 0`` test. Here the
flush's own write of a prefix is dropped (or fails), yet the final check
finds the prefix covered (another producer's file covers it by then): the
flush must still say not durable, because one of its writes did not land
(mutation: drop ``dropped == 0`` or ``failed == 0`` from ``durable``).
"""

from __future__ import annotations

import pytest

from tests.actors.durability.support import Driver, cloned, only_clone, only_send, results

T1 = (1, 2, 3)


@pytest.mark.parametrize(("outcome", "reason"), [("dropped", "over_cap"), ("failed", "io_error")])
def test_a_flush_whose_write_did_not_land_is_not_durable_even_if_the_prefix_is_covered(
    outcome: str, reason: str
) -> None:
    """A forced write dropped / failed, the prefix covered at verification anyway: durable false,
    with that write counted, and nothing pending or uncovered to explain it."""
    d = Driver()
    d.schedule(T1, "h1")
    _, effects = d.flush()
    effects = d.drained(only_send(effects, "spill_queue.drain").ref)
    turn = only_clone(d.covers(only_send(effects, "ssd_writer.covers").ref, False))
    enq = only_send(d.turn(turn.ref, cloned("c1", 3)), "spill_queue.enqueue")
    effects = d.settle(enq.ref, "c1", outcome, reason)  # type: ignore[arg-type]
    verify = only_send(effects, "ssd_writer.covers")
    stats = only_send(d.covers(verify.ref, True), "ssd_writer.stats_request")
    (result,) = results(d.stats_reply(stats.ref, entries=1, longest=3))
    assert (result.pending, result.uncovered, result.covered) == (0, 0, 1)
    assert getattr(result, outcome) == 1
    assert result.durable is False
