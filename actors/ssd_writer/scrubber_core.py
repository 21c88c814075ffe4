"""The idle scrubber's rules as a sans-IO core: ``handle(state, event) -> (state, effects)``.

One round per wake: ask the gateway for an idle engine turn, ask the index
for the next file, re-verify it on the worker pool, remove it when it is
bad, report to the index, and arm the next wake. The shell
(``actors/ssd_writer/scrubber.py``) performs each effect and feeds its
outcome back as the next event; every effect whose outcome the rules need
(:class:`AskIdle`, :class:`AskPick`, :class:`Verify`, :class:`RemoveBad`)
comes last in its batch.

Rules kept here (``tests/actors/ssd_writer/test_scrubber_core.py``):

- a round that checks nothing (engine busy, nothing indexed, the index
  did not answer) arms the next wake ``interval_s`` later; one that read
  ``n`` bytes arms it ``max(interval_s, n / bytes_per_s)`` later, so the
  reads stay under ``bytes_per_s`` on average;
- a bad file is removed (and reported ``removed``) unless the tier is
  read-only, which the index's answer says; a read-only tier is not asked
  again for an idle turn: its rounds end at once;
- one round at a time: a wake during a round is ignored (the round arms
  the next one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, assert_never

from messages.ssd_writer import ScrubReport, ScrubTarget

__all__ = [
    "Arm",
    "AskIdle",
    "AskPick",
    "BadRemoved",
    "Effect",
    "Event",
    "IdleAnswered",
    "Log",
    "Picked",
    "RemoveBad",
    "Report",
    "ScrubberState",
    "Started",
    "Verified",
    "Verify",
    "Woke",
    "handle",
]

VerifyOutcome = Literal["ok", "corrupt", "gone", "io_error"]


@dataclass
class ScrubberState:
    """The scrubber's settings and its round in progress."""

    interval_s: float
    bytes_per_s: float
    idle_wait_s: float
    read_only: bool = False
    """Learned from the index's answer (a read-only tier never changes in a run)."""
    target: ScrubTarget | None = None
    """The file being checked in this round."""
    in_round: bool = False
    removing: bool = False
    """The bad target's removal is under way (its outcome ends the round)."""
    error: str = ""
    """Why the target failed its check (for the log line after its removal)."""
    rounds: int = 0


# --- events (shell -> core) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Started:
    """The actor started at ``now``."""

    now: float


@dataclass(frozen=True, slots=True)
class Woke:
    """The alarm went off (a ``ScrubWake``)."""

    now: float


@dataclass(frozen=True, slots=True)
class IdleAnswered:
    """The gateway's answer to :class:`AskIdle`: the gate step ran (``ok``) or not in time."""

    ok: bool
    now: float


@dataclass(frozen=True, slots=True)
class Picked:
    """The index's answer to :class:`AskPick` (``None``: it did not answer in time)."""

    target: ScrubTarget | None
    now: float


@dataclass(frozen=True, slots=True)
class Verified:
    """How re-verifying the target went; ``nbytes`` checked when ``ok``."""

    outcome: VerifyOutcome
    now: float
    nbytes: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class BadRemoved:
    """The outcome of :class:`RemoveBad`: ``removed`` durably (unlink and directory fsync)."""

    removed: bool
    now: float


Event = Started | Woke | IdleAnswered | Picked | Verified | BadRemoved


# --- effects (core -> shell) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arm:
    """Set the one alarm to wake the scrubber at ``at``."""

    at: float


@dataclass(frozen=True, slots=True)
class AskIdle:
    """Ask the gateway for one idle turn of the gate step, waiting until ``deadline`` -> IdleAnswered."""

    deadline: float


@dataclass(frozen=True, slots=True)
class AskPick:
    """Ask the index for the next file (``ScrubPick``) -> :class:`Picked`."""


@dataclass(frozen=True, slots=True)
class Verify:
    """Re-check ``path`` against the index's facts, every tensor's hash -> :class:`Verified`."""

    path: str
    namespace: str
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RemoveBad:
    """Remove ``path`` durably -> :class:`BadRemoved`."""

    path: str


@dataclass(frozen=True, slots=True)
class Report:
    """Tell the index how the round went."""

    body: ScrubReport


@dataclass(frozen=True, slots=True)
class Log:
    """Write one warning: ``event`` about ``path`` (``error``; ``removed`` for a bad file)."""

    event: str
    path: str
    error: str = ""
    removed: bool | None = None


Effect = Arm | AskIdle | AskPick | Verify | RemoveBad | Report | Log


# --- rules ----------------------------------------------------------------------------------


def _end(state: ScrubberState, now: float, checked: int) -> list[Effect]:
    """End the round: the next wake, later when it read many bytes."""
    state.in_round = False
    state.target = None
    state.removing = False
    state.error = ""
    state.rounds += 1
    if state.interval_s <= 0:
        return []  # NOTE: no scrubbing in this run: never armed.
    wait = max(state.interval_s, checked / state.bytes_per_s)
    return [Arm(now + wait)]


def _woke(state: ScrubberState, now: float) -> list[Effect]:
    if state.in_round:
        return []  # NOTE: the round in progress arms the next wake itself.
    if state.read_only:
        return _end(state, now, 0)
    state.in_round = True
    return [AskIdle(now + state.idle_wait_s)]


def _picked(state: ScrubberState, event: Picked) -> list[Effect]:
    target = event.target
    if target is None:
        return _end(state, event.now, 0)  # NOTE: the index is restarting or stopping.
    state.read_only = target.read_only
    if target.path is None:
        return _end(state, event.now, 0)
    state.target = target
    return [Verify(target.path, target.namespace, target.tokens)]


def _verified(state: ScrubberState, event: Verified) -> list[Effect]:
    target = state.target
    if target is None or target.path is None or state.removing:
        raise ValueError("a verification outside a round")
    path = target.path
    match event.outcome:
        case "ok":
            return [Report(ScrubReport(path=path, ok=True, bytes=event.nbytes)),
                    *_end(state, event.now, event.nbytes)]
        case "corrupt":
            if not state.read_only:
                state.removing, state.error = True, event.error
                return [RemoveBad(path)]
            return [
                Log("ssd_cache.scrub_corrupt", path, event.error, removed=False),
                Report(ScrubReport(path=path, ok=False, reason="corrupt", removed=False)),
                *_end(state, event.now, target.file_bytes),
            ]
        case "gone":
            return [Report(ScrubReport(path=path, ok=False, reason="gone")),
                    *_end(state, event.now, 0)]
        case "io_error":
            return [
                Log("ssd_cache.scrub_failed", path, event.error),
                Report(ScrubReport(path=path, ok=False, reason="io_error")),
                *_end(state, event.now, 0),
            ]
        case _:
            assert_never(event.outcome)


def _bad_removed(state: ScrubberState, event: BadRemoved) -> list[Effect]:
    target = state.target
    if target is None or target.path is None or not state.removing:
        raise ValueError("a removal outside a round")
    path = target.path
    return [
        Log("ssd_cache.scrub_corrupt", path, state.error, removed=event.removed),
        Report(ScrubReport(path=path, ok=False, reason="corrupt", removed=event.removed)),
        *_end(state, event.now, target.file_bytes),
    ]


def handle(state: ScrubberState, event: Event) -> tuple[ScrubberState, list[Effect]]:
    """Apply one event; return the state with the effects to perform, in order.

    An outcome outside the round that asked for it raises ``ValueError``
    before anything changes.
    """
    effects: list[Effect]
    if isinstance(event, IdleAnswered | Picked) and (not state.in_round or state.target):
        raise ValueError("an answer outside a round")
    match event:
        case Started(now=now):
            effects = [Arm(now + state.interval_s)] if state.interval_s > 0 else []
        case Woke(now=now):
            effects = _woke(state, now)
        case IdleAnswered(ok=ok, now=now):
            effects = [AskPick()] if ok else _end(state, now, 0)
        case Picked():
            effects = _picked(state, event)
        case Verified():
            effects = _verified(state, event)
        case BadRemoved():
            effects = _bad_removed(state, event)
        case _:
            assert_never(event)
    return state, effects
