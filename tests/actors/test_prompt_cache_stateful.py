"""Hypothesis state machine: the prompt cache core against a small reference model."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors import _prompt_cache_core as core
from messages import EntryMeta, Put, Release, Take, TakeResult

CAP = 100
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)
ns_st = st.sampled_from(["", "lora"])


@dataclass
class RefEntry:
    """The reference model's view of one stored entry."""

    handle: str
    ns: str
    tokens: tuple[int, ...]
    nbytes: int
    trimmable: bool
    min_offset: int
    used: int
    leases: int = 0
    indexed: bool = True


def _prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PromptCacheMachine(RuleBasedStateMachine):
    """Drives Take/Put/Release on the core and on a naive model; they must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.state = core.CoreState(cap_bytes=CAP)
        self.ref: dict[str, RefEntry] = {}
        self.clock = 0
        self.next_handle = 0
        self.leases: dict[str, str] = {}
        self.finished: set[str] = set()

    # -- reference rules ---------------------------------------------------------

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _ref_usable(self, e: RefEntry, prompt: tuple[int, ...]) -> int:
        usable = min(_prefix(e.tokens, prompt), len(prompt) - 1)
        if usable <= 0:
            return 0
        if usable < len(e.tokens) and (not e.trimmable or usable < e.min_offset):
            return 0
        return usable

    def _ref_drop(self, e: RefEntry) -> None:
        e.indexed = False
        if e.leases == 0:
            del self.ref[e.handle]

    def _apply(self, effects: list[core.Effect]) -> None:
        for effect in effects:
            if isinstance(effect, core.Dispose | core.Spill):
                assert effect.handle not in self.finished, "handle finished twice"
                entry = self.state.entries.get(effect.handle)
                assert entry is None, "a finished handle is still tracked"
                for handle in self.leases.values():
                    assert handle != effect.handle, "disposed while leased"
                self.finished.add(effect.handle)

    # -- rules ----------------------------------------------------------------------

    @rule(
        tokens=tokens_st,
        ns=ns_st,
        nbytes=st.integers(1, 120),
        trimmable=st.booleans(),
        min_frac=st.integers(0, 6),
    )
    def put(self, tokens: tuple[int, ...], ns: str, nbytes: int, trimmable: bool, min_frac: int) -> None:
        """Put a fresh handle; the reference applies replace/supersede/evict/too-large."""
        self.next_handle += 1
        handle = f"h{self.next_handle}"
        min_offset = min(min_frac, len(tokens))
        meta = EntryMeta(
            offset=len(tokens), nbytes=nbytes, trimmable=trimmable, min_reusable_offset=min_offset
        )
        effects = core.put(self.state, Put(tokens=tokens, namespace=ns, handle=handle, meta=meta))
        self._apply(effects)
        if nbytes > CAP:
            self.finished.add(handle) if handle not in self.finished else None
            assert handle not in self.state.entries
            return
        for e in list(self.ref.values()):
            if not e.indexed or e.ns != ns:
                continue
            if e.tokens == tokens or (
                trimmable
                and len(e.tokens) < len(tokens)
                and tokens[: len(e.tokens)] == e.tokens
                and min_offset <= len(e.tokens)
            ):
                self._ref_drop(e)
        self.ref[handle] = RefEntry(handle, ns, tokens, nbytes, trimmable, min_offset, self._tick())
        while sum(e.nbytes for e in self.ref.values() if e.indexed) > CAP:
            victim = min(
                (e for e in self.ref.values() if e.indexed and e.handle != handle),
                key=lambda e: e.used,
            )
            self._ref_drop(victim)

    @rule(prompt=tokens_st, ns=ns_st)
    def take(self, prompt: tuple[int, ...], ns: str) -> None:
        """Take agrees with the reference's longest usable prefix (and tie-break)."""
        (reply,) = core.take(self.state, Take(tokens=prompt, namespace=ns))
        assert isinstance(reply, core.Reply)
        result = reply.body
        assert isinstance(result, TakeResult)
        best: RefEntry | None = None
        best_key: tuple[int, int, int] = (0, 0, 0)
        for e in self.ref.values():
            if not e.indexed or e.ns != ns:
                continue
            usable = self._ref_usable(e, prompt)
            key = (usable, -len(e.tokens), e.used)
            if usable > 0 and (best is None or key > best_key):
                best, best_key = e, key
        if best is None:
            assert result.handle is None
            assert result.cached_tokens == 0
            return
        assert result.handle == best.handle
        assert result.cached_tokens == best_key[0]
        assert 1 <= result.cached_tokens <= len(prompt) - 1
        assert result.lease_id is not None
        best.leases += 1
        best.used = self._tick()
        self.leases[result.lease_id] = best.handle

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Releasing a lease finishes an entry only once it is unindexed and unleased."""
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        handle = self.leases.pop(lease_id)
        effects = core.release(self.state, Release(lease_id=lease_id))
        self._apply(effects)
        e = self.ref[handle]
        e.leases -= 1
        if e.leases == 0 and not e.indexed:
            del self.ref[handle]
            assert [x.handle for x in effects if isinstance(x, core.Dispose)] == [handle]
        else:
            assert effects == []

    # -- invariants ---------------------------------------------------------------

    @invariant()
    def cap_never_exceeded(self) -> None:
        """Indexed bytes stay within the cap and match the reference."""
        stats = core.stats(self.state)
        assert stats.bytes <= CAP
        assert stats.bytes == sum(e.nbytes for e in self.ref.values() if e.indexed)

    @invariant()
    def same_entries(self) -> None:
        """The core holds exactly the reference's indexed and pinned entries."""
        indexed = {h for h, e in self.state.entries.items() if e.indexed}
        assert indexed == {h for h, e in self.ref.items() if e.indexed}
        assert set(self.state.entries) == set(self.ref)
        assert self.finished.isdisjoint(self.state.entries)


PromptCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPromptCacheRules = PromptCacheMachine.TestCase
