"""Helpers to drive the durability core by plain calls (no runtime)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from actors.durability import core
from messages import (
    Body,
    CoversResult,
    EntryMeta,
    Envelope,
    SpillOutcome,
    SpillsDrained,
    SpillSettled,
    SsdStats,
)
from messages.durability import Flush, FlushResult, Schedule, Wake
from messages.gateway import TurnDone

_ids = itertools.count()


def env(body: Body, correlation: str = "c-ext", receiver: str = "durability") -> Envelope:
    """An envelope around ``body`` as the runtime would deliver it."""
    return Envelope(f"m-{next(_ids)}", correlation, None, "peer", receiver, 0.0, body)


def meta(ntok: int, nbytes: int = 100) -> EntryMeta:
    """Metadata of a trimmable entry of ``ntok`` tokens."""
    return EntryMeta(offset=ntok, nbytes=nbytes, trimmable=True, min_reusable_offset=0)


def ssd_stats(entries: int = 0, longest: int = 0, nbytes: int = 0, max_bytes: int = 0) -> SsdStats:
    """An SsdStats answer with ``entries`` files of ``nbytes`` in all under ``max_bytes``, the longest holding ``longest`` tokens."""
    zeros = dict.fromkeys(
        [
            "bytes",
            "reserved_bytes",
            "max_bytes",
            "finds",
            "restores",
            "restore_failures",
            "spills",
            "store_failures",
            "too_large",
            "disk_full",
            "evicted",
            "replaced",
            "superseded",
            "corrupt_removed",
            "orphans_reaped",
            "foreign_dirs",
            "choices_restore",
            "choices_recompute",
        ],
        0,
    )
    return SsdStats.model_validate(
        {
            **zeros,
            "ready": True,
            "read_only": False,
            "entries": entries,
            "restore_ms_last": 0.0,
            "longest_entry_tokens": longest,
            "bytes": nbytes,
            "max_bytes": max_bytes,
        }
    )


@dataclass
class Driver:
    """Holds a core state and a clock; every call returns the effects of one event."""

    config: core.DurabilityConfig = field(default_factory=core.DurabilityConfig)
    now: float = 0.0

    def __post_init__(self) -> None:
        self.state = core.DurabilityState(config=self.config)
        self.log: list[core.Effect] = []

    def _do(self, event: core.Event) -> list[core.Effect]:
        self.state, effects = core.handle(self.state, event)
        self.log.extend(effects)
        return effects

    def deliver(self, body: Body, *, correlation: str = "c-ext") -> list[core.Effect]:
        """Deliver ``body`` (a reply when ``correlation`` is a ref)."""
        return self._do(core.Received(env(body, correlation), self.now))

    def schedule(self, tokens: tuple[int, ...], handle: str, ns: str = "") -> list[core.Effect]:
        """A put of ``tokens`` under ``handle``."""
        return self.deliver(Schedule(namespace=ns, tokens=tokens, handle=handle))

    def wake(self, at: float | None = None) -> list[core.Effect]:
        """The alarm goes off at ``at`` (default: when it was set)."""
        alarm = self.state.alarm_at
        assert at is not None or alarm is not None
        self.now = at if at is not None else alarm  # type: ignore[assignment]
        return self.deliver(Wake())

    def stop(self) -> list[core.Effect]:
        """The coordinator stops."""
        return self._do(core.Stopping(self.now))

    def flush(self) -> tuple[Envelope, list[core.Effect]]:
        """Ask for a flush; the request envelope (answered later) and the effects."""
        request = env(Flush(reply_to="asker"))
        return request, self._do(core.Received(request, self.now))

    def covers(self, ref: str, covered: bool) -> list[core.Effect]:
        """The SSD index answers the Covers ``ref``."""
        return self.deliver(CoversResult(covered=covered, entry_tokens=0), correlation=ref)

    def turn(
        self, ref: str, clone: core.CloneOutcome | None, *, error: str = ""
    ) -> list[core.Effect]:
        """The gateway answers the RunWhenIdle ``ref`` (the step's outcome with it)."""
        done = TurnDone(step_id=ref, ok=clone is not None, error_code=error)
        return self._do(core.Received(env(done, ref), self.now, clone))

    def settle(
        self, ref: str, handle: str, outcome: SpillOutcome, reason: str = ""
    ) -> list[core.Effect]:
        """The spill queue settles the Enqueue ``ref``."""
        body = SpillSettled(handle=handle, source="snapshot", outcome=outcome, reason=reason)
        return self.deliver(body, correlation=ref)

    def drained(self, ref: str) -> list[core.Effect]:
        """The spill queue answers the DrainSpills ``ref``."""
        body = SpillsDrained(enqueued=0, stored=0, dropped=0, failed=0, refused=0)
        return self.deliver(body, correlation=ref)

    def stats_reply(self, ref: str, entries: int = 0, longest: int = 0, nbytes: int = 0,
                    max_bytes: int = 0) -> list[core.Effect]:
        """The SSD index answers the SsdStatsRequest ``ref``."""
        return self.deliver(ssd_stats(entries, longest, nbytes, max_bytes), correlation=ref)


def sends(effects: list[core.Effect]) -> list[core.Send]:
    """The Send effects, in order."""
    return [e for e in effects if isinstance(e, core.Send)]


def only_send(effects: list[core.Effect], kind: str) -> core.Send:
    """The one Send of body ``kind`` among ``effects``."""
    found = [e for e in sends(effects) if e.body.kind == kind]
    assert len(found) == 1, (kind, effects)
    return found[0]


def only_clone(effects: list[core.Effect]) -> core.RunClone:
    """The one RunClone among ``effects``."""
    found = [e for e in effects if isinstance(e, core.RunClone)]
    assert len(found) == 1, effects
    return found[0]


def results(effects: list[core.Effect]) -> list[FlushResult]:
    """FlushResult answers among ``effects``."""
    return [
        e.body for e in effects if isinstance(e, core.Answer) and isinstance(e.body, FlushResult)
    ]


def cloned(handle: str, ntok: int) -> core.Cloned:
    """A clone step that produced ``handle`` for an entry of ``ntok`` tokens."""
    return core.Cloned(handle, meta(ntok))
