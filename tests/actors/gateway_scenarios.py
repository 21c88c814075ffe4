"""Gateway scenarios for the simulated runtime (``module:function`` for record/replay).

The engine and the prompt cache here are scripted fakes on purpose: the
subject is the turn protocol (admission, lookups, lane, engine-turn token,
cancellation, drain), not the model. Every turn the fake runs records the
gateway's live core state, and the scenario checks the invariants over the
whole run, so a bad interleaving fails it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from actors.engine_thread import (
    BackgroundSteps,
    InlineExecutor,
    Registered,
    StepHandle,
    StepResult,
    StepToken,
)
from actors.gateway import Gateway, TurnRunner
from actors.runtime import Actor, Context, SimulatedSystem
from messages import Body, Envelope, Release, Take, TakeResult
from messages.gateway import (
    AdmissionReply,
    AwaitDrained,
    BeginShutdown,
    CancelGeneration,
    DoneEvent,
    Drained,
    Generate,
    GenerationParams,
    RunWhenIdle,
    TokenEvent,
    TurnDone,
)
from tests.actors.runtime.demo_messages import Count, Ping, Pong


@dataclass(frozen=True)
class Seen:
    """The gateway's core as a step saw it while running on the (fake) engine."""

    owner: str
    holder: str | None
    lane: str | None
    queued: int
    lane_had_turns: bool
    lane_cancelled: bool = False
    lane_ready: bool = False


def observe(gateway: Gateway, owner: str) -> Seen:
    """Snapshot the core from inside a running turn."""
    state = gateway.state
    lane = state.lane
    return Seen(
        owner,
        state.holder(),
        lane,
        len(state.queue),
        state.lane_had_turns,
        state.lane_cancelled,
        lane is not None and state.ready(lane),
    )


@dataclass
class _FakeGen:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    cursor: int = 0
    emitted: int = 0
    cached_tokens: int = 0


class ScriptedBackend:
    """A fake engine: prefill in chunks of ``chunk`` tokens, then deterministic tokens.

    Token ``i`` of a request is ``(sum(prompt) + 7 * i) % 50``; token 0 acts as
    EOS. Every step records (turn owner, lane, queue length) from the gateway's
    core, which the scenario checks afterwards.
    """

    def __init__(self, gateway: Gateway, log: list[Seen], *, chunk: int = 4) -> None:
        self._gateway = gateway
        self._log = log
        self._chunk = chunk

    def open(
        self,
        request: Generate,
        handle: str | None,
        cached_tokens: int,
        *,
        staging_id: str | None = None,
    ) -> _FakeGen:
        """A fake generation state for ``request`` (it "reuses" what the lookup found, RAM or SSD)."""
        gen = _FakeGen(request.request_id, request.prompt_tokens, request.params.max_tokens)
        gen.cursor = gen.cached_tokens = cached_tokens if handle or staging_id else 0
        return gen

    def step(self, gen: _FakeGen) -> StepResult:
        """One scripted prefill chunk or decode step."""
        self._log.append(observe(self._gateway, f"request:{gen.request_id}"))
        remaining = len(gen.prompt) - gen.cursor
        if remaining > 1:
            gen.cursor += min(self._chunk, remaining - 1)
            return StepResult(phase="prefill", prefill_complete=len(gen.prompt) - gen.cursor <= 1)
        token = (sum(gen.prompt) + 7 * gen.emitted) % 50
        gen.emitted += 1
        finish: Any = None
        if token == 0:
            finish = "stop"
        elif gen.emitted >= gen.max_tokens:
            finish = "length"
        return StepResult(phase="decode", token=StepToken(token, f"<{token}>"), finish_reason=finish)

    def snapshot(self, gen: _FakeGen) -> Registered | None:
        """No prompt cache in these scenarios."""
        return None

    def register(self, gen: _FakeGen) -> Registered | None:
        """No prompt cache in these scenarios."""
        return None

    def discard(self, gen: _FakeGen) -> None:
        """Nothing to free."""

    def end_turn(self) -> None:
        """Nothing to drain."""


@dataclass
class Outcomes:
    """What every client saw, by request id (filled by the ``Client`` actors), and the leases."""

    admissions: dict[str, AdmissionReply] = field(default_factory=dict)
    events: dict[str, list[Body]] = field(default_factory=lambda: defaultdict(list))
    turn_done: list[TurnDone] = field(default_factory=list)
    steps: dict[str, StepHandle[str]] = field(default_factory=dict)
    leases: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)


class FakePromptCache(Actor):
    """Answers each ``Take`` at once: a hit (a lease on 2 tokens) for odd-length prompts, else a miss."""

    def __init__(self, out: Outcomes) -> None:
        self._out = out

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Answer lookups; record releases."""
        body = envelope.body
        if isinstance(body, Take):
            result = TakeResult()
            if len(body.tokens) % 2:
                lease = f"lease-{len(self._out.leases)}"
                self._out.leases.append(lease)
                result = TakeResult(lease_id=lease, handle=f"h-{lease}", cached_tokens=2, entry_tokens=2)
            await ctx.reply(envelope, result)
        elif isinstance(body, Release):
            self._out.released.append(body.lease_id)


class Client(Actor):
    """A requester that is an actor: admission replies and stream events land in its mailbox.

    On ``Count`` it sends its ``Generate``; with ``cancel_after`` it cancels
    (a client disconnect) after that many tokens.
    """

    def __init__(self, out: Outcomes, request: Generate, cancel_after: int = 0) -> None:
        self._out = out
        self._request = request
        self._cancel_after = cancel_after
        self._seen = 0

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Send the request on the kick, record what arrives, cancel when told to."""
        body = envelope.body
        if isinstance(body, Count):
            await ctx.tell("gateway", self._request.model_copy(update={"reply_to": ctx.name, "stream_to": ctx.name}))
        elif isinstance(body, AdmissionReply):
            self._out.admissions[body.request_id] = body
        elif isinstance(body, TokenEvent | DoneEvent):
            self._out.events[body.request_id].append(body)
            self._seen += isinstance(body, TokenEvent)
            if self._seen == self._cancel_after and isinstance(body, TokenEvent):
                await ctx.tell("gateway", CancelGeneration(request_id=body.request_id))
        elif isinstance(body, Ping):
            # NOTE: FIFO mailbox: answering proves everything sent earlier arrived.
            await ctx.reply(envelope, Pong(n=body.n))


class Writer(Actor):
    """A background actor: asks for ``total`` engine turns, one after another (like an SSD writer)."""

    def __init__(self, out: Outcomes, steps: BackgroundSteps, make_step: Any, total: int) -> None:
        self._out = out
        self._steps = steps
        self._make_step = make_step
        self._total = total
        self._next = 0

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Ask for the next turn on the kick and after each ``TurnDone``."""
        body = envelope.body
        if isinstance(body, TurnDone):
            self._out.turn_done.append(body)
        if isinstance(body, Count | TurnDone) and self._next < self._total:
            step_id = f"bg-{self._next}"
            self._next += 1
            self._out.steps[step_id] = self._steps.add(step_id, self._make_step(step_id))
            await ctx.tell("gateway", RunWhenIdle(step_id=step_id, reply_to=ctx.name))


def check(out: Outcomes, log: list[Seen]) -> None:
    """The protocol's invariants over one finished run."""
    for i, seen in enumerate(log):
        # One turn at a time: whoever runs holds the token.
        assert seen.holder == seen.owner, f"{seen.owner} ran but the holder is {seen.holder}"
        if seen.owner.startswith("background:"):
            # Never while a request is active; a request may have arrived (or
            # finished its lookup) during this step (lane reserved, no turn yet) ...
            assert not seen.lane_had_turns, f"{seen.owner} ran inside request {seen.lane}"
            # ... and once ready it waits for this one step only.
            following = log[i + 1] if i + 1 < len(log) else None
            if seen.lane_ready and following is not None and following.lane == seen.lane:
                assert following.owner == f"request:{seen.lane}", f"{seen.lane} waited past {seen.owner}"
        else:
            assert seen.owner == f"request:{seen.lane}", f"{seen.owner} ran but the lane is {seen.lane}"
    # A cancelled lane holder (bursts included) runs at most the one step in flight.
    after_cancel = [s.owner for s in log if s.owner.startswith("request:") and s.lane_cancelled]
    assert len(after_cancel) == len(set(after_cancel)), f"steps after a cancel: {after_cancel}"
    for rid, reply in out.admissions.items():
        events = out.events.get(rid, [])
        if not reply.accepted:
            assert events == [], f"refused {rid} got events"
            continue
        assert events, f"admitted {rid} got no events"
        assert isinstance(events[-1], DoneEvent), f"{rid} did not end with DoneEvent"
        assert sum(isinstance(e, DoneEvent) for e in events) == 1
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert [t.index for t in tokens] == list(range(len(tokens)))
        assert events[-1].usage.completion_tokens == len(tokens)
    assert all(t.ok for t in out.turn_done)
    # Every step that was granted ran once, and its asker's handle holds the outcome.
    for done in out.turn_done:
        assert out.steps[done.step_id].result() == done.step_id
    # Every lease a lookup took was given back exactly once.
    assert sorted(out.released) == sorted(out.leases), (out.leases, out.released)


async def token_protocol(
    system: SimulatedSystem,
    *,
    requests: int = 4,
    background: int = 4,
    max_queue: int = 2,
    max_tokens: int = 8,
    cancel_after: int = 2,
    max_burst: int = 3,
) -> None:
    """Clients, a background writer, a client disconnect and a drain race through the gateway.

    Decode turns are bursts of up to ``max_burst`` steps (1: one step per turn).
    """
    out = Outcomes()
    log: list[Seen] = []
    steps = BackgroundSteps()
    gateway = Gateway(
        runner="runner", max_queue=max_queue, max_burst=max_burst, prompt_cache="prompt_cache"
    )
    backend = ScriptedBackend(gateway, log)
    system.spawn("prompt_cache", lambda: FakePromptCache(out), capacity=16)
    system.spawn("gateway", lambda: gateway, capacity=32)
    system.spawn(
        "runner",
        lambda: TurnRunner(
            gateway="gateway",
            executor=InlineExecutor(),
            backend=backend,
            steps=steps,
            prompt_cache="prompt_cache",
            chain_steps=False,
        ),
        capacity=16,
    )

    def make_step(name: str) -> Any:
        def run() -> str:
            log.append(observe(gateway, f"background:{name}"))
            return name

        return run

    system.spawn("writer", lambda: Writer(out, steps, make_step, background), capacity=16)
    for i in range(requests):
        request = Generate(
            request_id=f"r{i}",
            prompt_tokens=tuple(range(1, 8 + 3 * i)),
            params=GenerationParams(max_tokens=max_tokens),
        )
        cancel = cancel_after if i == 1 else 0
        system.spawn(f"client-{i}", lambda r=request, c=cancel: Client(out, r, c), capacity=64)  # type: ignore[misc]
    await system.tell("writer", Count(n=0))
    for i in range(requests):
        await system.tell(f"client-{i}", Count(n=i))
    for i in range(requests):
        await system.ask(f"client-{i}", Ping(n=i), timeout=60.0, expect=Pong)
    await system.tell("gateway", BeginShutdown())
    await system.ask("gateway", AwaitDrained(), timeout=60.0, expect=Drained)
    for i in range(requests):
        await system.ask(f"client-{i}", Ping(n=i), timeout=60.0, expect=Pong)
    check(out, log)
    assert len(out.admissions) == requests
