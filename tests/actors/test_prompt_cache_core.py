"""Rules of the RAM prompt cache's sans-IO core (no MLX, no runtime)."""

from __future__ import annotations

from actors.prompt_cache import core as core
from messages import (
    Body,
    EntryMeta,
    Envelope,
    PromptCacheStatsRequest,
    Put,
    PutResult,
    Release,
    Take,
    TakeResult,
)
from messages.gateway import TurnDone
from messages.spill_queue import Enqueue


def _meta(n: int, nbytes: int = 10, *, trimmable: bool = True, min_offset: int = 0) -> EntryMeta:
    return EntryMeta(offset=n, nbytes=nbytes, trimmable=trimmable, min_reusable_offset=min_offset)


def _put(
    state: core.CoreState,
    handle: str,
    tokens: tuple[int, ...],
    *,
    ns: str = "",
    nbytes: int = 10,
    trimmable: bool = True,
    min_offset: int = 0,
) -> list[core.Effect]:
    msg = Put(
        tokens=tokens,
        namespace=ns,
        handle=handle,
        meta=_meta(len(tokens), nbytes, trimmable=trimmable, min_offset=min_offset),
    )
    return core.put(state, msg)


def _take(state: core.CoreState, tokens: tuple[int, ...], ns: str = "") -> TakeResult:
    (effect,) = core.take(state, Take(tokens=tokens, namespace=ns))
    assert isinstance(effect, core.Reply)
    assert isinstance(effect.body, TakeResult)
    return effect.body


def _indexed(state: core.CoreState) -> set[str]:
    return {e.handle for e in state.entries.values() if e.indexed}


def _disposed(effects: list[core.Effect]) -> list[str]:
    return [e.handle for e in effects if isinstance(e, core.Dispose)]


def test_common_prefix_len_matches_a_plain_loop() -> None:
    """The galloping prefix length equals an element-by-element count, at every split point of every block."""
    cases = [((), ()), ((1,), (2,)), ((1, 2, 3), (1, 2, 4)), ((1, 2), (1, 2, 3)), ((5,) * 50, (5,) * 49 + (6,))]
    base = tuple(range(300))
    # NOTE: a mismatch at every offset (inside and at the edges of the 16 / 32 / 64 ... blocks),
    # and prefixes of every length, both ways round.
    cases += [(base, (*base[:k], -1, *base[k + 1:])) for k in range(300)]
    cases += [(base[:k], base) for k in range(0, 300, 7)] + [(base, base[:k]) for k in range(0, 300, 11)]
    for a, b in cases:
        expected = 0
        while expected < min(len(a), len(b)) and a[expected] == b[expected]:
            expected += 1
        assert core.common_prefix_len(a, b) == expected


def test_take_returns_longest_usable_prefix() -> None:
    """Take picks the entry sharing the longest prefix with the prompt and leases it."""
    state = core.CoreState(cap_bytes=1000)
    _put(state, "short", (1, 2))
    _put(state, "other", (1, 9, 9, 9))
    _put(state, "long", (1, 2, 3, 4))
    res = _take(state, (1, 2, 3, 4, 5, 6))
    assert (res.handle, res.cached_tokens, res.entry_tokens) == ("long", 4, 4)
    assert res.lease_id is not None
    assert state.entries["long"].leases == 1
    assert core.stats(state).hits == 1


def test_take_ties_go_to_the_shorter_then_the_most_recent_entry() -> None:
    """Equal usable prefixes: the entry needing the smaller trim wins, then the most recently used."""
    state = core.CoreState(cap_bytes=1000)
    _put(state, "long", (1, 2, 3, 4))
    _put(state, "short", (1, 2, 9))  # not an ancestor: both stay
    res = _take(state, (1, 2, 7, 7))
    assert (res.handle, res.cached_tokens) == ("short", 2)
    _put(state, "sibling", (1, 2, 3, 8))  # same length as "long"
    assert _take(state, (1, 2, 3, 5)).handle == "sibling"  # the newer of two equals
    assert _take(state, (1, 2, 3, 4, 1)).handle == "long"  # touches "long"
    assert _take(state, (1, 2, 3, 5)).handle == "long"  # now "long" is the more recent


def test_take_caps_at_prompt_length_minus_one() -> None:
    """An exact repeat serves len(prompt) - 1 tokens (one token is always forwarded)."""
    state = core.CoreState(cap_bytes=1000)
    _put(state, "a", (1, 2, 3, 4))
    res = _take(state, (1, 2, 3, 4))
    assert (res.handle, res.cached_tokens) == ("a", 3)
    assert _take(state, (1,)).handle is None  # a 1-token prompt can reuse nothing


def test_untrimmable_longer_entry_is_skipped() -> None:
    """An entry longer than the match that cannot trim is skipped for a shorter usable one."""
    state = core.CoreState(cap_bytes=1000)
    _put(state, "ancestor", (1, 2))
    _put(state, "wrapped", (1, 2, 3, 4, 5), trimmable=False)
    res = _take(state, (1, 2, 3, 9))
    assert (res.handle, res.cached_tokens) == ("ancestor", 2)
    # an untrimmable entry still serves a prompt it is an exact prefix of
    res = _take(state, (1, 2, 3, 4, 5, 6))
    assert (res.handle, res.cached_tokens) == ("wrapped", 5)
    # and an exact repeat of it would need a trim: skipped
    assert _take(state, (1, 2, 3, 4, 5)).handle == "ancestor"


def test_minimum_reusable_offset_bounds_the_trim() -> None:
    """A trimmable entry is not trimmed below its minimum reusable offset."""
    state = core.CoreState(cap_bytes=1000)
    _put(state, "a", (1, 2, 3, 4, 5), min_offset=3)
    assert _take(state, (1, 2, 3, 9)).cached_tokens == 3
    assert _take(state, (1, 2, 9)).handle is None


def test_namespaces_never_serve_each_other() -> None:
    """An entry stored under one adapter namespace is invisible to another."""
    state = core.CoreState(cap_bytes=1000)
    _put(state, "base", (1, 2, 3), ns="")
    assert _take(state, (1, 2, 3, 4), ns="lora-a").handle is None
    assert _take(state, (1, 2, 3, 4), ns="").handle == "base"
    assert core.stats(state).misses == 1


def test_duplicate_put_replaces_regardless_of_trimmability() -> None:
    """A put with the same tokens and namespace replaces the old entry and disposes it."""
    state = core.CoreState(cap_bytes=1000)
    _put(state, "old", (1, 2, 3))
    effects = _put(state, "new", (1, 2, 3), trimmable=False)
    assert _disposed(effects) == ["old"]
    assert _indexed(state) == {"new"}
    assert isinstance(effects[-1], core.Reply)
    assert effects[-1].body == PutResult(stored=True, replaced=1)


def test_supersession_only_when_new_entry_is_trimmable() -> None:
    """Strict prefix ancestors go only when the new entry can trim down to them."""
    state = core.CoreState(cap_bytes=1000)
    _put(state, "snap", (1, 2, 3))
    _put(state, "sibling", (1, 2, 7, 7))
    effects = _put(state, "wrapped", (1, 2, 3, 4, 5), trimmable=False)
    assert _disposed(effects) == []
    assert _indexed(state) == {"snap", "sibling", "wrapped"}
    effects = _put(state, "trim", (1, 2, 3, 4, 5, 6), min_offset=0)
    assert sorted(_disposed(effects)) == ["snap", "wrapped"]
    assert _indexed(state) == {"sibling", "trim"}
    # a descendant that cannot trim below 4 leaves a 2-token ancestor alone
    _put(state, "anc2", (9, 9))
    _put(state, "desc", (9, 9, 8, 8, 8), min_offset=4)
    assert "anc2" in _indexed(state)
    assert _take(state, (9, 9, 7)).handle == "anc2"
    assert core.stats(state).superseded == 2


def test_lru_eviction_order_and_cap() -> None:
    """Eviction removes least recently used entries (a hit refreshes) until under the cap."""
    state = core.CoreState(cap_bytes=30)
    _put(state, "a", (1,), nbytes=10)
    _put(state, "b", (2,), nbytes=10)
    _put(state, "c", (3,), nbytes=10)
    res = _take(state, (1, 5))
    assert res.handle == "a"
    core.release(state, Release(lease_id=res.lease_id or ""))
    effects = _put(state, "d", (4,), nbytes=15)
    assert _disposed(effects) == ["b", "c"]
    assert _indexed(state) == {"a", "d"}
    assert core.stats(state).bytes == 25 <= 30
    assert core.stats(state).evicted == 2


def test_entry_larger_than_cap_is_never_stored() -> None:
    """A put bigger than the cap is disposed (or spilled with a cold tier), never indexed."""
    state = core.CoreState(cap_bytes=30)
    effects = _put(state, "big", (1, 2), nbytes=31)
    assert _disposed(effects) == ["big"]
    assert _indexed(state) == set()
    spilling = core.CoreState(cap_bytes=30, spill_enabled=True)
    effects = _put(spilling, "big", (1, 2), nbytes=31)
    assert [e.handle for e in effects if isinstance(e, core.Spill)] == ["big"]
    assert core.stats(spilling).rejected_too_large == 1


def test_disabled_cache_disposes_every_put() -> None:
    """Cap 0 disables the tier: puts are disposed and takes miss."""
    state = core.CoreState(cap_bytes=0)
    effects = _put(state, "a", (1, 2))
    assert _disposed(effects) == ["a"]
    assert _take(state, (1, 2, 3)).handle is None


def test_leased_entry_is_pinned_until_release() -> None:
    """A replaced entry held by leases stays alive (pinned, counted) until its last release."""
    state = core.CoreState(cap_bytes=25, spill_enabled=True)
    _put(state, "a", (1, 2), nbytes=10)
    lease1 = _take(state, (1, 2, 3)).lease_id
    lease2 = _take(state, (1, 2, 4)).lease_id
    assert lease1 is not None
    assert lease2 is not None
    effects = _put(state, "a2", (1, 2), nbytes=10)  # an exact duplicate replaces "a"
    assert [e for e in effects if not isinstance(e, core.Reply)] == []
    stats = core.stats(state)
    assert (stats.entries, stats.pinned_entries, stats.pinned_bytes, stats.bytes) == (1, 1, 10, 10)
    assert stats.retained_bytes == 20
    assert core.release(state, Release(lease_id=lease1)) == []
    # replaced entries are disposed, never spilled (the newer entry covers them)
    assert core.release(state, Release(lease_id=lease2)) == [core.Dispose("a")]
    assert core.release(state, Release(lease_id=lease2)) == []  # idempotent
    assert core.stats(state).retained_bytes == 10


def test_leased_bytes_count_against_the_cap() -> None:
    """Eviction skips leased entries; a put that cannot fit beside leased bytes is refused."""
    state = core.CoreState(cap_bytes=30)
    _put(state, "old", (1,), nbytes=10)
    _put(state, "mid", (2,), nbytes=10)
    lease = _take(state, (1, 5)).lease_id  # "old" is leased (and now most recent)
    assert lease is not None
    _take(state, (2, 5))  # "mid" leased too, touched last
    effects = _put(state, "c", (3,), nbytes=10)
    assert _disposed(effects) == []
    effects = _put(state, "d", (4,), nbytes=10)
    # the LRU entry would be "old" or "mid", but both are leased: "c" goes instead
    assert _disposed(effects) == ["c"]
    assert _indexed(state) == {"old", "mid", "d"}
    effects = _put(state, "e", (5,), nbytes=15)  # 20 leased + 15 > 30
    assert _disposed(effects) == ["e"]
    assert isinstance(effects[-1], core.Reply)
    assert effects[-1].body == PutResult(stored=False, reason="no_room")
    assert _indexed(state) == {"old", "mid", "d"}  # nothing was displaced for a refused put
    stats = core.stats(state)
    assert stats.rejected_no_room == 1
    assert stats.retained_bytes == 30 <= stats.cap_bytes
    core.release(state, Release(lease_id=lease))
    effects = _put(state, "e2", (5,), nbytes=15)
    assert _disposed(effects) == ["old", "d"]  # unleased again, "old" is the least recent
    assert _indexed(state) == {"mid", "e2"}


def test_invalid_put_is_refused() -> None:
    """A put whose token count disagrees with its meta is disposed and reported invalid."""
    state = core.CoreState(cap_bytes=100)
    msg = Put(tokens=(1, 2, 3), handle="h", meta=_meta(2))
    effects = core.put(state, msg)
    assert _disposed(effects) == ["h"]
    assert isinstance(effects[-1], core.Reply)
    assert effects[-1].body == PutResult(stored=False, reason="invalid")


def test_stats_request_and_dispose_all() -> None:
    """Stats report entries and bytes; dispose_all empties the index and counts disposals."""
    state = core.CoreState(cap_bytes=100)
    _put(state, "a", (1,), nbytes=7)
    _put(state, "b", (2,), nbytes=8)
    _, (reply,) = core.handle(state, core.Received(_envelope(PromptCacheStatsRequest()), 0.0))
    assert isinstance(reply, core.Reply)
    assert (reply.body.entries, reply.body.bytes) == (2, 15)  # type: ignore[attr-defined]
    assert sorted(_disposed(core.dispose_all(state))) == ["a", "b"]
    assert core.stats(state).entries == 0
    assert core.stats(state).disposed == 2


def _envelope(body: Body) -> Envelope:
    return Envelope("m-1", "c-1", None, "tester", "prompt_cache", 0.0, body)


def _handle(
    state: core.CoreState, message: Body | core.Event, now: float = 0.0
) -> list[core.Effect]:
    """The effects of one event, alarm settings left out (the alarm has its own tests)."""
    event = core.Received(_envelope(message), now) if isinstance(message, Body) else message
    _, effects = core.handle(state, event)
    return [e for e in effects if not isinstance(e, core.SetAlarm)]


def _put_msg(handle: str, tokens: tuple[int, ...], nbytes: int = 10) -> Put:
    return Put(tokens=tokens, handle=handle, meta=_meta(len(tokens), nbytes))


def test_leases_expire_at_their_deadline() -> None:
    """A lease nobody released ends once ``lease_ttl_s`` has passed since its Take, and the
    pinned entry it held is disposed then; releasing it afterwards does nothing."""
    state = core.CoreState(cap_bytes=100, lease_ttl_s=10.0)
    _handle(state, _put_msg("a", (1, 2)))
    (reply,) = _handle(state, Take(tokens=(1, 2, 3)), now=5.0)
    assert isinstance(reply, core.Reply)
    assert isinstance(reply.body, TakeResult)
    lease = reply.body.lease_id
    assert lease is not None
    _handle(state, _put_msg("a2", (1, 2)), now=6.0)  # "a" is replaced while leased: pinned
    assert core.stats(state).pinned_entries == 1
    assert _disposed(_handle(state, PromptCacheStatsRequest(), now=14.9)) == []
    assert _disposed(_handle(state, PromptCacheStatsRequest(), now=15.0)) == ["a"]
    assert _handle(state, Release(lease_id=lease), now=16.0) == []
    stats = core.stats(state)
    assert (stats.active_leases, stats.leases_expired, stats.pinned_entries) == (0, 1, 0)


def test_an_undelivered_lease_is_released() -> None:
    """A lease whose grant reached nobody ends at once (once: a repeat is ignored)."""
    state = core.CoreState(cap_bytes=100)
    _handle(state, _put_msg("a", (1, 2)))
    take = _take(state, (1, 2, 3))
    assert take.lease_id is not None
    _handle(state, _put_msg("b", (1, 2)))  # replaces "a" while leased
    assert _disposed(_handle(state, core.LeaseUndelivered(take.lease_id))) == ["a"]
    assert _handle(state, core.LeaseUndelivered(take.lease_id)) == []
    assert (core.stats(state).leases_undelivered, core.stats(state).active_leases) == (1, 0)


def test_disposals_ask_for_one_drain_turn_at_a_time() -> None:
    """The first disposal asks for a drain; more disposals wait for its answer, after which
    the ones it may have missed ask again; a refused drain waits for the next disposal."""
    state = core.CoreState(cap_bytes=100, drain_step="drain")
    _handle(state, _put_msg("a", (1,)))
    effects = _handle(state, _put_msg("a2", (1,), nbytes=7))  # replaces "a"
    assert _disposed(effects) == ["a"]
    assert effects[-1] == core.RequestDrain("drain")  # after the Put's reply
    _handle(state, _put_msg("b", (2,)))
    effects = _handle(state, _put_msg("b2", (2,)))
    assert _disposed(effects) == ["b"]
    assert not any(isinstance(e, core.RequestDrain) for e in effects)  # one in flight
    assert (core.stats(state).pending_disposals, core.stats(state).pending_disposal_bytes) == (2, 20)
    assert _handle(state, TurnDone(step_id="other", ok=True)) == []  # not ours
    assert _handle(state, TurnDone(step_id="drain", ok=True)) == [core.RequestDrain("drain")]
    assert core.stats(state).pending_disposals == 1  # "b" may have missed the first drain
    assert _handle(state, TurnDone(step_id="drain", ok=False)) == []
    assert core.stats(state).pending_disposals == 1
    effects = _handle(state, _put_msg("c", (1,)))  # replaces "a2": a new disposal asks again
    assert effects[-1] == core.RequestDrain("drain")
    assert _handle(state, TurnDone(step_id="drain", ok=True)) == []
    stats = core.stats(state)
    assert (stats.pending_disposals, stats.pending_disposal_bytes, stats.drains_requested) == (0, 0, 3)


def test_without_a_drain_step_nothing_is_requested() -> None:
    """A cache wired without a gateway asks for no turns (the engine drains at its next turn)."""
    state = core.CoreState(cap_bytes=100)
    _handle(state, _put_msg("a", (1,)))
    effects = _handle(state, _put_msg("a2", (1,)))
    assert _disposed(effects) == ["a"]
    assert not any(isinstance(e, core.RequestDrain) for e in effects)


def test_evictions_become_enqueue_messages_and_undelivered_ones_are_disposed() -> None:
    """With a cold tier, an evicted entry leaves as an Enqueue carrying its handle and
    metadata; if the queue cannot take it, the entry is disposed (and asks for a drain)."""
    state = core.CoreState(cap_bytes=10, spill_enabled=True, drain_step="drain")
    _handle(state, _put_msg("a", (1, 2)))
    effects = _handle(state, _put_msg("b", (3,)))
    spills = [e for e in effects if isinstance(e, core.Spill)]
    assert [s.message for s in spills] == [
        Enqueue(handle="a", tokens=(1, 2), meta=_meta(2), source="evict")
    ]
    assert not any(isinstance(e, core.RequestDrain) for e in effects)  # nothing disposed here
    effects = _handle(state, core.SpillUndelivered(spills[0].message))
    assert effects == [core.Dispose("a"), core.RequestDrain("drain")]
    stats = core.stats(state)
    assert (stats.spilled, stats.spills_undelivered, stats.disposed) == (0, 1, 1)
