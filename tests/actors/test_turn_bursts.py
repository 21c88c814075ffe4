"""Decode bursts on a real engine thread: tokens stream per step, a cancel stops the burst after the running step, a slow consumer bounds it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from actors.engine_thread import AHEAD, BackgroundSteps, Registered, StepResult, StepToken
from actors.gateway import Gateway, TurnRunner
from actors.runtime import ActorSystem, Inbox, MailboxClosed, Supervision
from kernels import EngineThread
from messages import Body
from messages.gateway import (
    AdmissionReply,
    CancelGeneration,
    DoneEvent,
    Generate,
    GenerationParams,
    TokenEvent,
)
from tests.actors.polling import until

pytestmark = pytest.mark.anyio

PROMPT = (1, 2, 3, 4, 5)


@dataclass
class _Gen:
    max_tokens: int
    prefilled: bool = False
    emitted: int = 0
    cached_tokens: int = 0


class GatedBackend:
    """A fake engine: one prefill chunk, then token ``i + 1`` per decode step (never EOS).

    Decode step ``gate_at`` (0-based) blocks on the engine thread until the
    test releases it, so the test can act while that exact step runs.
    ``decode_steps`` counts decode steps run (written on the engine thread).
    """

    def __init__(self, gate_at: int | None = None) -> None:
        self.gate_at = gate_at
        self.entered = threading.Event()
        self.release = threading.Event()
        self.decode_steps = 0
        self.threads: set[str] = set()

    def open(
        self,
        request: Generate,
        handle: str | None,
        cached_tokens: int,
        *,
        staging_id: str | None = None,
    ) -> _Gen:
        """A fresh fake generation."""
        return _Gen(request.params.max_tokens)

    def step(self, gen: _Gen) -> StepResult:
        """The prefill chunk first, then one decode step (gated at ``gate_at``)."""
        self.threads.add(threading.current_thread().name)
        if not gen.prefilled:
            gen.prefilled = True
            return StepResult(phase="prefill", prefill_complete=True)
        if gen.emitted == self.gate_at:
            self.entered.set()
            assert self.release.wait(10), "the test never released the gated step"
        gen.emitted += 1
        self.decode_steps += 1
        finish: Any = "length" if gen.emitted >= gen.max_tokens else None
        return StepResult(phase="decode", token=StepToken(gen.emitted, f"<{gen.emitted}>"), finish_reason=finish)

    def snapshot(self, gen: _Gen) -> Registered | None:
        """No prompt cache here."""
        return None

    def register(self, gen: _Gen) -> Registered | None:
        """No prompt cache here."""
        return None

    def discard(self, gen: _Gen) -> None:
        """Nothing to free."""

    def end_turn(self) -> None:
        """Nothing to drain."""


async def _stream(inbox: Inbox) -> list[Body]:
    out: list[Body] = []
    with anyio.fail_after(10):
        while True:
            try:
                out.append((await inbox.receive()).body)
            except MailboxClosed:
                return out


class _Rig:
    """Gateway + runner on a real ``EngineThread``, bursts of ``max_burst`` steps."""

    def __init__(self, system: ActorSystem, backend: GatedBackend, max_burst: int) -> None:
        self.system = system
        self.gateway = Gateway(runner="runner", max_queue=2, max_burst=max_burst)
        self.thread = EngineThread(name="kvtier-engine-test", max_queue=2)
        self.runner = TurnRunner(
            gateway="gateway",
            executor=self.thread,
            backend=backend,
            steps=BackgroundSteps(),
        )
        system.spawn("gateway", lambda: self.gateway, supervision=Supervision("resume"))
        system.spawn("runner", lambda: self.runner, supervision=Supervision("resume"))

    def stopping(self) -> bool:
        """Whether the runner has set its running burst's stop flag (it handled StopBurst)."""
        turn = self.runner.state.turn
        return turn is not None and turn.stop

    async def admit(self, request_id: str, max_tokens: int, capacity: int) -> Inbox:
        inbox = self.system.open_inbox(capacity, prefix=f"stream-{request_id}-")
        request = Generate(
            request_id=request_id,
            prompt_tokens=PROMPT,
            params=GenerationParams(max_tokens=max_tokens),
            stream_to=inbox.address,
        )
        reply = await self.system.ask("gateway", request, timeout=5, expect=AdmissionReply)
        assert reply.accepted, reply
        return inbox


async def test_tokens_stream_one_by_one_while_the_burst_still_runs() -> None:
    """Every token reaches the stream as its step ends, while the burst (one grant, no report yet) goes on on the engine thread."""
    backend = GatedBackend(gate_at=5)
    async with ActorSystem() as system:
        rig = _Rig(system, backend, max_burst=64)
        inbox = await rig.admit("r", max_tokens=20, capacity=64)
        await until(backend.entered.is_set)
        early = [(await inbox.receive()).body for _ in range(5)]
        stats = rig.gateway.state.stats
        # NOTE: one prefill turn reported, one decode burst granted and still running.
        grants, decode_reported = stats.request_turns, stats.decode_turns
        backend.release.set()
        rest = await _stream(inbox)
        await until(lambda: rig.gateway.state.idle)
        await rig.thread.aclose()
    assert [e.index for e in early if isinstance(e, TokenEvent)] == [0, 1, 2, 3, 4]
    assert (grants, decode_reported) == (2, 0)
    tokens = [e for e in early + rest if isinstance(e, TokenEvent)]
    assert [t.token_id for t in tokens] == list(range(1, 21))
    done = rest[-1]
    assert isinstance(done, DoneEvent)
    assert done.finish_reason == "length"
    assert rig.gateway.state.stats.decode_turns == 20
    assert rig.gateway.state.stats.request_turns == 2
    assert backend.threads == {"kvtier-engine-test"}


async def test_cancel_during_a_burst_stops_it_after_the_running_step() -> None:
    """A cancel that reaches the gateway while decode step k runs ends the burst with step k: k + 1 steps in all, the lane is free, the stream ends cancelled."""
    backend = GatedBackend(gate_at=7)
    async with ActorSystem() as system:
        rig = _Rig(system, backend, max_burst=1000)
        inbox = await rig.admit("r", max_tokens=1000, capacity=64)
        await until(backend.entered.is_set)
        await system.tell("gateway", CancelGeneration(request_id="r"))
        # NOTE: the cancel travels as messages (gateway -> StopBurst -> runner)
        # while step 7 runs; the runner's stop flag is set before the step ends.
        await until(rig.stopping)
        backend.release.set()
        events = await _stream(inbox)
        await until(lambda: rig.gateway.state.idle)
        await rig.thread.aclose()
        leftover = (rig.runner.state.turn, rig.runner.state.live, rig.runner.state.running)
    assert backend.decode_steps == 8
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.index for t in tokens] == list(range(8))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert done.finish_reason == "cancelled"
    stats = rig.gateway.state.stats
    assert (stats.cancelled, stats.preempted, stats.decode_turns) == (1, 1, 8)
    assert rig.gateway.state.lane is None
    assert leftover == (None, {}, None)


async def test_a_slow_consumer_parks_the_burst_exactly_within_its_look_ahead() -> None:
    """While nobody reads a full stream the engine thread runs at most AHEAD steps past what the runner took, then parks (no job left); reading resumes it and every token arrives in order."""
    backend = GatedBackend()
    async with ActorSystem() as system:
        rig = _Rig(system, backend, max_burst=1000)
        inbox = await rig.admit("r", max_tokens=60, capacity=2)

        def parked() -> bool:
            # NOTE: the stream is full and the engine thread holds no job: the
            # runner is blocked handing over the next token and starts nothing.
            return inbox.statistics().depth == 2 and rig.thread.statistics().queue_depth == 0

        await until(parked)
        steps_parked = backend.decode_steps
        taken = inbox.statistics().depth + 1  # NOTE: 2 in the stream, 1 the runner holds.
        events = await _stream(inbox)
        await until(lambda: rig.gateway.state.idle)
        await rig.thread.aclose()
    # NOTE: the chain ends once it is AHEAD steps past what the runner took
    # (at most `taken`), or earlier: the token that found the stream full
    # stops the chain after the step running then (runner_core._stream_full),
    # which is the step of that token itself when the loop outran the
    # engine thread. So it ran every step the runner took, and at most AHEAD more.
    assert taken <= steps_parked <= taken + AHEAD
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.token_id for t in tokens] == list(range(1, 61))
    assert isinstance(events[-1], DoneEvent)
    assert rig.gateway.state.stats.decode_turns == 60
