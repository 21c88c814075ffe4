"""Prompt-cache lookups run while a request waits for its turn, never inside one; their leases never leak."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from actors.engine_thread import BackgroundSteps, InlineExecutor, StepResult
from actors.gateway import Gateway, TurnRunner
from actors.runtime import Actor, ActorSystem, Context, Inbox, MailboxClosed, Supervision
from messages import Body, Envelope, Release, Take, TakeResult
from messages.gateway import (
    AdmissionReply,
    CancelGeneration,
    DoneEvent,
    Generate,
    GenerationParams,
    RunWhenIdle,
    TurnDone,
)
from tests.actors.polling import until

from .gateway_scenarios import ScriptedBackend

pytestmark = pytest.mark.anyio


class SlowPromptCache(Actor):
    """A prompt cache that holds every ``Take`` until the test answers it (``answer``), always with a hit."""

    def __init__(self) -> None:
        self.pending: list[Envelope] = []
        self.takes = 0
        self.released: list[str] = []
        self.ctx: Context | None = None

    async def started(self, ctx: Context) -> None:
        """Keep the context so the test can answer from outside."""
        self.ctx = ctx

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Hold lookups; record releases."""
        body = envelope.body
        if isinstance(body, Take):
            self.takes += 1
            self.pending.append(envelope)
        elif isinstance(body, Release):
            self.released.append(body.lease_id)

    async def answer(self) -> str:
        """Answer the oldest held lookup (waiting for one) with a hit on 2 tokens; its lease id."""
        assert self.ctx is not None
        await until(lambda: bool(self.pending))
        envelope = self.pending.pop(0)
        lease = f"lease-{self.takes}-{len(self.pending)}"
        await self.ctx.reply(envelope, TakeResult(lease_id=lease, handle="h", cached_tokens=2, entry_tokens=2))
        return lease


async def _stream(inbox: Inbox) -> list[Body]:
    out: list[Body] = []
    with anyio.fail_after(10):
        while True:
            try:
                out.append((await inbox.receive()).body)
            except MailboxClosed:
                return out


class _Rig:
    """Gateway + runner (inline engine, scripted backend) + a slow prompt cache."""

    def __init__(self, system: ActorSystem) -> None:
        self.system = system
        self.cache = SlowPromptCache()
        self.gateway = Gateway(runner="runner", max_queue=2, prompt_cache="cache")
        self.steps = BackgroundSteps()
        runner = TurnRunner(
            gateway="gateway",
            executor=InlineExecutor(),
            backend=ScriptedBackend(self.gateway, []),
            steps=self.steps,
            prompt_cache="cache",
        )
        system.spawn("cache", lambda: self.cache)
        system.spawn("gateway", lambda: self.gateway, supervision=Supervision("resume"))
        system.spawn("runner", lambda: runner, supervision=Supervision("resume"))

    async def admit(self, request_id: str, capacity: int = 16) -> Inbox:
        inbox = self.system.open_inbox(capacity, prefix=f"stream-{request_id}-")
        request = Generate(
            request_id=request_id,
            prompt_tokens=(1, 2, 3, 4, 5),
            params=GenerationParams(max_tokens=4),
            stream_to=inbox.address,
        )
        reply = await self.system.ask("gateway", request, timeout=5, expect=AdmissionReply)
        assert reply.accepted, reply
        return inbox


async def test_a_slow_lookup_does_not_hold_the_engine_turn() -> None:
    """While a request's Take is unanswered no turn is held: a background step is granted and runs meanwhile; the request runs once its lookup answers and releases the lease."""
    ran: list[str] = []
    async with ActorSystem() as system:
        rig = _Rig(system)
        inbox = await rig.admit("r1")
        await until(lambda: len(rig.cache.pending) == 1)
        rig.steps.add("bg", lambda: ran.append("bg"))
        with anyio.fail_after(5):
            done = await system.ask("gateway", RunWhenIdle(step_id="bg"), timeout=5, expect=TurnDone)
        lookup_still_pending = len(rig.cache.pending)
        lease = await rig.cache.answer()
        events = await _stream(inbox)
        await until(lambda: rig.cache.released == [lease])
    assert done.ok
    assert ran == ["bg"]
    assert lookup_still_pending == 1
    final = events[-1]
    assert isinstance(final, DoneEvent)
    assert final.finish_reason in ("stop", "length")
    assert final.usage.cached_tokens == 2


async def test_the_next_request_looks_up_while_the_lane_holder_generates() -> None:
    """A queued request's Take is sent while the request ahead of it still holds the lane, so the lookup overlaps its turns."""
    async with ActorSystem() as system:
        rig = _Rig(system)
        first = await rig.admit("r1", capacity=1)
        await rig.cache.answer()
        # NOTE: r1's stream holds one event and is not read: r1 keeps the lane.
        await until(lambda: rig.gateway.state.lane_had_turns)
        second = await rig.admit("r2")
        await until(lambda: rig.cache.takes == 2)
        # NOTE: r1 still generates: it holds the lane (in a turn, or blocked on its full
        # stream between turns), or it parked, blocked, for r2 (its generation open).
        state = rig.gateway.state
        overlapped = ((state.lane == "r1" and (state.turn is not None or state.lane_blocked))
                      or state.parked.get("r1") == "blocked")
        await rig.cache.answer()
        first_events = await _stream(first)
        second_events = await _stream(second)
    assert overlapped
    assert isinstance(first_events[-1], DoneEvent)
    assert isinstance(second_events[-1], DoneEvent)
    assert len(rig.cache.released) == 2


async def test_a_request_cancelled_during_its_lookup_gives_the_lease_back() -> None:
    """A request cancelled while its Take is outstanding ends cancelled with no turn, and the lease of the late answer is released."""
    async with ActorSystem() as system:
        rig = _Rig(system)
        inbox = await rig.admit("r1")
        await until(lambda: len(rig.cache.pending) == 1)
        await system.tell("gateway", CancelGeneration(request_id="r1"))
        events = await _stream(inbox)
        lease = await rig.cache.answer()
        await until(lambda: rig.cache.released == [lease])
        stats = rig.gateway.state.stats
    assert len(events) == 1
    assert isinstance(events[0], DoneEvent)
    assert events[0].finish_reason == "cancelled"
    assert (stats.request_turns, stats.cancelled) == (0, 1)


class _AskingBackend(ScriptedBackend):
    """A scripted backend that, inside r1's second step, asks the gateway for an idle-only step."""

    def __init__(self, gateway: Gateway, system: ActorSystem, reply_to: str) -> None:
        super().__init__(gateway, [])
        self._system = system
        self._reply_to = reply_to
        self.steps = 0
        self.asked_at: int | None = None

    def step(self, gen: Any) -> StepResult:
        """Step; the second time, tell the gateway an idle-only RunWhenIdle (the turn is in flight)."""
        self.steps += 1
        if self.steps == 2:
            ask = RunWhenIdle(step_id="drain", idle_only=True, reply_to=self._reply_to)
            assert self._system.try_tell("gateway", ask)
            self.asked_at = self.steps
        return super().step(gen)


async def test_an_idle_only_ask_is_answered_done_by_a_later_turn_without_running() -> None:
    """Under a request's turns, an idle-only ask is answered ok by the next turn's end; its step never runs and the engine never idled for it."""
    ran: list[str] = []
    async with ActorSystem() as system:
        answers = system.open_inbox(4, prefix="drain-")
        gateway = Gateway(runner="runner", max_queue=2, max_burst=1)
        steps = BackgroundSteps()
        steps.add("drain", lambda: ran.append("drain"))
        backend = _AskingBackend(gateway, system, answers.address)
        runner = TurnRunner(gateway="gateway", executor=InlineExecutor(), backend=backend, steps=steps)
        system.spawn("gateway", lambda: gateway, supervision=Supervision("resume"))
        system.spawn("runner", lambda: runner, supervision=Supervision("resume"))
        inbox = system.open_inbox(64, prefix="stream-r1-")
        request = Generate(request_id="r1", prompt_tokens=(1, 2, 3, 4, 5),
                           params=GenerationParams(max_tokens=40), stream_to=inbox.address)
        reply = await system.ask("gateway", request, timeout=5, expect=AdmissionReply)
        assert reply.accepted
        with anyio.fail_after(5):
            done = (await answers.receive()).body
        steps_when_answered = backend.steps
        events = await _stream(inbox)
    assert isinstance(done, TurnDone)
    assert done.ok
    assert ran == []
    assert gateway.state.stats.background_confirmed == 1
    # NOTE: answered by the first turn granted after the ask (the step after it), while r1 ran.
    assert backend.asked_at == 2
    assert steps_when_answered < backend.steps
    final = events[-1]
    assert isinstance(final, DoneEvent)
    assert final.usage.completion_tokens > steps_when_answered
