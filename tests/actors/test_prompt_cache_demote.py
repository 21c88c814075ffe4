"""``prompt_cache.Demote``: hand unleased RAM entries to the cold tier now (admin drain, memory relief)."""

from __future__ import annotations

from actors.prompt_cache import core as core
from messages import EntryMeta, Put, Take, TakeResult
from messages.prompt_cache import Demote, DemoteResult


def _state(*, tier: bool = True) -> core.CoreState:
    return core.CoreState(cap_bytes=10_000, spill_enabled=tier)


def _put(state: core.CoreState, handle: str, tokens: tuple[int, ...], nbytes: int,
         now: float) -> None:
    meta = EntryMeta(offset=len(tokens), nbytes=nbytes, trimmable=True, min_reusable_offset=0)
    core.put(state, Put(tokens=tokens, handle=handle, meta=meta), now)


def _demote(state: core.CoreState, msg: Demote, now: float = 100.0
            ) -> tuple[list[core.Effect], DemoteResult]:
    effects = core.demote(state, msg, now)
    reply = effects[-1]
    assert isinstance(reply, core.Reply)
    assert isinstance(reply.body, DemoteResult)
    return effects[:-1], reply.body


def _spilled(effects: list[core.Effect]) -> list[tuple[str, str]]:
    return [(e.message.handle, e.message.source) for e in effects if isinstance(e, core.Spill)]


def test_demote_with_no_idle_time_hands_every_unleased_entry_oldest_first() -> None:
    """idle_s=0: every unleased entry leaves as a demotion spill, least recently used first;
    a leased entry stays; the reply counts both and what is left."""
    state = _state()
    _put(state, "a", (1, 2), 10, now=1.0)
    _put(state, "b", (3, 4), 20, now=2.0)
    _put(state, "c", (5, 6), 30, now=3.0)
    (lease,) = core.take(state, Take(tokens=(3, 4, 9)), 4.0)
    assert isinstance(lease, core.Reply)
    assert isinstance(lease.body, TakeResult)
    assert lease.body.handle == "b"
    effects, result = _demote(state, Demote())
    assert _spilled(effects) == [("a", "demote"), ("c", "demote")]
    assert result == DemoteResult(spilled=2, spilled_bytes=40, leased=1, left=1, left_bytes=20)
    assert core.stats(state).demotions == 2
    assert {h for h, e in state.entries.items() if e.indexed} == {"b"}


def test_demote_stops_once_max_bytes_were_handed_and_honours_idle_time() -> None:
    """max_bytes stops the LRU walk as soon as enough bytes left; idle_s skips recent entries."""
    state = _state()
    for i, handle in enumerate("abcd"):
        _put(state, handle, (i, i + 1), 10, now=float(i))
    effects, result = _demote(state, Demote(max_bytes=15))
    assert _spilled(effects) == [("a", "demote"), ("b", "demote")]
    assert (result.spilled_bytes, result.left) == (20, 2)
    effects, result = _demote(state, Demote(idle_s=97.5), now=100.0)
    assert _spilled(effects) == [("c", "demote")]
    assert result.left == 1


def test_without_a_cold_tier_entries_stay_unless_disposal_is_asked() -> None:
    """No cold tier: a plain Demote moves nothing; dispose_without_tier drops them (relief)."""
    state = _state(tier=False)
    _put(state, "a", (1, 2), 10, now=1.0)
    _put(state, "b", (3, 4), 10, now=2.0)
    effects, result = _demote(state, Demote())
    assert effects == []
    assert (result.spilled, result.disposed, result.left) == (0, 0, 2)
    effects, result = _demote(state, Demote(dispose_without_tier=True, max_bytes=5))
    assert effects == [core.Dispose("a")]
    assert (result.disposed, result.disposed_bytes, result.left) == (1, 10, 1)
    assert core.stats(state).demotions == 0


def test_demote_arrives_as_a_message_through_handle() -> None:
    """The actor's dispatch routes a Demote envelope to the rule and answers it."""
    from messages import Envelope

    state = _state()
    _put(state, "a", (1, 2), 10, now=1.0)
    envelope = Envelope("m1", "c1", None, "admin", "prompt_cache", 50.0, Demote(reply_to="admin"))
    _, effects = core.handle(state, core.Received(envelope, 50.0))
    replies = [e for e in effects if isinstance(e, core.Reply)]
    assert [type(r.body) for r in replies] == [DemoteResult]
    assert _spilled(effects) == [("a", "demote")]
