"""``kvtier serve``: the OpenAI-compatible HTTP server under uvicorn.

Flags are generated from :class:`~actors.engine.EngineConfig` (one per
field; ``--help`` shows each default and its ``KVTIER_*`` variable) and are
named like ``mlx_lm.server``'s where they overlap. Lifecycle:
start the :class:`~actors.engine.Engine` (model load on the engine thread),
bind, print ``kvtier: ready at http://HOST:PORT/v1 (model: ID)`` on stdout.
On SIGINT/SIGTERM: stop admission (generation routes and ``/health`` answer
503), let the streams in flight finish (``--shutdown-timeout`` seconds is
the whole budget: what still runs then is cut, a stream with an error event
and ``[DONE]``), then close the listener, stop the engine and exit 0.
Stopping the engine first flushes the SSD tier (on by default, at
``$KVTIER_HOME/kv``): every RAM entry not on disk yet and every queued spill
get what is left of the same ``--shutdown-timeout`` (counted from the first
signal) to reach it (docs/durability.md); the last log line
(``serve.stopped``) says whether the state on disk is durable. A second
signal cuts at once (exit 0 too: the stop was asked for); later signals are
ignored. Exit 1: the model could not be loaded
or the port could not be bound; exit 2: bad flags.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any, Literal

import anyio

from actors.engine.config import (
    SETTINGS,
    ConfigError,
    EngineConfig,
    add_flags,
    config_from_flags,
    flag_dest,
    option_names,
)

DeviceKind = Literal["cpu", "cuda", "metal"]
"""The device MLX computes on: its CPU, an NVIDIA GPU (CUDA) or an Apple GPU (Metal)."""

SERVE_MAX_BATCH: dict[DeviceKind, int] = {"cpu": 8, "cuda": 32, "metal": 8}
"""``kvtier serve``'s batch rows, by device, when neither ``--max-batch`` nor ``KVTIER_MAX_BATCH`` is given.

NOTE: chosen from measurements (docs/batching.md "The default"). CPU 8:
with the batch lane, 4 and 8 concurrent clients get more aggregate tok/s
than one at a time, and a lone client decodes as fast as on the serial
lane (docs/benchmarks.md, #10). CUDA 32: on the H200 (8B shape), 32
streams reached 0.60x ``mlx_lm.server`` at 32 rows against 0.32x at 8
rows (docs/benchmarks.md, #20). Metal: not measured; it keeps the CPU's 8.
The embedded ``Engine`` keeps 1 (serial lane only) unless configured, like
the SSD tier: an embedder opts in.
"""

SERVE_PREFILL_STEP: dict[DeviceKind, int] = {"cpu": 256, "cuda": 2048, "metal": 2048}
"""``kvtier serve``'s prompt tokens per prefill chunk, by device, when neither ``--prefill-step-size`` nor its variable is given.

NOTE: a chunk is one forward. On a GPU a forward has a fixed cost
(launches, the weights read once) that a 512-token chunk does not amortize:
on the H200 (8B shape) a ~530-token prompt took two prefill forwards and the
decode step's, where ``mlx_lm.server`` (2,048-token chunks) takes one and
its first step (docs/benchmarks/serving.md). Metal keeps mlx-lm's 2,048
(not measured here). The CPU takes 256: there a forward's cost is its
arithmetic, attention's grows with the chunk (each chunk's scores are
chunk x cached tokens), and a smaller chunk bounds how long decoding rows
wait behind a joining row's prefill; with the native softmax a 3,000-token
prompt prefilled in 12.6 s at 256 against 15.6 s at 512
(``tools/bench/cpu_attention.py``, docs/benchmarks.md). The embedded
``Engine`` keeps ``EngineConfig``'s 512.
"""

_SERVE_DEFAULTS = {
    "ssd_cache": "$KVTIER_HOME/kv; off with --prompt-cache 0",
    # NOTE: help shows it as it is: no unit added.
    "max_batch": "from the device: 8 rows on the CPU, 32 on CUDA, 8 on Metal (unmeasured); "
                 "measurements in docs/benchmarks.md",
    "prefill_step_size": "from the device: 256 tokens on the CPU, 2048 on CUDA and Metal; "
                         "measurements in docs/benchmarks.md",
}
"""Defaults that differ from the embedded Engine's (help text)."""

_SSD_SUBOPTIONS = tuple(name for name in option_names("ssd") if name != "ssd_cache")
"""The SSD tier's settings besides the tier itself: ignored, with a warning, while it is off."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``kvtier serve``'s flags: one per ``EngineConfig`` field (help shows default and variable)."""
    # NOTE: the SSD sub-options' flags default to None so that run() can tell
    # the ones the user gave (flag or variable) from defaults (rule D5-5).
    add_flags(parser, serve_defaults=_SERVE_DEFAULTS, tracked=_SSD_SUBOPTIONS)
    # NOTE: not EngineConfig fields: the live trace is the process's, recorded
    # around the whole served session (docs/operations.md, "Recording a live trace").
    parser.add_argument(
        "--record-trace", metavar="FILE", type=Path, default=None,
        help="record every actor core's inbound events and effects to FILE (JSONL, "
             "replayed by `kvtier replay FILE`); default: off")
    parser.add_argument(
        "--record-trace-max", metavar="GB", type=float, default=1.0,
        help="bound of the --record-trace file: past it recording stops and the file says "
             "it is truncated (in GiB; default: %(default)s GiB)")


def _ssd_default(args: argparse.Namespace) -> Path | None:
    """``kvtier serve`` turns the SSD tier on at ``$KVTIER_HOME/kv`` unless the RAM tier is off.

    NOTE: ``--prompt-cache 0`` with the tier named explicitly (flag or
    variable) is a startup error (``EngineConfig``); with only this implicit
    default the tier stays off, so disabling the RAM tier alone still works.
    """
    cap = args.prompt_cache
    if cap is not None and float(cap) == 0:
        return None
    from kernels import kvtier_home

    return kvtier_home() / "kv"


def device_kind() -> DeviceKind:
    """The device MLX computes on by default (imports MLX)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    return "metal" if mx.metal.is_available() else "cpu"


def serve_config(args: argparse.Namespace, *, device: DeviceKind | None = None) -> EngineConfig:
    """The ``EngineConfig`` of ``kvtier serve``'s parsed flags; raises ``ConfigError``.

    ``device`` (``None``: ``cpu`` under ``--device cpu``, else :func:`device_kind`) picks the defaults of
    ``--max-batch`` and ``--prefill-step-size`` where neither the flag nor its
    variable is given.
    """
    serve_defaults: dict[str, Any] = {}
    kind = device
    if kind is None and getattr(args, "device", None) == "cpu":
        # NOTE: --device cpu (or KVTIER_DEVICE=cpu): the CPU's defaults beside a GPU too.
        kind = "cpu"
    # NOTE: tensor parallelism has neither the SSD tier nor the batch lane
    # yet (docs/tensor-parallel.md): their serve defaults stay off there, and
    # only an explicit flag or variable is refused (EngineConfig).
    tp = bool(getattr(args, "tensor_parallel", False))
    if args.ssd_cache is None:
        serve_defaults["ssd_cache"] = None if tp else _ssd_default(args)
    if args.max_batch is None:
        kind = kind or device_kind()
        serve_defaults["max_batch"] = 1 if tp else SERVE_MAX_BATCH[kind]
    if args.prefill_step_size is None:
        serve_defaults["prefill_step_size"] = SERVE_PREFILL_STEP[kind or device_kind()]
    return config_from_flags(args, serve_defaults=serve_defaults)


def ignored_ssd_options(args: argparse.Namespace, config: EngineConfig) -> tuple[str, ...]:
    """The SSD sub-options given (flag or ``KVTIER_SSD_*`` variable) although the tier is off."""
    if config.ssd_cache is not None:
        return ()
    return tuple(f"{SETTINGS[name].flag} ({SETTINGS[name].env})" for name in _SSD_SUBOPTIONS
                 if getattr(args, flag_dest(name), None) is not None)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal; 0 after a graceful drain, 1 on startup failure, 2 on bad flags."""
    try:
        config = serve_config(args)
    except ConfigError as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    from actors.runtime import configure_logging

    configure_logging(config.log_format, config.log_level)
    ignored = ignored_ssd_options(args, config)
    if ignored:
        import structlog

        structlog.get_logger("kvtier.serve").warning(
            "serve.ssd_options_ignored", options=list(ignored),
            reason="the SSD tier is off (--ssd-cache off, or --prompt-cache 0 without --ssd-cache)")
    aliases: tuple[str, ...] = ()
    if config.model is None:
        from kernels import (
            DefaultModelFetchError,
            ModelConversionError,
            UntrustedPath,
            ensure_default_model,
        )

        # NOTE: prepared here (before the loop starts) so a download or conversion
        # failure is one clear line; the engine then finds the model in place and
        # reports the default model's own name as its id.
        try:
            aliases = (str(ensure_default_model()),)
        except (DefaultModelFetchError, ModelConversionError, UntrustedPath) as exc:
            print(f"kvtier serve: cannot prepare the default model: {exc}", file=sys.stderr)
            return 1
    else:
        aliases = (config.model, os.path.basename(config.model.rstrip("/")))
    if config.tensor_parallel:
        from actors.distributed import follower_rank

        # NOTE: under mlx.launch every rank runs this command; the ranks past
        # 0 load their shard and follow rank 0 without HTTP (docs/tensor-parallel.md).
        follower = follower_rank(config, aliases[0] if config.model is None else config.model)
        if follower is not None:
            return follower
    trace: Path | None = getattr(args, "record_trace", None)
    if trace is None:
        return anyio.run(_serve, config, aliases, backend="asyncio")
    from actors.runtime import CoreTraceRecorder, recording

    try:
        recorder = CoreTraceRecorder(trace, max_bytes=int(args.record_trace_max * (1 << 30)))
    except (OSError, ValueError) as exc:
        print(f"kvtier serve: cannot record a trace to {trace}: {exc}", file=sys.stderr)
        return 2
    with recording(recorder):
        status = anyio.run(_serve, config, aliases, backend="asyncio")
    shown = f" (truncated: {recorder.truncated})" if recorder.truncated else ""
    print(f"kvtier serve: {recorder.lines} trace lines in {trace}{shown}", file=sys.stderr)
    return status


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def _serve(config: EngineConfig, aliases: tuple[str, ...]) -> int:
    import structlog

    from actors.engine import Engine
    from actors.http import HttpSettings, HttpState, create_app, exposure_warning
    from actors.http import serve as serve_http

    from .heap import startup_heap_frozen

    log = structlog.get_logger("kvtier.serve")
    settings = HttpSettings.from_config(config, model_aliases=(*aliases, "default"))
    # NOTE: bind before loading the model, so a busy port fails in milliseconds
    # and --port 0 knows its real port; uvicorn serves on this very socket.
    try:
        sock = _bind(config.host, config.port)
    except OSError as exc:
        print(f"kvtier serve: cannot bind {_url(config.host, config.port)}: {exc}",
              file=sys.stderr)
        return 1
    warning = exposure_warning(config.host, config.api_key)
    if warning:
        print(f"kvtier serve: WARNING: {warning}", file=sys.stderr, flush=True)
        log.warning("serve.exposed_without_api_key", host=config.host)
    with sock:
        try:
            engine = Engine(config=config)
        except Exception as exc:  # noqa: BLE001 - report any construction failure as a startup error
            print(f"kvtier serve: cannot configure the engine: {exc}", file=sys.stderr)
            return 1
        try:
            await engine.start()
        except Exception as exc:  # noqa: BLE001 - a model that fails to load is a startup error
            shown = config.model or "the default model"
            print(f"kvtier serve: cannot start the engine for {shown}: {exc}", file=sys.stderr)
            await engine.aclose()
            return 1
        try:
            app = create_app(engine, settings, state=HttpState(),
                             stream_write_timeout_s=config.stream_write_timeout_s)

            def announce(port: int) -> None:
                print(f"kvtier: ready at {_url(config.host, port)}/v1 (model: {engine.model_id})",
                      flush=True)

            # NOTE: connection limits, timeouts, signals and the shutdown
            # budget live in actors.http.serve (docs/operations.md). The
            # start-up heap stays out of the collector's walks while serving
            # and is thawed before the engine closes (actors/cli/heap.py).
            with startup_heap_frozen() as frozen:
                log.info("serve.heap_frozen", objects=frozen)
                await serve_http(app, sock, drain=engine.drain,
                                 shutdown_timeout=config.shutdown_timeout, on_ready=announce)
        finally:
            # NOTE: not inside a CancelScope of ours: the engine's actor-system
            # task group must be the innermost scope when it exits.
            await engine.aclose()
            if config.tensor_parallel:
                from actors.distributed import release_followers

                await release_followers()
    _log_stopped(log, engine)
    return 0


def _log_stopped(log: Any, engine: Any) -> None:
    """The last log line: whether the SSD tier's state on disk is durable (docs/durability.md)."""
    flushed = engine.final_flush
    if engine.config.ssd_cache is None:
        log.info("serve.stopped", durable=None, disk="no SSD tier")
    elif flushed is None:
        log.warning("serve.stopped", durable=False,
                    disk=f"not durable: {engine.final_flush_error or 'no flush ran'}")
    elif flushed.durable:
        log.info("serve.stopped", durable=True,
                 disk="durable: every cached prefix put before shutdown is on disk",
                 entries=flushed.entries,
                 longest_durable_prefix_tokens=flushed.longest_durable_prefix_tokens)
    else:
        log.warning("serve.stopped", durable=False, disk=not_durable_reason(flushed),
                    pending=flushed.pending, dropped=flushed.dropped, failed=flushed.failed,
                    uncovered=flushed.uncovered, lost=flushed.lost, entries=flushed.entries)


def not_durable_reason(flushed: Any) -> str:
    """What the last line says of a final flush that was not durable (a ``FlushResult``).

    NOTE: when the only shortfall is ``uncovered`` (written, then evicted
    from the SSD tier by its cap before the flush verified it), more flushing
    cannot help; the cap can.
    """
    if flushed.uncovered and not (flushed.pending or flushed.dropped or flushed.failed
                                  or flushed.lost):
        return (f"not durable: {flushed.uncovered} cached prefixes reached the disk but the SSD "
                "tier's cap evicted them again (a larger --ssd-cache-max keeps them)")
    return "not durable: some cached prefixes did not reach the disk"


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
