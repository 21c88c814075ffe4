"""The prompt cache core with a cold tier: lookups through the SSD index, restores, demotions.

Plain calls of ``core.handle`` (no runtime, no files): the SSD index's answers
are written by hand, so every path of a cold lookup is reached on purpose.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.prompt_cache import core
from messages import Body, EntryMeta, Envelope, Failure, Put, Release, Take, TakeResult
from messages.spill_queue import Enqueue
from messages.ssd_writer import Find, FindResult, Restore, RestoreResult

_ids = itertools.count()
PROMPT = tuple(range(1, 21))


def _meta(n: int, nbytes: int = 10) -> EntryMeta:
    return EntryMeta(offset=n, nbytes=nbytes, trimmable=True, min_reusable_offset=0)


def _envelope(body: Body, *, causation: str | None = None) -> Envelope:
    return Envelope(f"m-{next(_ids)}", "c-1", causation, "gateway", "prompt_cache", 0.0, body)


def _state(**kw: object) -> core.CoreState:
    options: dict[str, object] = {
        "cap_bytes": 1000,
        "spill_enabled": True,
        "cold_lookups": True,
        "cold_timeout_s": 5.0,
    }
    options.update(kw)
    return core.CoreState(**options)  # type: ignore[arg-type]


def _run(state: core.CoreState, event: core.Event) -> list[core.Effect]:
    _, effects = core.handle(state, event)
    return [e for e in effects if not isinstance(e, core.SetAlarm)]


def _put(state: core.CoreState, handle: str, tokens: tuple[int, ...], now: float = 0.0) -> None:
    put = Put(tokens=tokens, handle=handle, meta=_meta(len(tokens)))
    _run(state, core.Received(_envelope(put), now))


def _take(state: core.CoreState, now: float = 0.0) -> tuple[Envelope, list[core.Effect]]:
    take = _envelope(Take(tokens=PROMPT, reply_to="gateway"))
    return take, _run(state, core.Received(take, now))


def _ask(effects: list[core.Effect]) -> core.AskCold:
    (ask,) = [e for e in effects if isinstance(e, core.AskCold)]
    return ask


def _sent(state: core.CoreState, ask: core.AskCold, now: float = 0.0) -> str:
    msg_id = f"ask-{next(_ids)}"
    assert _run(state, core.ColdAskSent(ask.take_id, msg_id, now)) == []
    return msg_id


def _answer(effects: list[core.Effect]) -> tuple[TakeResult, Envelope | None]:
    (reply,) = [e for e in effects if isinstance(e, core.Reply)]
    assert isinstance(reply.body, TakeResult)
    return reply.body, reply.to


def _found(cached: int, entry: int, choice: str = "restore") -> FindResult:
    return FindResult(
        choice=choice,  # type: ignore[arg-type]
        path="/f.kvt",
        cached_tokens=cached,
        entry_tokens=entry,
        file_bytes=100,
    )


def test_a_take_asks_the_index_for_more_than_ram_has_and_answers_nothing_yet() -> None:
    """With a cold tier, a Take leases the RAM candidate and asks Find beyond its prefix;
    the answer waits for the index."""
    state = _state()
    _put(state, "a", PROMPT[:5])
    _, effects = _take(state)
    ask = _ask(effects)
    assert ask.body == Find(tokens=PROMPT, better_than=5)
    assert not any(isinstance(e, core.Reply) for e in effects)
    assert state.entries["a"].leases == 1


def test_a_take_whose_rest_no_file_could_serve_skips_the_index() -> None:
    """With the index's minimum gain: a rest past RAM's hit shorter than it is answered from RAM at once, counted; as long as it asks Find."""
    # NOTE: PROMPT has 20 tokens, so a file serves at most 19; RAM serves 12.
    state = _state(cold_min_gain=8)
    _put(state, "a", PROMPT[:12])
    _, effects = _take(state)
    assert not [e for e in effects if isinstance(e, core.AskCold)]
    result, _ = _answer(effects)
    assert (result.cached_tokens, result.tier) == (12, "ram")
    assert (state.ssd_lookups, state.ssd_lookups_skipped) == (0, 1)
    state = _state(cold_min_gain=7)
    _put(state, "a", PROMPT[:12])
    _, effects = _take(state)
    assert _ask(effects).body == Find(tokens=PROMPT, better_than=12)
    assert (state.ssd_lookups, state.ssd_lookups_skipped) == (1, 0)


def test_a_longer_file_is_restored_and_its_staged_bytes_replace_the_ram_lease() -> None:
    """A file with a strictly longer prefix is restored; the Take is answered with an ssd
    lease on the staged bytes, and the RAM candidate's lease is released."""
    state = _state()
    _put(state, "a", PROMPT[:5])
    take, effects = _take(state)
    find_id = _sent(state, _ask(effects))
    effects = _run(state, core.Received(_envelope(_found(12, 14), causation=find_id), 1.0))
    restore = _ask(effects)
    assert restore.body == Restore(path="/f.kvt", ticket=restore.take_id)
    _sent(state, restore)
    restored = RestoreResult(
        ok=True, path="/f.kvt", staging_id="st-1", entry_tokens=14, ticket=restore.take_id
    )
    result, to = _answer(_run(state, core.Received(_envelope(restored), 2.0)))
    assert to is take
    assert (result.tier, result.staging_id, result.handle) == ("ssd", "st-1", None)
    assert (result.cached_tokens, result.entry_tokens) == (12, 14)
    assert state.entries["a"].leases == 0
    stats = core.stats(state)
    assert (stats.ssd_hits, stats.ssd_cached_tokens_served, stats.hits) == (1, 12, 0)


def test_ram_answers_when_the_index_has_nothing_longer() -> None:
    """A Find that offers no longer prefix (a miss, or not better than RAM) is answered
    with RAM's own lease."""
    state = _state()
    _put(state, "a", PROMPT[:5])
    take, effects = _take(state)
    find_id = _sent(state, _ask(effects))
    result, to = _answer(_run(state, core.Received(_envelope(FindResult(), causation=find_id), 1.0)))
    assert (to, result.tier, result.handle, result.cached_tokens) == (take, "ram", "a", 5)
    assert core.stats(state).hits == 1


def test_recompute_advice_is_followed_and_counted() -> None:
    """When the estimator predicts prefilling is faster, RAM answers and the choice is counted."""
    state = _state()
    _, effects = _take(state)
    find_id = _sent(state, _ask(effects))
    found = _envelope(_found(15, 15, choice="recompute"), causation=find_id)
    result, _ = _answer(_run(state, core.Received(found, 1.0)))
    assert result == TakeResult()
    stats = core.stats(state)
    assert (stats.ssd_recompute, stats.misses, stats.ssd_lookups) == (1, 1, 1)


def test_a_failed_restore_is_a_miss_and_its_bytes_are_dropped() -> None:
    """A restore that fails (corrupt file) answers RAM's candidate, counts a failure and drops
    any bytes staged for it; a Failure from the index does the same."""
    state = _state()
    _put(state, "a", PROMPT[:5])
    _, effects = _take(state)
    _sent(state, _ask(effects))
    found_id = next(iter(state.asks))
    restore = _ask(_run(state, core.Received(_envelope(_found(12, 12), causation=found_id), 1.0)))
    _sent(state, restore)
    bad = RestoreResult(ok=False, path="/f.kvt", reason="corrupt", ticket=restore.take_id)
    result, _ = _answer(_run(state, core.Received(_envelope(bad), 2.0)))
    assert (result.tier, result.cached_tokens) == ("ram", 5)
    assert core.stats(state).ssd_failures == 1

    _, effects = _take(state, now=3.0)
    find_id = _sent(state, _ask(effects))
    failure = _envelope(Failure(error="HandlerFailed"), causation=find_id)
    result, _ = _answer(_run(state, core.Received(failure, 4.0)))
    assert result.tier == "ram"
    assert core.stats(state).ssd_failures == 2


def test_a_lookup_past_its_deadline_answers_from_ram_and_late_bytes_are_dropped() -> None:
    """A cold lookup that runs past cold_timeout_s is answered from RAM (counted); a restore
    that completes afterwards has its staged bytes dropped at once."""
    state = _state(cold_timeout_s=5.0)
    take, effects = _take(state, now=0.0)
    find_id = _sent(state, _ask(effects))
    restore = _ask(_run(state, core.Received(_envelope(_found(12, 12), causation=find_id), 1.0)))
    _sent(state, restore)
    effects = _run(state, core.Received(_envelope(Release(lease_id="none")), 5.0))
    result, to = _answer(effects)
    assert (to, result) == (take, TakeResult())
    assert core.stats(state).ssd_timeouts == 1
    late = RestoreResult(
        ok=True, path="/f.kvt", staging_id="st-late", entry_tokens=12, ticket=restore.take_id
    )
    assert _run(state, core.Received(_envelope(late), 6.0)) == [core.DiscardStaged("st-late")]


def test_ending_an_ssd_lease_drops_the_staged_bytes_nobody_took() -> None:
    """Releasing an ssd lease, its deadline passing, or its grant reaching nobody drops the
    staged bytes (a no-op for bytes the holder already materialized)."""
    for ending in ("release", "deadline", "undelivered"):
        state = _state(lease_ttl_s=10.0)
        _, effects = _take(state)
        find_id = _sent(state, _ask(effects))
        restore = _ask(_run(state, core.Received(_envelope(_found(9, 9), causation=find_id), 0.0)))
        ok = RestoreResult(
            ok=True, path="/f.kvt", staging_id="st-9", entry_tokens=9, ticket=restore.take_id
        )
        result, _ = _answer(_run(state, core.Received(_envelope(ok), 0.0)))
        assert result.lease_id is not None
        if ending == "release":
            effects = _run(state, core.Received(_envelope(Release(lease_id=result.lease_id)), 1.0))
        elif ending == "deadline":
            effects = _run(state, core.Received(_envelope(Release(lease_id="x")), 10.0))
        else:
            effects = _run(state, core.LeaseUndelivered(result.lease_id, 1.0))
        assert effects == [core.DiscardStaged("st-9")], ending
        assert core.stats(state).active_leases == 0


def test_ram_answers_at_once_when_no_file_could_serve_more() -> None:
    """A told Take, a RAM hit of everything but the last token, or too many lookups in flight
    never ask the index."""
    state = _state(max_cold_lookups=1)
    _put(state, "full", PROMPT)
    take = _envelope(Take(tokens=PROMPT, reply_to="gateway"))
    result, to = _answer(_run(state, core.Received(take, 0.0)))
    assert (result.cached_tokens, to) == (len(PROMPT) - 1, None)
    told = _envelope(Take(tokens=(7, 8, 9)))
    assert not any(isinstance(e, core.AskCold) for e in _run(state, core.Received(told, 0.0)))
    first = _envelope(Take(tokens=(7, 8, 9), reply_to="gateway"))
    assert any(isinstance(e, core.AskCold) for e in _run(state, core.Received(first, 0.0)))
    second = _envelope(Take(tokens=(7, 8, 10), reply_to="gateway"))
    effects = _run(state, core.Received(second, 0.0))
    assert not any(isinstance(e, core.AskCold) for e in effects)
    assert _answer(effects)[0] == TakeResult()


def test_an_index_that_cannot_be_reached_is_a_miss() -> None:
    """An ask the shell could not send answers RAM's candidate and counts a failure."""
    state = _state()
    take, effects = _take(state)
    result, to = _answer(_run(state, core.ColdAskUndelivered(_ask(effects).take_id, 0.0)))
    assert (to, result) == (take, TakeResult())
    assert core.stats(state).ssd_failures == 1


def test_idle_entries_are_demoted_a_few_per_scan_and_never_while_leased() -> None:
    """Entries unused for demote_idle_s leave as Enqueue(source="demote"), oldest first, at
    most demote_batch per scan and one scan per demote_scan_s; a leased entry stays; the
    alarm is set for when the next one is due."""
    state = _state(demote_idle_s=10.0, demote_batch=2, demote_scan_s=3.0, cold_lookups=False)
    for i, handle in enumerate("abcd"):
        _put(state, handle, (i + 50, 1), now=float(i))
    take = _envelope(Take(tokens=(53, 1, 2), reply_to="gateway"))
    _run(state, core.Received(take, 4.0))  # leases "d" (and touches it)
    _, effects = core.handle(state, core.Received(_envelope(Release(lease_id="none")), 9.9))
    assert not any(isinstance(e, core.Spill) for e in effects)
    assert [e for e in effects if isinstance(e, core.SetAlarm)] == []  # already set for 10.0
    assert state.alarm_at == 10.0
    _, effects = core.handle(state, core.Received(_envelope(core_wake()), 12.0))
    spilled = [e.message for e in effects if isinstance(e, core.Spill)]
    assert [(m.handle, m.source) for m in spilled] == [("a", "demote"), ("b", "demote")]
    assert state.alarm_at == 15.0  # "c" is due, but the next scan comes at 12 + 3
    _, effects = core.handle(state, core.Received(_envelope(core_wake()), 15.0))
    assert [e.message.handle for e in effects if isinstance(e, core.Spill)] == ["c"]
    assert "d" in state.entries  # leased
    assert core.stats(state).demotions == 3


def core_wake() -> Body:
    """The alarm's message."""
    from messages.prompt_cache import PromptCacheWake

    return PromptCacheWake()


def test_a_stored_put_is_announced_to_the_durability_coordinator() -> None:
    """With notify_puts, every stored put ends with NotifyPut (a refused one does not)."""
    state = _state(notify_puts=True, cap_bytes=15)
    put = Put(tokens=(1, 2), handle="h", meta=_meta(2))
    effects = _run(state, core.Received(_envelope(put), 0.0))
    assert core.NotifyPut("", (1, 2), "h") in effects
    big = Put(tokens=(3, 4), handle="big", meta=_meta(2, nbytes=100))
    effects = _run(state, core.Received(_envelope(big), 0.0))
    assert not any(isinstance(e, core.NotifyPut) for e in effects)
    assert [e.message for e in effects if isinstance(e, core.Spill)] == [
        Enqueue(handle="big", tokens=(3, 4), meta=_meta(2, nbytes=100), source="evict")
    ]


_STEP = st.sampled_from(["take", "find_more", "find_none", "restore_ok", "restore_bad", "tick", "release"])


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(_STEP, max_size=40))
def test_every_take_is_answered_once_and_every_staged_byte_has_one_owner(steps: list[str]) -> None:
    """Over random interleavings of takes, index answers (more, none, restored, failed, late)
    and time: every Take is answered exactly once, and every staged id is either handed to
    exactly one asker or dropped exactly once (never both, never twice)."""
    state = _state(cold_timeout_s=3.0, max_cold_lookups=3, lease_ttl_s=7.0)
    _put(state, "ram", PROMPT[:4])
    now = 0.0
    takes: list[Envelope] = []
    answers: Counter[str] = Counter()
    given_out: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    leases: list[str] = []
    staged = itertools.count()

    def apply(event: core.Event) -> None:
        _, effects = core.handle(state, event)
        for e in effects:
            if isinstance(e, core.Reply) and isinstance(e.body, TakeResult):
                to = e.to if e.to is not None else getattr(event, "envelope", None)
                assert to is not None
                answers[to.msg_id] += 1
                if e.body.staging_id is not None:
                    given_out[e.body.staging_id] += 1
                if e.body.lease_id is not None:
                    leases.append(e.body.lease_id)
            elif isinstance(e, core.DiscardStaged):
                dropped[e.staging_id] += 1
            elif isinstance(e, core.AskCold):
                apply(core.ColdAskSent(e.take_id, f"ask-{e.take_id}-{type(e.body).__name__}", now))

    for step in steps:
        if step == "take":
            env = _envelope(Take(tokens=PROMPT, reply_to="gateway"))
            takes.append(env)
            apply(core.Received(env, now))
        elif step in ("find_more", "find_none") and state.pending:
            take_id = next(iter(state.pending))
            found = _found(10, 12) if step == "find_more" else FindResult()
            apply(core.Received(_envelope(found, causation=f"ask-{take_id}-Find"), now))
        elif step in ("restore_ok", "restore_bad"):
            # NOTE: answers may also come for lookups that already ended (late).
            ticket = next(iter(state.pending), "take-gone")
            sid = f"st-{next(staged)}"
            ok = step == "restore_ok"
            restored = RestoreResult(
                ok=ok, path="/f.kvt", staging_id=sid if ok else None, entry_tokens=12, ticket=ticket
            )
            if ok:
                given_out[sid] += 0
            apply(core.Received(_envelope(restored), now))
        elif step == "tick":
            now += 2.0
            apply(core.Received(_envelope(core_wake()), now))
        elif step == "release" and leases:
            apply(core.Received(_envelope(Release(lease_id=leases.pop(0))), now))
    now += 100.0  # every lookup and lease past its deadline
    apply(core.Received(_envelope(core_wake()), now))
    assert all(answers[t.msg_id] == 1 for t in takes)
    for sid in given_out:
        handed, gone = given_out[sid], dropped[sid]
        # NOTE: a handed-out id is dropped once more when its lease ends (a no-op if taken).
        assert (handed, gone) in ((0, 1), (1, 1)), (sid, handed, gone)
