"""The gateway actor: admission, the serial lane and the engine-turn token.

A thin async shell over :class:`actors._gateway_core.GatewayCore`: it turns
messages into core events (stamped with the injected clock) and performs the
core's effects as messages: admission replies, ``RunTurn`` to the turn runner
(``actors._turn.TurnRunner``), ``TurnDone`` replies to background askers.
It never awaits the engine itself, so admission and cancellation are handled
while a turn runs. See docs/engine-turn.md.

A turn that fails without a report (the runner's handler raised: the runtime
answers the ``RunTurn`` request with a ``Failure``; or the runner is gone and
the ``RunTurn`` cannot be sent) fails the request holding it with an
``ErrorEvent`` (code ``turn_failed``) and frees the lane, or answers the
background asker ``TurnDone(ok=False)``: the gateway never waits forever for
a report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from actors.runtime import Actor, Context, MailboxClosed, RuntimeFailure, UnknownAddress
from messages import Envelope, Failure
from messages.gateway import (
    AdmissionReply,
    AwaitDrained,
    BackgroundTurnReport,
    BeginShutdown,
    CancelGeneration,
    DoneEvent,
    Drained,
    EndRequest,
    ErrorEvent,
    Generate,
    RequestTurnReport,
    RunTurn,
    RunWhenIdle,
    ShutdownStarted,
    StopTurns,
    TurnDone,
    Usage,
)

from . import core
from .runner import TurnControl, end_stream

__all__ = ["Gateway"]


@dataclass(slots=True)
class _Admitted:
    request: Generate
    admitted_at: float
    correlation_id: str
    started: bool = False
    phase: Literal["prefill", "decode"] = "prefill"


class Gateway(Actor):
    """Admits requests into the serial lane and hands out engine turns one at a time.

    ``runner`` is the address of the turn runner; ``max_queue`` requests may
    wait behind the one holding the lane. ``max_burst`` > 1 grants the lane
    holder bursts of up to that many decode steps per turn; ``control`` (the
    same object the runner reads) is then required: it is how a cancel ends
    a burst after the step in flight.
    """

    def __init__(
        self,
        *,
        runner: str,
        max_queue: int,
        max_burst: int = 1,
        control: TurnControl | None = None,
    ) -> None:
        if max_burst > 1 and control is None:
            raise ValueError("bursts (max_burst > 1) need the TurnControl shared with the runner")
        self._runner = runner
        self._control = control if control is not None else TurnControl()
        self.core = core.GatewayCore(max_queue=max_queue, max_burst=max_burst)
        self._admitted: dict[str, _Admitted] = {}
        self._askers: dict[str, Envelope] = {}
        self._drain_waiters: list[Envelope] = []
        self._drained = False
        self._now = 0.0

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready statistics of the lane and the engine-turn token."""
        snap = self.core.snapshot(self._now)
        snap["background_asks_open"] = len(self._askers)
        return snap

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Translate one message into a core event and perform the effects."""
        now = ctx.clock.now()
        self._now = now
        body = envelope.body
        event: core.CoreEvent
        if isinstance(body, Generate):
            if body.request_id in self._admitted:
                await ctx.reply(
                    envelope,
                    AdmissionReply(
                        request_id=body.request_id,
                        accepted=False,
                        error_code="duplicate_id",
                        detail="a request with this id is already admitted",
                    ),
                )
                return
            self._admitted[body.request_id] = _Admitted(body, now, envelope.correlation_id)
            event = core.AdmitRequest(body.request_id, now)
        elif isinstance(body, CancelGeneration):
            await self._perform(self.core.handle(core.CancelRequest(body.request_id, now)), envelope, ctx)
            if self.core.lane != body.request_id:
                # NOTE: the request is gone (or was never here): drop a preempt
                # mark its requester may have set; a lane holder keeps its mark
                # until its burst reports.
                self._control.clear(body.request_id)
            return
        elif isinstance(body, RunWhenIdle):
            if body.step_id in self._askers:
                await ctx.reply(
                    envelope,
                    TurnDone(step_id=body.step_id, ok=False, error_code="duplicate_step"),
                )
                return
            self._askers[body.step_id] = envelope
            event = core.WantBackgroundTurn(body.step_id, now)
        elif isinstance(body, RequestTurnReport):
            if body.outcome != "continue":
                self._admitted.pop(body.request_id, None)
                self._control.clear(body.request_id)
            elif (entry := self._admitted.get(body.request_id)) is not None:
                entry.phase = body.phase
            event = core.RequestTurnDone(body.request_id, body.phase, body.outcome, now, body.steps)
        elif isinstance(body, BackgroundTurnReport):
            asker = self._askers.pop(body.step_id, None)
            if asker is not None:
                await ctx.reply(
                    asker,
                    TurnDone(
                        step_id=body.step_id,
                        ok=body.ok,
                        error_code=body.error_code,
                        detail=body.detail,
                    ),
                )
            event = core.BackgroundTurnDone(body.step_id, now)
        elif isinstance(body, BeginShutdown):
            event = core.BeginDrain(now)
            effects = self.core.handle(event)
            if body.reply_to:
                await ctx.reply(
                    envelope,
                    ShutdownStarted(
                        in_flight=0 if self.core.lane is None else 1, queued=len(self.core.queue)
                    ),
                )
            await self._perform(effects, envelope, ctx)
            return
        elif isinstance(body, AwaitDrained):
            if self._drained:
                await ctx.reply(envelope, Drained())
            else:
                self._drain_waiters.append(envelope)
            return
        elif isinstance(body, StopTurns):
            event = core.StopTurns(now)
        elif isinstance(body, Failure) and body.actor == self._runner:
            await self._turn_failed(f"{body.error}: {body.message}", envelope, ctx)
            return
        else:
            return
        await self._perform(self.core.handle(event), envelope, ctx)

    async def _run_turn(self, turn: RunTurn, correlation_id: str, envelope: Envelope, ctx: Context) -> None:
        """Send ``turn`` to the runner under the owner's correlation id; a runner that is gone fails it."""
        # NOTE: the explicit correlation id keeps every turn (and the tokens the
        # runner streams from it) on its request's id, whichever message the
        # gateway happened to be handling when it granted the turn.
        try:
            await ctx.ref(self._runner).tell(turn, correlation_id=correlation_id)
        except RuntimeFailure as exc:
            await self._turn_failed(f"the turn runner is unavailable ({exc!r})", envelope, ctx)

    async def _turn_failed(self, detail: str, envelope: Envelope, ctx: Context) -> None:
        """The turn in flight ended without a report: fail its owner and go on with the next."""
        turn = self.core.turn
        now = ctx.clock.now()
        if turn is None:
            return  # NOTE: nothing in flight: a stale failure changes nothing.
        if turn.owner == "request":
            entry = self._admitted.pop(turn.ident, None)
            phase: Literal["prefill", "decode"] = "prefill" if entry is None else entry.phase
            if entry is not None:
                stream_to = entry.request.stream_to
                error = ErrorEvent(request_id=turn.ident, error_code="turn_failed", detail=detail)
                try:
                    ctx.try_tell(stream_to, error)
                except (MailboxClosed, UnknownAddress):
                    pass
                end_stream(ctx, stream_to)
                if entry.started:
                    # NOTE: lets a live runner drop the request's state; a dead one cannot.
                    end = EndRequest(request_id=turn.ident, reason="failed")
                    await self._tell_runner(end, entry.correlation_id, ctx)
            event: core.CoreEvent = core.RequestTurnDone(turn.ident, phase, "failed", now)
        else:
            asker = self._askers.pop(turn.ident, None)
            if asker is not None:
                await ctx.reply(
                    asker,
                    TurnDone(step_id=turn.ident, ok=False, error_code="turn_failed", detail=detail),
                )
            event = core.BackgroundTurnDone(turn.ident, now)
        await self._perform(self.core.handle(event), envelope, ctx)

    async def _tell_runner(self, body: EndRequest, correlation_id: str | None, ctx: Context) -> None:
        try:
            await ctx.ref(self._runner).tell(body, correlation_id=correlation_id)
        except RuntimeFailure:
            pass  # NOTE: the runner is gone; it holds no state any more.

    async def _perform(self, effects: list[core.Effect], envelope: Envelope, ctx: Context) -> None:
        for effect in effects:
            if isinstance(effect, core.RequestAdmitted | core.RejectRequest):
                await self._answer_admission(effect, envelope, ctx)
            elif isinstance(effect, core.RunRequestTurn):
                entry = self._admitted.get(effect.request_id)
                start: Generate | None = None
                admitted_at = 0.0
                correlation = envelope.correlation_id
                if entry is not None:
                    correlation = entry.correlation_id
                    if not entry.started:
                        entry.started = True
                        start = entry.request
                        admitted_at = entry.admitted_at
                turn = RunTurn(
                    owner="request",
                    ident=effect.request_id,
                    start=start,
                    admitted_at=admitted_at,
                    reply_to=ctx.name,
                    max_steps=effect.max_steps,
                )
                await self._run_turn(turn, correlation, envelope, ctx)
            elif isinstance(effect, core.PreemptTurn):
                self._control.preempt(effect.request_id)
            elif isinstance(effect, core.FinishRequest):
                self._control.clear(effect.request_id)
                await self._finish(effect, ctx)
            elif isinstance(effect, core.RunBackgroundTurn):
                asker = self._askers.get(effect.step_id)
                correlation = envelope.correlation_id if asker is None else asker.correlation_id
                turn = RunTurn(owner="background", ident=effect.step_id, reply_to=ctx.name)
                await self._run_turn(turn, correlation, envelope, ctx)
            elif isinstance(effect, core.RefuseBackground):
                asker = self._askers.pop(effect.step_id, None)
                if asker is not None:
                    await ctx.reply(
                        asker,
                        TurnDone(
                            step_id=effect.step_id,
                            ok=False,
                            error_code="turn_unavailable",
                            detail="the gateway grants no more turns",
                        ),
                    )
            else:
                self._drained = True
                waiters, self._drain_waiters = self._drain_waiters, []
                for waiter in waiters:
                    await ctx.reply(waiter, Drained())

    async def _answer_admission(
        self, effect: core.RequestAdmitted | core.RejectRequest, envelope: Envelope, ctx: Context
    ) -> None:
        if isinstance(effect, core.RequestAdmitted):
            reply = AdmissionReply(request_id=effect.request_id, accepted=True, position=effect.position)
        else:
            self._admitted.pop(effect.request_id, None)
            reply = AdmissionReply(
                request_id=effect.request_id,
                accepted=False,
                position=effect.queued,
                error_code=effect.reason,
                detail=f"{effect.queued} waiting, max_queue={effect.max_queue}",
            )
        body = envelope.body
        if isinstance(body, Generate) and body.reply_to:
            await ctx.reply(envelope, reply)

    async def _finish(self, effect: core.FinishRequest, ctx: Context) -> None:
        entry = self._admitted.pop(effect.request_id, None)
        if effect.had_turns:
            correlation = None if entry is None else entry.correlation_id
            await self._tell_runner(EndRequest(request_id=effect.request_id), correlation, ctx)
            return
        if entry is None:
            return
        # NOTE: never started: the gateway closes the stream itself.
        request = entry.request
        done = DoneEvent(
            request_id=request.request_id,
            finish_reason="cancelled",
            usage=Usage(prompt_tokens=len(request.prompt_tokens), completion_tokens=0),
        )
        try:
            ctx.try_tell(request.stream_to, done)
        except (MailboxClosed, UnknownAddress):
            pass
        end_stream(ctx, request.stream_to)
