"""The FastAPI app: OpenAI-compatible routes on top of the engine API.

One code path for embedders and HTTP: every generation goes through
``engine.chat`` / ``engine.generate`` and the ``GenerationStream`` they
return. Admission happens before any response byte is sent, so refusals are
plain 429/503/400 answers, never a broken stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actors.engine.config import EngineConfig
from actors.errors import KvtierError, ServerShuttingDown
from messages.gateway import DoneEvent, GenerationParams, Usage

from ._access import parse_networks
from ._admin import install_admin
from ._answer import (
    ChatAnswer,
    CompletionAnswer,
    Echo,
    LogprobOptions,
)
from ._choices import CHOICE_EVENTS, Failure, choice_id, choice_params, drain
from ._convert import (
    chat_messages,
    chat_response,
    check_against_vocab,
    choices_usage,
    completion_response,
    grammar_for,
    needs_grammar,
    resolve_model,
    to_params,
    tool_parsing,
    tools_for_template,
)
from ._errors import (
    ApiError,
    error_body,
    install_error_handlers,
    kvtier_error_to_api,
    validation_to_api,
)
from ._events import choice_events, error_event, usage_tail
from ._isolation import request_cache_scope
from ._metrics import HttpMetrics, MeteredEngine, install_metrics
from ._middleware import (
    AdminGuardMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HostAllowlistMiddleware,
    JsonContentTypeMiddleware,
    TrailingSlashMiddleware,
)
from ._openapi import json_body, openapi_document
from ._port import EnginePort, StreamPort
from ._request_id import REQUEST_ID_KEY, RequestId
from ._schemas import (
    MAX_CHOICES,
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    NamedToolChoice,
    _SamplingFields,
)
from ._sse import DONE, EventStreamResponse, sse_json
from ._state import HttpSettings, HttpState
from ._status import install_status
from ._timeline import TimedStream, Timeline

__all__ = ["begin_shutdown", "create_app", "cut_streams"]

_log = structlog.get_logger("kvtier.http")

_Answer = ChatAnswer | CompletionAnswer


def _request_id(scope: Scope) -> RequestId:
    rid = scope.get(REQUEST_ID_KEY)
    assert isinstance(rid, RequestId), "_AccessLog must wrap the app"
    return rid


class _AccessLog:
    """Names every request, logs one structlog event for it and counts statuses.

    Every response carries ``X-Request-Id`` (errors included), and every log
    line of the request carries the same id as ``correlation_id``.
    NOTE: bound with tokens and reset after the response: a request never
    sees a binding made by another one (uvicorn may create the next request's
    task from inside this one's, copying its context; the server also gives
    each request a fresh context, see ``_server``).
    """

    def __init__(self, app: ASGIApp, state: HttpState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        started = time.perf_counter()
        hex_id = self.state.new_id()
        rid = RequestId(hex=hex_id, value=f"req-{hex_id}")
        scope = {**scope, REQUEST_ID_KEY: rid}
        tokens = structlog.contextvars.bind_contextvars(correlation_id=rid.value)

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self.state.statuses[status] += 1
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"x-request-id"]
                headers.append((b"x-request-id", rid.value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            # NOTE: request_id is the engine's correlation id for generation
            # requests: it links this line to the request's actor-message trace.
            _log.info("http.request", method=scope["method"], path=scope["path"],
                      status=status, request_id=rid.value, correlation_id=rid.value,
                      duration_ms=round((time.perf_counter() - started) * 1e3, 2))
            structlog.contextvars.reset_contextvars(**tokens)


_Body = TypeVar("_Body", bound=BaseModel)
_Gen = TypeVar("_Gen", bound=_SamplingFields)


async def _parse(request: Request, model: type[_Body]) -> _Body:
    """Validate the JSON body (``JsonContentTypeMiddleware`` already required ``application/json``).

    NOTE: read here rather than by FastAPI's body parameters so that a bad
    body yields OpenAI's 400 shapes and the size cap applies while reading.
    """
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise _ClientLeft() from None
    if not raw.strip():
        raise ApiError(400, "The request body is empty; send a JSON object.", code="invalid_json")
    if _ROUTER_MARK in raw:
        if len(raw) <= _INLINE_PARSE_BYTES:
            raw = _without_router_defaults(raw)
        else:
            raw = await anyio.to_thread.run_sync(_without_router_defaults, raw)
    try:
        if len(raw) <= _INLINE_PARSE_BYTES:
            return model.model_validate_json(raw)
        # NOTE: a large body (thousands of messages) takes milliseconds to
        # validate; a worker thread keeps /health and streams responsive.
        return await anyio.to_thread.run_sync(model.model_validate_json, raw)
    except ValidationError as exc:
        raise validation_to_api(exc.errors()) from None


_ROUTER_DEFAULTS: dict[str, bool] = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
"""SGLang sampling fields sglang-router adds to every body it forwards, at their defaults."""

_ROUTER_MARK = b'"no_stop_trim"'


def _without_router_defaults(raw: bytes) -> bytes:
    """``raw`` without the SGLang fields a router added at their default values.

    NOTE: sglang-router (docs/scale-out.md) forwards every chat body with
    these fields set to SGLang's defaults; at those values they ask for what
    kvtier does anyway, so they are dropped. Any other value stays and the
    strict schema refuses it (400): kvtier does not implement them.
    (``ignore_eos`` is a field of kvtier's own, with vLLM's meaning.)
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw  # NOTE: the validator reports the bad (or too deep) JSON as a 400.
    if not isinstance(body, dict):
        return raw
    for key, default in _ROUTER_DEFAULTS.items():
        if key in body and body[key] is default:
            del body[key]
    return json.dumps(body).encode()


_INLINE_PARSE_BYTES = 64 * 1024
"""Bodies up to this size are validated on the event loop (cheaper than a thread hop)."""


class _ClientLeft(Exception):
    """The client disconnected while its body was being read (nobody reads the answer)."""


class _Cut:
    """Fires once, when the server cuts the responses still running (its shutdown budget is spent)."""

    def __init__(self) -> None:
        self.fired = False
        self._event: anyio.Event | None = None

    def fire(self) -> None:
        self.fired = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if self.fired:
            return
        if self._event is None:
            # NOTE: created on first use: an anyio.Event needs the running loop.
            self._event = anyio.Event()
        await self._event.wait()


_CUT_MESSAGE = "The server is shutting down; this response was cut before its end."

_STREAM_WRITE_TIMEOUT_S = EngineConfig().stream_write_timeout_s

_ARRIVED = "kvtier.arrived"
"""Key of the request's arrival (``HttpState.monotonic``) in its ASGI ``scope["state"]``."""


_HAND_PARSED: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest)
"""Bodies parsed by hand (``_parse``), described in the OpenAPI document by ``openapi_document``."""


def create_app(
    engine: EnginePort,
    settings: HttpSettings | None = None,
    *,
    state: HttpState | None = None,
    stream_write_timeout_s: float = _STREAM_WRITE_TIMEOUT_S,
) -> FastAPI:
    """Build the app over ``engine`` (started by the caller; the app never closes it).

    ``state`` injects the clock/id ports and lets the caller (``kvtier
    serve``) watch in-flight responses during shutdown; it is also
    ``app.state.http``. ``stream_write_timeout_s``: the deadline on each
    write of a streamed answer (``--stream-write-timeout``; ``_sse``).
    """
    settings = settings or HttpSettings()
    st = state or HttpState()
    # NOTE: no slash redirects: a 307 makes clients drop or re-send a POST;
    # TrailingSlashMiddleware routes "/v1/chat/completions/" directly.
    app = FastAPI(title="kvtier", version="0.1.0", docs_url=None, redoc_url=None,
                  redirect_slashes=False)
    app.state.http = st
    app.state.engine = engine
    # NOTE: operator surfaces (/admin, /metrics, the status page) live in
    # their own modules; generation streams are metered at this edge.
    metrics = HttpMetrics(engine.stats, st)
    app.state.metrics = metrics
    install_admin(app, engine)
    install_metrics(app, metrics)
    install_status(app)
    engine = MeteredEngine.wrap(engine, metrics)
    cut = _Cut()
    app.state.cut = cut
    install_error_handlers(app)
    app.openapi = lambda: openapi_document(app, _HAND_PARSED)  # type: ignore[method-assign]

    async def on_client_left(_request: Request, _exc: Exception) -> Response:
        st.disconnects += 1
        return Response(status_code=499)

    app.add_exception_handler(_ClientLeft, on_client_left)

    def created() -> int:
        return int(st.clock())

    def check_admission_open() -> None:
        if st.shutting_down:
            raise ServerShuttingDown()

    # --------------------------------------------------------------- routes

    # NOTE: one route for both methods, so a 405 (OPTIONS /health) names both
    # in its Allow header; openapi_document describes the two operations (one
    # route would give both the same operation id).
    @app.api_route("/health", methods=["GET", "HEAD"], response_model=None,
                   include_in_schema=False)
    async def health() -> JSONResponse:
        """Liveness; 503 ``draining`` once shutdown began (no auth needed, so nothing but the status)."""
        if st.shutting_down:
            return JSONResponse({"status": "draining"}, status_code=503)
        # NOTE: no model id: it may be a local path, and /health answers without a key.
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        """The one served model."""
        return ModelList(data=[ModelCard(id=engine.model_id, created=int(st.started_at))])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        """One model by id (404 for any other)."""
        served = resolve_model(model_id, engine.model_id, settings.model_aliases)
        return ModelCard(id=served, created=int(st.started_at))

    # NOTE: what routers probe before they route to a worker (sglang-router
    # 0.3: /health, then /server_info and /model_info, falling back to the
    # /get_* names); docs/scale-out.md. Same auth as /v1/models.
    @app.get("/get_model_info")
    @app.get("/model_info", operation_id="model_info")
    async def model_info() -> dict[str, Any]:
        """The served model, in the shape SGLang's workers answer."""
        return {"model_path": engine.model_id, "tokenizer_path": None, "is_generation": True,
                "served_model_name": engine.model_id}

    @app.get("/get_server_info")
    @app.get("/server_info", operation_id="server_info")
    async def server_info() -> dict[str, Any]:
        """Server facts a router or a KV-event subscriber needs (``kv_events``: endpoints, hashing)."""
        info: dict[str, Any] = {"version": app.version, "model_path": engine.model_id,
                                "served_model_name": engine.model_id}
        snapshot = await engine.stats()
        if "kv_events" in snapshot:
            info["kv_events"] = snapshot["kv_events"]
        return info

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """Gateway, engine-turn token and mailbox statistics, plus the HTTP layer's own."""
        return {"engine": await engine.stats(), "http": st.snapshot()}

    @app.post("/v1/chat/completions", response_model=None,
              openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions, streamed (SSE) or not; tools, logprobs, structured output."""
        body, rid, model, params = await _accept(request, ChatCompletionRequest, "chatcmpl")
        tools = tool_parsing(body, engine.tool_format)
        messages = chat_messages(body)
        hex_id = _request_id(request.scope).hex
        choice = body.effective_tool_choice()

        def make(c: int) -> tuple[StreamPort, _Answer]:
            # NOTE: a tool call's id names its choice too, so ids stay unique across choices.
            calls = f"call_{hex_id}_" if c == 0 else f"call_{hex_id}_{c}_"
            answer = ChatAnswer(tools=tools, logprobs=_logprob_options(params),
                                call_id=lambda n: f"{calls}{n}",
                                forced=choice == "required" or isinstance(choice, NamedToolChoice))
            stream = engine.chat(messages, choice_params(params, c), request_id=choice_id(rid, c),
                                 tools=tools_for_template(body),
                                 fit_context=body.requested_max_tokens() is None)
            return stream, answer

        if body.n == 1:
            return await _respond(*make(0), body, request, rid, model)
        return await _respond_choices(body.n, body.n, make, body, request, rid, model)

    @app.post("/v1/completions", response_model=None,
              openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        """OpenAI (legacy) text completions, streamed (SSE) or not."""
        body, rid, model, params = await _accept(request, CompletionRequest, "cmpl")
        prompts = body.prompt_values()
        # NOTE: the choices of one request share their prompt (n) or often a
        # prefix (a batch's few-shot examples): each then takes the prompt
        # snapshot, and a sibling waits for it instead of prefilling it too.
        shared = len(prompts) * body.n > 1

        def make(c: int) -> tuple[StreamPort, _Answer]:
            # NOTE: choice c is prompt c // n's (c % n)-th, as OpenAI numbers a batch's choices.
            prompt = prompts[c // body.n]
            echo = Echo(prompt, engine.token_bytes) if body.echo else None
            answer = CompletionAnswer(logprobs=_logprob_options(params), echo=echo,
                                      scores_only=body.scores_only)
            stream = engine.generate(prompt, choice_params(params, c % body.n),
                                     request_id=choice_id(rid, c),
                                     fit_context=body.requested_max_tokens() is None,
                                     shared_prompt=shared)
            return stream, answer

        count = len(prompts) * body.n
        if count > MAX_CHOICES:
            raise ApiError(400, f"This request asks for {count} choices ({len(prompts)} prompts x "
                                f"n {body.n}); at most {MAX_CHOICES} are allowed.",
                           code="invalid_value", param="n")
        if count == 1:
            return await _respond(*make(0), body, request, rid, model)
        return await _respond_choices(count, body.n, make, body, request, rid, model)

    # ------------------------------------------------------------ plumbing

    async def _accept(request: Request, schema: type[_Gen],
                      prefix: str) -> tuple[_Gen, str, str, GenerationParams]:
        """Parse and check a generation body; name the request (body, id, model, params)."""
        # NOTE: the request's arrival, the timeline's origin (_timeline).
        request.scope.setdefault("state", {})[_ARRIVED] = st.monotonic()
        check_admission_open()
        body = await _parse(request, schema)
        model = resolve_model(body.model, engine.model_id, settings.model_aliases)
        grammar: str | None = None
        if isinstance(body, ChatCompletionRequest) and needs_grammar(body):
            # NOTE: compiling a schema into a grammar may take milliseconds.
            grammar = await anyio.to_thread.run_sync(grammar_for, body, engine.tool_format)
        scope = request_cache_scope(settings.cache_namespace,
                                    request.headers.get("authorization"))
        params = to_params(body, settings.defaults, grammar, scope)
        check_against_vocab(body, params, engine.vocab_size)
        named = _request_id(request.scope)
        named.value = rid = f"{prefix}-{named.hex}"
        # NOTE: the request id is also the engine's correlation id: binding it
        # here puts it on every log line of this request (the access log, the
        # SSE body task, which copies this context), next to the actors' events.
        # _AccessLog resets the binding when the response is done.
        structlog.contextvars.bind_contextvars(correlation_id=rid)
        return body, rid, model, params

    def _logprob_options(params: GenerationParams) -> LogprobOptions | None:
        if not params.logprobs:
            return None
        return LogprobOptions(top=params.top_logprobs, spell=engine.token_bytes)

    async def _admit(stream: StreamPort) -> None:
        """Admit (the engine refuses over-long prompts before admission); on refusal release the stream."""
        try:
            await stream.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise

    async def _respond(stream: StreamPort, answer: _Answer, body: _SamplingFields,
                       request: Request, rid: str, model: str) -> Response:
        st.enter()
        try:
            await _admit(stream)
        except BaseException:
            st.leave()
            raise
        arrived = request.scope.get("state", {}).get(_ARRIVED)
        timeline = Timeline(rid, arrived if arrived is not None else st.monotonic(),
                            clock=st.monotonic)
        timeline.admitted()
        headers = {"X-Request-Id": rid}
        if not body.stream:
            try:
                return await _collect(stream, request, rid, model, answer, headers)
            finally:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                st.leave()

        async def release() -> None:
            await stream.aclose()
            st.leave()
            st.timelines.record(timeline)

        events = _sse_events(TimedStream(stream, timeline), rid, model, answer,
                             body.include_usage(), body.continuous_usage())
        err = kvtier_error_to_api(ServerShuttingDown(_CUT_MESSAGE))
        return EventStreamResponse(
            events, on_close=release, headers=headers, cut=cut.wait,
            cut_event=sse_json(error_body(err.message, err.type, err.code, err.param)),
            write_timeout=stream_write_timeout_s, request_id=rid, on_write=timeline.wrote)

    async def _respond_choices(count: int, n: int, make: Callable[[int], tuple[StreamPort, _Answer]],
                               body: _SamplingFields, request: Request, rid: str,
                               model: str) -> Response:
        """Answer a request of ``count`` choices (``n`` per prompt), each a generation of its own.

        At most ``settings.choice_window`` choices generate at once (the
        rest wait for one to end, not in the admission queue). The answer
        is all or nothing: the first choice that fails (a refusal such as
        a full queue, or a failed generation) cancels the others and is the
        response; a client that leaves cancels them all.
        """
        if body.stream:
            return await _stream_choices(count, n, make, body, request, rid, model)
        results: list[tuple[_Answer, DoneEvent] | None] = [None] * count
        failures: list[KvtierError] = []
        left = False
        window = anyio.CapacityLimiter(settings.choice_window)
        st.enter()
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    nonlocal left
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    left = True
                    st.disconnects += 1
                    tg.cancel_scope.cancel()

                async def watch_cut() -> None:
                    await cut.wait()
                    tg.cancel_scope.cancel()

                async def run(c: int) -> None:
                    async with window:
                        stream, answer = make(c)
                        try:
                            await _admit(stream)
                            done = await drain(stream, answer)
                        except KvtierError as exc:
                            failures.append(exc)
                            tg.cancel_scope.cancel()
                            return
                        finally:
                            with anyio.CancelScope(shield=True):
                                await stream.aclose()
                        if done is not None:
                            answer.finish(done)
                            results[c] = (answer, done)

                tg.start_soon(watch_disconnect)
                tg.start_soon(watch_cut)
                async with anyio.create_task_group() as choices:
                    for c in range(count):
                        choices.start_soon(run, c)
                tg.cancel_scope.cancel()
        finally:
            st.leave()
        if failures:
            raise failures[0]
        if left:
            return Response(status_code=499)
        answered = [r for r in results if r is not None]
        if len(answered) < count:
            # NOTE: only the cut ends choices without a failure or a departure.
            raise ServerShuttingDown(_CUT_MESSAGE)
        result: ChatCompletion | CompletionResponse
        if isinstance(answered[0][0], ChatAnswer):
            chats = [(a, d) for a, d in answered if isinstance(a, ChatAnswer)]
            result = chat_response(rid, created(), model, chats,
                                   logprobs=chats[0][0].reports_logprobs)
        else:
            texts = [(a, d) for a, d in answered if isinstance(a, CompletionAnswer)]
            result = completion_response(rid, created(), model, texts, n)
        return JSONResponse(result.model_dump(mode="json"), headers={"X-Request-Id": rid})

    async def _collect(stream: StreamPort, request: Request, rid: str, model: str,
                       answer: _Answer, headers: dict[str, str]) -> Response:
        """Run a non-streamed request to the end, cancelling it if the client leaves."""
        done: DoneEvent | None = None
        failure: KvtierError | None = None
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                # NOTE: the body is already read, so the next receive() returns
                # only when the client disconnects.
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                st.disconnects += 1
                tg.cancel_scope.cancel()

            async def watch_cut() -> None:
                await cut.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            tg.start_soon(watch_cut)
            try:
                done = await drain(stream, answer)
            except KvtierError as exc:
                # NOTE: kept out of the task group so it is not wrapped in an ExceptionGroup.
                failure = exc
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if done is None and cut.fired:
            raise ServerShuttingDown(_CUT_MESSAGE)
        if done is None:
            # The client left; nobody reads this answer.
            return Response(status_code=499)
        answer.finish(done)
        result: ChatCompletion | CompletionResponse = (
            chat_response(rid, created(), model, [(answer, done)],
                          logprobs=answer.reports_logprobs)
            if isinstance(answer, ChatAnswer)
            else completion_response(rid, created(), model, [(answer, done)])
        )
        return JSONResponse(result.model_dump(mode="json"), headers=headers)

    async def _sse_events(stream: StreamPort, rid: str, model: str, answer: _Answer,
                          include_usage: bool, continuous: bool) -> AsyncIterator[bytes]:
        """The SSE events of a one-choice answer: the choice's, the usage tail, ``[DONE]``."""
        ts = created()
        finished = False
        ended: list[Usage] = []
        try:
            async for event in choice_events(stream, rid, ts, model, answer, continuous, 0,
                                              ended):
                yield event
            if include_usage and ended:
                yield usage_tail(rid, ts, model, answer, ended[0])
            finished = True
            yield DONE
        except KvtierError as exc:
            yield error_event(exc, rid)
            finished = True
        finally:
            if not finished and not cut.fired:
                st.disconnects += 1

    async def _stream_choices(count: int, n: int,
                              make: Callable[[int], tuple[StreamPort, _Answer]],
                              body: _SamplingFields, request: Request, rid: str,
                              model: str) -> Response:
        """Stream a request of ``count`` choices (``n`` per prompt): their chunks interleaved, one ``[DONE]``.

        The first ``choice_window`` choices are admitted before the response
        starts, so their refusals are statuses as a one-choice request's; a
        later choice refused, or any choice failing, ends the stream with
        an error event (and no ``[DONE]``) and cancels the others. Each
        choice's chunks carry its index; the usage tail (``include_usage``)
        counts each prompt once. The choices feed one bounded channel that
        the response drains: a client that stops reading holds them all,
        and the write deadline ends them all. Each choice has a timeline of
        its own (``/stats`` ``http.timeline``, a ``request.timeline`` line
        named by its choice id): its first byte is the first chunk written
        after its first token.
        """
        window = settings.choice_window
        first = [make(c) for c in range(min(count, window))]
        arrived = request.scope.get("state", {}).get(_ARRIVED)
        timelines = [Timeline(choice_id(rid, c), arrived if arrived is not None else st.monotonic(),
                              clock=st.monotonic) for c in range(count)]
        st.enter()
        try:
            for c, (stream, _) in enumerate(first):
                await _admit(stream)
                timelines[c].admitted()
        except BaseException:
            with anyio.CancelScope(shield=True):
                for stream, _ in first:
                    await stream.aclose()
            st.leave()
            raise
        ts = created()
        usages: list[Usage | None] = [None] * count
        send, receive = anyio.create_memory_object_stream[tuple[int, bytes] | Failure](CHOICE_EVENTS)

        async def produce() -> None:
            slots = anyio.Semaphore(window)
            taken: set[int] = set()
            try:
                await _produce(slots, taken)
            finally:
                # NOTE: a task closes its own choice's stream. One of the
                # choices admitted before the response whose task was
                # cancelled before it ran (another choice failed first) never
                # took its stream; it is closed here.
                with anyio.CancelScope(shield=True):
                    for c, (stream, _) in enumerate(first):
                        if c not in taken:
                            await stream.aclose()

        async def _produce(slots: anyio.Semaphore, taken: set[int]) -> None:
            async with send, anyio.create_task_group() as tg:

                async def one(c: int) -> None:
                    taken.add(c)
                    try:
                        stream, answer = first[c] if c < len(first) else make(c)
                        try:
                            if c >= len(first):
                                await _admit(stream)
                                timelines[c].admitted()
                            ended: list[Usage] = []
                            async for event in choice_events(
                                    TimedStream(stream, timelines[c]), rid, ts, model, answer,
                                    body.continuous_usage(), c, ended):
                                await send.send((c, event))
                            usages[c] = ended[0] if ended else None
                        except KvtierError as exc:
                            await send.send(Failure(error_event(exc, rid)))
                            tg.cancel_scope.cancel()
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            # NOTE: the response ended (its reader closed the
                            # channel after a failure); this choice is not read.
                            return
                        finally:
                            with anyio.CancelScope(shield=True):
                                await stream.aclose()
                    finally:
                        slots.release()

                for c in range(count):
                    await slots.acquire()
                    tg.start_soon(one, c)

        tail_answer = first[0][1]

        async def events() -> AsyncIterator[bytes]:
            finished = False
            try:
                async with receive:
                    async for item in receive:
                        if isinstance(item, Failure):
                            finished = True
                            yield item.event
                            return
                        c, chunk = item
                        yield chunk
                        # NOTE: the writer asks for the next chunk once this one is written.
                        timelines[c].wrote()
                ended = [u for u in usages if u is not None]
                if len(ended) < count:
                    # NOTE: only the end of the response (cut, deadline) stops choices silently.
                    return
                if body.include_usage():
                    yield usage_tail(rid, ts, model, tail_answer, choices_usage(ended, n))
                finished = True
                yield DONE
            finally:
                if not finished and not cut.fired:
                    st.disconnects += 1

        async def release() -> None:
            st.leave()
            for timeline in timelines:
                st.timelines.record(timeline)

        err = kvtier_error_to_api(ServerShuttingDown(_CUT_MESSAGE))
        return EventStreamResponse(
            events(), on_close=release, headers={"X-Request-Id": rid}, cut=cut.wait,
            cut_event=sse_json(error_body(err.message, err.type, err.code, err.param)),
            write_timeout=stream_write_timeout_s, request_id=rid, producer=produce)

    # ----------------------------------------------------------- middleware
    # Starlette wraps in reverse order: the last added runs first.
    # Order of checks: Host, API key, admin guard, JSON content type, body cap.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(JsonContentTypeMiddleware, posts=frozenset(
        route.path for route in app.routes
        if isinstance(route, APIRoute) and "POST" in (route.methods or ())))
    app.add_middleware(AdminGuardMiddleware, key=settings.admin_key or settings.api_key,
                       loopback=settings.admin_loopback,
                       trusted_proxies=parse_networks(settings.trusted_proxies))
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_hosts is not None:
        app.add_middleware(HostAllowlistMiddleware, allowed=settings.allowed_hosts)
    app.add_middleware(TrailingSlashMiddleware)
    app.add_middleware(_AccessLog, state=st)
    return app


def begin_shutdown(app: FastAPI) -> None:
    """Stop admission: generation routes and ``/health`` answer 503, in-flight streams finish."""
    st: HttpState = app.state.http
    st.shutting_down = True
    engine: EnginePort = app.state.engine
    engine.begin_shutdown()


def cut_streams(app: FastAPI) -> None:
    """End every generation response still running, now (the shutdown budget is spent).

    A stream ends with an OpenAI error event (``shutting_down``) and
    ``data: [DONE]``; a non-streamed request answers 503 ``shutting_down``.
    Each response then releases its engine request (cancelled within one
    decode step). Call after :func:`begin_shutdown`.
    """
    cut: _Cut = app.state.cut
    cut.fire()
