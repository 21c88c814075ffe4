"""FlushAll, the whole flush sequence in the coordinator: barrier, flush, final drain."""

from __future__ import annotations

from actors.durability import core
from messages import Failure
from messages.durability import FlushAll
from messages.prompt_cache import PromptCacheStats, PromptCacheStatsRequest

from .support import Driver, env, only_send, results, sends


def _running(d: Driver) -> core.FlushRun | None:
    # NOTE: a call, so mypy does not carry one assertion's narrowing past the deliveries.
    return d.state.flush


def _cache_stats() -> PromptCacheStats:
    zeros = {n: 0 for n, f in PromptCacheStats.model_fields.items() if f.is_required()}
    return PromptCacheStats.model_validate(zeros)


def test_a_put_scheduled_before_the_barriers_answer_is_in_the_flush_and_the_queue_drains_after() -> None:
    """FlushAll asks the prompt cache first and starts no flush; a Schedule that arrives before the
    answer is in the flush's scope; the asker is answered only after a second, final drain."""
    d = Driver()
    request = env(FlushAll(reply_to="engine"))
    effects = d._do(core.Received(request, d.now))
    barrier = only_send(effects, "prompt_cache.stats_request")
    assert (barrier.to, barrier.body) == ("prompt_cache", PromptCacheStatsRequest())
    assert _running(d) is None
    d.schedule((1, 2), "a")  # NOTE: the Put the prompt cache handled before the barrier.
    effects = d.deliver(_cache_stats(), correlation=barrier.ref)
    flush = _running(d)
    assert flush is not None
    assert flush.scope == (("", (1, 2)),)
    drain = only_send(effects, "spill_queue.drain")
    effects = d.drained(drain.ref)
    forced = only_send(effects, "ssd_writer.covers")
    # NOTE: already on disk (an earlier write): the forced attempt writes nothing.
    verify = only_send(d.covers(forced.ref, True), "ssd_writer.covers")
    stats_ask = only_send(d.covers(verify.ref, True), "ssd_writer.stats_request")
    effects = d.stats_reply(stats_ask.ref, entries=1, longest=2)
    assert results(effects) == []
    final = only_send(effects, "spill_queue.drain")
    effects = d.drained(final.ref)
    (result,) = results(effects)
    assert result.scope == 1
    assert any(isinstance(e, core.Answer) and e.request is request for e in effects)


def test_a_failed_barrier_still_flushes_and_a_stopping_coordinator_answers_every_stage() -> None:
    """A Failure from the prompt cache skips the barrier (the flush runs); stop answers a FlushAll
    waiting for its barrier and one waiting for its final drain, neither durable."""
    d = Driver()
    first = env(FlushAll(reply_to="engine"))
    barrier = only_send(d._do(core.Received(first, d.now)), "prompt_cache.stats_request")
    failure = Failure.model_validate({"error": "HandlerFailed: boom"})
    effects = d.deliver(failure, correlation=barrier.ref)
    assert d.state.flush is not None
    drain = only_send(effects, "spill_queue.drain")
    stats_ask = only_send(d.drained(drain.ref), "ssd_writer.stats_request")
    final = only_send(d.stats_reply(stats_ask.ref), "spill_queue.drain")
    assert final.ref in d.state.final_drains
    second = env(FlushAll(reply_to="engine"))
    assert [s.to for s in sends(d._do(core.Received(second, d.now)))] == ["prompt_cache"]
    effects = d.stop()
    answered = [e.request for e in effects if isinstance(e, core.Answer)]
    assert answered == [second, first]
    assert not results(effects)[0].durable
    assert d.state.final_drains == {}
