"""kvtier's public embedding API: :class:`Engine`.

An ``Engine`` loads one model on its engine thread, starts kvtier's actor
system (gateway, prompt cache) on the caller's event loop, and streams
generations::

    async with Engine() as engine:                      # default model
        async with engine.chat([{"role": "user", "content": "Hi"}],
                               GenerationParams(max_tokens=32)) as stream:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    print(event.text, end="")
                else:                                   # DoneEvent, always last
                    print(event.finish_reason, event.usage)

Admission errors (``QueueFull``, ``ServerShuttingDown``, ``InvalidRequest``)
are raised by ``async with`` / ``start()`` BEFORE the first event, so an HTTP
layer can still answer 429/503/400. Leaving the ``async with`` block early
(client disconnect) cancels the generation; the lane is free again within
one decode step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self, TypedDict, TypeVar, Unpack

import anyio
import anyio.to_thread
import structlog
from pydantic import ValidationError

from actors.engine_thread import BackgroundSteps
from actors.errors import (
    EngineClosed,
    EngineNotStarted,
    GenerationFailed,
    InvalidRequest,
    KvtierError,
    MemoryBusy,
    MemoryPressure,
    MemoryShortAtStart,
    QueueFull,
    ServerShuttingDown,
    TurnUnavailable,
)
from actors.gateway import GatewayTurns
from actors.runtime import (
    ActorRef,
    ActorSystem,
    AskTimeout,
    Inbox,
    MailboxClosed,
    RuntimeFailure,
    use_correlation,
)
from messages import (
    Envelope,
)
from messages.durability import FlushAll, FlushResult
from messages.gateway import (
    AdmissionReply,
    Arriving,
    AwaitDrained,
    BeginShutdown,
    CancelGeneration,
    DoneEvent,
    ErrorEvent,
    Generate,
    GenerationEvent,
    GenerationParams,
    StopTurns,
    Timings,
    TokenEvent,
    Usage,
)
from messages.prompt_cache import DemoteResult

from . import _memory_asks, _stats, prompts, startup, wiring
from ._shutdown import Shutdown
from ._stream_ends import StreamEnds
from .config import ConfigError, EngineConfig, option_names
from .startup import ModelParts, Running

if TYPE_CHECKING:
    from kernels import CacheRegistry, EngineThread, ModelIdentity
    from kernels.cache import FilePort
    from kernels.engine import TokenBytes, ToolFormat

__all__ = [
    "CacheDemotion",
    "ChatMessage",
    "Completion",
    "Engine",
    "EngineOptions",
    "GenerationStream",
    "KvQuant",
]

ChatMessage = Mapping[str, Any]
"""An OpenAI-style chat message: ``{"role": ..., "content": ...}`` (extra keys go to the template)."""

KvQuant = str | int
"""``--kv-quant`` values: ``"off"``, ``4``/``"4"``, ``8``/``"8"`` or ``"config"``."""

T = TypeVar("T")

_log = structlog.get_logger("kvtier.engine")

_GATEWAY = wiring.GATEWAY

_ADMISSION_ERRORS: dict[str, type[KvtierError]] = {
    "queue_full": QueueFull,
    "shutting_down": ServerShuttingDown,
    "duplicate_id": InvalidRequest,
}


class EngineOptions(TypedDict, total=False):
    """The keyword options of :class:`Engine` (``Engine.from_loaded`` takes the same).

    Exactly the engine, sampling and SSD fields of :class:`EngineConfig`
    (``model`` is ``Engine``'s positional argument); defaults, bounds and
    units are documented there. A test keeps the two in step.
    """

    max_queue: int
    prefill_step_size: int
    prefill_budget: int
    max_burst: int
    max_batch: int
    prompt_cache_bytes: int | None
    kv_quant: KvQuant | None
    max_prompt_tokens: int | None
    stream_buffer: int
    stream_write_timeout_s: float
    render_threads: int
    render_inline_chars: int
    batch_gather_s: float
    background_in_chain: bool
    snapshot_min_new_tokens: int
    ask_timeout_s: float
    stats_timeout_s: float
    shutdown_timeout: float
    tensor_parallel: bool
    device: Literal["auto", "cpu"]
    warm_up: Literal["auto", "on", "off"]
    mlx_cache_limit_bytes: int | None
    memory_budget_bytes: int | None
    max_tokens: int
    max_tokens_limit: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    ssd_cache: str | Path | None
    ssd_cache_max_bytes: int | None
    ssd_cache_verify: bool
    ssd_restore: Literal["auto", "always"]
    ssd_demote_idle: float
    ssd_writebehind: bool
    ssd_spill_queue_bytes: int
    generation_checkpoint: int
    kv_events: str | None
    kv_events_replay: str | None
    kv_events_format: Literal["array", "map"]


_SERVER_OPTIONS = frozenset(option_names("server"))


def _engine_config(config: EngineConfig | None, options: Mapping[str, Any]) -> EngineConfig:
    """``config`` (or defaults and ``KVTIER_*`` variables) with ``options`` applied, validated."""
    server = sorted(k for k in options if k in _SERVER_OPTIONS)
    if server:
        raise ConfigError(
            f"{', '.join(map(repr, server))}: `kvtier serve` option(s), not Engine options"
        )
    if config is None:
        return EngineConfig.from_env(**options)
    return config.replace(**options) if options else config


def _salted(params: GenerationParams, cache_salt: str | None) -> GenerationParams:
    """``params`` with ``cache_salt`` (when given) as its salt; a bad salt is ``InvalidRequest``."""
    if cache_salt is None:
        return params
    try:
        return GenerationParams.model_validate({**params.model_dump(), "cache_salt": cache_salt})
    except ValidationError as exc:
        raise InvalidRequest(f"invalid cache_salt: {exc.errors()[0]['msg']}") from None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole (non-streamed) generation: what :meth:`Engine.complete` returns."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    timings: Timings


def _abandon(system: ActorSystem, inbox: Inbox, request_id: str, ended: StreamEnds) -> None:
    # NOTE: runs on the loop. Closing the inbox unblocks a runner waiting on
    # a full stream (it then stops the request); the cancel makes the
    # gateway drop a queued request or stop a running burst (StopBurst to
    # the runner) after its current step.
    inbox.close()
    ended.ended()
    try:
        system.try_tell(_GATEWAY, CancelGeneration(request_id=request_id), correlation_id=request_id)
    except RuntimeFailure:
        pass


def _abandon_soon(
    loop: asyncio.AbstractEventLoop,
    system: ActorSystem,
    inbox: Inbox,
    request_id: str,
    ended: StreamEnds,
) -> None:
    # NOTE: weakref finalizer of a stream dropped unfinished; the garbage
    # collector may run it on any thread, so hop to the loop.
    try:
        loop.call_soon_threadsafe(_abandon, system, inbox, request_id, ended)
    except RuntimeError:
        pass  # the loop is closed: nothing left to cancel


class _StartClose:
    """``async with`` = ``await start()`` ... ``await aclose()``."""

    async def start(self) -> None:
        """Acquire (subclasses implement)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release (subclasses implement)."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class GenerationStream(_StartClose):
    """One request's event stream; an async context manager and async iterator.

    ``__aenter__`` (or :meth:`start`) performs admission and raises its typed
    error; iteration yields ``TokenEvent`` then exactly one ``DoneEvent``;
    ``__aexit__`` / :meth:`aclose` cancel the request if it has not finished.
    A mid-generation engine failure is raised from iteration as
    ``GenerationFailed``.
    """

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prepare: prompts.Render | list[int],
        params: GenerationParams,
        *,
        chat: bool,
        fit_context: bool = False,
        shared_prompt: bool = False,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        # NOTE: a list is a prompt already in token ids: nothing to render,
        # so no trip through a worker thread at admission.
        self._prepare = prepare
        self._params = params
        self._chat = chat
        self._shared_prompt = shared_prompt
        self._fit_context = fit_context
        self._inbox: Inbox | None = None
        self._prompt_tokens: int | None = None
        self._tokens: list[int] | None = None
        self._yielded = False
        self._readmit_until: float | None = None
        self._readmitted_at: float | None = None
        self._render_span: tuple[float, float, float] | None = None
        self._counted = False
        self._started = False
        self._finished = False
        self._done: DoneEvent | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    async def start(self) -> None:
        """Admit the request (idempotent); raises ``QueueFull``/``ServerShuttingDown``/``InvalidRequest``."""
        if self._started:
            return
        self._started = True
        engine = self._engine
        engine._check_open()
        # NOTE: a hint, sent before the prompt is rendered and checked (tens
        # of ms for a long chat): an idle batch lane lets rows that are ready
        # wait for this one, so requests sent together start in one step.
        # Dropped if the gateway's mailbox is full; nothing waits on it, and a
        # closed gateway is reported by the admission ask below.
        try:
            engine._require_system().try_tell(
                _GATEWAY, Arriving(request_id=self.request_id), correlation_id=self.request_id
            )
        except RuntimeFailure:
            pass
        try:
            prepare = self._prepare
            if isinstance(prepare, list):
                tokens = prepare
            else:
                # NOTE: the render's wait for a worker thread and its own time,
                # apart (the timeline's admission parts): on a busy loop the
                # hop to the thread and back can cost more than the render.
                asked = time.monotonic()
                span: list[float] = []

                def render(tokenizer: Any) -> list[int]:
                    span.append(time.monotonic())
                    try:
                        return prepare(tokenizer)
                    finally:
                        span.append(time.monotonic())

                if prepare.chars <= engine.config.render_inline_chars:
                    # NOTE: on the loop: the render keeps the GIL (its tokenizing
                    # too: kernels.engine._token_cache), so a worker thread runs it
                    # no sooner, and the hops there and back each wait for the GIL
                    # beside the engine thread (docs/benchmarks.md, 2026-12-06 15:30).
                    tokens = render(engine.tokenizer)
                else:
                    tokens = await anyio.to_thread.run_sync(render, engine.tokenizer,
                                                            limiter=engine._render_limiter())
                self._render_span = (asked, span[0], span[1])
        except KvtierError:
            self._finished = True
            raise
        except Exception as exc:
            self._finished = True
            raise InvalidRequest(f"cannot render the prompt: {exc}") from exc
        if self._fit_context:
            self._params = prompts.fit_to_context(engine._loaded, tokens, self._params)
        prompts.validate_prompt(engine._loaded, engine.config, tokens, self._params)
        if self._params.grammar is not None:
            # NOTE: compiling a grammar (and, once per tokenizer, llguidance's
            # view of the vocabulary: about a second) happens on a worker
            # thread, so neither the loop nor the engine thread waits on it.
            await anyio.to_thread.run_sync(prompts.prepare_grammar, engine._loaded,
                                          self._params.grammar)
        self._prompt_tokens = len(tokens)
        self._tokens = tokens
        engine._check_open()
        await self._admit_memory(len(tokens))
        await self._submit(tokens)

    async def _admit_memory(self, prompt_tokens: int, *, refused_in_turn: bool = False) -> None:
        """Admission's memory check, waiting while running requests hold the memory it needs.

        NOTE: a ``MemoryBusy`` refusal fits beside the memory the process
        holds at rest: a running request that ends hands its KV to the
        prompt cache, where the next check's relief can move it out. So
        admission waits for a stream to end and asks again, within
        ``memory_relief_timeout_s`` in all; with no stream running there is
        nothing to wait for and it raises.
        """
        engine = self._engine
        timeout = engine.config.memory_relief_timeout_s
        deadline = anyio.current_time() + timeout
        while True:
            try:
                await _memory_asks.admit(engine._running, self.request_id, prompt_tokens,
                                         self._params, timeout=timeout,
                                         refused_in_turn=refused_in_turn)
                return
            except MemoryBusy:
                streams = engine._streams
                left = deadline - anyio.current_time()
                if left <= 0 or streams.live == 0:
                    streams.busy_failed += 1
                    raise
                await streams.wait(left)

    async def _submit(self, tokens: list[int]) -> None:
        """Hand the admitted request to the gateway with a fresh stream inbox."""
        engine = self._engine
        system = engine._require_system()
        inbox = system.open_inbox(engine.config.stream_buffer, prefix=f"stream-{self.request_id}-")
        request = Generate(
            request_id=self.request_id,
            prompt_tokens=tuple(tokens),
            params=self._params,
            stream_to=inbox.address,
            chat=self._chat,
            shared_prompt=self._shared_prompt,
            namespace=self._params.cache_namespace,
        )
        try:
            with use_correlation(self.request_id):
                reply = await engine._gateway().ask(
                    request, timeout=engine.config.ask_timeout_s, expect=AdmissionReply
                )
        except AskTimeout as exc:
            inbox.close()
            self._finished = True
            raise QueueFull(queued=-1, max_queue=engine.config.max_queue) from exc
        except MailboxClosed as exc:
            inbox.close()
            self._finished = True
            raise ServerShuttingDown(f"the gateway is not accepting requests ({exc})") from exc
        except RuntimeFailure as exc:
            # NOTE: the gateway's handler raised (HandlerFailed): a bug, not a refusal.
            inbox.close()
            self._finished = True
            raise GenerationFailed(f"admission failed: {exc}") from exc
        if not reply.accepted:
            inbox.close()
            self._finished = True
            if reply.error_code == "queue_full":
                raise QueueFull(queued=reply.position, max_queue=engine.config.max_queue)
            error = _ADMISSION_ERRORS.get(reply.error_code, InvalidRequest)
            raise error(reply.detail or reply.error_code)
        self._inbox = inbox
        self._finished = False
        engine._streams.started()
        self._counted = True
        self._finalizer = weakref.finalize(
            self,
            _abandon_soon,
            asyncio.get_running_loop(),
            system,
            inbox,
            self.request_id,
            engine._streams,
        )

    async def _readmit(self, refusal: ErrorEvent) -> None:
        """Take a request the in-turn guard refused before its prefill back to admission.

        NOTE: admission decided on a reading (and the running requests'
        growth as the lanes last published it) without the requests
        admitted beside it that started since or joined in the same step,
        which the turn counts; inside a
        turn nothing can be reclaimed, at admission the memory actor can move
        cached entries out. The first refusal goes back at once (a relief may
        be all it takes). A later one waits for a running stream to end first
        (its KV then goes to the prompt cache, where relief can move it out):
        asked again at once, it would meet the same requests at the same size.
        All within ``memory_relief_timeout_s`` of the first refusal. Nothing
        of the request ran, so the client sees one answer. A refusal with no
        stream left to wait for, past that bound, or at admission reaches the
        caller.
        """
        tokens = self._tokens
        if self._yielded or tokens is None:
            raise MemoryPressure(refusal.detail)
        engine = self._engine
        now = anyio.current_time()
        if self._readmit_until is None:
            self._readmit_until = now + engine.config.memory_relief_timeout_s
        else:
            streams = engine._streams
            left = self._readmit_until - now
            if left <= 0 or streams.live == 0 or not await streams.wait(left):
                raise MemoryPressure(refusal.detail)
        engine._check_open()
        await self._admit_memory(len(tokens), refused_in_turn=True)
        await self._submit(tokens)
        self._readmitted_at = time.monotonic()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerationEvent:
        """The next event; admits first if :meth:`start` was not called."""
        if not self._started:
            await self.start()
        while True:
            if self._finished or self._inbox is None:
                raise StopAsyncIteration
            try:
                envelope: Envelope = await self._inbox.receive()
            except MailboxClosed:
                # NOTE: the stream ended without a DoneEvent (cancelled elsewhere).
                self._close_inbox()
                raise StopAsyncIteration from None
            body = envelope.body
            if isinstance(body, TokenEvent):
                self._yielded = True
                return body
            if isinstance(body, DoneEvent):
                self._done = body
                self._close_inbox()
                return body
            self._close_inbox()
            if isinstance(body, ErrorEvent):
                if body.error_code == MemoryShortAtStart.__name__:
                    await self._readmit(body)
                    continue
                if body.error_code == MemoryPressure.__name__:
                    # NOTE: the in-turn guard refused the request (engine thread).
                    raise MemoryPressure(body.detail)
                raise GenerationFailed(f"{body.error_code}: {body.detail}")
            raise GenerationFailed(f"unexpected message on the stream: {body.kind}")

    async def aclose(self) -> None:
        """Cancel the request if it is still queued or running; safe to call twice."""
        if self._inbox is None or self._finished:
            self._finished = True
            return
        request_id = self.request_id
        # NOTE: closing the inbox first makes a runner blocked on this full
        # stream stop the request at once; the cancel reaches a running burst
        # as StopBurst (gateway -> runner) within the step in flight.
        self._close_inbox()
        system = self._engine._system
        if system is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await system.tell(
                        _GATEWAY, CancelGeneration(request_id=request_id), correlation_id=request_id
                    )
                except RuntimeFailure:
                    # NOTE: the gateway is gone (engine closing): nothing left to cancel.
                    pass

    def _close_inbox(self) -> None:
        self._finished = True
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._counted:
            self._counted = False
            self._engine._streams.ended()
        if self._inbox is not None:
            self._inbox.close()

    @property
    def prompt_tokens(self) -> int:
        """How many tokens the rendered prompt has (known once admitted)."""
        if self._prompt_tokens is None:
            raise EngineNotStarted("the stream has not been started")
        return self._prompt_tokens

    @property
    def done(self) -> DoneEvent | None:
        """The final event once the stream has ended normally, else ``None``."""
        return self._done

    @property
    def render_span(self) -> tuple[float, float, float] | None:
        """When the prompt's render was asked for, began (on the loop, or a render thread), and ended
        (``time.monotonic``).

        ``None``: nothing was rendered (a prompt given as token ids), or not yet.
        """
        return self._render_span

    @property
    def readmitted_at(self) -> float | None:
        """When the request was last admitted again after a take-back (``time.monotonic``).

        ``None``: it was never taken back (a refusal for memory before its
        prefill sends it back to admission; the client still sees one answer).
        """
        return self._readmitted_at


async def _collect(stream: GenerationStream) -> Completion:
    """Read ``stream`` to its final event: the whole text and token ids."""
    parts: list[str] = []
    ids: list[int] = []
    async with stream:
        async for event in stream:
            if isinstance(event, TokenEvent):
                parts.append(event.text)
                ids.append(event.token_id)
            else:
                return Completion(
                    request_id=stream.request_id,
                    text="".join(parts),
                    token_ids=tuple(ids),
                    finish_reason=event.finish_reason,
                    usage=event.usage,
                    timings=event.timings,
                )
    raise GenerationFailed("the stream ended without a final event")


class Engine(_StartClose):
    """One model, one engine thread, one actor system: kvtier embedded in an async app.

    ``model``: a local mlx-lm model directory or a Hugging Face id; ``None``
    takes ``config.model``, else kvtier's default model (SmolLM2-135M-Instruct,
    fetched and converted on first use).

    Options come from ONE settings model, :class:`EngineConfig` (defaults,
    bounds, units, ``KVTIER_*`` variables: docs/engine.md). Pass
    ``config=EngineConfig(...)``, or keyword options (:class:`EngineOptions`),
    or both (the keywords override the config). Without ``config`` the
    ``KVTIER_*`` variables apply under the keywords. An unknown or invalid
    option, or a ``kvtier serve``-only one (``host``, ``port``, ...), raises
    ``ConfigError`` (a ``ValueError``) naming it.

    The most used: ``max_queue`` requests may wait behind the one generating
    (more → ``QueueFull``); ``prompt_cache_bytes`` caps the RAM prompt cache
    (0 disables it, ``None``: a quarter of available memory); ``max_prompt_tokens``
    refuses longer prompts (``ContextTooLong``) before admission, as does a
    prompt whose ``max_tokens`` would run past the model's context;
    ``max_burst`` decode steps may run per engine turn (docs/engine-turn.md);
    ``shutdown_timeout`` bounds how long :meth:`aclose` waits for in-flight
    requests. The sampling fields (``max_tokens``, ``temperature``, ...) are
    the parameters of a request that passes none.

    ``start()`` and ``aclose()`` must run in the same task (``async with``
    does that): the actor system's task group lives between them.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: EngineConfig | None = None,
        **options: Unpack[EngineOptions],
    ) -> None:
        cfg = _engine_config(config, options)
        self._config = cfg
        if model is None and cfg.model is not None:
            model = cfg.model
        self._model_arg = model
        self._model_id = "" if model is None else str(model)
        self._loaded: ModelParts | None = None
        """The served model (``None`` until loaded; its module is dropped at close when owned)."""
        self._owns_model = True
        self._file_port: FilePort | None = None
        self._engine_thread: EngineThread | None = None
        self._system: ActorSystem | None = None
        self._running: Running | None = None
        """The wiring and the parts ``start`` built (dropped on the engine thread at close)."""
        self._steps = BackgroundSteps()
        self._streams = StreamEnds()
        self._state = "new"
        self._ids = 0
        self._shutdown = Shutdown(cfg.shutdown_timeout)
        self._renders: anyio.CapacityLimiter | None = None
        """Bounds the prompt renders at admission (``render_threads``); made in the loop, on first use."""

    @classmethod
    def from_loaded(
        cls,
        model: object,
        tokenizer: object,
        *,
        model_id: str,
        identity: ModelIdentity | None = None,
        max_context: int | None = None,
        config: EngineConfig | None = None,
        file_port: FilePort | None = None,
        **options: Unpack[EngineOptions],
    ) -> Engine:
        """An engine over an already-built mlx-lm model and tokenizer (tests, custom loaders).

        ``tokenizer`` must be mlx-lm's ``TokenizerWrapper``. The model must not
        be used from any other thread afterwards: the engine thread owns it.
        ``max_context`` is the model's context length in tokens (``None``: not
        checked); ``config`` and ``options`` are :class:`Engine`'s
        (``config.model`` is not used). ``file_port`` (a
        ``kernels.cache.FilePort``) replaces the SSD tier's file system
        access, for tests that inject faults (``None``: the real one).
        """
        engine = cls(None, config=config, **options)
        engine._file_port = file_port
        engine._owns_model = False
        engine._model_id = model_id
        engine._loaded = ModelParts(model=model, tokenizer=tokenizer, model_id=model_id,
                                    identity=identity, max_context=max_context)
        return engine

    # --- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Load the model on the engine thread and start the actors on the running loop."""
        if self._state != "new":
            raise EngineClosed(f"the engine was already started (state {self._state})")
        self._state = "starting"
        # NOTE: imported here so `import actors.engine` stays cheap for tools
        # that only need the types (the HTTP app's unit tests, kvtier replay).
        import kernels

        thread = kernels.EngineThread(name="kvtier-engine", max_queue=4)
        self._engine_thread = thread
        try:
            loaded = self._loaded
            if loaded is None:
                loaded = await thread.run(startup.load_model, self._model_arg, self._config)
                self._loaded = loaded
                self._model_id = loaded.model_id
            running = await startup.start(thread, loaded, self._config, self._steps,
                                          file_port=self._file_port)
        except BaseException:
            self._state = "closed"
            await thread.aclose()
            raise
        self._system, self._running = running.system, running
        self._state = "running"

    def begin_shutdown(self) -> None:
        """Stop admission now: new requests get ``ServerShuttingDown``; in-flight streams finish."""
        if self._state != "running":
            return
        self._state = "draining"
        # NOTE: the shutdown budget (shutdown_timeout) runs from here: the
        # drain and the final flush of aclose() share it.
        self._shutdown.begin()
        if self._system is not None:
            # NOTE: the engine-side flag refuses new requests at once; the
            # message makes the gateway refuse any already on their way.
            try:
                if not self._system.try_tell(_GATEWAY, BeginShutdown()):
                    _log.warning("engine.begin_shutdown_deferred")
            except RuntimeFailure:
                pass

    async def drain(self) -> None:
        """Wait until no request is running or queued (call after :meth:`begin_shutdown`)."""
        if self._system is None:
            return
        if self._state == "running":
            self.begin_shutdown()
        with use_correlation("engine-drain"):
            await self._gateway().tell(BeginShutdown())
            await self._gateway().ask(AwaitDrained(), timeout=self._shutdown.left())

    async def flush(self, *, timeout: float | None = None) -> FlushResult | None:
        """Write every RAM entry the cold tier does not hold yet, and wait for the spill queue.

        One ``FlushAll`` to the durability coordinator, which runs the whole
        sequence: a barrier through the prompt cache (every request whose
        final event was delivered before the call is covered), the flush
        (``FlushResult.durable`` says, with evidence, whether everything put
        so far is on disk), then the spill queue's drain. ``timeout``
        (default: ``shutdown_timeout``) bounds the whole call. ``None``
        without a cold tier.
        """
        running = self._running
        if running is None or running.cold is None or wiring.DURABILITY not in running.wired.refs:
            return None
        wait = self._config.shutdown_timeout if timeout is None else timeout
        with use_correlation("engine-flush"):
            return await running.wired.ref(wiring.DURABILITY).ask(
                FlushAll(), timeout=wait, expect=FlushResult
            )

    async def demote_cache(
        self,
        *,
        idle_s: float = 0.0,
        max_bytes: int | None = None,
        dispose_without_tier: bool = False,
        wait: bool = True,
        timeout: float | None = None,
    ) -> CacheDemotion | None:
        """Move unleased RAM entries idle for ``idle_s`` seconds to the SSD tier now (LRU first).

        ``max_bytes`` stops after that many bytes. With ``wait`` the call
        returns once the spill queue is empty (every moved entry written, or
        dropped or failed, and its memory released). Without a cold tier
        nothing moves unless ``dispose_without_tier`` (then entries are
        dropped). ``None`` without the RAM tier. Each ask is bounded by
        ``timeout`` (default ``shutdown_timeout``).
        """
        running = self._running
        if running is None or wiring.MEMORY not in running.wired.refs or running.registry is None:
            return None
        reply = await _memory_asks.relieve(
            running.wired, idle_s=idle_s, max_bytes=max_bytes,
            dispose_without_tier=dispose_without_tier, wait=wait,
            timeout=self._config.shutdown_timeout if timeout is None else timeout)
        if reply.result is None:
            raise TurnUnavailable(f"the demotion did not run: {reply.error}")
        return CacheDemotion(result=reply.result, stored=reply.stored, dropped=reply.dropped,
                             failed=reply.failed)

    @property
    def final_flush(self) -> FlushResult | None:
        """The flush :meth:`aclose` ran (``None``: none ran, see :attr:`final_flush_error`)."""
        return self._shutdown.flushed

    @property
    def final_flush_error(self) -> str | None:
        """Why :meth:`aclose`'s flush gave no result (timed out, failed); ``None`` otherwise."""
        return self._shutdown.error

    async def aclose(self) -> None:
        """Begin shutdown, drain in-flight requests, flush the cold tier, stop the actors and the engine thread.

        With a cold tier, queued spills (and, with write-behind, every entry
        not yet on disk) get ``shutdown_timeout`` to reach it after the
        requests drained; engine turns keep being granted meanwhile (the
        store reads tensors back in idle turns). What is still queued then
        is released by the spill queue as it stops.
        """
        if self._state in ("closed", "closing"):
            return
        if self._state == "new":
            self._state = "closed"
            return
        self._state = "closing"
        self._shutdown.begin()
        system = self._system
        try:
            if system is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await self.drain()
                    except RuntimeFailure as exc:
                        _log.warning("engine.drain_incomplete", error=repr(exc))
                    if self._running is not None and self._running.cold is not None:
                        await self._shutdown.final_flush(lambda left: self.flush(timeout=left))
                    try:
                        await system.tell(_GATEWAY, StopTurns())
                    except RuntimeFailure:
                        pass
                # NOTE: outside the shield: the system's task group scope must be
                # the innermost scope when it exits.
                await system.__aexit__(None, None, None)
        finally:
            self._state = "closed"
            self._system = None
            # NOTE: the stopped actor system is a reference cycle (refs <->
            # cells) that still reaches the model and the cached KV through
            # the actors; drop our last strong reference so that the
            # collections on the engine thread (below, and when the
            # EngineThread closes) free them now, there.
            system = None
            if self._engine_thread is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await self._engine_thread.run(self._release_mlx_state)
                    except Exception as exc:  # noqa: BLE001 - closing must go on
                        _log.warning("engine.release_failed", error=repr(exc))
                    await self._engine_thread.aclose()

    def _release_mlx_state(self) -> None:
        """Drop every MLX array this engine owns, ON the engine thread.

        NOTE: the engine thread outlives the Engine (one parked thread per
        process, docs/engine-thread.md), so whatever a closed Engine still
        held would stay allocated until the application drops it or a later
        collection finds it. ``release_mlx_memory`` collects and waits for
        work still in flight; ``EngineThread.close()`` collects once more
        (tests/actors/engine/test_engine_lifetime.py). A model passed to
        ``from_loaded`` stays alive: its caller owns it.
        """
        startup.release_mlx_state(None if self._running is None else self._running.registry)
        self._running = None
        if self._owns_model and self._loaded is not None:
            # NOTE: the tokenizer stays (read-only, off the engine thread).
            self._loaded = dataclasses.replace(self._loaded, model=None)

    # --- identity ----------------------------------------------------------

    @property
    def model_id(self) -> str:
        """The served model's id (what the OpenAI API reports as ``model``)."""
        return self._model_id

    @property
    def identity(self) -> ModelIdentity | None:
        """The loaded model's ``kernels.ModelIdentity`` (``None`` for ``from_loaded`` without one)."""
        return None if self._loaded is None else self._loaded.identity

    def _render_limiter(self) -> anyio.CapacityLimiter:
        """The limiter every admission's prompt render runs under (``render_threads`` at once).

        NOTE: a render is mostly Python holding the GIL (the chat template,
        the piece cache, the tokenizer's calls). With many at once (the
        default, 40: the bound of anyio's shared pool they used before), a
        burst of N arrivals renders N prompts side by side: each finishes
        near the end of all of them, and N threads contend for the GIL with
        the event loop's hops. With a few, a burst renders in arrival order
        and the loop's hops stay short, but one long chat holds up the
        short ones behind it. On the 2-core CPU, 32 arrivals at once: the
        admission phase's p50 0.78 x and the lookup's 0.41 x at 2 threads,
        the rows then waiting longer to join, TTFT 0.97 x (docs/benchmarks.md,
        "the admission burst"); not measured on a GPU host yet.
        """
        if self._renders is None:
            self._renders = anyio.CapacityLimiter(self._config.render_threads)
        return self._renders

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (mlx-lm ``TokenizerWrapper``); read-only use off the engine thread."""
        return None if self._loaded is None else self._loaded.tokenizer

    @property
    def vocab_size(self) -> int | None:
        """Token ids run ``0..vocab_size - 1`` (``None`` before the model is loaded)."""
        return prompts.vocab_size(self._loaded)

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        """``kernels.engine.TokenBytes`` of the tokenizer: the bytes of token ids (logprob reports)."""
        from kernels.engine import TokenBytes

        if self._loaded is None:
            raise EngineNotStarted("start the engine first")
        return TokenBytes(self._loaded.tokenizer)

    @property
    def tool_format(self) -> ToolFormat | None:
        """The model's tool-call format (``kernels.engine.ToolFormat``), ``None`` if it has none."""
        from kernels.engine import tool_format

        return tool_format(self._loaded.tokenizer) if self._loaded is not None else None

    @property
    def config(self) -> EngineConfig:
        """The validated settings this engine runs with."""
        return self._config

    @property
    def system(self) -> ActorSystem | None:
        """The running actor system (to spawn more actors next to the gateway), or ``None``."""
        return self._system

    @property
    def background_steps(self) -> BackgroundSteps:
        """The turn runner's step registry: actors ``register`` their ``RunWhenIdle`` callables here."""
        return self._steps

    @property
    def cache_registry(self) -> CacheRegistry | None:
        """The engine thread's ``kernels.CacheRegistry`` (``None`` with the prompt cache off)."""
        return None if self._running is None else self._running.registry

    # --- requests ----------------------------------------------------------

    def chat(
        self,
        messages: Sequence[ChatMessage],
        params: GenerationParams | None = None,
        *,
        request_id: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        fit_context: bool = False,
        cache_salt: str | None = None,
    ) -> GenerationStream:
        """A stream for a chat request (rendered with the model's chat template).

        Nothing happens until the stream is entered or iterated. With
        ``fit_context``, ``params.max_tokens`` is an upper bound that shrinks
        to the context the prompt leaves (what OpenAI does when a request
        names no ``max_tokens``) instead of refusing with ``ContextTooLong``.
        ``cache_salt`` (when given, it replaces ``params.cache_salt``): the
        request reuses only cached prefixes stored under the same salt (and
        ``params.cache_scope``); see docs/prompt-cache.md, "Cache isolation".
        """
        return GenerationStream(
            self,
            request_id or self._new_id(),
            prompts.chat_renderer(messages, tools, chat_template_kwargs),
            _salted(params or self._config.default_params(), cache_salt),
            chat=True,
            fit_context=fit_context,
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        *,
        request_id: str | None = None,
        fit_context: bool = False,
        cache_salt: str | None = None,
        shared_prompt: bool = False,
    ) -> GenerationStream:
        """A stream for a raw completion of ``prompt`` (text, or token ids used verbatim).

        ``fit_context`` and ``cache_salt`` as in :meth:`chat`. ``shared_prompt``:
        other requests over this prompt (or a long prefix of it) follow at
        once, e.g. the choices of one request; the prompt is then prefilled
        once and the others reuse it, as chat prompts always do.
        """
        prepare = (prompts.text_renderer(prompt) if isinstance(prompt, str)
                   else [int(t) for t in prompt])
        return GenerationStream(
            self,
            request_id or self._new_id(),
            prepare,
            _salted(params or self._config.default_params(), cache_salt),
            chat=False,
            fit_context=fit_context,
            shared_prompt=shared_prompt,
        )

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        params: GenerationParams | None = None,
        *,
        request_id: str | None = None,
        fit_context: bool = False,
        cache_salt: str | None = None,
    ) -> Completion:
        """Run a chat request to the end and return the whole text (non-streaming)."""
        return await _collect(
            self.chat(
                messages,
                params,
                request_id=request_id,
                fit_context=fit_context,
                cache_salt=cache_salt,
            )
        )

    async def complete_prompt(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        *,
        request_id: str | None = None,
        fit_context: bool = False,
        cache_salt: str | None = None,
    ) -> Completion:
        """Run a raw completion to the end and return the whole text (non-streaming)."""
        return await _collect(
            self.generate(
                prompt, params, request_id=request_id, fit_context=fit_context, cache_salt=cache_salt
            )
        )

    async def run_when_idle(self, fn: Callable[[], T], *, timeout: float | None = None) -> T:
        """Run ``fn()`` as ONE background engine turn, granted when no request runs or waits.

        For background work (cache write-back, snapshots) from outside the
        actors; actors send ``RunWhenIdle`` themselves. Raises
        ``TurnUnavailable`` once the engine stops granting turns, and
        ``fn``'s own exception if it raised.
        """
        system = self._require_system()
        turns = GatewayTurns(system, self._steps, timeout=self._config.shutdown_timeout,
                             gateway=_GATEWAY, label="engine", prefix="step-")
        return await turns.run_when_idle(fn, timeout=timeout)

    # --- observability -----------------------------------------------------

    async def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """A JSON-ready snapshot: gateway (queue, lane, requests, engine-turn token),
        prompt cache, engine thread, cache registry, mailboxes.

        The actors are ASKED (each with ``timeout``, default
        ``config.stats_timeout_s``, all at once); one that does not answer in
        time (the turn runner answers between turns) is listed under
        ``unavailable`` instead of delaying the snapshot. The engine thread's
        and the registry's counters are thread-safe reads.
        """
        stats = await _stats.engine_stats(
            model_id=self._model_id, state=self._state, loaded=self._loaded,
            running=self._running, system=self._system, thread=self._engine_thread,
            timeout=timeout)
        memory = stats.get("memory")
        if isinstance(memory, dict) and "budget_bytes" in memory:
            # NOTE: the admissions that waited for running requests to end (MemoryBusy).
            memory["admission_waits"] = self._streams.waits
            memory["admission_busy_failed"] = self._streams.busy_failed
            memory["streams_live"] = self._streams.live
        return stats

    # --- internals -----------------------------------------------------------

    def _new_id(self, prefix: str = "req-") -> str:
        self._ids += 1
        return f"{prefix}{id(self):x}-{self._ids}"

    def _check_open(self) -> None:
        if self._state in ("new", "starting"):
            raise EngineNotStarted("start the engine first (`async with Engine(...)`)")
        if self._state in ("draining", "closing"):
            raise ServerShuttingDown()
        if self._state == "closed":
            raise EngineClosed("the engine is closed")

    def _require_system(self) -> ActorSystem:
        if self._system is None:
            self._check_open()
            raise EngineClosed("the engine is closed")
        return self._system

    def _gateway(self) -> ActorRef:
        if self._running is None:
            raise EngineNotStarted("start the engine first")
        return self._running.wired.ref(_GATEWAY)


@dataclass(frozen=True, slots=True)
class CacheDemotion:
    """What :meth:`Engine.demote_cache` did: the RAM tier's answer and, after waiting, the writes.

    ``stored``/``dropped``/``failed``: spill-queue items settled that way
    between the demotion and the queue's drain (other producers' items
    included); ``None`` when the call did not wait or there is no cold tier.
    """

    result: DemoteResult
    stored: int | None = None
    dropped: int | None = None
    failed: int | None = None
