"""The gateway never waits forever for a turn: a failing turn or runner fails its request and frees the lane;
a failure always reaches the gateway and the stream, however full their mailboxes are; an abandoned
``RunWhenIdle`` is never granted later."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from actors.engine_thread import BackgroundSteps, InlineExecutor, StepResult, StepToken
from actors.gateway import Gateway, TurnRunner
from actors.runtime import (
    Actor,
    ActorSystem,
    AskTimeout,
    Context,
    Inbox,
    MailboxClosed,
    Supervision,
)
from messages import Body, Envelope
from messages.gateway import (
    AdmissionReply,
    CancelGeneration,
    DoneEvent,
    ErrorEvent,
    Generate,
    GenerationParams,
    RunTurn,
    RunWhenIdle,
    TokenEvent,
    TurnDone,
)
from tests.actors.polling import until

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


class FailingBackend(ScriptedBackend):
    """The scripted engine, but the decode step number ``fail_at`` (1-based) raises on the engine thread."""

    def __init__(self, gateway: Gateway, fail_at: int) -> None:
        super().__init__(gateway, [])
        self._fail_at = fail_at
        self._decoded = 0

    def step(self, gen: Any) -> StepResult:
        """Like the scripted step until ``fail_at``."""
        result = super().step(gen)
        if result.phase == "decode":
            self._decoded += 1
            if self._decoded == self._fail_at:
                raise RuntimeError("forward pass failed")
        return result


class FloodingRunner(Actor):
    """A turn runner whose handler fills the gateway's mailbox with ordinary messages, then raises."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Flood, then fail, on every turn."""
        if isinstance(envelope.body, RunTurn):
            # NOTE: one event loop: the gateway cannot read while this handler runs.
            while ctx.try_tell("gateway", CancelGeneration(request_id="nobody")):
                pass
            raise RuntimeError("runner bug")


async def _admit(
    system: ActorSystem, request_id: str, max_tokens: int = 4, capacity: int = 16
) -> Inbox:
    inbox = system.open_inbox(capacity, prefix=f"stream-{request_id}-")
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
        await until(lambda: gateway.state.idle)
        failures = system.statistics().actors
    assert isinstance(bad_events[-1], ErrorEvent)
    assert bad_events[-1].error_code == "ValidationError"
    assert not any(isinstance(e, TokenEvent | DoneEvent) for e in bad_events)
    assert isinstance(good_events[-1], DoneEvent)
    assert good_events[-1].usage.completion_tokens == 4
    assert gateway.state.stats.failed == 1
    assert gateway.state.stats.completed == 1
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
        await until(lambda: gateway.state.idle)
    for events in (first_events, second_events):
        assert len(events) == 1
        assert isinstance(events[0], ErrorEvent)
        assert events[0].error_code == "turn_failed"
    assert not done.ok
    assert done.error_code == "turn_failed"
    assert gateway.state.stats.failed == 2
    assert gateway.state.lane is None
    # NOTE: a stopped runner saw only the first turn; the gateway failed the rest itself.
    assert runner.turns == (3 if policy == "resume" else 1)


async def test_a_runner_failure_reaches_a_gateway_whose_mailbox_is_full() -> None:
    """The runtime's Failure answer to a RunTurn fits in the gateway's reserved room even when ordinary traffic filled its mailbox, so the request still fails instead of hanging."""
    gateway = Gateway(runner="runner", max_queue=2)
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: gateway, capacity=4, supervision=Supervision("resume"))
        system.spawn("runner", FloodingRunner, supervision=Supervision("resume"))
        events = await _stream(await _admit(system, "r1"))
        await until(lambda: gateway.state.idle)
        dead = [d.reason for d in system.dead_letters()]
    assert len(events) == 1
    assert isinstance(events[0], ErrorEvent)
    assert events[0].error_code == "turn_failed"
    assert "reply slot full" not in dead


async def test_a_stream_that_is_full_when_its_turn_fails_still_ends_with_the_error() -> None:
    """The final ErrorEvent uses the stream's reserved slot: a reader that fell behind sees every token, then the error, never a silent end."""
    gateway = Gateway(runner="runner", max_queue=1)
    backend = FailingBackend(gateway, fail_at=3)
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: gateway, supervision=Supervision("resume"))
        system.spawn(
            "runner",
            lambda: TurnRunner(
                gateway="gateway", executor=InlineExecutor(), backend=backend, steps=BackgroundSteps()
            ),
            supervision=Supervision("resume"),
        )
        inbox = await _admit(system, "r1", max_tokens=8, capacity=2)
        # NOTE: nobody reads until the request is over: the 2 tokens fill the stream.
        await until(lambda: gateway.state.idle)
        events = await _stream(inbox)
    assert [type(e) for e in events] == [TokenEvent, TokenEvent, ErrorEvent]
    error = events[-1]
    assert isinstance(error, ErrorEvent)
    assert (error.error_code, error.detail) == ("RuntimeError", "forward pass failed")
    assert gateway.state.stats.failed == 1


async def test_a_timed_out_run_when_idle_is_never_granted_later() -> None:
    """A RunWhenIdle whose ask timed out while a request held the lane is dropped: its step never runs and takes no grant; a later ask still runs."""
    gateway = Gateway(runner="runner", max_queue=1)
    ran: list[str] = []
    steps = BackgroundSteps()
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: gateway, supervision=Supervision("resume"))
        runner = TurnRunner(
            gateway="gateway",
            executor=InlineExecutor(),
            backend=ScriptedBackend(gateway, []),
            steps=steps,
        )
        system.spawn("runner", lambda: runner, supervision=Supervision("resume"))
        # NOTE: a stream nobody reads: the request holds the lane until it is read.
        held = await _admit(system, "r1", max_tokens=6, capacity=1)
        steps.add("late", lambda: ran.append("late"))
        with pytest.raises(AskTimeout):
            await system.ask("gateway", RunWhenIdle(step_id="late"), timeout=0.05)
        await _stream(held)
        await until(lambda: gateway.state.idle)
        granted_before = gateway.state.stats.background_turns
        steps.add("later", lambda: ran.append("later"))
        with anyio.fail_after(10):
            done = await system.ask("gateway", RunWhenIdle(step_id="later"), timeout=10, expect=TurnDone)
    assert granted_before == 0
    assert done.ok
    assert ran == ["later"]
    assert gateway.state.stats.background_expired == 1
