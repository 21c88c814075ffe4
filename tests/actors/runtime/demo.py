"""A small conversation among four actors, used as the runtime's demo scenario.

``conversation`` is a scenario for the simulated runtime (see docs/runtime.md):
a coordinator splits each ``Work`` request between two workers; each worker
tells a counter one ``Add`` per amount, asks the counter for its total and
reports ``WorkDone``; once both halves are done the coordinator replies to
the requester. It exercises tell, ask, reply-to-an-actor, inboxes and a
sans-IO core, and its trace is committed under ``tests/data/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from actors.runtime import Actor, Context, CoreActor, Effect, Reply, SimulatedSystem, Tell
from messages import Envelope

from .demo_messages import Add, GetTotal, Ping, Pong, Total, Work, WorkDone

__all__ = ["Coordinator", "Counter", "Worker", "conversation"]


class Counter(CoreActor[tuple[int, int]]):
    """Sums ``Add`` amounts; answers ``GetTotal`` and ``Ping``. State: (total, count)."""

    def initial_state(self) -> tuple[int, int]:
        return (0, 0)

    def handle(
        self, state: tuple[int, int], envelope: Envelope
    ) -> tuple[tuple[int, int], Sequence[Effect]]:
        total, count = state
        body = envelope.body
        if isinstance(body, Add):
            return (total + body.amount, count + 1), ()
        if isinstance(body, GetTotal):
            return state, (Reply(envelope, Total(total=total, count=count)),)
        if isinstance(body, Ping):
            return state, (Reply(envelope, Pong(n=body.n)),)
        return state, ()


class Worker(Actor):
    """Adds its amounts to the counter, then reports the counter's total."""

    def __init__(self, counter: str) -> None:
        self.counter = counter

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        if not isinstance(body, Work):
            return
        for amount in body.amounts:
            await ctx.tell(self.counter, Add(amount=amount))
        total = await ctx.ask(self.counter, GetTotal(), timeout=10.0, expect=Total)
        await ctx.reply(envelope, WorkDone(job=body.job, total=total.total))


@dataclass(frozen=True)
class _Job:
    request: Envelope
    waiting: int


class Coordinator(CoreActor[dict[str, _Job]]):
    """Splits ``Work`` between two workers and replies when both are done."""

    def __init__(self, workers: tuple[str, str]) -> None:
        self.workers = workers
        super().__init__()

    def initial_state(self) -> dict[str, _Job]:
        return {}

    def handle(
        self, state: dict[str, _Job], envelope: Envelope
    ) -> tuple[dict[str, _Job], Sequence[Effect]]:
        body = envelope.body
        me = envelope.receiver
        if isinstance(body, Work):
            halves = (body.amounts[0::2], body.amounts[1::2])
            effects = [
                Tell(worker, Work(job=body.job, amounts=half, reply_to=me))
                for worker, half in zip(self.workers, halves, strict=True)
            ]
            return {**state, body.job: _Job(envelope, len(effects))}, effects
        if isinstance(body, WorkDone) and body.job in state:
            job = replace(state[body.job], waiting=state[body.job].waiting - 1)
            rest = {k: v for k, v in state.items() if k != body.job}
            if job.waiting > 0:
                return {**rest, body.job: job}, ()
            return rest, (Reply(job.request, WorkDone(job=body.job, total=body.total)),)
        return state, ()


async def conversation(system: SimulatedSystem, *, jobs: int = 2, amounts: int = 4) -> None:
    """Spawn counter, two workers and a coordinator; run ``jobs`` Work requests."""
    system.spawn("counter", Counter, capacity=8)
    system.spawn("worker-a", lambda: Worker("counter"), capacity=4)
    system.spawn("worker-b", lambda: Worker("counter"), capacity=4)
    coordinator = system.spawn("coordinator", lambda: Coordinator(("worker-a", "worker-b")))
    pong = await system.ask("counter", Ping(n=7), timeout=10.0, expect=Pong)
    assert pong.n == 7
    async with system.open_inbox(capacity=jobs) as inbox:
        for j in range(jobs):
            work = Work(
                job=f"job-{j}",
                amounts=tuple(range(j * amounts + 1, (j + 1) * amounts + 1)),
                reply_to=inbox.address,
            )
            await coordinator.tell(work)
        for _ in range(jobs):
            await inbox.receive(timeout=10.0)
