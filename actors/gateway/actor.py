"""The gateway actor: admission, the serial lane and the engine-turn token.

A thin async shell over the sans-IO core (``core.handle``): it turns
messages into core events (stamped with the injected clock) and performs the
core's effects, matched exhaustively: admission replies, prompt-cache
lookups (``Take`` sent as a request whose answer comes back to this
mailbox), ``RunTurn``/``StopBurst``/``EndRequest`` to the turn runner,
``TurnDone`` replies to background askers. It never awaits the engine or an
answer, so admission, cancels and lookups are handled while a turn runs.
With generation checkpoints on (``checkpoints``), the shell keys each
request at admission and loads its checkpoint on a worker thread beside the
``Take`` (``LoadCheckpoint``, ``CheckpointLoads``); the result comes back
as a note to this mailbox (re-posted before the next message if the mailbox
was full), and the first ``RunTurn`` carries the key and the found
checkpoint's handle, so the runner's first turn never waits for a file.
See docs/engine-turn.md.

A turn that fails without a report (the runner's handler raised: the runtime
answers the ``RunTurn`` (or the runner's ``EngineWake``) with a ``Failure``
in this mailbox's reserved room; or the runner is gone and ``RunTurn``
cannot be sent) fails the request holding it with an ``ErrorEvent`` (code
``turn_failed``) and frees the lane, or answers the background asker
``TurnDone(ok=False)``: the gateway never waits forever for a report.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, assert_never

import structlog

from actors.checkpoints import CheckpointLoads, CheckpointPort, ResumeFrom
from actors.runtime import Actor, Context, RuntimeFailure
from kernels.engine import batch_params_refusal
from messages import Envelope, Failure, Release, Take, TakeResult
from messages.batch_scheduler import (
    BatchTurnReport,
    BatchWants,
    LendBackgroundStep,
    LentStepReport,
    RunBatchStep,
    StopBatchChain,
)
from messages.gateway import (
    AdmissionReply,
    Arriving,
    AwaitDrained,
    BackgroundTurnReport,
    BeginShutdown,
    CancelGeneration,
    DoneEvent,
    Drained,
    EndRequest,
    ErrorEvent,
    GatewayCheckpointsLoaded,
    GatewayStats,
    GatewayStatsRequest,
    Generate,
    LaneUnblocked,
    RequestTurnReport,
    RunTurn,
    RunWhenIdle,
    ShutdownStarted,
    StopBurst,
    StopTurns,
    TurnDone,
    Usage,
)

from . import core

__all__ = ["Gateway"]

_log = structlog.get_logger("kvtier.gateway")


@dataclass(slots=True)
class _Admitted:
    request: Generate
    admitted_at: float
    correlation_id: str
    started: bool = False
    phase: Literal["prefill", "decode"] = "prefill"
    lookup: TakeResult | None = None
    """The answered lookup; its lease is the gateway's until the first ``RunTurn`` carries it."""
    lookup_started_at: float | None = None
    lookup_done_at: float | None = None
    checkpoint_key: str | None = None
    """Its generation-checkpoint key (``None``: not checkpointed)."""
    checkpoint: ResumeFrom | None = None
    """Its loaded checkpoint (host bytes), the gateway's until the first ``RunTurn`` hands it over."""


class Gateway(Actor):
    """Admits requests into the serial lane and hands out engine turns one at a time.

    ``runner`` is the address of the turn runner; ``max_queue`` requests may
    wait behind the one holding the lane. ``max_burst`` > 1 grants the lane
    holder bursts of up to that many decode steps per turn (a cancel ends
    one with ``StopBurst`` to the runner). ``prompt_cache`` (an address, or
    ``None`` for none) is where each request's lookup is made while it waits
    for its turn. ``batch`` (an address, or ``None``): the batch scheduler;
    every request then goes to the batch lane (the wiring sets it only when
    the model passes the batching gates), and the batch's steps share the
    engine-turn token with the serial lane (docs/batching.md).
    ``background_share``: background work's share of engine time under load
    (``core.GatewayState``; 0 = idle turns only). ``chain_background``: a
    background step due under load is lent to the running batch chain
    (``LendBackgroundStep``) instead of cutting it. ``checkpoints``:
    generation checkpoints of the serial lane (``None``: off); the same port
    as the runner's, which claims the checkpoints handed over to it.
    """

    def __init__(
        self,
        *,
        runner: str,
        max_queue: int,
        max_burst: int = 1,
        prompt_cache: str | None = None,
        batch: str | None = None,
        background_share: float = 0.0,
        chain_background: bool = False,
        checkpoints: CheckpointPort | None = None,
    ) -> None:
        self._runner = runner
        self._ckpt = checkpoints
        # NOTE: checkpoint loads finished on worker threads, fed to the core
        # when their note (``GatewayCheckpointsLoaded``) is read.
        self._loads = CheckpointLoads(GatewayCheckpointsLoaded)
        self._prompt_cache = prompt_cache
        self._batch = batch
        self._batched: set[str] = set()  # request ids forwarded to the batch lane, until they end
        self._batch_refusals: dict[str, int] = {}  # why requests stayed on the serial lane
        self.state = core.GatewayState(
            max_queue=max_queue, max_burst=max_burst, lookups=prompt_cache is not None,
            background_share=background_share,
            chain_background=chain_background and batch is not None,
        )
        self._admitted: dict[str, _Admitted] = {}
        self._lookups: dict[str, str] = {}  # Take msg_id -> request id
        self._askers: dict[str, Envelope] = {}
        self._drain_waiters: list[Envelope] = []
        self._drained = False
        self._now = 0.0

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready statistics of the lane and the engine-turn token."""
        snap = self.state.snapshot(self._now)
        snap["background_asks_open"] = len(self._askers)
        if self._batch is not None:
            snap["batch_refused"] = dict(self._batch_refusals)
        return snap

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Translate one message into a core event and perform the effects."""
        now = ctx.clock.now()
        self._now = now
        self._loads.rewake(ctx.self_ref)  # NOTE: a note that found the mailbox full goes now.
        body = envelope.body
        event: core.CoreEvent
        if isinstance(body, Arriving):
            # NOTE: only the batch lane gathers arrivals; the serial lane has no use for the hint.
            if self._batch is not None and not self.state.draining:
                await self._tell_batch(body, envelope.correlation_id, ctx)
            return
        if isinstance(body, Generate):
            if self._batch is not None and await self._route_to_batch(body, envelope, ctx):
                return
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
            key = self._ckpt.key_of(body) if self._ckpt is not None else None
            self._admitted[body.request_id] = _Admitted(
                body, now, envelope.correlation_id, checkpoint_key=key
            )
            event = core.AdmitRequest(body.request_id, now, checkpoint=key is not None)
        elif isinstance(body, CancelGeneration):
            if self._batch is not None and body.request_id in self._batched:
                await self._tell_batch(body, envelope.correlation_id, ctx)
                return
            event = core.CancelRequest(body.request_id, now)
        elif isinstance(body, BatchWants):
            self._batched.difference_update(body.left)
            event = core.BatchStatus(body.busy, body.ready, now)
        elif isinstance(body, BatchTurnReport):
            self._batched.difference_update(body.left)
            if self.state.turn is None or self.state.turn.owner != "batch":
                return  # NOTE: a report of a turn already ended by a failure.
            event = core.BatchTurnDone(body.busy, body.ready, now, body.steps)
        elif isinstance(body, LentStepReport):
            if body.ran:
                asker = self._askers.pop(body.step_id, None)
                if asker is not None:
                    done = TurnDone(step_id=body.step_id, ok=body.ok,
                                    error_code=body.error_code, detail=body.detail)
                    await self._answer(asker, done, ctx)
            event = core.LentBackgroundDone(body.step_id, now, body.ran, body.held_s)
        elif isinstance(body, Failure) and self._batch is not None and body.actor == self._batch:
            # NOTE: the scheduler's handler raised: the batch turn (if one runs)
            # ends here; the scheduler's next report or status tells the truth.
            _log.error("gateway.batch_failed", error=f"{body.error}: {body.message}")
            lent = self.state.lent
            if lent is not None:
                # NOTE: whether the lent step ran is unknown: its asker hears
                # it failed, and the core stops waiting for its report.
                await self._deny_step(lent.step_id, "turn_failed", body.message, ctx)
                await self._feed(core.LentBackgroundDone(lent.step_id, now, ran=True),
                                 envelope, ctx)
            turn = self.state.turn
            if turn is None or turn.owner != "batch":
                return
            # NOTE: steps=0: whether a step ran (and drained) is unknown, so
            # the turn confirms no idle-only step (core._confirm_idle_only).
            event = core.BatchTurnDone(self.state.batch_busy, False, now, steps=0)
        elif isinstance(body, TakeResult):
            rid = self._lookups.pop(envelope.causation_id or "", None)
            entry = None if rid is None else self._admitted.get(rid)
            if rid is None or entry is None:
                # NOTE: the request left while its lookup ran: the lease is ours to give back.
                await self._release(body, ctx)
                return
            entry.lookup = body
            event = self._lookup_done(rid, now)
        elif isinstance(body, Failure) and envelope.causation_id in self._lookups:
            # NOTE: a prompt cache that cannot answer is a miss, never a failed request.
            rid = self._lookups.pop(envelope.causation_id or "")
            _log.warning("gateway.lookup_failed", request_id=rid, error=f"{body.error}: {body.message}")
            event = self._lookup_done(rid, now)
        elif isinstance(body, GatewayCheckpointsLoaded):
            for rid, found in self._loads.take():
                entry = self._admitted.get(rid)
                if entry is not None and not entry.started:
                    entry.checkpoint = found
                # NOTE: a request gone meanwhile drops its checkpoint's bytes here.
                await self._feed(core.CheckpointLoaded(rid, ctx.clock.now()), envelope, ctx)
            return
        elif isinstance(body, RunWhenIdle):
            if body.step_id in self._askers:
                await ctx.reply(
                    envelope,
                    TurnDone(step_id=body.step_id, ok=False, error_code="duplicate_step"),
                )
                return
            self._askers[body.step_id] = envelope
            event = core.WantBackgroundTurn(body.step_id, now, body.deadline, body.idle_only)
        elif isinstance(body, RequestTurnReport):
            if body.outcome not in ("continue", "blocked"):
                self._admitted.pop(body.request_id, None)
            elif (entry := self._admitted.get(body.request_id)) is not None:
                entry.phase = body.phase
            event = core.RequestTurnDone(body.request_id, body.phase, body.outcome, now, body.steps)
        elif isinstance(body, LaneUnblocked):
            if body.outcome != "continue":
                self._admitted.pop(body.request_id, None)
            event = core.LaneUnblocked(body.request_id, body.outcome, now)
        elif isinstance(body, BackgroundTurnReport):
            asker = self._askers.pop(body.step_id, None)
            if asker is not None:
                await self._answer(
                    asker,
                    TurnDone(
                        step_id=body.step_id,
                        ok=body.ok,
                        error_code=body.error_code,
                        detail=body.detail,
                    ),
                    ctx,
                )
            event = core.BackgroundTurnDone(body.step_id, now)
        elif isinstance(body, BeginShutdown):
            event = core.BeginDrain(now)
            self.state, effects = ctx.traced(core.handle, self.state, event)
            if body.reply_to:
                lane = self.state.lane
                await ctx.reply(
                    envelope,
                    ShutdownStarted(in_flight=(0 if lane is None else 1) + len(self.state.parked),
                                    queued=len(self.state.queue)),
                )
            await self._perform(effects, envelope, ctx)
            return
        elif isinstance(body, AwaitDrained):
            if self._drained:
                await ctx.reply(envelope, Drained())
            else:
                self._drain_waiters.append(envelope)
            return
        elif isinstance(body, GatewayStatsRequest):
            stats = GatewayStats(token=self.snapshot(), admitted_requests=len(self._admitted))
            await ctx.reply(envelope, stats)
            return
        elif isinstance(body, StopTurns):
            event = core.StopTurns(now)
        elif isinstance(body, Failure) and body.actor == self._runner:
            await self._turn_failed(f"{body.error}: {body.message}", envelope, ctx)
            return
        else:
            return
        await self._feed(event, envelope, ctx)

    # --- the core ----------------------------------------------------------------

    async def _feed(self, event: core.CoreEvent, envelope: Envelope, ctx: Context) -> None:
        self.state, effects = ctx.traced(core.handle, self.state, event)
        await self._perform(effects, envelope, ctx)

    async def _perform(self, effects: list[core.Effect], envelope: Envelope, ctx: Context) -> None:
        """Perform ``effects`` in order; an effect that answers the core at once queues what follows from it."""
        todo = deque(effects)
        while todo:
            effect = todo.popleft()
            follow_up: core.CoreEvent | None = None
            match effect:
                case core.RequestAdmitted() | core.RejectRequest():
                    await self._answer_admission(effect, envelope, ctx)
                case core.StartLookup():
                    follow_up = await self._start_lookup(effect.request_id, ctx)
                case core.LoadCheckpoint():
                    follow_up = self._load_checkpoint(effect.request_id, ctx)
                case core.RunRequestTurn():
                    follow_up = await self._run_request_turn(effect, envelope, ctx)
                case core.PreemptTurn():
                    entry = self._admitted.get(effect.request_id)
                    correlation = None if entry is None else entry.correlation_id
                    await self._tell_runner(StopBurst(request_id=effect.request_id), correlation, ctx)
                case core.FinishRequest():
                    await self._finish(effect, ctx)
                case core.RunBackgroundTurn():
                    follow_up = await self._run_background_turn(effect.step_id, envelope, ctx)
                case core.RunBatchTurn():
                    step = RunBatchStep(
                        turn=effect.turn, max_steps=effect.max_steps, reply_to=ctx.name
                    )
                    if not await self._tell_batch(step, envelope.correlation_id, ctx):
                        follow_up = core.BatchTurnDone(False, False, ctx.clock.now(), steps=0)
                case core.PreemptBatchTurn():
                    stop = StopBatchChain(turn=effect.turn)
                    await self._tell_batch(stop, envelope.correlation_id, ctx)
                case core.LendBackground():
                    lend = LendBackgroundStep(turn=effect.turn, step_id=effect.step_id)
                    if not await self._tell_batch(lend, envelope.correlation_id, ctx):
                        follow_up = core.LentBackgroundDone(
                            effect.step_id, ctx.clock.now(), ran=False
                        )
                case core.RefuseBackground():
                    await self._deny_step(
                        effect.step_id, "turn_unavailable", "the gateway grants no more turns", ctx
                    )
                case core.ConfirmBackground():
                    asker = self._askers.pop(effect.step_id, None)
                    if asker is not None:
                        await self._answer(asker, TurnDone(step_id=effect.step_id, ok=True), ctx)
                case core.ExpireBackground():
                    await self._deny_step(
                        effect.step_id,
                        "expired",
                        "the step was not granted before its deadline",
                        ctx,
                    )
                case core.Drained():
                    self._drained = True
                    waiters, self._drain_waiters = self._drain_waiters, []
                    for waiter in waiters:
                        await ctx.reply(waiter, Drained())
                case _:
                    assert_never(effect)
            if follow_up is not None:
                self.state, more = ctx.traced(core.handle, self.state, follow_up)
                todo.extend(more)

    # --- the batch lane ---------------------------------------------------------------

    async def _route_to_batch(self, body: Generate, envelope: Envelope, ctx: Context) -> bool:
        """Forward ``body`` (with its reply slot) to the batch lane; ``False``: serve it here instead."""
        rid = body.request_id
        if self.state.draining:
            return False  # NOTE: the core refuses it (shutting_down) like any other.
        unsupported = batch_params_refusal(body.params)
        if unsupported is not None:
            # NOTE: an option only the serial kernel serves: the request stays here.
            self._batch_refusals[unsupported] = self._batch_refusals.get(unsupported, 0) + 1
            return False
        if rid in self._batched or rid in self._admitted:
            refusal = AdmissionReply(
                request_id=rid,
                accepted=False,
                error_code="duplicate_id",
                detail="a request with this id is already admitted",
            )
            if body.reply_to:
                await ctx.reply(envelope, refusal)
            return True
        if not await self._tell_batch(body, envelope.correlation_id, ctx):
            return False  # NOTE: a batch lane that is gone leaves the serial lane.
        self._batched.add(rid)
        return True

    async def _tell_batch(self, body: Any, correlation_id: str, ctx: Context) -> bool:
        assert self._batch is not None
        try:
            await ctx.tell(self._batch, body, correlation_id=correlation_id)
        except RuntimeFailure as exc:
            _log.warning("gateway.batch_unavailable", error=repr(exc))
            return False
        return True

    # --- lookups -------------------------------------------------------------------

    async def _start_lookup(self, rid: str, ctx: Context) -> core.CoreEvent | None:
        """Send ``rid``'s ``Take``; the answer comes back to this mailbox (``None``), or a miss now."""
        entry = self._admitted.get(rid)
        now = ctx.clock.now()
        if entry is None or self._prompt_cache is None:
            return core.LookupDone(rid, now)
        entry.lookup_started_at = now
        request = entry.request
        if len(request.prompt_tokens) <= 1:
            return self._lookup_done(rid, now)  # NOTE: nothing shorter than the prompt to reuse.
        take = Take(tokens=request.prompt_tokens, namespace=request.namespace)
        try:
            msg_id = await ctx.request(self._prompt_cache, take, correlation_id=entry.correlation_id)
        except RuntimeFailure as exc:
            # NOTE: a prompt cache that is gone is a miss, not a failure.
            _log.warning("gateway.lookup_failed", request_id=rid, error=repr(exc))
            return self._lookup_done(rid, now)
        self._lookups[msg_id] = rid
        return None

    def _load_checkpoint(self, rid: str, ctx: Context) -> core.CoreEvent | None:
        """Load ``rid``'s checkpoint on a worker thread; the result comes back through ``GatewayCheckpointsLoaded``."""
        entry = self._admitted.get(rid)
        port = self._ckpt
        if entry is None or port is None or entry.checkpoint_key is None:
            return core.CheckpointLoaded(rid, ctx.clock.now())
        request = entry.request
        self._loads.start(port, ctx.self_ref, rid, entry.checkpoint_key, request.namespace,
                          tuple(request.prompt_tokens))
        return None

    def _lookup_done(self, rid: str, now: float) -> core.LookupDone:
        """``rid``'s lookup ended at ``now`` (its request's timeline marks it)."""
        entry = self._admitted.get(rid)
        if entry is not None:
            entry.lookup_done_at = now
        return core.LookupDone(rid, now)

    async def _release(self, lookup: TakeResult | None, ctx: Context) -> None:
        """Give a lookup's lease back to the prompt cache (nothing to do for a miss)."""
        if lookup is None or lookup.lease_id is None or self._prompt_cache is None:
            return
        try:
            await ctx.tell(self._prompt_cache, Release(lease_id=lookup.lease_id))
        except RuntimeFailure as exc:
            _log.warning("gateway.release_failed", lease_id=lookup.lease_id, error=repr(exc))

    # --- turns ---------------------------------------------------------------------

    async def _run_request_turn(
        self, effect: core.RunRequestTurn, envelope: Envelope, ctx: Context
    ) -> core.CoreEvent | None:
        entry = self._admitted.get(effect.request_id)
        start: Generate | None = None
        lookup: TakeResult | None = None
        admitted_at = 0.0
        looked: tuple[float | None, float | None] = (None, None)
        correlation = envelope.correlation_id
        key: str | None = None
        handle: str | None = None
        if entry is not None:
            correlation = entry.correlation_id
            if not entry.started:
                start, admitted_at, lookup = entry.request, entry.admitted_at, entry.lookup
                looked = (entry.lookup_started_at, entry.lookup_done_at)
                key = entry.checkpoint_key
                if entry.checkpoint is not None and self._ckpt is not None:
                    handle = self._ckpt.hand_over(effect.request_id, entry.checkpoint)
        turn = RunTurn(
            owner="request",
            ident=effect.request_id,
            start=start,
            admitted_at=admitted_at,
            reply_to=ctx.name,
            max_steps=effect.max_steps,
            lookup=lookup,
            lookup_started_at=looked[0],
            lookup_done_at=looked[1],
            checkpoint_key=key,
            checkpoint=handle,
        )
        if not await self._send_turn(turn, correlation, ctx):
            if handle is not None and self._ckpt is not None:
                self._ckpt.claim(handle)  # NOTE: never delivered: its bytes go.
            return await self._turn_lost("the turn runner is unavailable", ctx)
        if entry is not None and start is not None:
            # NOTE: the runner owns the lookup's lease and the checkpoint from
            # here (it releases the lease after materializing).
            entry.started, entry.lookup, entry.checkpoint = True, None, None
        return None

    async def _run_background_turn(
        self, step_id: str, envelope: Envelope, ctx: Context
    ) -> core.CoreEvent | None:
        asker = self._askers.get(step_id)
        if asker is None or not self._waiting(asker, ctx):
            # NOTE: nobody waits for this step any more (its ask timed out):
            # take the grant back before it reaches the engine.
            return core.WithdrawBackground(step_id, ctx.clock.now())
        turn = RunTurn(owner="background", ident=step_id, reply_to=ctx.name)
        if not await self._send_turn(turn, asker.correlation_id, ctx):
            return await self._turn_lost("the turn runner is unavailable", ctx)
        return None

    async def _send_turn(self, turn: RunTurn, correlation_id: str, ctx: Context) -> bool:
        """Send ``turn`` to the runner under its owner's correlation id; ``False`` if the runner is gone."""
        # NOTE: the explicit correlation id keeps every turn (and the tokens the
        # runner streams from it) on its request's id, whichever message the
        # gateway happened to be handling when it granted the turn.
        try:
            await ctx.tell(self._runner, turn, correlation_id=correlation_id)
        except RuntimeFailure as exc:
            _log.warning("gateway.runner_unavailable", turn=turn.ident, error=repr(exc))
            return False
        return True

    async def _turn_failed(self, detail: str, envelope: Envelope, ctx: Context) -> None:
        """The turn in flight ended without a report: fail its owner and go on with the next."""
        event = await self._turn_lost(detail, ctx)
        if event is not None:
            await self._feed(event, envelope, ctx)

    async def _turn_lost(self, detail: str, ctx: Context) -> core.CoreEvent | None:
        """Fail the owner of the turn in flight; the event that ends the turn (``None``: nothing runs)."""
        turn = self.state.turn
        now = ctx.clock.now()
        if turn is None:
            return None  # NOTE: nothing in flight: a stale failure changes nothing.
        if turn.owner == "background":
            await self._deny_step(turn.ident, "turn_failed", detail, ctx)
            return core.BackgroundTurnDone(turn.ident, now)
        entry = self._admitted.pop(turn.ident, None)
        phase: Literal["prefill", "decode"] = "prefill" if entry is None else entry.phase
        if entry is not None:
            error = ErrorEvent(request_id=turn.ident, error_code="turn_failed", detail=detail)
            ctx.end_stream(entry.request.stream_to, error, correlation_id=entry.correlation_id)
            # NOTE: a lookup the runner never received is still ours to release.
            await self._release(entry.lookup, ctx)
            if entry.started:
                # NOTE: lets a live runner drop the request's state; a dead one cannot.
                end = EndRequest(request_id=turn.ident, reason="failed")
                await self._tell_runner(end, entry.correlation_id, ctx)
        return core.RequestTurnDone(turn.ident, phase, "failed", now)

    async def _tell_runner(
        self, body: EndRequest | StopBurst, correlation_id: str | None, ctx: Context
    ) -> None:
        try:
            await ctx.tell(self._runner, body, correlation_id=correlation_id)
        except RuntimeFailure:
            pass  # NOTE: the runner is gone; it holds no state any more.

    # --- answers -------------------------------------------------------------------

    @staticmethod
    def _waiting(asker: Envelope, ctx: Context) -> bool:
        """Whether the asker of a ``RunWhenIdle`` still waits (a told one, with no reply slot, always does)."""
        body = asker.body
        reply_to = body.reply_to if isinstance(body, RunWhenIdle) else ""
        return not reply_to or ctx.system.is_open(reply_to)

    async def _answer(self, asker: Envelope, answer: TurnDone, ctx: Context) -> None:
        body = asker.body
        if isinstance(body, RunWhenIdle) and body.reply_to and ctx.system.is_open(body.reply_to):
            await ctx.reply(asker, answer)

    async def _deny_step(self, step_id: str, code: str, detail: str, ctx: Context) -> None:
        """Answer ``step_id``'s waiting ``RunWhenIdle`` asker, if any: not run or failed, and why."""
        asker = self._askers.pop(step_id, None)
        if asker is not None:
            denied = TurnDone(step_id=step_id, ok=False, error_code=code, detail=detail)
            await self._answer(asker, denied, ctx)

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
        # NOTE: never started: the gateway gives the lookup's lease back (a
        # lookup still running is released when its answer comes) and closes
        # the stream itself.
        await self._release(entry.lookup, ctx)
        request = entry.request
        done = DoneEvent(
            request_id=request.request_id,
            finish_reason="cancelled",
            usage=Usage(prompt_tokens=len(request.prompt_tokens), completion_tokens=0),
        )
        ctx.end_stream(request.stream_to, done, correlation_id=entry.correlation_id)
