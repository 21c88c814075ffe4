"""A flush reports the generation checkpoint writes lost since the previous flush (durability core)."""

from __future__ import annotations

from messages import SpillsDrained
from tests.actors.durability.support import Driver, only_send, results


def _empty_flush(d: Driver, lost: int) -> int:
    """Run a flush with nothing dirty; the spill queue's drained answer counts ``lost`` checkpoints."""
    _, effects = d.flush()
    drain = only_send(effects, "spill_queue.drain")
    body = SpillsDrained(enqueued=0, stored=0, dropped=0, failed=0, refused=0,
                         checkpoints_lost=lost)
    effects = d.deliver(body, correlation=drain.ref)
    stats = only_send(effects, "ssd_writer.stats_request")
    found = results(d.stats_reply(stats.ref))
    assert len(found) == 1
    assert found[0].durable  # NOTE: a lost checkpoint is not a lost prefix.
    return found[0].checkpoints_lost


def test_flush_reports_checkpoints_lost_since_the_previous_flush() -> None:
    """The queue's lifetime count 2, then 2 again, then 5: the flushes report 2, 0, 3."""
    d = Driver()
    assert [_empty_flush(d, 2), _empty_flush(d, 2), _empty_flush(d, 5)] == [2, 0, 3]
