"""The gateway never waits forever for a turn: a failing turn or runner fails its request and frees the lane."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from actors.gateway import Gateway
from actors.gateway.runner import BackgroundSteps, InlineExecutor, StepResult, StepToken, TurnRunner
from actors.runtime import Actor, ActorSystem, Context, Inbox, MailboxClosed, Supervision
from messages import Body, Envelope
from messages.gateway import (
    AdmissionReply,
    DoneEvent,
    ErrorEvent,
    Generate,
    GenerationParams,
    RunTurn,
    RunWhenIdle,
    TokenEvent,
    TurnDone,
)

from .gateway_scenarios import ScriptedBackend, Seen

pytestmark = pytest.mark.anyio


class BuggyBackend(ScriptedBackend):
    """The scripted engine, but decode steps of ``bad`` return a malformed token (text ``None``).

    The step itself succeeds on the engine thread; the runner then fails while
    turning the result into a ``TokenEvent``: a bug outside the engine job.
    """

    def __init__(self, gateway: Gateway, bad: str) -> None:
        self._seen: list[Seen] = []
        super().__init__(gateway, self._seen)
        self._bad = bad

    def step(self, gen: Any) -> StepResult:
        """Like the scripted step; ``bad``'s tokens carry no text."""
        result = super().step(gen)
        if gen.request_id == self._bad and result.token is not None:
            broken = StepToken(result.token.token_id, None)  # type: ignore[arg-type]
            return StepResult(phase=result.phase, token=broken, finish_reason=result.finish_reason)
        return result


class CrashingRunner(Actor):
    """A turn runner whose handler raises on every ``RunTurn`` (counts them)."""

    def __init__(self) -> None:
        self.turns = 0

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Raise on every turn, as a runner with a bug would."""
        if isinstance(envelope.body, RunTurn):
            self.turns += 1
            raise RuntimeError("runner bug")


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(2000):
        if check():
            return
        await anyio.sleep(0.005)
    raise AssertionError("not reached within 10 s")


async def _admit(system: ActorSystem, request_id: str, max_tokens: int = 4) -> Inbox:
    inbox = system.open_inbox(16, prefix=f"stream-{request_id}-")
    request = Generate(
        request_id=request_id,
        prompt_tokens=(1, 2, 3, 4, 5),
        params=GenerationParams(max_tokens=max_tokens),
        stream_to=inbox.address,
    )
    reply = await system.ask("gateway", request, timeout=5, expect=AdmissionReply)
    assert reply.accepted, reply
    return inbox


async def _stream(inbox: Inbox) -> list[Body]:
    out: list[Body] = []
    with anyio.fail_after(10):
        while True:
            try:
                out.append((await inbox.receive()).body)
            except MailboxClosed:
                return out


async def test_runner_bug_outside_the_engine_job_fails_the_request_and_frees_the_lane() -> None:
    """A malformed step result fails that request with an ErrorEvent; the request queued behind it completes."""
    gateway = Gateway(runner="runner", max_queue=2)
    backend = BuggyBackend(gateway, bad="bad")
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: gateway, supervision=Supervision("resume"))
        system.spawn(
            "runner",
            lambda: TurnRunner(
                gateway="gateway", executor=InlineExecutor(), backend=backend, steps=BackgroundSteps()
            ),
            supervision=Supervision("resume"),
        )
        bad = await _admit(system, "bad")
        good = await _admit(system, "good")
        bad_events = await _stream(bad)
        good_events = await _stream(good)
        await _until(lambda: gateway.core.idle)
        failures = system.statistics().actors
    assert isinstance(bad_events[-1], ErrorEvent)
    assert bad_events[-1].error_code == "ValidationError"
    assert not any(isinstance(e, TokenEvent | DoneEvent) for e in bad_events)
    assert isinstance(good_events[-1], DoneEvent)
    assert good_events[-1].usage.completion_tokens == 4
    assert gateway.core.stats.failed == 1
    assert gateway.core.stats.completed == 1
    # NOTE: the runner handled the bug itself; no handler raised.
    assert sum(m.failed for m in failures) == 0


@pytest.mark.parametrize("policy", ["resume", "stop"])
async def test_runner_whose_handler_raises_fails_each_turn_without_hanging(policy: str) -> None:
    """A runner that raises (and then resumes, or stops for good) fails every request and background ask with a typed error."""
    gateway = Gateway(runner="runner", max_queue=2)
    runner = CrashingRunner()
    steps = BackgroundSteps()
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: gateway, supervision=Supervision("resume"))
        system.spawn("runner", lambda: runner, supervision=Supervision(policy))  # type: ignore[arg-type]
        first = await _admit(system, "r1")
        second = await _admit(system, "r2")
        first_events = await _stream(first)
        second_events = await _stream(second)
        steps.add("bg", lambda: None)
        with anyio.fail_after(10):
            done = await system.ask("gateway", RunWhenIdle(step_id="bg"), timeout=10, expect=TurnDone)
        await _until(lambda: gateway.core.idle)
    for events in (first_events, second_events):
        assert len(events) == 1
        assert isinstance(events[0], ErrorEvent)
        assert events[0].error_code == "turn_failed"
    assert not done.ok
    assert done.error_code == "turn_failed"
    assert gateway.core.stats.failed == 2
    assert gateway.core.lane is None
    # NOTE: a stopped runner saw only the first turn; the gateway failed the rest itself.
    assert runner.turns == (3 if policy == "resume" else 1)
