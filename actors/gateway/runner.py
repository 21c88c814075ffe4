"""The turn runner: the ONE actor that submits engine jobs, one turn at a time.

The gateway decides who gets the next engine turn (``_gateway_core``); the
runner performs it: one prefill chunk or decode step of a request (and
streams its token to the requester's inbox), or one registered background
step. Keeping the runner a separate actor keeps the gateway's mailbox
responsive (admission, cancels, ``RunWhenIdle`` asks) while a turn runs,
without spawning untracked tasks, so the simulated runtime sees every step.

Ports: an ``Executor`` (``kernels.EngineThread`` in serving; an inline
executor in simulation) and a ``Backend`` whose methods run ON the engine
thread (``actors._backend.MlxBackend`` in serving; a scripted fake in the
gateway's simulation scenarios).

Failure handling: an engine job that raises fails its request (``ErrorEvent``
on the stream, ``outcome="failed"`` to the gateway) and the lane moves on; so
does any other unexpected error while the runner performs a request turn. If
the runner's handler still raises, the runtime answers the gateway's
``RunTurn`` request with a ``Failure`` and the gateway fails the turn itself
(``actors.gateway``): a turn never ends without the gateway hearing of it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import structlog

from actors.runtime import Actor, Context, MailboxClosed, RuntimeFailure, UnknownAddress
from messages import Envelope
from messages.gateway import (
    BackgroundTurnReport,
    DoneEvent,
    EndRequest,
    ErrorEvent,
    Generate,
    RequestTurnReport,
    RunTurn,
    Timings,
    TokenEvent,
    TurnOutcome,
    Usage,
)
from messages.prompt_cache import EntryMeta, Put, Release, Take, TakeResult

__all__ = [
    "Backend",
    "BackgroundSteps",
    "Executor",
    "InlineExecutor",
    "Registered",
    "StepResult",
    "StepToken",
    "TurnControl",
    "TurnRunner",
    "end_stream",
]

T = TypeVar("T")

# NOTE: how many steps a burst's chain job may run ahead of the tokens the
# loop has streamed; bounds the results held when the consumer is slow.
_AHEAD = 4

_log = structlog.get_logger("kvtier.gateway")


class Executor(Protocol):
    """Runs a callable on the engine thread (``kernels.EngineThread``)."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine thread; its exception re-raised here."""
        ...

    def submit(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Queue ``fn(*args)`` NOW; awaiting the result yields its value (or raises its error)."""
        ...


class TurnControl:
    """Burst preemption marks shared by the gateway, the runner and the Engine's streams.

    The gateway (on a cancel) or a closing ``GenerationStream`` marks a
    request whose burst must end after the step in flight; the runner's
    chain job reads the mark on the engine thread before every step. NOTE:
    plain state, not a message: the runner is busy inside its burst and
    reads no mail until it ends. Marks are set and cleared on the event
    loop only; the engine thread only tests membership (atomic under the GIL).
    """

    def __init__(self) -> None:
        self._preempted: set[str] = set()

    def preempt(self, request_id: str) -> None:
        """End ``request_id``'s burst after the step in flight."""
        self._preempted.add(request_id)

    def preempted(self, request_id: str) -> bool:
        """True when ``request_id``'s burst must not start another step."""
        return request_id in self._preempted

    def clear(self, request_id: str) -> None:
        """Forget ``request_id``'s mark (the request ended or is gone)."""
        self._preempted.discard(request_id)

    def __len__(self) -> int:
        return len(self._preempted)


def end_stream(ctx: Context, address: str) -> None:
    """End the stream to ``address`` if it is an inbox (an actor consumer keeps its mailbox)."""
    if address not in ctx.system.actors():
        ctx.end_stream(address)


class _Settled:
    """An awaitable over an outcome that is already known (``InlineExecutor.submit``)."""

    __slots__ = ("_error", "_result")

    def __init__(self, result: Any, error: BaseException | None) -> None:
        self._result = result
        self._error = error

    def __await__(self) -> Generator[Any, None, Any]:
        return self._outcome().__await__()

    async def _outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result


class InlineExecutor:
    """Runs jobs inline on the caller's thread (simulation and scripted tests only)."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` now."""
        return fn(*args)

    def submit(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Call ``fn(*args)`` now; the awaitable hands back its outcome."""
        try:
            return _Settled(fn(*args), None)
        except Exception as exc:  # noqa: BLE001 - re-raised when awaited, like the engine thread
            return _Settled(None, exc)


@dataclass(frozen=True, slots=True)
class StepToken:
    """One generated token and the text it released."""

    token_id: int
    text: str
    logprob: float | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one request turn did on the engine thread."""

    phase: Literal["prefill", "decode"]
    token: StepToken | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prefill_complete: bool = False


@dataclass(frozen=True, slots=True)
class Registered:
    """A cache entry registered on the engine thread: its handle, facts and exact tokens."""

    handle: str
    meta: EntryMeta
    tokens: tuple[int, ...]


class Backend(Protocol):
    """The engine-thread half of request turns. Every method runs ON the engine thread."""

    def open(self, request: Generate, handle: str | None, cached_tokens: int) -> Any:
        """A fresh generation state for ``request`` (reusing ``handle``'s first tokens if given).

        The state's ``cached_tokens`` says how many prompt tokens it really
        reused: a backend that cannot materialize the entry falls back to a
        cold prefill (0), because a cache-tier failure is a miss.
        """
        ...

    def step(self, gen: Any) -> StepResult:
        """One prefill chunk (until the prefill completes) or one decode step."""
        ...

    def snapshot(self, gen: Any) -> Registered | None:
        """Register a prompt-only clone of the live cache (``None``: nothing worth keeping)."""
        ...

    def register(self, gen: Any) -> Registered | None:
        """Take the live cache over as an entry (``None``: nothing worth keeping)."""
        ...

    def discard(self, gen: Any) -> None:
        """Drop ``gen``'s arrays (on the engine thread) without keeping anything."""
        ...

    def end_turn(self) -> None:
        """Housekeeping after every turn (e.g. drop arrays of disposed cache handles)."""
        ...


@dataclass(slots=True)
class _Step:
    fn: Callable[[], Any]
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class BackgroundSteps:
    """In-process registry of background step callables, keyed by the ``RunWhenIdle.step_id``.

    NOTE: callables never travel inside messages (traces stay serializable);
    the asker registers its step here, sends ``RunWhenIdle(step_id)``, and
    reads the outcome here after ``TurnDone``.
    """

    def __init__(self) -> None:
        self._steps: dict[str, _Step] = {}

    def add(self, step_id: str, fn: Callable[[], Any]) -> None:
        """Register ``fn`` (run on the engine thread when the turn is granted)."""
        if step_id in self._steps:
            raise ValueError(f"step {step_id!r} is already registered")
        self._steps[step_id] = _Step(fn)

    def get(self, step_id: str) -> Callable[[], Any] | None:
        """The callable of a registered, not yet run step (``None`` if unknown or done)."""
        step = self._steps.get(step_id)
        return None if step is None or step.done else step.fn

    def settle(self, step_id: str, result: Any, error: BaseException | None) -> None:
        """Record a step's outcome (called by the runner after the turn)."""
        step = self._steps.get(step_id)
        if step is not None:
            step.done, step.result, step.error = True, result, error

    def pop(self, step_id: str) -> tuple[bool, Any, BaseException | None]:
        """Forget a step; returns (ran, result, error)."""
        step = self._steps.pop(step_id, None)
        if step is None:
            return False, None, None
        return step.done, step.result, step.error

    def __len__(self) -> int:
        return len(self._steps)


@dataclass(slots=True)
class _Live:
    """A request the runner has started: its generation state and accounting."""

    request: Generate
    admitted_at: float
    gen: Any = None
    cached_tokens: int = 0
    emitted: int = 0
    first_token_at: float | None = None
    started_at: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    puts: list[tuple[Literal["completion", "snapshot"], Registered]] = field(default_factory=list)


class _Burst:
    """One granted request turn in progress, shared by the runner (loop) and its chain job (engine thread).

    NOTE: the engine thread appends to ``results`` and reads ``stop``,
    ``steps`` and the preempt mark; the loop pops ``results`` and sets
    ``stop``. Each is a single attribute/deque operation, atomic under the
    GIL; ``wake`` crosses threads only through ``call_soon_threadsafe``.
    """

    __slots__ = ("consumed", "done", "loop", "max_steps", "phase", "results", "steps", "stop", "waiter")

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.steps = 0  # steps run (engine side)
        self.consumed = 0  # steps streamed (loop side)
        self.phase: Literal["prefill", "decode"] = "prefill"
        self.results: deque[StepResult] = deque()
        self.stop = False
        self.done = True  # no chain job in flight
        self.loop: asyncio.AbstractEventLoop | None = None
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        """Engine thread: tell the waiting runner a result (or the chain's end) is there.

        NOTE: only a runner that is waiting is woken; one that is busy
        streaming re-checks ``results``/``done`` after setting its waiter,
        and the engine thread appends BEFORE it reads ``waiter``, so no
        wake-up is lost and a busy loop gets no self-pipe write per token.
        """
        loop = self.loop
        if loop is not None and self.waiter is not None:
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:
                pass  # NOTE: the loop is closed; nobody waits any more.

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class TurnRunner(Actor):
    """Performs the engine turns the gateway grants and reports each one back to it."""

    def __init__(
        self,
        *,
        gateway: str,
        executor: Executor,
        backend: Backend,
        steps: BackgroundSteps,
        prompt_cache: str | None = None,
        snapshot_min_new_tokens: int = 64,
        ask_timeout_s: float = 30.0,
        control: TurnControl | None = None,
    ) -> None:
        self._gateway = gateway
        self._control = control if control is not None else TurnControl()
        self._executor = executor
        self._backend = backend
        self._steps = steps
        self._prompt_cache = prompt_cache
        self._snapshot_min = snapshot_min_new_tokens
        self._ask_timeout = ask_timeout_s
        self._live: dict[str, _Live] = {}
        self._decode_steps = 0

    @property
    def decode_steps_run(self) -> int:
        """Decode steps run on the engine thread so far (all requests)."""
        return self._decode_steps

    @property
    def live_requests(self) -> int:
        """Requests whose generation state the runner holds."""
        return len(self._live)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Run one granted turn, or end a cancelled request."""
        body = envelope.body
        if isinstance(body, RunTurn):
            if body.owner == "background":
                await self._background_turn(body.ident, ctx)
            else:
                await self._request_turn(body, ctx)
        elif isinstance(body, EndRequest):
            live = self._live.pop(body.request_id, None)
            if live is not None:
                cancelled = body.reason == "cancelled"
                await self._keep_or_discard(live, ctx, keep=cancelled)
                if cancelled:
                    await self._finish_stream(live, ctx, "cancelled")

    # --- background ---------------------------------------------------------

    async def _background_turn(self, step_id: str, ctx: Context) -> None:
        fn = self._steps.get(step_id)
        report: BackgroundTurnReport
        if fn is None:
            report = BackgroundTurnReport(
                step_id=step_id, ok=False, error_code="unknown_step", detail="step not registered"
            )
        else:
            try:
                result = await self._executor.run(fn)
            except Exception as exc:  # noqa: BLE001 - the asker gets the error, the gateway goes on
                self._steps.settle(step_id, None, exc)
                report = BackgroundTurnReport(
                    step_id=step_id, ok=False, error_code=type(exc).__name__, detail=str(exc)
                )
            else:
                self._steps.settle(step_id, result, None)
                report = BackgroundTurnReport(step_id=step_id, ok=True)
        await ctx.tell(self._gateway, report)

    # --- requests -------------------------------------------------------------

    async def _request_turn(self, body: RunTurn, ctx: Context) -> None:
        rid = body.ident
        live = self._live.get(rid)
        if live is None:
            if body.start is None:
                # NOTE: raising answers the RunTurn with a Failure: the gateway fails the turn.
                raise RuntimeError(f"turn for unknown request {rid!r}")
            live = _Live(request=body.start, admitted_at=body.admitted_at)
            self._live[rid] = live
        burst = _Burst(max_steps=body.max_steps)
        try:
            await self._perform_request_turn(live, burst, ctx)
        except Exception as exc:  # noqa: BLE001 - a bug fails this request, not the lane
            _log.error("gateway.turn_bug", request_id=rid, error=repr(exc))
            # NOTE: a chain job still running stops after its step; the
            # discard job _fail queues runs after it (one FIFO engine thread).
            burst.stop = True
            await self._fail(live, ctx, exc, burst.steps)

    async def _perform_request_turn(self, live: _Live, burst: _Burst, ctx: Context) -> None:
        """One granted turn: one step, or a burst of decode steps while the grant and the request last.

        NOTE: a burst's decode steps are chained ON the engine thread (one
        job, ``_chain_job``): the engine starts the next step as soon as one
        ends, without waiting for the event loop, which streams each token
        as it arrives. Between steps the job checks the gateway's preempt
        mark (a cancel) and ``stop`` (the stream is gone), so a cancelled
        request runs at most the step already running: its lane is still
        free within one step. The job also stops ``_AHEAD`` tokens ahead of
        the stream (a slow consumer's backpressure stays bounded); the
        runner then queues the next chain job after streaming.
        """
        rid = live.request.request_id
        clock = ctx.clock
        began = clock.now()
        if live.started_at is None:
            live.started_at = began
        try:
            if live.gen is None:
                first = await self._first_turn(live, ctx)
            else:
                first = await self._executor.run(self._turn_job, live)
        except Exception as exc:  # noqa: BLE001 - one request fails, the gateway goes on
            _log.warning("gateway.turn_failed", request_id=rid, error=repr(exc))
            await self._fail(live, ctx, exc, 1)
            return
        burst.steps = 1
        burst.results.append(first)
        try:
            await self._stream_burst(live, burst, began, ctx)
        except BaseException:
            # NOTE: the runner itself is being cancelled or hit a bug: a chain
            # job still running must not go on stepping this request.
            burst.stop = True
            raise

    async def _stream_burst(self, live: _Live, burst: _Burst, began: float, ctx: Context) -> None:
        """Stream the burst's results as they arrive; queue (and re-queue) its chain job; report."""
        rid = live.request.request_id
        clock = ctx.clock
        pending: Awaitable[None] | None = None
        outcome: TurnOutcome = "continue"
        last = burst.results[0]
        while True:
            if burst.results:
                result = burst.results.popleft()
                burst.consumed += 1
                now = clock.now()
                if result.phase == "prefill":
                    live.prefill_s += now - began
                else:
                    live.decode_s += now - began
                began = now
                burst.phase = result.phase
                last = result
                if pending is None and self._may_chain(burst, result, rid):
                    burst.done = False
                    burst.loop = asyncio.get_running_loop()
                    pending = self._executor.submit(self._chain_job, live, burst)
                outcome = await self._deliver(live, result, ctx, burst, pending)
                if outcome != "continue":
                    await self._settle_quietly(pending, burst, rid)
                    break
                continue
            if pending is None:
                break
            if not burst.done:
                waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                burst.waiter = waiter
                if not burst.results and not burst.done:
                    await waiter
                burst.waiter = None
                continue
            job, pending = pending, None
            try:
                await job
            except Exception as exc:  # noqa: BLE001 - one request fails, the gateway goes on
                _log.warning("gateway.turn_failed", request_id=rid, error=repr(exc))
                await self._fail(live, ctx, exc, min(burst.steps + 1, burst.max_steps))
                return
            # NOTE: the job stopped ahead of the stream or on a preempt mark;
            # streaming what it left re-queues the chain if the grant allows.
            if not burst.results and self._may_chain(burst, last, rid):
                burst.done = False
                pending = self._executor.submit(self._chain_job, live, burst)
        await self._report(rid, burst, outcome, ctx)

    def _may_chain(self, burst: _Burst, result: StepResult, rid: str) -> bool:
        """Whether the grant allows another step after ``result`` (checked on the loop)."""
        return (
            result.phase == "decode"
            and result.finish_reason is None
            and burst.steps < burst.max_steps
            and not burst.stop
            and not self._control.preempted(rid)
        )

    # NOTE: runs ON the engine thread (see _perform_request_turn). The only
    # put a chained step makes is the completion entry of the final step,
    # after which the job ends, so the loop's _flush_puts never races an append.
    def _chain_job(self, live: _Live, burst: _Burst) -> None:
        rid = live.request.request_id
        try:
            while (
                burst.steps < burst.max_steps
                and not burst.stop
                and not self._control.preempted(rid)
                and burst.steps - burst.consumed < _AHEAD
            ):
                result = self._turn_job(live)
                burst.steps += 1
                burst.results.append(result)
                burst.wake()
                if result.phase != "decode" or result.finish_reason is not None:
                    break
        finally:
            burst.done = True
            burst.wake()

    async def _report(self, rid: str, burst: _Burst, outcome: TurnOutcome, ctx: Context) -> None:
        await ctx.tell(
            self._gateway,
            RequestTurnReport(request_id=rid, phase=burst.phase, outcome=outcome, steps=burst.steps),
        )

    async def _settle_quietly(self, pending: Awaitable[None] | None, burst: _Burst, rid: str) -> None:
        """Stop the chain job and wait for it: its results will not be used (the request stopped)."""
        burst.stop = True
        if pending is None:
            return
        try:
            await pending
        except Exception as exc:  # noqa: BLE001 - the request is ending anyway
            _log.warning("gateway.turn_failed", request_id=rid, error=repr(exc))

    async def _first_turn(self, live: _Live, ctx: Context) -> StepResult:
        request = live.request
        take = TakeResult()
        if self._prompt_cache is not None and len(request.prompt_tokens) > 1:
            try:
                take = await ctx.ask(
                    self._prompt_cache,
                    Take(tokens=request.prompt_tokens, namespace=request.namespace),
                    timeout=self._ask_timeout,
                    expect=TakeResult,
                )
            except RuntimeFailure as exc:
                # NOTE: a prompt cache that cannot answer in time is a miss, not a failure.
                _log.warning("gateway.take_failed", request_id=request.request_id, error=repr(exc))
                take = TakeResult()
        try:
            return await self._executor.run(self._open_job, live, take.handle, take.cached_tokens)
        finally:
            if take.lease_id is not None and self._prompt_cache is not None:
                await ctx.tell(self._prompt_cache, Release(lease_id=take.lease_id))

    # NOTE: the *_job methods run ON the engine thread; they touch only `live`
    # (owned by this actor, which awaits the job) and the backend.
    def _open_job(self, live: _Live, handle: str | None, cached: int) -> StepResult:
        live.gen = self._backend.open(live.request, handle, cached if handle else 0)
        # NOTE: the backend may have fallen back to a cold prefill; report what it reused.
        live.cached_tokens = live.gen.cached_tokens
        return self._turn_job(live)

    def _turn_job(self, live: _Live) -> StepResult:
        try:
            result = self._backend.step(live.gen)
            if result.phase == "decode":
                # NOTE: written on the engine thread only; an int read elsewhere is atomic.
                self._decode_steps += 1
            if result.prefill_complete and self._wants_snapshot(live):
                snap = self._cache_call("snapshot", live, self._backend.snapshot)
                if snap is not None:
                    live.puts.append(("snapshot", snap))
            if result.finish_reason is not None:
                if self._prompt_cache is None:
                    # NOTE: nobody would own a registered entry: drop the arrays here.
                    self._backend.discard(live.gen)
                else:
                    entry = self._cache_call("register", live, self._backend.register)
                    if entry is not None:
                        live.puts.append(("completion", entry))
                live.gen = None
            return result
        finally:
            self._backend.end_turn()

    @staticmethod
    def _cache_call(
        what: str, live: _Live, fn: Callable[[Any], Registered | None]
    ) -> Registered | None:
        # NOTE: keeping an entry is an optimisation: a failure here is a future
        # miss, never a failed request (the tokens were already produced).
        try:
            return fn(live.gen)
        except Exception as exc:  # noqa: BLE001
            _log.warning(
                f"prompt_cache.{what}_failed", request_id=live.request.request_id, error=repr(exc)
            )
            return None

    def _wants_snapshot(self, live: _Live) -> bool:
        request = live.request
        new_tokens = len(request.prompt_tokens) - live.cached_tokens
        return self._prompt_cache is not None and request.chat and new_tokens >= self._snapshot_min

    def _discard_job(self, live: _Live) -> None:
        if live.gen is not None:
            self._backend.discard(live.gen)
            live.gen = None
        self._backend.end_turn()

    def _register_job(self, live: _Live) -> None:
        if live.gen is not None:
            entry = self._backend.register(live.gen)
            live.gen = None
            if entry is not None:
                live.puts.append(("completion", entry))
        self._backend.end_turn()

    async def _deliver(
        self,
        live: _Live,
        result: StepResult,
        ctx: Context,
        burst: _Burst,
        pending: Awaitable[None] | None,
    ) -> TurnOutcome:
        await self._flush_puts(live, ctx)
        request = live.request
        token = result.token
        try:
            if token is not None:
                if live.first_token_at is None:
                    live.first_token_at = ctx.clock.now()
                event = TokenEvent(
                    request_id=request.request_id,
                    index=live.emitted,
                    token_id=token.token_id,
                    text=token.text,
                    logprob=token.logprob,
                )
                live.emitted += 1
                await ctx.tell(request.stream_to, event)
            if result.finish_reason is not None:
                self._live.pop(request.request_id, None)
                await self._finish_stream(live, ctx, result.finish_reason)
                return "finished"
        except (MailboxClosed, UnknownAddress):
            # NOTE: the requester closed its stream (client left): stop now,
            # keep what was computed for the prompt cache (after the step
            # already queued, so the engine thread never holds two jobs).
            self._live.pop(request.request_id, None)
            await self._settle_quietly(pending, burst, request.request_id)
            await self._keep_or_discard(live, ctx, keep=True)
            return "cancelled"
        return "continue"

    async def _finish_stream(
        self, live: _Live, ctx: Context, reason: Literal["stop", "length", "cancelled"]
    ) -> None:
        request = live.request
        now = ctx.clock.now()
        first = live.first_token_at
        done = DoneEvent(
            request_id=request.request_id,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=len(request.prompt_tokens),
                completion_tokens=live.emitted,
                cached_tokens=live.cached_tokens,
            ),
            timings=Timings(
                queued_s=max(0.0, (live.started_at or now) - live.admitted_at),
                ttft_s=max(0.0, (first if first is not None else now) - live.admitted_at),
                prefill_s=live.prefill_s,
                decode_s=live.decode_s,
            ),
        )
        try:
            if reason == "cancelled":
                ctx.try_tell(request.stream_to, done)
            else:
                await ctx.tell(request.stream_to, done)
        except (MailboxClosed, UnknownAddress):
            pass
        end_stream(ctx, request.stream_to)

    async def _fail(self, live: _Live, ctx: Context, exc: Exception, steps: int = 1) -> None:
        request = live.request
        self._live.pop(request.request_id, None)
        try:
            await self._executor.run(self._discard_job, live)
        except Exception as cleanup:  # noqa: BLE001 - already failing; log and go on
            _log.warning("gateway.discard_failed", error=repr(cleanup))
        await self._flush_puts(live, ctx)
        error = ErrorEvent(request_id=request.request_id, error_code=type(exc).__name__, detail=str(exc))
        try:
            ctx.try_tell(request.stream_to, error)
        except (MailboxClosed, UnknownAddress):
            pass
        end_stream(ctx, request.stream_to)
        phase: Literal["prefill", "decode"] = "decode" if live.emitted else "prefill"
        await ctx.tell(
            self._gateway,
            RequestTurnReport(request_id=request.request_id, phase=phase, outcome="failed", steps=max(1, steps)),
        )

    async def _keep_or_discard(self, live: _Live, ctx: Context, *, keep: bool) -> None:
        """Hand a stopped request's cache to the prompt cache (or drop it) on the engine thread."""
        if live.gen is not None:
            job = self._register_job if keep and self._prompt_cache is not None else self._discard_job
            try:
                await self._executor.run(job, live)
            except Exception as exc:  # noqa: BLE001 - losing a cache entry is not an error
                _log.warning("gateway.keep_failed", error=repr(exc))
        await self._flush_puts(live, ctx)

    async def _flush_puts(self, live: _Live, ctx: Context) -> None:
        if not live.puts:
            return
        puts, live.puts = live.puts, []
        if self._prompt_cache is None:
            return
        request = live.request
        for role, entry in puts:
            try:
                await ctx.tell(
                    self._prompt_cache,
                    Put(
                        tokens=entry.tokens,
                        namespace=request.namespace,
                        handle=entry.handle,
                        meta=entry.meta,
                        role=role,
                    ),
                )
            except RuntimeFailure as exc:
                # NOTE: a prompt cache that is gone (stopping) loses the entry, not
                # the request; its registry handle is released with the registry.
                _log.warning("gateway.put_failed", handle=entry.handle, error=repr(exc))
