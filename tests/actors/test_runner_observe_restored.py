"""A request served from the SSD tier reports the prefill of its suffix (its landing left out), so
the restore-or-recompute estimator learns prefill speed on a restarted server too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from actors.engine_thread import StepResult, StepToken
from actors.gateway import runner_core as rc
from actors.gateway.burst import StepOutput
from actors.gateway.engine_work import EngineWork, Opening
from messages import TakeResult
from messages.gateway import Generate, GenerationParams, RunTurn

REQUEST = Generate(
    request_id="r1",
    prompt_tokens=tuple(range(100)),
    params=GenerationParams(max_tokens=8),
    stream_to="s1",
)
SSD = TakeResult(lease_id="L", staging_id="st", cached_tokens=60, entry_tokens=60, tier="ssd")


class Core:
    """The runner state plus ``handle``, so each test reads as a script."""

    def __init__(self) -> None:
        self.state = rc.RunnerState(keep_entries=True)

    def handle(self, event: rc.Event) -> list[rc.Effect]:
        self.state, effects = rc.handle(self.state, event)
        return effects


def _run(lookup: TakeResult | None, steps: list[tuple[float, float]]) -> list[rc.Observe]:
    """Grant at 0; prefill steps ending at ``t`` with ``open_s`` each (the last completes the
    prefill); one finishing decode step; the Observe effects."""
    core = Core()
    turn = RunTurn(
        owner="request",
        ident="r1",
        start=REQUEST,
        max_steps=len(steps),
        reply_to="gateway",
        lookup=lookup,
    )
    effects = core.handle(rc.TurnGranted(turn, "c-1", 0.0))
    cached = 0 if lookup is None else lookup.cached_tokens
    for n, (t, open_s) in enumerate(steps):
        last = n == len(steps) - 1
        result = StepResult(phase="prefill", prefill_complete=last)
        output = StepOutput(result, (), cached if n == 0 else None, open_s)
        effects += core.handle(rc.StepDone(output, t))
    end = steps[-1][0]
    effects += core.handle(rc.JobEnded(end))
    again = RunTurn(owner="request", ident="r1", max_steps=1, reply_to="gateway")
    effects += core.handle(rc.TurnGranted(again, "c-1", end + 0.1))
    decode = StepOutput(
        StepResult(phase="decode", token=StepToken(7, "<7>"), finish_reason="length")
    )
    effects += core.handle(rc.StepDone(decode, end + 0.2))
    effects += core.handle(rc.TokenDelivered(end + 0.2))
    return [e for e in effects if isinstance(e, rc.Observe)]


def test_an_ssd_hit_reports_its_suffix_prefill_without_the_landing() -> None:
    """60 tokens restored (landing 0.3 s of the first 0.5 s step), 40 prefilled in 0.5 + 0.25 s: 40 tokens, 0.45 s."""
    observed = _run(SSD, [(0.5, 0.3), (0.75, 0.0)])
    assert [(o.body.tokens, round(o.body.seconds, 9)) for o in observed] == [(40, 0.45)]


def test_a_ram_hit_leaves_out_its_copy_too() -> None:
    """A RAM hit's opening (the entry's copy) is not prefill either: 0.1 s of 0.4 s left out."""
    ram = TakeResult(lease_id="L", handle="h", cached_tokens=60, entry_tokens=60, tier="ram")
    observed = _run(ram, [(0.4, 0.1)])
    assert [(o.body.tokens, round(o.body.seconds, 9)) for o in observed] == [(40, 0.3)]


def test_an_ssd_hit_with_a_short_suffix_reports_nothing() -> None:
    """Fewer than 32 computed tokens (90 restored of 100) is mostly overhead: not reported."""
    short = SSD.model_copy(update={"cached_tokens": 90, "entry_tokens": 90})
    assert _run(short, [(0.5, 0.3)]) == []


def test_an_opening_that_took_the_whole_step_reports_nothing() -> None:
    """An opening reported longer than its step (clocks of two threads) leaves no prefill time: nothing reported."""
    assert _run(SSD, [(0.5, 0.9)]) == []


class _Backend:
    """Opens in a scripted time: ``open`` advances the scripted clock by ``open_s``."""

    def __init__(self, clock: list[float], open_s: float) -> None:
        self.clock = clock
        self.open_s = open_s
        self.staging_ids: list[str | None] = []

    def open(
        self,
        request: Generate,
        handle: str | None,
        cached_tokens: int,
        *,
        staging_id: str | None = None,
    ) -> Any:
        """Record, advance the clock, return a generation stand-in."""
        self.staging_ids.append(staging_id)
        self.clock[0] += self.open_s
        return _Gen(cached_tokens)

    def step(self, gen: Any) -> StepResult:
        """One prefill step (the clock does not move)."""
        return StepResult(phase="prefill", prefill_complete=True)

    def end_turn(self) -> None:
        """Nothing to end."""


class _Gen:
    def __init__(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens


def _clock(now: list[float]) -> Iterator[float]:
    while True:
        yield now[0]


def test_the_engine_half_times_the_opening_of_a_restored_request() -> None:
    """``EngineWork.step`` reports as ``open_s`` what the backend's open took (the landing), and 0 without an opening."""
    now = [10.0]
    backend = _Backend(now, open_s=0.25)
    ticks = _clock(now)
    work = EngineWork(backend, keep_entries=False, clock=lambda: next(ticks))  # type: ignore[arg-type]
    opening = Opening(REQUEST, cached_tokens=60, staging_id="st")
    first = work.step("r1", opening)
    assert (first.open_s, first.cached_tokens, backend.staging_ids) == (0.25, 60, ["st"])
    assert work.step("r1", None).open_s == 0.0
