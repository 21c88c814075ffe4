"""Hypothesis state machine: the prompt cache core against an independent reference model.

The reference is written from the rules in ``docs/prompt-cache.md``, not from
the core: the usable prefix is found by brute force over every length, LRU
order is an explicit recency list, and the room check sums what leases keep
alive. It predicts every effect (which handles are disposed, which spilled)
as well as every Take answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors.prompt_cache import core as core
from messages import EntryMeta, Put, PutResult, Release, Take, TakeResult

CAP = 100
TTL = 10.0
tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=6).map(tuple)
ns_st = st.sampled_from(["", "lora"])


@dataclass
class RefEntry:
    """The reference model's view of one entry the cache still holds."""

    ns: str
    tokens: tuple[int, ...]
    nbytes: int
    trimmable: bool
    min_offset: int
    leases: int = 0
    indexed: bool = True
    fate: str = "dispose"


def ref_usable(e: RefEntry, prompt: tuple[int, ...]) -> int:
    """The longest k (1 <= k <= len(prompt) - 1) that ``e`` can serve, by trying every k."""
    best = 0
    for k in range(1, len(prompt)):
        if e.tokens[:k] != prompt[:k]:
            break
        exact = k == len(e.tokens)
        if exact or (e.trimmable and k >= e.min_offset):
            best = k
    return best


class PromptCacheMachine(RuleBasedStateMachine):
    """Drives Take/Put/Release on the core and on the reference; they must agree exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.state = core.CoreState(cap_bytes=CAP)
        self.spill = False
        self.ref: dict[str, RefEntry] = {}
        self.recency: list[str] = []  # indexed handles, least recently used first
        self.next_handle = 0
        self.leases: dict[str, str] = {}
        self.deadlines: dict[str, float] = {}
        self.now = 0.0
        self.finished: set[str] = set()

    @initialize(spill=st.booleans())
    def start(self, spill: bool) -> None:
        """Start with or without a cold tier's queue to spill to."""
        self.spill = spill
        self.state = core.CoreState(cap_bytes=CAP, spill_enabled=spill, lease_ttl_s=TTL)

    # -- reference helpers -------------------------------------------------------

    def _retained(self) -> int:
        return sum(e.nbytes for e in self.ref.values())

    def _unindex(self, handle: str, fate: str, expect: dict[str, str]) -> None:
        e = self.ref[handle]
        e.indexed = False
        e.fate = fate
        self.recency.remove(handle)
        if e.leases == 0:
            del self.ref[handle]
            expect[handle] = "spill" if fate == "spill" and self.spill else "dispose"

    def _check_effects(self, effects: list[core.Effect], expect: dict[str, str]) -> None:
        got: dict[str, str] = {}
        for effect in effects:
            if isinstance(effect, core.Dispose | core.Spill):
                assert effect.handle not in got, "handle finished twice in one message"
                assert effect.handle not in self.finished, "handle finished twice"
                assert effect.handle not in self.leases.values(), "finished while leased"
                got[effect.handle] = "spill" if isinstance(effect, core.Spill) else "dispose"
        assert got == expect
        self.finished.update(got)

    # -- rules -------------------------------------------------------------------

    @rule(
        tokens=tokens_st,
        ns=ns_st,
        nbytes=st.integers(1, 120),
        trimmable=st.booleans(),
        min_offset=st.integers(0, 6),
    )
    def put(self, tokens: tuple[int, ...], ns: str, nbytes: int, trimmable: bool, min_offset: int) -> None:
        """A put stores, replaces, supersedes and evicts exactly as the reference predicts."""
        self.next_handle += 1
        handle = f"h{self.next_handle}"
        min_offset = min(min_offset, len(tokens))
        meta = EntryMeta(
            offset=len(tokens), nbytes=nbytes, trimmable=trimmable, min_reusable_offset=min_offset
        )
        effects = core.put(self.state, Put(tokens=tokens, namespace=ns, handle=handle, meta=meta))
        reply = effects[-1]
        assert isinstance(reply, core.Reply)
        result = reply.body
        assert isinstance(result, PutResult)
        expect: dict[str, str] = {}

        kept_alive = sum(e.nbytes for e in self.ref.values() if e.leases > 0)
        if nbytes > CAP or kept_alive + nbytes > CAP:
            assert result.reason == ("too_large" if nbytes > CAP else "no_room")
            expect[handle] = "spill" if self.spill else "dispose"
            self._check_effects(effects, expect)
            return

        displaced = [
            h
            for h in self.recency
            if self.ref[h].ns == ns
            and (
                self.ref[h].tokens == tokens
                or (
                    trimmable
                    and len(self.ref[h].tokens) < len(tokens)
                    and tokens[: len(self.ref[h].tokens)] == self.ref[h].tokens
                    and min_offset <= len(self.ref[h].tokens)
                )
            )
        ]
        for h in displaced:
            self._unindex(h, "dispose", expect)
        self.ref[handle] = RefEntry(ns, tokens, nbytes, trimmable, min_offset)
        self.recency.append(handle)
        evicted = 0
        while self._retained() > CAP:
            victim = next(h for h in self.recency if self.ref[h].leases == 0)
            assert victim != handle
            self._unindex(victim, "spill", expect)
            evicted += 1
        assert result.stored
        assert result.replaced + result.superseded == len(displaced)
        assert result.evicted == evicted
        self._check_effects(effects, expect)

    @precondition(lambda self: bool(self.ref))
    @rule(
        data=st.data(),
        cut=st.integers(0, 6),
        tail=st.lists(st.integers(0, 1), max_size=3).map(tuple),
        nbytes=st.integers(1, 60),
        trimmable=st.booleans(),
        min_offset=st.integers(0, 6),
    )
    def put_related(
        self,
        data: st.DataObject,
        cut: int,
        tail: tuple[int, ...],
        nbytes: int,
        trimmable: bool,
        min_offset: int,
    ) -> None:
        """Put a duplicate, ancestor, descendant or sibling of a held entry (the interesting cases)."""
        e = self.ref[data.draw(st.sampled_from(sorted(self.ref)))]
        tokens = (e.tokens[: max(1, len(e.tokens) - cut)] + tail) or e.tokens
        self.put(tokens, e.ns, nbytes, trimmable, min_offset)

    @precondition(lambda self: bool(self.ref))
    @rule(data=st.data(), cut=st.integers(0, 6), tail=st.lists(st.integers(0, 1), max_size=3).map(tuple))
    def take_related(self, data: st.DataObject, cut: int, tail: tuple[int, ...]) -> None:
        """Take a prompt that shares a prefix with a held entry."""
        e = self.ref[data.draw(st.sampled_from(sorted(self.ref)))]
        self.take(e.tokens[: max(0, len(e.tokens) - cut)] + tail, e.ns)

    @rule(prompt=tokens_st, ns=ns_st)
    def take(self, prompt: tuple[int, ...], ns: str) -> None:
        """Take serves the longest usable prefix; ties go to the shorter, then the newer entry."""
        self.now += 1.0
        (reply,) = core.take(self.state, Take(tokens=prompt, namespace=ns), self.now)
        assert isinstance(reply, core.Reply)
        result = reply.body
        assert isinstance(result, TakeResult)
        usable = {h: ref_usable(self.ref[h], prompt) for h in self.recency if self.ref[h].ns == ns}
        longest = max(usable.values(), default=0)
        if longest == 0:
            assert (result.handle, result.lease_id, result.cached_tokens) == (None, None, 0)
            return
        best = [h for h, u in usable.items() if u == longest]
        shortest = min(len(self.ref[h].tokens) for h in best)
        expected = [h for h in self.recency if h in best and len(self.ref[h].tokens) == shortest][-1]
        assert result.handle == expected
        assert result.cached_tokens == longest
        assert result.entry_tokens == len(self.ref[expected].tokens)
        assert prompt[:longest] == self.ref[expected].tokens[:longest]
        assert result.lease_id is not None
        self.ref[expected].leases += 1
        self.recency.remove(expected)
        self.recency.append(expected)
        self.leases[result.lease_id] = expected
        self.deadlines[result.lease_id] = self.now + TTL

    def _end_lease(self, lease_id: str, expect: dict[str, str]) -> None:
        handle = self.leases.pop(lease_id)
        del self.deadlines[lease_id]
        e = self.ref[handle]
        e.leases -= 1
        if e.leases == 0 and not e.indexed:
            del self.ref[handle]
            expect[handle] = "spill" if e.fate == "spill" and self.spill else "dispose"

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data(), how=st.sampled_from(["release", "undelivered"]))
    def release(self, data: st.DataObject, how: str) -> None:
        """Releasing (or a grant that reached nobody) finishes an entry only when it left the
        index and this was its last lease."""
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        if how == "release":
            effects = core.release(self.state, Release(lease_id=lease_id))
        else:
            effects = core.lease_undelivered(self.state, core.LeaseUndelivered(lease_id))
        expect: dict[str, str] = {}
        self._end_lease(lease_id, expect)
        self._check_effects(effects, expect)
        assert core.release(self.state, Release(lease_id=lease_id)) == []  # idempotent

    @rule(dt=st.floats(0.0, 2 * TTL))
    def advance(self, dt: float) -> None:
        """Time passes: every lease past its deadline ends, as if released."""
        self.now += dt
        effects = core.expire_leases(self.state, self.now)
        expect: dict[str, str] = {}
        for lease_id in [k for k, d in self.deadlines.items() if d <= self.now]:
            self._end_lease(lease_id, expect)
        self._check_effects(effects, expect)

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def cap_never_exceeded(self) -> None:
        """Indexed plus pinned bytes stay within the cap and match the reference."""
        stats = core.stats(self.state)
        assert stats.retained_bytes == stats.bytes + stats.pinned_bytes <= CAP
        assert stats.retained_bytes == self._retained()
        assert stats.bytes == sum(self.ref[h].nbytes for h in self.recency)

    @invariant()
    def same_entries(self) -> None:
        """The core holds exactly the reference's indexed and pinned entries."""
        indexed = {h for h, e in self.state.entries.items() if e.indexed}
        assert indexed == set(self.recency)
        assert set(self.state.entries) == set(self.ref)
        assert self.finished.isdisjoint(self.state.entries)
        assert core.stats(self.state).active_leases == len(self.leases)


PromptCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPromptCacheRules = PromptCacheMachine.TestCase
