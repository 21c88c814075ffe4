"""The simulated runtime: one delivery at a time, seeded order, virtual clock.

How determinism is obtained: the scheduler counts the tasks it knows that
can run (actor loops, the scenario, tasks blocked in a runtime wait are not
counted). It delivers the next message only when that count is zero, i.e.
when every known task is blocked on a mailbox; each delivery wakes at most
one task. So exactly one task runs between two deliveries, and ids, clock
readings and sends happen in an order fixed by the sequence of choices, and
the choices are fixed by the seed (or forced from a recorded trace).
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from messages import Envelope

from ._endpoints import Endpoint
from ._errors import ReplayDiverged
from ._ports import ManualClock, SeededRng, SequentialIds
from ._system import ActorSystem, _Cell

__all__ = ["Scenario", "SimulatedSystem", "SimulationStalled", "delivery_line"]

Scenario = Callable[..., Awaitable[None]]
"""``async def scenario(system: SimulatedSystem, **params) -> None``: spawn actors, inject inputs."""


class SimulationStalled(RuntimeError):
    """Nothing can run and nothing can be delivered, but the scenario has not finished."""


def delivery_line(step: int, at: float, envelope: Envelope) -> str:
    """One trace line: the delivery's step and virtual time, then the envelope."""
    record = {
        "step": step,
        "at": at,
        "msg_id": envelope.msg_id,
        "correlation_id": envelope.correlation_id,
        "causation_id": envelope.causation_id,
        "sender": envelope.sender,
        "receiver": envelope.receiver,
        "sent_at": envelope.sent_at,
        "call_chain": list(envelope.call_chain),
        "body": envelope.body.model_dump(mode="json"),
    }
    return json.dumps(record, separators=(",", ":"))


class _Scheduler:
    """Counts runnable tasks and signals when none is left."""

    __slots__ = ("_idle", "running")

    def __init__(self) -> None:
        self.running = 0
        self._idle = anyio.Event()

    def acquire(self) -> None:
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        # NOTE: every wake-up acquires a token for the woken task BEFORE it
        # resumes, so `running == 0` already means quiescent: no task is
        # runnable-but-not-yet-resumed.
        while self.running > 0:
            self._idle = anyio.Event()
            await self._idle.wait()


class SimEndpoint(Endpoint):
    """A mailbox whose messages wait in ``pending`` until the scheduler delivers them."""

    __slots__ = ("_blocked", "_closed", "_receiver", "_sched", "buffer", "pending")

    def __init__(
        self, address: str, capacity: int, *, is_actor: bool, sched: _Scheduler, reserve: int = 0
    ) -> None:
        super().__init__(address, capacity, is_actor=is_actor, reserve=reserve)
        self._sched = sched
        self.pending: deque[Envelope] = deque()
        self.buffer: deque[Envelope] = deque()
        self._receiver: anyio.Event | None = None
        self._blocked: deque[anyio.Event] = deque()
        self._closed = False

    # -- senders ------------------------------------------------------------

    def put_nowait(self, envelope: Envelope, *, reserved: bool = False) -> bool:
        if self._closed:
            raise self.closed_error()
        if len(self.pending) + len(self.buffer) >= self.limit(reserved):
            return False
        self.pending.append(envelope)
        return True

    async def put(self, envelope: Envelope, *, reserved: bool = False) -> None:
        while not self.put_nowait(envelope, reserved=reserved):
            event = anyio.Event()
            self._blocked.append(event)
            await self._park(event)

    async def _park(self, event: anyio.Event) -> None:
        """Wait for ``event``; whoever sets it hands this task a run token."""
        self._sched.release()
        try:
            await event.wait()
        except BaseException:
            if not event.is_set():
                self._sched.acquire()
            raise

    def _wake(self, event: anyio.Event) -> None:
        self._sched.acquire()
        event.set()

    # -- the reader ---------------------------------------------------------

    async def get(self) -> Envelope | None:
        if not self.buffer:
            if self._closed and not self.pending:
                return None
            event = anyio.Event()
            self._receiver = event
            try:
                await self._park(event)
            finally:
                if self._receiver is event:
                    self._receiver = None
            if not self.buffer:
                return None
        envelope = self.buffer.popleft()
        if self._blocked:
            self._wake(self._blocked.popleft())
        return envelope

    def get_nowait(self) -> Envelope | None:
        if self.buffer:
            return self.buffer.popleft()
        if self.pending:
            return self.pending.popleft()
        return None

    # -- the scheduler ------------------------------------------------------

    @property
    def deliverable(self) -> bool:
        """A message is pending and its reader can take it now (or it buffers)."""
        return bool(self.pending) and (self._receiver is not None or not self.is_actor)

    def deliver(self) -> Envelope:
        envelope = self.pending.popleft()
        self.buffer.append(envelope)
        receiver = self._receiver
        if receiver is not None:
            self._receiver = None
            self._wake(receiver)
        return envelope

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._blocked:
            self._wake(self._blocked.popleft())
        if not self.pending and not self.buffer and self._receiver is not None:
            receiver, self._receiver = self._receiver, None
            self._wake(receiver)

    def discard(self) -> None:
        self.close()
        self.pending.clear()
        self.buffer.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> int:
        return len(self.pending) + len(self.buffer)

    def waiting_senders(self) -> int:
        return len(self._blocked)


class SimulatedSystem(ActorSystem):
    """An ``ActorSystem`` whose deliveries a seeded scheduler makes one at a time.

    Between two deliveries the scheduler waits until every task it knows
    (actors, the scenario) is blocked on a mailbox, then picks the next
    mailbox to deliver to with a ``random.Random(seed)`` (FIFO within each
    mailbox), advances the ``ManualClock`` by ``tick`` and hands over one
    message. Ids come from ``SequentialIds`` and ``ctx.rng`` is a separate
    seeded stream, so a seed fixes the whole run. With ``expected`` lines
    (a recorded trace without its header) the order is forced instead and
    each produced line is compared: the first difference raises
    ``ReplayDiverged``.
    """

    # NOTE: every delivery is the scheduler's choice, so an actor never takes
    # a waiting message past it (``ActorSystem._max_streak``).
    _max_streak = 1

    def __init__(
        self,
        *,
        seed: int = 0,
        tick: float = 0.001,
        stop_timeout: float = 30.0,
        expected: list[str] | None = None,
    ) -> None:
        super().__init__(
            clock=ManualClock(),
            ids=SequentialIds(),
            rng=SeededRng(seed + 1),
            stop_timeout=stop_timeout,
        )
        self.seed = seed
        self.tick = tick
        self._sched = _Scheduler()
        self._choices = random.Random(seed)  # reproducible scheduling, not cryptography
        self._sim_endpoints: list[SimEndpoint] = []
        self._lines: list[str] = []
        self._expected = expected
        self._expected_ids: list[str | None] = (
            [_msg_id(line) for line in expected] if expected is not None else []
        )
        self._scenario_done = True
        self._scenario_error: BaseException | None = None

    @property
    def lines(self) -> list[str]:
        """The delivery lines produced so far."""
        return list(self._lines)

    def end_line(self) -> str:
        """The trace's closing line: totals that a replay must reproduce too."""
        return json.dumps(
            {"end": True, "steps": len(self._lines), "dead_letters": self.statistics().dead_letters},
            separators=(",", ":"),
        )

    # -- driving --------------------------------------------------------------

    async def run(self, scenario: Scenario, params: Mapping[str, Any] | None = None) -> list[str]:
        """Run ``scenario(self, **params)`` to quiescence; return the delivery lines."""
        if self._tg is None:
            raise RuntimeError("run inside `async with SimulatedSystem()`")
        self._scenario_done = False
        self._sched.acquire()
        self._tg.start_soon(self._run_scenario, scenario, dict(params or {}), name="scenario")
        await self.drive()
        if self._scenario_error is not None:
            raise self._scenario_error
        if not self._scenario_done:
            raise SimulationStalled("the scenario is blocked and no message can be delivered")
        return self.lines

    async def _run_scenario(self, scenario: Scenario, params: dict[str, Any]) -> None:
        try:
            await scenario(self, **params)
        except Exception as exc:  # noqa: BLE001 - re-raised by run() in the driver's task
            self._scenario_error = exc
        finally:
            self._scenario_done = True
            self._sched.release()

    async def drive(self) -> None:
        """Deliver one message at a time until nothing can run or be delivered."""
        while True:
            await self._sched.wait_idle()
            if self._scenario_error is not None:
                return
            endpoint = self._choose()
            if endpoint is None:
                return
            self._deliver(endpoint)

    def _choose(self) -> SimEndpoint | None:
        candidates = sorted(
            (e for e in self._sim_endpoints if e.deliverable), key=lambda e: e.address
        )
        if self._expected is None:
            if not candidates:
                return None
            return candidates[self._choices.randrange(len(candidates))]
        line_no = len(self._lines)
        if line_no >= len(self._expected_ids):
            if candidates:
                raise ReplayDiverged(
                    line_no + 2, "(end of the recorded deliveries)", _peek(candidates[0])
                )
            return None
        wanted = self._expected_ids[line_no]
        for endpoint in candidates:
            if endpoint.pending[0].msg_id == wanted:
                return endpoint
        assert self._expected is not None
        heads = ", ".join(f"{e.pending[0].msg_id}->{e.address}" for e in candidates) or "none"
        raise ReplayDiverged(
            line_no + 2,
            self._expected[line_no],
            f"(message {wanted} is not deliverable; deliverable: {heads})",
        )

    def _deliver(self, endpoint: SimEndpoint) -> None:
        assert isinstance(self.clock, ManualClock)
        self.clock.advance(self.tick)
        envelope = endpoint.deliver()
        line = delivery_line(len(self._lines) + 1, self.clock.now(), envelope)
        if self._expected is not None:
            index = len(self._lines)
            if self._expected[index] != line:
                raise ReplayDiverged(index + 2, self._expected[index], line)
        self._lines.append(line)

    # -- hooks into ActorSystem ---------------------------------------------

    def _new_mailbox(
        self, address: str, capacity: int, *, is_actor: bool, reserve: int = 0
    ) -> Endpoint:
        endpoint = SimEndpoint(
            address, capacity, is_actor=is_actor, sched=self._sched, reserve=reserve
        )
        self._sim_endpoints.append(endpoint)
        return endpoint

    def _new_slot(self, address: str) -> Endpoint:
        return self._new_mailbox(address, 1, is_actor=False)

    def _unregister(self, address: str, endpoint: Endpoint) -> None:
        if isinstance(endpoint, SimEndpoint):
            for envelope in (*endpoint.buffer, *endpoint.pending):
                self._dead_letter(envelope, "reader closed")
            if endpoint in self._sim_endpoints:
                self._sim_endpoints.remove(endpoint)
        super()._unregister(address, endpoint)

    def _start_task(self, fn: Callable[[_Cell], Any], cell: _Cell) -> None:
        assert self._tg is not None
        self._sched.acquire()
        self._tg.start_soon(self._counted, fn, cell, name=f"actor:{cell.name}")

    async def _counted(self, fn: Callable[[_Cell], Awaitable[None]], cell: _Cell) -> None:
        try:
            await fn(cell)
        finally:
            self._sched.release()

    async def _wait_stopped(self, cell: _Cell) -> None:
        await self.drive()
        if not cell.done.is_set():
            raise SimulationStalled(f"actor {cell.name!r} did not stop")


def _msg_id(line: str) -> str | None:
    try:
        value = json.loads(line).get("msg_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _peek(endpoint: SimEndpoint) -> str:
    envelope = endpoint.pending[0]
    return f"(an extra delivery: {envelope.msg_id} {envelope.body.kind} -> {endpoint.address})"
