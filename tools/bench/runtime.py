"""Actor runtime overhead: tell throughput and ask latency vs raw anyio streams.

Prints, in one run and side by side: messages/s of one-way sends through raw
anyio memory object streams and through the runtime (tracing filtered, and
tracing on into a JSON sink), ask round-trip p50/p99 for both, and the ratios.

    .venv/bin/python tools/bench/runtime.py [--messages 50000] [--asks 5000]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_messages import Count, Ping, Pong

from actors.runtime import Actor, ActorSystem, Context, configure_logging, set_tracing
from messages import Envelope


class _Sink(Actor):
    """Counts messages; sets ``done`` after ``expected`` of them."""

    def __init__(self, expected: int, done: anyio.Event) -> None:
        self.expected = expected
        self.done = done
        self.seen = 0

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        self.seen += 1
        if self.seen == self.expected:
            self.done.set()


class _Echo(Actor):
    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        if isinstance(body, Ping):
            ctx.reply_nowait(envelope, Pong(n=body.n))


async def raw_tell(n: int) -> float:
    """Seconds to move ``n`` items through one bounded memory object stream."""
    send, recv = anyio.create_memory_object_stream[int](64)
    done = anyio.Event()

    async def consume() -> None:
        seen = 0
        async with recv:
            async for _ in recv:
                seen += 1
                if seen == n:
                    done.set()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg, send:
        tg.start_soon(consume)
        for i in range(n):
            await send.send(i)
        await done.wait()
    return time.perf_counter() - start


async def runtime_tell(n: int) -> float:
    """Seconds to tell ``n`` messages to one actor through the runtime."""
    done = anyio.Event()
    body = Count(n=1)
    async with ActorSystem() as system:
        ref = system.spawn("sink", lambda: _Sink(n, done), capacity=64)
        start = time.perf_counter()
        for _ in range(n):
            await ref.tell(body)
        await done.wait()
        return time.perf_counter() - start


async def raw_ask(n: int) -> list[float]:
    """Round-trip latencies of request/reply over raw streams (a one-shot event reply)."""
    send, recv = anyio.create_memory_object_stream[tuple[int, list[int], anyio.Event]](64)

    async def serve() -> None:
        async with recv:
            async for value, out, event in recv:
                out.append(value)
                event.set()

    latencies: list[float] = []
    async with anyio.create_task_group() as tg, send:
        tg.start_soon(serve)
        for i in range(n):
            start = time.perf_counter()
            out: list[int] = []
            event = anyio.Event()
            await send.send((i, out, event))
            with anyio.fail_after(5):
                await event.wait()
            latencies.append(time.perf_counter() - start)
    return latencies


async def runtime_ask(n: int) -> list[float]:
    """Round-trip latencies of ``ActorRef.ask`` to an echo actor."""
    latencies: list[float] = []
    async with ActorSystem() as system:
        ref = system.spawn("echo", _Echo)
        for i in range(n):
            start = time.perf_counter()
            await ref.ask(Ping(n=i), timeout=5.0, expect=Pong)
            latencies.append(time.perf_counter() - start)
    return latencies


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


async def _best(fn: Callable[[int], Awaitable[float]], n: int, repeats: int) -> float:
    return min([await fn(n) for _ in range(repeats)])


async def main(messages: int, asks: int, repeats: int) -> None:
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(f"tell: {messages} messages, best of {repeats}; ask: {asks} round trips")
    set_tracing(False)
    raw = await _best(raw_tell, messages, repeats)
    filtered = await _best(runtime_tell, messages, repeats)
    sink = io.StringIO()
    configure_logging(format="json", level="debug", stream=sink)
    traced = await _best(runtime_tell, messages, repeats)
    traced_ask = await runtime_ask(asks)
    structlog.reset_defaults()
    set_tracing(False)
    raw_lat = await raw_ask(asks)
    ask_lat = await runtime_ask(asks)
    rate = {name: messages / t for name, t in
            (("raw", raw), ("filtered", filtered), ("traced", traced))}
    print()
    print(f"{'tell throughput':32s} {'msg/s':>12s} {'vs raw':>8s}")
    for name, label in (("raw", "raw anyio stream"), ("filtered", "runtime, tracing filtered"),
                        ("traced", "runtime, tracing on (JSON)")):
        print(f"{label:32s} {rate[name]:12,.0f} {rate[name] / rate['raw']:8.1%}")
    print()
    print(f"{'ask round trip':32s} {'p50 us':>10s} {'p99 us':>10s}")
    for label, lat in (("raw stream + event", raw_lat), ("runtime, tracing filtered", ask_lat),
                       ("runtime, tracing on (JSON)", traced_ask)):
        print(f"{label:32s} {_pct(lat, 0.5) * 1e6:10.1f} {_pct(lat, 0.99) * 1e6:10.1f}")
    print()
    print(f"ratio tell filtered/raw: {rate['filtered'] / rate['raw']:.2f} (target >= 0.30)")
    print(f"ratio tell traced/filtered: {rate['traced'] / rate['filtered']:.2f}")
    print(f"ratio ask p50 runtime/raw: {_pct(ask_lat, 0.5) / _pct(raw_lat, 0.5):.2f}")
    print(f"ask p50 runtime: {_pct(ask_lat, 0.5) * 1e6:.1f} us (target <= 100 us)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--asks", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    anyio.run(main, args.messages, args.asks, args.repeats)
