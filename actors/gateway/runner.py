"""The turn runner: the ONE actor that submits engine jobs, one at a time.

The gateway decides who gets the next engine turn (``core``); the runner
performs it: one prefill chunk or a burst of decode steps of a request
(streaming each token to the requester), or one registered background step.
It is a thin shell over its sans-IO core (``runner_core.handle``): it turns
messages into core events and performs the core's effects, matched
exhaustively.

The runner never awaits the engine. A job is submitted to the ``Executor``
and its outputs come back as :class:`~messages.gateway.EngineWake` messages
in the runner's own mailbox (its reserved room, see ``burst.py``), so the
runner keeps reading its mailbox while the engine works: a ``StopBurst``
from the gateway reaches a running burst at once and sets the stop flag the
engine thread checks before every step.

The runner waits on nothing but sends, and never on a client: a token finds
its requester's stream full (backpressure: the engine thread, its chain
``AHEAD`` steps past the stream, has already ended its job) is held
(``StreamFull``), the turn ends ``blocked`` and the engine serves the other
lane; a retry alarm sends the held tokens as the reader makes room
(``DeliverHeld``) and the gateway grants the request turns again once all
went out (``LaneUnblocked``). A held stream that took nothing for
``stream_write_timeout_s`` is gone: the request stops like a cancel (its
cache kept), its stream ends with ``ErrorEvent(stream_write_timeout)``, and
the lane moves on. So no reader holds the engine turn at all.

Failure handling: an engine job that raises fails its request (``ErrorEvent``
as the stream's final message, ``outcome="failed"`` to the gateway) and the
lane moves on. If the runner's handler itself raises, the runtime answers
the message being handled (``RunTurn``, or ``EngineWake`` whose reply slot
is the gateway) with a ``Failure`` to the gateway, which fails the turn
itself: a turn never ends without the gateway hearing of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any, assert_never

import structlog

from actors.checkpoints import CheckpointPort, ResumeFrom
from actors.engine_thread.job import job_failure
from actors.engine_thread.memory_guard import MemoryGuard
from actors.engine_thread.ports import Backend, Executor
from actors.engine_thread.steps import BackgroundSteps
from actors.runtime import (
    Actor,
    Alarm,
    Context,
    MailboxClosed,
    RuntimeFailure,
    UnknownAddress,
    WakeAlarm,
    send_while_room,
)
from messages import Envelope, Release, RemoveCheckpoints
from messages.gateway import (
    EndRequest,
    EngineWake,
    ErrorEvent,
    RunnerRetry,
    RunnerStats,
    RunnerStatsRequest,
    RunTurn,
    StopBurst,
)

from . import runner_core as rc
from .burst import Burst, StepOutput, run_chain
from .engine_work import EngineWork

__all__ = ["TurnRunner"]

_log = structlog.get_logger("kvtier.gateway")


class TurnRunner(Actor):
    """Performs the engine turns the gateway grants and reports each one back to it.

    ``steps`` is the background-step registry this runner owns (askers hold
    typed handles); ``prompt_cache`` (an address or ``None``) receives the
    cache entries the engine registers and the leases the runner releases.
    ``chain_steps=False`` runs one step per engine job: for an inline
    executor (simulation), whose job would otherwise run a whole burst
    before any message sent meanwhile (a ``StopBurst``) could arrive; the
    runner then chains the burst's steps job by job, and the simulated
    runtime may deliver between two steps as a real engine thread allows.
    ``observe_prefill`` (an address or ``None``) receives each finished
    request's measured prefill (``ObservePrefill``, the cold tier's
    restore-or-recompute estimator). ``memory_guard`` checks each request's
    memory before its prefill and during its decode (``memory_guard.py``).
    ``stream_write_timeout_s``: how long a held stream may take nothing before
    it counts as gone (module docstring); ``alarm``: the retry timer of the
    held streams (default: one on the event loop).
    ``checkpoints``: generation checkpoints (docs/cold-tier.md): a request's
    key and found checkpoint come with its first ``RunTurn`` (the gateway
    loaded it at admission, beside the ``Take``: the turn claims it from the
    port, it never looks a file up), snapshots every ``every`` emitted
    tokens handed to the spill queue without waiting, completion's removal.
    """

    def __init__(
        self,
        *,
        gateway: str,
        executor: Executor,
        backend: Backend,
        steps: BackgroundSteps,
        prompt_cache: str | None = None,
        snapshot_min_new_tokens: int = 64,
        chain_steps: bool = True,
        observe_prefill: str | None = None,
        memory_guard: MemoryGuard | None = None,
        stream_write_timeout_s: float = 30.0,
        checkpoints: CheckpointPort | None = None,
        alarm: Alarm | None = None,
    ) -> None:
        if not stream_write_timeout_s > 0:
            raise ValueError("stream_write_timeout_s must be > 0")
        self._write_timeout = stream_write_timeout_s
        self._gateway = gateway
        self._observe_to = observe_prefill
        self._chain_steps = chain_steps
        self._executor = executor
        self._steps = steps
        self._prompt_cache = prompt_cache
        self._work = EngineWork(
            backend,
            keep_entries=prompt_cache is not None,
            snapshot_min_new_tokens=snapshot_min_new_tokens,
            guard=memory_guard,
            checkpoint_every=checkpoints.every if checkpoints is not None else 0,
        )
        self._ckpt = checkpoints
        # NOTE: per live request: its checkpoint key and namespace, a found
        # checkpoint waiting for the first step, and whether files may exist.
        self._ckpt_keys: dict[str, tuple[str, str]] = {}
        self._ckpt_found: dict[str, ResumeFrom] = {}
        self._ckpt_files: set[str] = set()
        self.state = rc.RunnerState(keep_entries=prompt_cache is not None,
                                    write_timeout_s=stream_write_timeout_s)
        # NOTE: only a retry (or a reader's room) moves held tokens on: a retry
        # that finds the mailbox full must come again.
        self._alarm = WakeAlarm(RunnerRetry, alarm, again_s=self.state.retry_s)
        self._burst: Burst | None = None

    @property
    def decode_steps_run(self) -> int:
        """Decode steps run on the engine thread so far (all requests)."""
        return self._work.decode_steps

    @property
    def live_requests(self) -> int:
        """Requests whose generation state the runner holds."""
        return len(self.state.live)

    @property
    def steps(self) -> BackgroundSteps:
        """The background-step registry this runner owns (askers ``register`` and keep the handle)."""
        return self._steps

    async def started(self, ctx: Context) -> None:
        """Bind the held streams' retry timer (on the event loop unless one was given)."""
        self._alarm.bind(ctx)

    async def stopped(self, ctx: Context) -> None:
        """Cancel the retry timer."""
        self._alarm.set(None)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Turn a message into a core event (or drain an engine job's outputs) and perform the effects."""
        body = envelope.body
        now = ctx.clock.now()
        if isinstance(body, RunnerRetry):
            await self._feed(rc.RetryHeld(now), ctx)
        elif isinstance(body, EngineWake):
            await self._drain(body.job, ctx)
        elif isinstance(body, RunTurn):
            if body.start is not None and self._ckpt is not None:
                self._checkpoint_start(body)
            await self._feed(rc.TurnGranted(body, envelope.correlation_id, now), ctx)
        elif isinstance(body, StopBurst):
            await self._feed(rc.Preempt(body.request_id, now), ctx)
        elif isinstance(body, EndRequest):
            await self._feed(rc.EndRequested(body.request_id, body.reason, now), ctx)
        elif isinstance(body, RunnerStatsRequest):
            stats = RunnerStats(live_requests=self.live_requests, decode_steps_run=self.decode_steps_run)
            await ctx.reply(envelope, stats)

    # --- the core ----------------------------------------------------------------

    async def _feed(self, event: rc.Event, ctx: Context) -> None:
        """Apply ``event``; perform the effects, feeding back each outcome the core asked for."""
        todo: deque[rc.Event] = deque([event])
        while todo:
            self.state, effects = ctx.traced(rc.handle, self.state, todo.popleft())
            for effect in effects:
                follow_up = await self._perform(effect, ctx)
                if follow_up is not None:
                    todo.append(follow_up)

    async def _perform(self, effect: rc.Effect, ctx: Context) -> rc.Event | None:
        match effect:
            case rc.Submit():
                return self._submit(effect, ctx)
            case rc.StopSteps():
                burst = self._burst
                if burst is not None and burst.job_id == effect.job_id:
                    burst.stop = True
            case rc.EmitToken():
                try:
                    # NOTE: never a wait on a client: a full stream's token is held.
                    sent = ctx.ref(effect.stream_to).try_tell(
                        effect.event, correlation_id=effect.correlation_id)
                except (MailboxClosed, UnknownAddress):
                    return rc.StreamGone(ctx.clock.now())
                return rc.TokenDelivered(ctx.clock.now()) if sent else rc.StreamFull(ctx.clock.now())
            case rc.DeliverHeld():
                return self._deliver_held(effect, ctx)
            case rc.ArmRetry():
                self._alarm.set(effect.at)
            case rc.EndStream():
                final = effect.final
                if isinstance(final, ErrorEvent) and final.error_code == rc.STREAM_WRITE_TIMEOUT:
                    _log.warning("gateway.stream_write_timeout", request_id=final.request_id,
                                 timeout_s=self._write_timeout)
                ctx.end_stream(effect.stream_to, final, correlation_id=effect.correlation_id)
            case rc.Report():
                await ctx.tell(self._gateway, effect.body, correlation_id=effect.correlation_id)
            case rc.PutEntry():
                if self._prompt_cache is not None:
                    try:
                        await ctx.tell(self._prompt_cache, effect.put, correlation_id=effect.correlation_id)
                    except RuntimeFailure as exc:
                        # NOTE: a prompt cache that is gone (stopping) loses the entry, not
                        # the request; its registry handle is released with the registry.
                        _log.warning("gateway.put_failed", handle=effect.put.handle, error=repr(exc))
            case rc.ReleaseLease():
                if self._prompt_cache is not None:
                    try:
                        await ctx.tell(self._prompt_cache, Release(lease_id=effect.lease_id))
                    except RuntimeFailure as exc:
                        _log.warning("gateway.release_failed", lease_id=effect.lease_id, error=repr(exc))
            case rc.Observe():
                if self._observe_to is not None:
                    try:
                        # NOTE: a measurement; dropped when the estimator's mailbox is full.
                        ctx.try_tell(self._observe_to, effect.body)
                    except RuntimeFailure:
                        pass
            case _:
                assert_never(effect)
        return None

    @staticmethod
    def _deliver_held(effect: rc.DeliverHeld, ctx: Context) -> rc.Event:
        """Send held tokens in order until the stream refuses one."""
        sent, gone = send_while_room(ctx, effect.stream_to, effect.events, effect.correlation_id)
        return rc.HeldDelivered(effect.request_id, sent, gone, ctx.clock.now())

    # --- engine jobs -----------------------------------------------------------------

    def _submit(self, submit: rc.Submit, ctx: Context) -> rc.Event | None:
        """Start a job on the engine thread; a job that cannot start ends at once (the event says how)."""
        job_id, job = submit.job_id, submit.job
        wake = EngineWake(job=job_id, reply_to=self._gateway)
        correlation = submit.correlation_id or None

        def post() -> bool:
            try:
                return ctx.self_ref.post(wake, correlation_id=correlation)
            except MailboxClosed:
                return True  # NOTE: the runner is stopping: nobody is left to wake.

        burst = Burst(job_id, asyncio.get_running_loop(), post)
        fn: Callable[[], Any]
        match job:
            case rc.StepJob():
                burst.budget = job.budget if self._chain_steps else 1
                fn = self._chain(burst, job)
            case rc.DropJob():
                fn = self._drop(job)
            case rc.BackgroundJob():
                step = self._steps.take(job.step_id)
                if step is None:
                    error = rc.JobError("unknown_step", "step not registered")
                    return rc.JobEnded(ctx.clock.now(), error=error)
                fn = step
            case _:
                assert_never(job)
        try:
            future = self._executor.submit(fn)
        except Exception as exc:  # noqa: BLE001 - the engine refused the job: it fails, the lane goes on
            _log.warning("gateway.job_refused", job=job_id, error=repr(exc))
            if isinstance(job, rc.BackgroundJob):
                self._steps.settle(job.step_id, None, exc)
            return rc.JobEnded(ctx.clock.now(), error=rc.JobError(type(exc).__name__, str(exc)))
        self._burst = burst
        future.add_done_callback(burst.settled)
        return None

    def _chain(self, burst: Burst, job: rc.StepJob) -> Callable[[], None]:
        work, rid, opening = self._work, job.request_id, job.opening
        if opening is not None and rid in self._ckpt_keys:
            opening = dataclasses.replace(opening, checkpoint=True,
                                          resume=self._ckpt_found.pop(rid, None))

        def chain() -> None:
            run_chain(burst, lambda first: work.step(rid, opening if first else None))

        return chain

    def _drop(self, job: rc.DropJob) -> Callable[[], Any]:
        work, rid, keep = self._work, job.request_id, job.keep
        # NOTE: a cancelled or failed answer keeps its checkpoints (a retry resumes them).
        self._forget_checkpoint(job.request_id)
        return lambda: work.drop(rid, keep=keep)

    # --- generation checkpoints ----------------------------------------------------

    def _checkpoint_start(self, turn: RunTurn) -> None:
        """Take a first turn's checkpoint key and claim the checkpoint the gateway loaded (no file read here)."""
        port, request = self._ckpt, turn.start
        assert port is not None
        assert request is not None
        found = port.claim(turn.checkpoint) if turn.checkpoint is not None else None
        if turn.checkpoint_key is None:
            return
        rid = request.request_id
        self._ckpt_keys[rid] = (turn.checkpoint_key, request.namespace)
        if found is not None:
            self._ckpt_found[rid] = found
            self._ckpt_files.add(rid)

    def _checkpoint_output(self, rid: str, output: StepOutput, ctx: Context) -> None:
        """Count a resume, hand a snapshot to the spill queue, void a finished answer's files."""
        port = self._ckpt
        assert port is not None
        counters = port.counters
        if output.resumed is not None:
            if output.resumed >= 0:
                counters.resumed += 1
                counters.tokens_saved += output.resumed
                counters.prompt_tokens_saved += int(output.cached_tokens or 0)
            else:
                counters.resume_failed += 1
        keyed = self._ckpt_keys.get(rid)
        cap = output.checkpoint
        if cap is not None:
            sent = False
            if keyed is not None:
                counters.taken += 1
                try:
                    # NOTE: never waits: decode goes on whether or not the queue takes it.
                    sent = ctx.try_tell(port.spill_queue, port.enqueue(keyed[0], keyed[1], cap))
                except RuntimeFailure:
                    sent = False
            if sent:
                self._ckpt_files.add(rid)
            else:
                counters.unsent += keyed is not None
                self._dispose(cap.handle)
        if output.result.finish_reason is not None and keyed is not None:
            may_exist = rid in self._ckpt_files
            self._forget_checkpoint(rid)
            if may_exist:
                # NOTE: completion voids the key's checkpoints: the queue drops its
                # queued ones and the writer removes the files after any write in flight.
                try:
                    ctx.try_tell(port.spill_queue, RemoveCheckpoints(request_key=keyed[0]))
                except RuntimeFailure as exc:
                    _log.warning("checkpoint.remove_unsent", request_id=rid, error=repr(exc))

    def _forget_checkpoint(self, rid: str) -> None:
        self._ckpt_keys.pop(rid, None)
        self._ckpt_found.pop(rid, None)
        self._ckpt_files.discard(rid)

    def _dispose(self, handle: str) -> None:
        port = self._ckpt
        assert port is not None
        try:
            port.dispose(handle)
        except KeyError:
            pass  # NOTE: the registry no longer knows it: nothing left to free.

    async def _drain(self, job_id: int, ctx: Context) -> None:
        """Feed the core every output of job ``job_id`` the engine produced, then its end if it ended."""
        burst = self._burst
        if burst is None or burst.job_id != job_id:
            return  # NOTE: a late wake of a job already drained.
        # NOTE: cleared BEFORE draining: an output appended from now on posts a new wake.
        burst.wake_pending = False
        try:
            while burst.results:
                output = burst.results.popleft()
                burst.consumed += 1
                running = self.state.running
                rid = running[1].request_id if running is not None \
                    and isinstance(running[1], rc.StepJob) else None
                if self._ckpt is not None and rid is not None:
                    self._checkpoint_output(rid, output, ctx)
                await self._feed(rc.StepDone(output, ctx.clock.now()), ctx)
        except Exception as exc:  # noqa: BLE001 - a bug fails this request, not the lane
            _log.error("gateway.turn_bug", job=job_id, error=repr(exc))
            crash = rc.Crash(rc.JobError(type(exc).__name__, str(exc)), ctx.clock.now())
            await self._feed(crash, ctx)
            # NOTE: what the job produced after the bug (its cache entries) and
            # its end are still drained, by the next wake.
            burst.wake()
            return
        if not burst.ended:
            return
        self._burst = None
        running = self.state.running
        error: rc.JobError | None = None
        kept: Any = None
        failure = burst.error
        if failure is not None:
            _log.warning("gateway.job_failed", job=job_id, error=repr(failure))
            error = rc.JobError(*job_failure(failure, type(failure).__name__, str(failure)))
        elif running is not None and isinstance(running[1], rc.DropJob):
            kept = burst.value
        if running is not None and isinstance(running[1], rc.BackgroundJob):
            # NOTE: settled before the report, so the asker's handle holds the
            # outcome once its TurnDone arrives.
            self._steps.settle(running[1].step_id, burst.value, burst.error)
        await self._feed(rc.JobEnded(ctx.clock.now(), error=error, kept=kept), ctx)
