"""The batch scheduler actor: the batch lane's shell over its sans-IO core.

It turns messages into core events (stamped with the injected clock) and
performs the core's effects, matched exhaustively: admission answers to the
forwarded ``Generate``, prompt-cache ``Take`` (sent as a request whose answer
comes back here) and ``Release``, ``Put`` of every registered cache, token
events and final events on each row's stream, ``BatchWants`` /
``BatchTurnReport`` to the gateway, and the engine job of a granted step.

It never awaits the engine: a granted turn's job (a step chain,
``chain.py``: up to ``max_steps`` batch steps back to back) is submitted to
the ``Executor``; each step's output, and the job's end, come back through
a ``BatchWake`` posted to this mailbox's reserved room, so tokens stream per
step and cancels, new admissions and the gateway's ``StopBatchChain`` are
handled while the engine computes: rows to join or remove are offered to
the running chain (``OfferRows``: ``Chain.offer``, taken by its next step;
a chain that closed hands them back, ``RowsReturned``), and what needs the
engine back gets ``StopChain``, which sets the chain's stop flag. If the handler itself
raises while handling a ``RunBatchStep`` or a ``BatchWake``, the runtime
answers the gateway with a ``Failure`` (their reply slot), and the gateway
ends the turn.

It never waits on a row's stream either: tokens are sent with ``try_tell``;
a full stream's event goes back to the core (``StreamFull``), which holds
that row's events and hands them out again (``Deliver``) as its reader makes
room, so one slow reader never holds up the other rows. The retry alarm
(``ArmRetry``) posts a ``BatchRetry`` to this mailbox. A held stream that
takes nothing for ``stream_write_timeout_s`` is ended by the core
(``StreamTimedOut``: logged here once, with the request id) and its row
leaves the batch at the next step.

Generation checkpoints (``checkpoints``, docs/cold-tier.md): the shell keys
each admitted request (``CheckpointPort.key_of``), looks a key up on a
worker thread when the core asks (``LoadCheckpoint``; the results wait in
``CheckpointLoads`` and one ``BatchCheckpointsLoaded`` note to itself,
re-posted before the next message if the mailbox was full, feeds them to
the core), hands snapshots to the spill queue with ``try_tell`` (never
waits: a full mailbox frees the snapshot, counted ``unsent``) and voids a
finished answer's checkpoints (``RemoveCheckpoints``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any, assert_never

import structlog

from actors.checkpoints import CheckpointLoads, CheckpointPort
from actors.engine_thread.job import job_failure
from actors.engine_thread.ports import Executor
from actors.engine_thread.steps import BackgroundSteps
from actors.runtime import (
    Actor,
    ActorStopped,
    Alarm,
    Context,
    LoopAlarm,
    MailboxClosed,
    RuntimeFailure,
    UnknownAddress,
    send_while_room,
)
from messages import Envelope, Failure, Release, RemoveCheckpoints, Take, TakeResult
from messages.batch_scheduler import (
    BatchCheckpointsLoaded,
    BatchGather,
    BatchRetry,
    BatchStats,
    BatchStatsRequest,
    BatchWake,
    BatchWants,
    LendBackgroundStep,
    LentStepReport,
    RunBatchStep,
    StopBatchChain,
)
from messages.gateway import AdmissionReply, Arriving, BeginShutdown, CancelGeneration, Generate
from messages.ssd_writer import ObservePrefill

from . import core
from .chain import Chain, LoopWaker, run_chain
from .engine import BatchEngine

__all__ = ["BatchScheduler"]

_log = structlog.get_logger("kvtier.batch")


class BatchScheduler(Actor):
    """Runs the batch lane: rows join at step boundaries; a granted engine turn runs a step chain.

    ``gateway``: where ``BatchWants``/``BatchTurnReport`` go (it holds the
    engine-turn token); ``prompt_cache``: the address rows look up in and
    put to (``None``: no prompt cache); ``engine``: the engine-thread half,
    run through ``executor``. ``backlog_max``: tokens held for a row whose
    stream is full before that row is stopped (``slow_reader``); ``alarm``:
    the retry timer (``None``: one on the running loop). ``observe_prefill``
    (an address or ``None``) receives the speed of steps that only
    prefilled (the cold tier's restore-or-recompute estimator).
    ``gather_alarm``: the timer bounding how long rows ready to start an
    idle batch wait for the other arrivals' lookups (``None``: one on the
    running loop).
    ``after_step``: runs on the engine thread after every step of a chain
    (``chain.run_chain``; the engine's C heap trim).
    ``stream_write_timeout_s``: how long a row's full stream may take nothing
    before it is ended and the row removed (``stream_write_timeout``).
    ``checkpoints``: generation checkpoints (``None``: off).
    ``steps``: the background-step registry, from which a step the gateway
    lends to a running chain (``LendBackgroundStep``) is taken; its chain
    runs it between two steps, and the scheduler settles it and reports it
    (``LentStepReport``) before the turn's own report (``None``: lent steps
    are handed back unrun).
    """

    def __init__(
        self,
        *,
        gateway: str,
        executor: Executor,
        engine: BatchEngine,
        max_rows: int,
        max_queue: int,
        prompt_cache: str | None = None,
        backlog_max: int = 1024,
        alarm: Alarm | None = None,
        observe_prefill: str | None = None,
        gather_alarm: Alarm | None = None,
        after_step: Callable[[], object] | None = None,
        stream_write_timeout_s: float = 30.0,
        gather_s: float = 0.05,
        checkpoints: CheckpointPort | None = None,
        steps: BackgroundSteps | None = None,
    ) -> None:
        self._gateway = gateway
        self._steps = steps
        self._ckpt = checkpoints
        # NOTE: checkpoint lookups finished on worker threads, fed to the core
        # when their note (``BatchCheckpointsLoaded``) is read.
        self._loads = CheckpointLoads(BatchCheckpointsLoaded)
        # NOTE: found checkpoints (host bytes) by request id until their row
        # joins; the core knows only that one was found (traces stay small).
        self._found: dict[str, Any] = {}
        self._executor = executor
        self._after_step = after_step
        self._engine = engine
        self._prompt_cache = prompt_cache
        self._alarm = alarm
        self._gather_alarm = gather_alarm
        self._observe_to = observe_prefill
        self.state = core.SchedulerState(
            max_rows=max_rows,
            max_queue=max_queue,
            lookups=prompt_cache is not None,
            backlog_max=backlog_max,
            observe_prefill=observe_prefill is not None,
            write_timeout_s=stream_write_timeout_s,
            gather_s=gather_s,
        )
        self._requests: dict[str, Envelope] = {}  # forwarded Generate envelopes, until answered
        self._lookups: dict[str, str] = {}  # Take msg_id -> request id
        self._chain: Chain | None = None
        self._waker: LoopWaker | None = None

    def snapshot(self) -> dict[str, int | bool | dict[str, int]]:
        """JSON-ready statistics of the batch lane (``blas``: the decode steps' BLAS thread choice)."""
        stats = self.state.snapshot()
        blas = self._engine.blas_stats()
        if blas is not None:
            stats["blas"] = blas
        return stats

    async def started(self, ctx: Context) -> None:
        """Bind the retry alarm to the running loop (unless one was given)."""
        if self._alarm is None:
            self._alarm = LoopAlarm(ctx.clock)
        if self._gather_alarm is None:
            self._gather_alarm = LoopAlarm(ctx.clock)
        if self._waker is None:
            self._waker = LoopWaker()

    async def stopped(self, ctx: Context) -> None:
        """Give back every lease rows still hold (an SSD hit's host bytes with it), end held streams.

        NOTE: the prompt cache is spawned before this actor, so it is still
        running when this one stops (reverse spawn order).
        """
        await self._feed(core.Stopping(ctx.clock.now()), ctx)
        if self._waker is not None:
            self._waker.close()
            self._waker = None

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Translate one message into a core event and perform the effects."""
        now = ctx.clock.now()
        self._loads.rewake(ctx.self_ref)  # NOTE: a note that found the mailbox full goes now.
        body = envelope.body
        event: core.Event
        if isinstance(body, Generate):
            self._requests[body.request_id] = envelope
            key = self._ckpt.key_of(body) if self._ckpt is not None else None
            event = core.Admit(body, envelope.correlation_id, now, key)
        elif isinstance(body, Arriving):
            event = core.Arriving(body.request_id, now)
        elif isinstance(body, BatchCheckpointsLoaded):
            for looked, found in self._loads.take():
                if found is not None and looked in self.state.rows:
                    self._found[looked] = found
                event = core.CheckpointLoaded(looked, looked in self._found, ctx.clock.now())
                await self._feed(event, ctx)
            return
        elif isinstance(body, CancelGeneration):
            event = core.Cancel(body.request_id, now)
        elif isinstance(body, TakeResult):
            rid = self._lookups.pop(envelope.causation_id or "", None)
            if rid is None:
                await self._release(body.lease_id, ctx)
                return
            event = core.LookupAnswered(rid, body, now)
        elif isinstance(body, Failure) and (envelope.causation_id or "") in self._lookups:
            # NOTE: a prompt cache that cannot answer is a miss, never a failed request.
            rid = self._lookups.pop(envelope.causation_id or "")
            _log.warning(
                "batch.lookup_failed", request_id=rid, error=f"{body.error}: {body.message}"
            )
            event = core.LookupAnswered(rid, None, now)
        elif isinstance(body, RunBatchStep):
            event = core.TurnGranted(body.turn, now, body.max_steps)
        elif isinstance(body, StopBatchChain):
            event = core.YieldTurn(body.turn, now)
        elif isinstance(body, LendBackgroundStep):
            await self._lend(body, ctx)
            return
        elif isinstance(body, BatchWake):
            await self._drain(body.turn, ctx)
            return
        elif isinstance(body, BatchRetry):
            event = core.RetryDelivery(now)
        elif isinstance(body, BatchGather):
            event = core.GatherDue(now)
        elif isinstance(body, BeginShutdown):
            event = core.BeginDrain(now)
        elif isinstance(body, BatchStatsRequest):
            await ctx.reply(envelope, BatchStats(batch=self.snapshot()))
            return
        else:
            return
        await self._feed(event, ctx)

    async def _drain(self, turn: int, ctx: Context) -> None:
        """Feed the core every step the chain of ``turn`` produced, then the job's end if it ended."""
        chain = self._chain
        if chain is None or chain.turn != turn:
            return  # NOTE: a late wake of a job already drained.
        # NOTE: cleared BEFORE draining: a step appended from now on posts a new wake.
        chain.wake_pending = False
        # NOTE: first, so each lent step's report reaches the gateway before
        # the report of the turn it ran in.
        await self._lent_ran(chain, ctx)
        while chain.results:
            out = chain.results.popleft()
            chain.consumed += 1
            last = chain.ended and not chain.results and chain.error is None
            if last:
                # NOTE: before feeding: the core may submit the turn's next job.
                self._chain = None
                await self._returned(chain, ctx)
            if out.joined:
                # NOTE: one line per step that joined rows (at most one per
                # request): what a join costs, beside each request's
                # ``request.timeline`` (its ``first_step`` phase).
                _log.info("batch.join_step", turn=turn, joined=[rid for rid, _ in out.joined],
                          cached=[c for _, c in out.joined], prefill_tokens=out.prefill_tokens,
                          decode_rows=out.decode_rows, join_ms=round(out.join_s * 1e3, 3),
                          step_ms=round(out.step_s * 1e3, 3), since_clear=out.since_clear)
            if out.cleared:
                # NOTE: the batch lane empties MLX's buffer cache every
                # KVTIER_BATCH_CLEAR_EVERY steps; a step after it allocates afresh.
                _log.info("batch.cache_cleared", turn=turn, freed_bytes=out.cleared_bytes,
                          clear_ms=round(out.clear_s * 1e3, 3), step_ms=round(out.step_s * 1e3, 3))
            await self._feed(core.StepFinished(turn, out, ctx.clock.now(), last), ctx)
            if last:
                return
        if not chain.ended or self._chain is not chain:
            return
        self._chain = None
        await self._returned(chain, ctx)
        exc, now = chain.error, ctx.clock.now()
        if exc is None:
            await self._feed(core.JobEnded(turn, now), ctx)
            return
        _log.warning("batch.step_failed", turn=turn, error=repr(exc))
        code, detail = job_failure(exc, "batch_step_failed", f"{type(exc).__name__}: {exc}")
        await self._feed(core.StepFailed(turn, code, detail, now), ctx)

    async def _lend(self, body: LendBackgroundStep, ctx: Context) -> None:
        """Hand a lent background step to the running chain of its turn, or back to the gateway."""
        chain, steps = self._chain, self._steps
        if steps is None or chain is None or chain.turn != body.turn:
            await self._tell_gateway(LentStepReport(step_id=body.step_id, ran=False), ctx)
            return
        fn = steps.take(body.step_id)
        if fn is None:
            # NOTE: withdrawn by its asker (or never registered): nothing to run.
            report = LentStepReport(step_id=body.step_id, ran=True, ok=False,
                                    error_code="unknown_step", detail="step not registered")
            await self._tell_gateway(report, ctx)
            return
        if not chain.lend(body.step_id, fn):
            steps.put_back(body.step_id)
            await self._tell_gateway(LentStepReport(step_id=body.step_id, ran=False), ctx)

    async def _lent_ran(self, chain: Chain, ctx: Context) -> None:
        """Settle the lent steps ``chain`` ran and report each to the gateway."""
        runs = chain.lent_runs()
        if not runs:
            return
        steps = self._steps
        assert steps is not None, "a chain ran a lent step without a registry"
        for run in runs:
            # NOTE: settled before the report, so the asker's handle holds the
            # outcome once its TurnDone arrives (as the runner does).
            steps.settle(run.step_id, run.value, run.error)
            error = run.error
            report = LentStepReport(
                step_id=run.step_id, ran=True, ok=error is None,
                error_code="" if error is None else type(error).__name__,
                detail="" if error is None else str(error), held_s=run.held_s,
            )
            await self._tell_gateway(report, ctx)

    async def _returned(self, chain: Chain, ctx: Context) -> None:
        """Before the end of ``chain``'s job reaches the core: lent steps and offered rows it did not take."""
        await self._lent_ran(chain, ctx)
        lent, chain.returned_lent = chain.returned_lent, ()
        for step_id in lent:
            if self._steps is not None:
                self._steps.put_back(step_id)
            await self._tell_gateway(LentStepReport(step_id=step_id, ran=False), ctx)
        joins, cancels = chain.returned
        if not joins and not cancels:
            return
        chain.returned = ((), ())
        rids = tuple(j.request.request_id for j in joins)
        await self._feed(core.RowsReturned(chain.turn, rids, cancels, ctx.clock.now()), ctx)

    # --- the core -------------------------------------------------------------------

    async def _feed(self, event: core.Event, ctx: Context) -> None:
        todo: deque[core.Event] = deque([event])
        while todo:
            self.state, effects = ctx.traced(core.handle, self.state, todo.popleft())
            # NOTE: once a stream refuses an event, its later events of these
            # effects go back to the core unsent, so they stay in order.
            refused: set[str] = set()
            for effect in effects:
                # NOTE: a token (nearly every effect while rows decode: one per
                # row per step) is sent here, without a coroutine of its own;
                # every other effect goes through _perform.
                if type(effect) is core.EmitToken:
                    follow_up = self._emit(effect, ctx, refused)
                else:
                    follow_up = await self._perform(effect, ctx, refused)
                if follow_up is not None:
                    todo.append(follow_up)
        if self._found:
            # NOTE: a row that left before it joined drops its checkpoint's bytes.
            for rid in [r for r in self._found if r not in self.state.rows]:
                del self._found[rid]

    async def _perform(
        self, effect: core.Effect, ctx: Context, refused: set[str]
    ) -> core.Event | None:
        match effect:
            case core.AnswerAdmission():
                await self._answer(effect, ctx)
            case core.StartLookup():
                return await self._start_lookup(effect, ctx)
            case core.LoadCheckpoint():
                return self._load_checkpoint(effect, ctx)
            case core.SendCheckpoint():
                self._send_checkpoint(effect, ctx)
            case core.VoidCheckpoints():
                if self._ckpt is not None:
                    try:
                        ctx.try_tell(self._ckpt.spill_queue,
                                     RemoveCheckpoints(request_key=effect.key))
                    except RuntimeFailure as exc:
                        _log.warning("checkpoint.remove_unsent", error=repr(exc))
            case core.Resumed():
                if self._ckpt is not None:
                    counters = self._ckpt.counters
                    if effect.replayed >= 0:
                        counters.resumed += 1
                        counters.tokens_saved += effect.replayed
                        counters.prompt_tokens_saved += effect.prompt_tokens
                    else:
                        counters.resume_failed += 1
            case core.ReleaseLease():
                await self._release(effect.lease_id, ctx)
            case core.SubmitStep():
                joins = tuple(
                    dataclasses.replace(j, resume=self._found.pop(j.request.request_id, None))
                    if j.resume is True else j
                    for j in effect.joins
                )
                return self._submit(dataclasses.replace(effect, joins=joins), ctx)
            case core.OfferRows():
                chain = self._chain
                if chain is not None and chain.turn == effect.turn \
                        and chain.offer(effect.joins, effect.cancels):
                    return None
                rids = tuple(j.request.request_id for j in effect.joins)
                return core.RowsReturned(effect.turn, rids, effect.cancels, ctx.clock.now())
            case core.StopChain():
                chain = self._chain
                if chain is not None and chain.turn == effect.turn:
                    chain.stop = True
            case core.EmitToken():
                return self._emit(effect, ctx, refused)
            case core.EndStream():
                if effect.stream_to in refused:
                    return core.StreamFull(
                        effect.final.request_id,
                        effect.stream_to,
                        effect.correlation_id,
                        effect.final,
                        ctx.clock.now(),
                    )
                ctx.end_stream(effect.stream_to, effect.final, correlation_id=effect.correlation_id)
            case core.Deliver():
                return self._deliver(effect, ctx)
            case core.StreamTimedOut():
                _log.warning(
                    "batch.stream_write_timeout",
                    request_id=effect.request_id,
                    timeout_s=self.state.write_timeout_s,
                )
                ctx.end_stream(effect.stream_to, effect.final, correlation_id=effect.correlation_id)
            case core.ArmRetry():
                self._arm(self._alarm, effect.at, BatchRetry(), ctx)
            case core.ArmGather():
                self._arm(self._gather_alarm, effect.at, BatchGather(), ctx)
            case core.ObservePrefill():
                if self._observe_to is not None:
                    body = ObservePrefill(tokens=effect.tokens, seconds=effect.seconds)
                    try:
                        # NOTE: a measurement; dropped when the estimator's mailbox is full.
                        ctx.try_tell(self._observe_to, body)
                    except RuntimeFailure:
                        pass
            case core.PutEntry():
                if self._prompt_cache is not None:
                    try:
                        await ctx.tell(
                            self._prompt_cache,
                            effect.put,
                            correlation_id=effect.correlation_id or None,
                        )
                    except RuntimeFailure as exc:
                        _log.warning("batch.put_failed", handle=effect.put.handle, error=repr(exc))
            case core.ReportTurn():
                await self._tell_gateway(effect.report, ctx)
            case core.Status():
                await self._tell_gateway(
                    BatchWants(busy=effect.busy, ready=effect.ready, left=effect.left), ctx
                )
            case _:
                assert_never(effect)
        return None

    @staticmethod
    def _emit(effect: core.EmitToken, ctx: Context, refused: set[str]) -> core.Event | None:
        """Send one token without waiting; a full (or already refusing) stream hands it back."""
        stream_to = effect.stream_to
        if stream_to not in refused:
            try:
                if ctx.ref(stream_to).try_tell(effect.event, correlation_id=effect.correlation_id):
                    return None
            except (MailboxClosed, UnknownAddress):
                return core.StreamGone(effect.event.request_id, ctx.clock.now())
            refused.add(stream_to)
        return core.StreamFull(
            effect.event.request_id, stream_to, effect.correlation_id, effect.event, ctx.clock.now()
        )

    @staticmethod
    def _deliver(effect: core.Deliver, ctx: Context) -> core.Event:
        """Send held events in order until the stream refuses one; end it if all went out."""
        now = ctx.clock.now()
        sent, gone = send_while_room(ctx, effect.stream_to, effect.events, effect.correlation_id)
        if gone or sent < len(effect.events):
            return core.Delivered(effect.request_id, sent, False, gone, now)
        if effect.final is None:
            return core.Delivered(effect.request_id, sent, False, False, now)
        ctx.end_stream(effect.stream_to, effect.final, correlation_id=effect.correlation_id)
        return core.Delivered(effect.request_id, sent, True, False, now)

    @staticmethod
    def _arm(
        alarm: Alarm | None, at: float | None, note: BatchRetry | BatchGather, ctx: Context
    ) -> None:
        ref = ctx.self_ref
        if alarm is None:
            return

        def wake() -> None:
            try:
                # NOTE: a full mailbox holds messages already; handling any of
                # them tries the held streams (or ends a gather whose time is
                # up) and sets the alarm again.
                ref.try_tell(note)
            except (ActorStopped, MailboxClosed, UnknownAddress):
                return

        alarm.set(at, wake)

    async def _tell_gateway(self, body: Any, ctx: Context) -> None:
        try:
            await ctx.tell(self._gateway, body)
        except RuntimeFailure as exc:
            _log.warning("batch.gateway_unavailable", error=repr(exc))

    async def _answer(self, effect: core.AnswerAdmission, ctx: Context) -> None:
        envelope = self._requests.pop(effect.request_id, None)
        if envelope is None:
            return
        body = envelope.body
        if isinstance(body, Generate) and body.reply_to:
            reply = AdmissionReply(
                request_id=effect.request_id,
                accepted=effect.accepted,
                position=effect.position,
                error_code=effect.error_code,
                detail=effect.detail,
            )
            await ctx.reply(envelope, reply)

    async def _start_lookup(self, effect: core.StartLookup, ctx: Context) -> core.Event | None:
        request = effect.request
        if self._prompt_cache is None:
            return core.LookupAnswered(request.request_id, None, ctx.clock.now())
        take = Take(tokens=request.prompt_tokens, namespace=request.namespace)
        try:
            msg_id = await ctx.request(
                self._prompt_cache, take, correlation_id=effect.correlation_id
            )
        except RuntimeFailure as exc:
            _log.warning("batch.lookup_failed", request_id=request.request_id, error=repr(exc))
            return core.LookupAnswered(request.request_id, None, ctx.clock.now())
        self._lookups[msg_id] = request.request_id
        return None

    # --- generation checkpoints -----------------------------------------------------

    def _load_checkpoint(self, effect: core.LoadCheckpoint, ctx: Context) -> core.Event | None:
        """Look the key up on a worker thread; its result comes back through ``BatchCheckpointsLoaded``."""
        port = self._ckpt
        request = effect.request
        if port is None:
            return core.CheckpointLoaded(request.request_id, False, ctx.clock.now())
        self._loads.start(port, ctx.self_ref, request.request_id, effect.key, request.namespace,
                          tuple(request.prompt_tokens))
        return None

    def _send_checkpoint(self, effect: core.SendCheckpoint, ctx: Context) -> None:
        """Hand a snapshot to the spill queue without waiting; one it does not take is freed."""
        port = self._ckpt
        cap = effect.captured
        sent = False
        if port is not None and effect.key is not None:
            port.counters.taken += 1
            try:
                # NOTE: never waits: decode goes on whether or not the queue takes it.
                sent = ctx.try_tell(port.spill_queue, port.enqueue(effect.key, effect.namespace, cap))
            except RuntimeFailure:
                sent = False
            port.counters.unsent += not sent
        if sent or port is None:
            return
        try:
            port.dispose(cap.handle)
        except KeyError:
            pass  # NOTE: the registry no longer knows it: nothing left to free.

    async def _release(self, lease_id: str | None, ctx: Context) -> None:
        if lease_id is None or self._prompt_cache is None:
            return
        try:
            await ctx.tell(self._prompt_cache, Release(lease_id=lease_id))
        except RuntimeFailure as exc:
            _log.warning("batch.release_failed", lease_id=lease_id, error=repr(exc))

    # --- the engine job ---------------------------------------------------------------

    def _submit(self, effect: core.SubmitStep, ctx: Context) -> core.Event | None:
        engine, joins, cancels = self._engine, effect.joins, effect.cancels
        wake = BatchWake(turn=effect.turn, reply_to=self._gateway)
        ref = ctx.self_ref

        def post() -> bool:
            try:
                return ref.post(wake)
            except MailboxClosed:
                return True  # NOTE: the scheduler is stopping: nobody is left to wake.

        chain = Chain(
            effect.turn,
            asyncio.get_running_loop(),
            post,
            budget=effect.max_steps,
            waker=self._waker,
        )
        try:
            future = self._executor.submit(
                run_chain, chain, engine.step, engine.idle, joins, cancels, self._after_step
            )
        except Exception as exc:  # noqa: BLE001 - the engine refused the job: the step fails
            _log.warning("batch.job_refused", turn=effect.turn, error=repr(exc))
            return core.StepFailed(effect.turn, "engine_unavailable", repr(exc), ctx.clock.now())
        self._chain = chain
        future.add_done_callback(chain.settled)
        return None
