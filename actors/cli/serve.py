"""``kvtier serve``: the OpenAI-compatible HTTP server under uvicorn.

Flags are named like ``mlx_lm.server``'s where they overlap. Lifecycle:
start the :class:`~actors.engine.Engine` (model load on the engine thread),
bind, print ``kvtier: ready at http://HOST:PORT/v1 (model: ID)`` on stdout.
On SIGINT/SIGTERM: stop admission (generation routes and ``/health`` answer
503), let the streams in flight finish (at most ``--shutdown-timeout``
seconds), then close the listener, stop the engine and exit 0. A second
signal exits at once (still 0 for SIGTERM-driven runs, as the drain was
abandoned on purpose). Exit 1: the model could not be loaded or the port
could not be bound; exit 2: bad flags.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Generator
from typing import Any

import anyio

_KV_QUANT_CHOICES = ("off", "4", "8", "config")
_GB = 10**9  # NOTE: decimal GB, like KVTIER_PROMPT_CACHE_GB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``kvtier serve``'s flags."""
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="local mlx-lm model directory or Hugging Face id "
                        "(default: SmolLM2-135M-Instruct, fetched and converted on first use)")
    m.add_argument("--prefill-step-size", type=int, default=512,
                   help="prompt tokens per prefill engine turn (default: 512)")
    m.add_argument("--max-burst", type=int, default=64,
                   help="decode steps per engine turn while a request holds the lane; "
                        "1 = one gateway turn per token (default: 64)")
    m.add_argument("--prompt-cache", type=float, default=None, metavar="GB",
                   help="RAM prompt-cache cap in decimal GB; 0 disables "
                        "(default: $KVTIER_PROMPT_CACHE_GB or a quarter of available memory)")
    m.add_argument("--kv-quant", choices=_KV_QUANT_CHOICES, default="off",
                   help="KV cache storage: off (model dtype), 4 / 8 (affine bits), "
                        "config (per-layer kv_config.json in the model dir)")

    s = parser.add_argument_group("sampling defaults (a request's own fields win)")
    s.add_argument("--max-tokens", type=int, default=512,
                   help="completion tokens when a request gives no max_tokens (default: 512)")
    s.add_argument("--max-tokens-limit", type=int, default=32768,
                   help="largest max_tokens a request may ask for; more is a 400 (default: 32768)")
    s.add_argument("--temp", type=float, default=0.0, help="temperature (default: 0 = greedy)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0)")
    s.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 = off (default: 0)")
    s.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (default: 0)")

    h = parser.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    h.add_argument("--port", type=int, default=8080,
                   help="bind port; 0 picks a free one (default: 8080)")
    h.add_argument("--api-key", default=os.environ.get("KVTIER_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $KVTIER_API_KEY; unset = no auth)")
    h.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the generating one; more get 429 "
                        "(default: 16)")
    h.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body; more gets 413 (default: 4 MiB)")
    h.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens; more gets 400 (default: no extra limit)")
    h.add_argument("--shutdown-timeout", type=float, default=120.0,
                   help="seconds to let in-flight streams finish after SIGTERM (default: 120)")
    h.add_argument("--log-level", type=str.lower, default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="log level; debug also traces every actor message (default: info)")
    h.add_argument("--log-format", choices=["console", "json"],
                   default=os.environ.get("KVTIER_LOG_FORMAT") or "console",
                   help="console (readable) or json (one object per line) "
                        "(default: $KVTIER_LOG_FORMAT or console)")


def _check(args: argparse.Namespace) -> str | None:
    """The first flag error, or None."""
    if not 0 <= args.port <= 65535:
        return "--port must be 0..65535"
    positive = {"--max-tokens": args.max_tokens, "--max-tokens-limit": args.max_tokens_limit,
                "--prefill-step-size": args.prefill_step_size,
                "--max-body-bytes": args.max_body_bytes, "--max-burst": args.max_burst}
    for flag, value in positive.items():
        if value < 1:
            return f"{flag} must be >= 1"
    if args.max_tokens > args.max_tokens_limit:
        return "--max-tokens must not exceed --max-tokens-limit"
    if args.max_queue < 0:
        return "--max-queue must be >= 0"
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        return "--max-prompt-tokens must be >= 1"
    if args.prompt_cache is not None and args.prompt_cache < 0:
        return "--prompt-cache must be >= 0"
    if args.temp < 0 or not 0 < args.top_p <= 1 or args.top_k < 0 or not 0 <= args.min_p <= 1:
        return "sampling defaults out of range (--temp >= 0, 0 < --top-p <= 1, --top-k >= 0, 0 <= --min-p <= 1)"
    if args.shutdown_timeout < 0:
        return "--shutdown-timeout must be >= 0"
    return None


def run(args: argparse.Namespace) -> int:
    """Serve until a signal; 0 after a graceful drain, 1 on startup failure, 2 on bad flags."""
    problem = _check(args)
    if problem:
        print(f"kvtier serve: {problem}", file=sys.stderr)
        return 2
    from actors.runtime import configure_logging

    configure_logging(args.log_format, args.log_level)
    aliases: tuple[str, ...] = ()
    if args.model is None:
        from kernels import DefaultModelFetchError, ModelConversionError, ensure_default_model

        # NOTE: prepared here (before the loop starts) so a download or conversion
        # failure is one clear line; the engine then finds the model in place and
        # reports the default model's own name as its id.
        try:
            aliases = (str(ensure_default_model()),)
        except (DefaultModelFetchError, ModelConversionError) as exc:
            print(f"kvtier serve: cannot prepare the default model: {exc}", file=sys.stderr)
            return 1
    else:
        aliases = (args.model, os.path.basename(args.model.rstrip("/")))
    served: list[bool] = []
    code = anyio.run(_serve, args, aliases, served, backend="asyncio")
    if served:
        # NOTE: the server ran and everything is drained and closed (engine
        # thread joined, sockets closed). Interpreter finalization can still
        # abort the process ("terminate called without an active exception",
        # SIGABRT) when C++ runtimes' thread-local state (MLX streams, BLAS
        # pools) is torn down after Python's; seen in 2 of 14 e2e runs. Skip
        # finalization so a graceful stop reliably exits with its own code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def _serve(args: argparse.Namespace, aliases: tuple[str, ...], served: list[bool]) -> int:
    import structlog
    import uvicorn

    from actors.engine import Engine
    from actors.http import Defaults, HttpSettings, HttpState, begin_shutdown, create_app

    log = structlog.get_logger("kvtier.serve")
    engine_kwargs: dict[str, Any] = {
        "max_queue": args.max_queue,
        "prefill_step_size": args.prefill_step_size,
        "prompt_cache_bytes": None if args.prompt_cache is None else int(args.prompt_cache * _GB),
        "kv_quant": args.kv_quant,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_burst": args.max_burst,
    }
    settings = HttpSettings(
        defaults=Defaults(max_tokens=args.max_tokens, max_tokens_limit=args.max_tokens_limit,
                          temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p),
        model_aliases=(*aliases, "default"),
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
    )
    # NOTE: bind before loading the model, so a busy port fails in milliseconds
    # and --port 0 knows its real port; uvicorn serves on this very socket.
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"kvtier serve: cannot bind {_url(args.host, args.port)}: {exc}", file=sys.stderr)
        return 1
    with sock:
        try:
            engine = Engine(args.model, **engine_kwargs)
        except Exception as exc:  # noqa: BLE001 - report any construction failure as a startup error
            print(f"kvtier serve: cannot configure the engine: {exc}", file=sys.stderr)
            return 1
        served.append(True)
        try:
            await engine.start()
        except Exception as exc:  # noqa: BLE001 - a model that fails to load is a startup error
            shown = args.model or "the default model"
            print(f"kvtier serve: cannot start the engine for {shown}: {exc}", file=sys.stderr)
            await engine.aclose()
            return 1
        try:
            state = HttpState()
            app = create_app(engine, settings, state=state)
            config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=5, server_header=False)
            server = _Server(config)
            async with anyio.create_task_group() as tg:

                async def drain_then_stop() -> None:
                    with anyio.move_on_after(args.shutdown_timeout) as scope:
                        await state.wait_idle()
                        await engine.drain()
                    log.info("serve.drained", timed_out=scope.cancelled_caught)
                    server.should_exit = True

                async def on_signals() -> None:
                    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                        async for signum in signals:
                            if not state.shutting_down:
                                log.info("serve.shutdown_begun", signal=signal.Signals(signum).name,
                                         in_flight=state.in_flight)
                                begin_shutdown(app)
                                tg.start_soon(drain_then_stop)
                            else:
                                log.warning("serve.forced_exit")
                                server.should_exit = True
                                server.force_exit = True

                async def announce() -> None:
                    await server.ready.wait()
                    port = sock.getsockname()[1]
                    print(f"kvtier: ready at {_url(args.host, port)}/v1 (model: {engine.model_id})",
                          flush=True)

                tg.start_soon(on_signals)
                tg.start_soon(announce)
                await server.serve(sockets=[sock])
                tg.cancel_scope.cancel()
        finally:
            # NOTE: not inside a CancelScope of ours: the engine's actor-system
            # task group must be the innermost scope when it exits.
            await engine.aclose()
    log.info("serve.stopped")
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: name IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections
    # only for sockets whose proto says TCP. Without it Nagle held each small
    # write (an SSE token, a response body after its headers) until the
    # client's delayed ACK: ~40 ms added to TTFT and to keep-alive requests.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


class _Server:
    """uvicorn's Server minus its signal handlers (kvtier drains first, then stops it)."""

    def __init__(self, config: Any) -> None:
        import uvicorn

        outer = self

        class _Inner(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                # NOTE: uvicorn would close the listener on the first signal;
                # kvtier keeps it open to answer 503 while streams finish.
                yield

            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets=sockets)
                outer.ready.set()

        self._inner = _Inner(config)
        self.ready = anyio.Event()

    @property
    def should_exit(self) -> bool:
        return bool(self._inner.should_exit)

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._inner.should_exit = value

    @property
    def force_exit(self) -> bool:
        return bool(self._inner.force_exit)

    @force_exit.setter
    def force_exit(self, value: bool) -> None:
        self._inner.force_exit = value

    async def serve(self, sockets: list[socket.socket]) -> None:
        await self._inner.serve(sockets=sockets)
