"""Small scripted actors shared by the runtime tests."""

from __future__ import annotations

import anyio

from actors.runtime import Actor, Context
from messages import Envelope

from .demo_messages import Add, Count, GetTotal, Ping, Pong, Total, Work


class Gate(Actor):
    """Handles each message only after ``gate`` is set; records what it handled."""

    def __init__(self, gate: anyio.Event, seen: list[Envelope]) -> None:
        self.gate = gate
        self.seen = seen

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        await self.gate.wait()
        self.seen.append(envelope)


class Silent(Actor):
    """Never replies."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        return None


class Echo(Actor):
    """Replies ``Pong(n)`` to ``Ping(n)``."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        if isinstance(envelope.body, Ping):
            await ctx.reply(envelope, Pong(n=envelope.body.n))


class Relay(Actor):
    """On ``Ping`` asks ``target`` with a ``Ping`` and replies with its answer."""

    def __init__(self, target: str) -> None:
        self.target = target

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        if isinstance(envelope.body, Ping):
            pong = await ctx.ask(self.target, Ping(n=envelope.body.n), timeout=5.0, expect=Pong)
            await ctx.reply(envelope, pong)


class Forward(Actor):
    """Tells every ``Add`` on to ``target`` unchanged."""

    def __init__(self, target: str) -> None:
        self.target = target

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        await ctx.tell(self.target, envelope.body)


class Fragile(Actor):
    """Sums ``Add``; raises on a negative amount; appends to ``births`` when built."""

    def __init__(self, births: list[int]) -> None:
        births.append(len(births) + 1)
        self.total = 0
        self.count = 0

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        if isinstance(body, Add):
            if body.amount < 0:
                raise ValueError("negative amount")
            self.total += body.amount
            self.count += 1
        elif isinstance(body, GetTotal):
            await ctx.reply(envelope, Total(total=self.total, count=self.count))


class Streamer(Actor):
    """On ``Work`` streams one ``Count`` per amount to ``reply_to``, then ends the stream."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        if isinstance(body, Work):
            for amount in body.amounts:
                await ctx.tell(body.reply_to, Count(n=amount))
            ctx.end_stream(body.reply_to)


class Logger(Actor):
    """Appends ``(name, amount)`` for each ``Add`` to ``log``, then tells it on to ``forward_to`` if given."""

    def __init__(self, name: str, log: list[tuple[str, int]], forward_to: str | None = None) -> None:
        self.name = name
        self.log = log
        self.forward_to = forward_to

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        if isinstance(body, Add):
            self.log.append((self.name, body.amount))
            if self.forward_to is not None:
                await ctx.tell(self.forward_to, body)
