"""kvtier's OpenAI-compatible app as a Ray Serve application (``pip install 'kvtier[ray]'``).

Two deployments (docs/scale-out.md "Ray Serve"):

- ``KvtierIngress`` (one replica is enough; it only relays bytes) is the
  HTTP ingress behind Ray's proxy. It reads the request body (bounded),
  takes the prompt text out of a chat or completions body and calls
  ``KvtierReplica.handle_http`` through a streaming deployment handle;
  each ASGI message the replica sends comes back as one streamed item and
  is written to the client as it comes.
- ``KvtierReplica`` (N replicas, autoscaling allowed) each holds one
  :class:`~actors.engine.Engine` and the app of :func:`actors.http.create_app`,
  and runs each relayed request through that very app, in process.

NOTE: why two deployments: Ray's proxy hands a plain ingress deployment the
ASGI scope before the body is read, so no request router can see the prompt
there. A call through a deployment handle carries its arguments, and Ray's
``PrefixCacheAffinityRouter`` (:data:`PREFIX_ROUTER`) routes such
calls by the longest prefix match of an argument's ``prompt`` attribute
(:class:`RelayedRequest.prompt`). It is therefore set as the replica
deployment's request router; with ``prefix_affinity=False`` Ray's default
power-of-two-choices router is used.

``ray`` is imported lazily (inside :func:`build_app`) so this module imports
without the extra.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from actors.engine.config import EngineConfig

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = 16 * 1024 * 1024
"""The ingress refuses (413) a body larger than this before relaying it."""

RELAY_QUEUE = 64
"""ASGI messages a replica buffers ahead of the ingress reading them (bounded)."""

RELAY_PUT_TIMEOUT_S = 30.0
"""Deadline on each buffered message: a reader this far behind ends the request."""

_PROMPT_CHARS = 65_536
"""The prompt text handed to the router is cut here: a prefix match needs no more."""


PREFIX_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware."
                 "prefix_aware_router.PrefixCacheAffinityRouter")
"""Ray's prefix-affinity request router, by import path (see :func:`build_app`)."""


@dataclass(frozen=True)
class RelayedRequest:
    """One HTTP request as the ingress relays it to a replica (picklable, no sockets)."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None
    prompt: str = field(default="")
    """The request's prompt text (chat messages' text joined, or ``prompt``): what the router matches on."""


def prompt_text(body: bytes) -> str:
    """The text a prefix router matches on: chat messages' text in order, or the completion prompt.

    Anything that is not such a JSON body gives ``""`` (the app itself
    answers it with its usual 4xx); the text is cut at a fixed length.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(doc, dict):
        return ""
    parts: list[str] = []
    messages = doc.get("messages")
    if isinstance(messages, list):
        parts.extend(_content_text(message.get("content"))
                     for message in messages if isinstance(message, dict))
    else:
        parts.append(_content_text(doc.get("prompt")))
    return "".join(parts)[:_PROMPT_CHARS]


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_content_text(part) for part in content)
    if isinstance(content, dict):
        text = content.get("text")
        return text if isinstance(text, str) else ""
    return ""


async def run_relayed(app: Callable[[Scope, Receive, Send], Awaitable[None]],
                      request: RelayedRequest) -> AsyncIterator[Message]:
    """Run ``request`` through the ASGI ``app`` and yield each message it sends.

    The body is delivered in one ``http.request`` message; later receives
    wait until the consumer goes away (closing this generator), which the
    app then sees as ``http.disconnect``, so a client that hangs up cuts its
    stream like it does under uvicorn.
    """
    scope: Scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": request.method, "scheme": "http",
        "path": request.path, "raw_path": request.path.encode("latin-1"),
        "query_string": request.query_string, "root_path": "",
        "headers": [tuple(pair) for pair in request.headers],
        "client": request.client, "server": None,
    }
    gone = asyncio.Event()
    body_sent = False
    queue: asyncio.Queue[Message | None] = asyncio.Queue(maxsize=RELAY_QUEUE)

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        # NOTE: bounded, with a deadline: a reader that stopped reading ends the app's
        # writes with TimeoutError (the app cuts its stream) instead of buffering without end.
        await asyncio.wait_for(queue.put(message), RELAY_PUT_TIMEOUT_S)

    async def drive() -> None:
        try:
            await app(scope, receive, send)
        finally:
            gone.set()
            await queue.put(None)

    task = asyncio.create_task(drive())
    try:
        while True:
            message = await queue.get()
            if message is None:
                break
            yield message
        await task
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def relay_to_client(items: AsyncIterator[Message], send: Send) -> None:
    """Write each relayed ASGI message to the client as it arrives."""
    async for message in items:
        await send(message)


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The whole request body, or ``None`` once it passes ``limit`` bytes (or the client left)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None  # NOTE: nobody reads the answer; the 413 written then is dropped
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def relayed_request(scope: Scope, body: bytes) -> RelayedRequest:
    """The picklable form of an ASGI ``scope`` and its ``body``, with the prompt text for the router."""
    client = scope.get("client")
    return RelayedRequest(
        method=str(scope["method"]), path=str(scope["path"]),
        query_string=bytes(scope.get("query_string", b"")),
        headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", [])),
        body=body, client=None if client is None else (str(client[0]), int(client[1])),
        # NOTE: never empty: Ray's prefix router divides by the text's length (and raises
        # on an empty one); a request without a prompt is matched on its method and path.
        prompt=(prompt_text(body) if scope["method"] == "POST" else "")
        or f"{scope['method']} {scope['path']}",
    )


async def _too_large(send: Send) -> None:
    body = json.dumps({"error": {
        "message": f"request body larger than {MAX_BODY_BYTES} bytes",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@dataclass(frozen=True)
class RayServeSettings:
    """How :func:`build_app` deploys kvtier (docs/scale-out.md "Ray Serve")."""

    config: EngineConfig
    """Each replica's engine settings (``model=None``: the default model)."""
    replicas: int = 2
    """Fixed replica count (ignored when ``autoscaling`` is given)."""
    autoscaling: dict[str, Any] | None = None
    """Ray Serve's ``autoscaling_config`` for the replicas (e.g. ``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests``); ``None``: ``replicas`` fixed."""
    prefix_affinity: bool = True
    """Route by prompt prefix (Ray's ``PrefixCacheAffinityRouter``); ``False``: Ray's default router."""
    replica_cpus: float = 1.0
    """``num_cpus`` reserved for each replica's Ray actor."""
    max_ongoing_requests: int = 16
    """Requests one replica takes at once (Ray queues the rest at the caller)."""


def _engine_settings(config: EngineConfig) -> tuple[EngineConfig, tuple[str, ...]]:
    """The config with the default model resolved in place, and the model's aliases (as ``kvtier serve``)."""
    import dataclasses
    import os

    if config.model is None:
        from kernels import ensure_default_model

        return config, (str(ensure_default_model()), "default")
    return dataclasses.replace(config), (config.model,
                                         os.path.basename(config.model.rstrip("/")), "default")


class _ReplicaHost:
    """One engine and its app, started and stopped by one long-lived task.

    NOTE: the engine enters its actor system's task group in ``start`` and
    leaves it in ``aclose``; both must run in the same task, so a host task
    owns the whole lifecycle and the deployment only signals it.
    """

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        self.app: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure

    async def _run(self) -> None:
        from actors.engine import Engine
        from actors.http import HttpSettings, HttpState, create_app

        config, aliases = _engine_settings(self._config)
        engine = Engine(config=config)
        try:
            await engine.start()
            settings = HttpSettings.from_config(config, model_aliases=aliases)
            self.app = create_app(engine, settings, state=HttpState(),
                                  stream_write_timeout_s=config.stream_write_timeout_s)
        except BaseException as exc:
            self._failure = exc
            self._ready.set()
            await engine.aclose()
            raise
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await engine.aclose()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


def build_app(settings: RayServeSettings) -> Any:
    """The bound Ray Serve application (pass it to ``serve.run``): ingress + kvtier replicas."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    replica_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": settings.replica_cpus},
        "max_ongoing_requests": settings.max_ongoing_requests,
    }
    if settings.autoscaling is not None:
        replica_options["autoscaling_config"] = AutoscalingConfig(**settings.autoscaling)
    else:
        replica_options["num_replicas"] = settings.replicas
    if settings.prefix_affinity:
        # NOTE: imported by path inside Ray. The public alias
        # ray.serve.llm.request_router.PrefixCacheAffinityRouter imports
        # ray.serve.llm, which in Ray 2.60 refuses to load without vLLM or
        # SGLang; the class itself (ray.llm._internal) needs neither.
        # (RequestRouterConfig's __init__ is annotated `**kwargs: dict`, hence the mapping.)
        router: dict[str, Any] = {"request_router_class": PREFIX_ROUTER}
        replica_options["request_router_config"] = RequestRouterConfig(**router)

    @serve.deployment(name="KvtierReplica", **replica_options)
    class KvtierReplica:
        """One kvtier engine and its app; each relayed request runs through that app."""

        async def __init__(self, config: EngineConfig) -> None:  # type: ignore[misc]
            self._host = _ReplicaHost(config)
            await self._host.start()

        async def handle_http(self, request: RelayedRequest) -> AsyncIterator[Message]:
            """Run one relayed request; yield each ASGI message the app sends."""
            app = self._host.app
            assert app is not None  # NOTE: start() returned, so the app exists
            async for message in run_relayed(app, request):
                yield message

        async def __del__(self) -> None:
            await self._host.stop()

    @serve.deployment(name="KvtierIngress", num_replicas=1,
                      ray_actor_options={"num_cpus": 0})
    @serve.ingress()
    class KvtierIngress:
        """Ray's HTTP proxy sends every request here; it relays each to a replica."""

        def __init__(self, replicas: Any) -> None:
            self._replicas = replicas.options(stream=True)

        def __serve_build_asgi_app__(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
            replicas = self._replicas

            async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
                if scope["type"] != "http":
                    return
                body = await read_body(receive)
                if body is None:
                    await _too_large(send)
                    return
                request = relayed_request(scope, body)
                await relay_to_client(replicas.handle_http.remote(request), send)

            return asgi

    ingress: Any = KvtierIngress
    replica: Any = KvtierReplica
    return ingress.bind(replica.bind(settings.config))


__all__ = [
    "MAX_BODY_BYTES",
    "PREFIX_ROUTER",
    "RayServeSettings",
    "RelayedRequest",
    "build_app",
    "prompt_text",
    "read_body",
    "relay_to_client",
    "relayed_request",
    "run_relayed",
]
