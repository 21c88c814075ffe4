"""A checkpoint lookup that ends while its actor's mailbox is full is not lost.

The gateway and the batch scheduler learn that a lookup ended from a note
posted to their own mailbox (``CheckpointLoads``). Here the port fills the
actor's whole mailbox (ordinary room with ``try_tell``, then the reserved
room with ``post``, until both refuse) on the event loop right before the
lookup's result arrives, so the note finds no room; no other lookup
follows. The request must still go on: its turn is granted (gateway) or
its row becomes ready (batch scheduler).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest

from actors.batch_scheduler import BatchScheduler
from actors.checkpoints import CheckpointCounters, CheckpointPort, ResumeFrom
from actors.gateway import Gateway
from actors.runtime import Actor, ActorRef, ActorSystem, Context, Inbox
from messages import Body, Envelope
from messages.batch_scheduler import BatchStatsRequest, BatchWants
from messages.gateway import (
    AdmissionReply,
    GatewayStatsRequest,
    Generate,
    GenerationParams,
    RunTurn,
)

pytestmark = pytest.mark.anyio

PROMPT = (1, 2, 3, 4, 5)
CAPACITY = 4
RESERVE = 2


class FillingPort(CheckpointPort):
    """A checkpoint port that finds nothing, and fills ``target``'s mailbox just before a lookup's result arrives."""

    def __init__(self) -> None:
        super().__init__(every=8, directory="unused", fingerprint="f", port=None,  # type: ignore[arg-type]
                         spill_queue="spill", dispose=lambda _h: None, counters=CheckpointCounters())
        self.target: ActorRef | None = None
        self.filler: Callable[[], Body] = GatewayStatsRequest
        self.filled: tuple[int, int] | None = None  # (ordinary, reserved) messages put in

    def load(self, key: str, namespace: str, prompt: tuple[int, ...]) -> ResumeFrom | None:
        """No checkpoint on disk."""
        return None

    def load_soon(self, key: str, namespace: str, prompt: tuple[int, ...],
                  on_loaded: Callable[[ResumeFrom | None], object], *,
                  request_id: str = "") -> None:
        """The real lookup, whose result arrives (on the loop) at a mailbox just filled to the brim."""

        def arrive(found: ResumeFrom | None) -> None:
            target = self.target
            assert target is not None
            ordinary = reserved = 0
            # NOTE: no await between the fill and the note: the actor reads nothing meanwhile.
            while target.try_tell(self.filler()):
                ordinary += 1
            while target.post(self.filler()):
                reserved += 1
            self.filled = (ordinary, reserved)
            on_loaded(found)

        super().load_soon(key, namespace, prompt, arrive, request_id=request_id)


class RecordingRunner(Actor):
    """Records every ``RunTurn`` the gateway grants (and runs nothing)."""

    def __init__(self) -> None:
        self.turns: list[RunTurn] = []
        self.granted = anyio.Event()

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Keep the turn."""
        if isinstance(envelope.body, RunTurn):
            self.turns.append(envelope.body)
            self.granted.set()


class IdleEngine:
    """The batch lane's engine half for a row that never runs a step (only statistics are asked)."""

    def blas_stats(self) -> None:
        """No BLAS thread choice."""


def _stats_to(inbox: Inbox, kind: type[GatewayStatsRequest] | type[BatchStatsRequest]) -> Callable[[], Body]:
    return lambda: kind(reply_to=inbox.address)


async def test_gateway_grants_the_turn_when_the_loaded_note_found_the_mailbox_full() -> None:
    """The gateway's note finds capacity and reserve full; the request still gets its first turn."""
    port = FillingPort()
    runner = RecordingRunner()
    async with ActorSystem() as system:
        answers = system.open_inbox(4 * (CAPACITY + RESERVE), prefix="stats-")
        port.target = system.spawn(
            "gateway", lambda: Gateway(runner="runner", max_queue=2, checkpoints=port),
            capacity=CAPACITY, reserve=RESERVE,
        )
        port.filler = _stats_to(answers, GatewayStatsRequest)
        system.spawn("runner", lambda: runner)
        request = Generate(request_id="r1", prompt_tokens=PROMPT,
                           params=GenerationParams(max_tokens=4), stream_to=answers.address)
        reply = await system.ask("gateway", request, timeout=5, expect=AdmissionReply)
        assert reply.accepted, reply
        with anyio.fail_after(5):
            await runner.granted.wait()
        answers.close()
    assert port.filled is not None
    assert port.filled[1] == RESERVE  # NOTE: the reserved room was filled too.
    assert runner.turns[0].start is not None
    assert runner.turns[0].start.request_id == "r1"


async def test_batch_row_becomes_ready_when_the_loaded_note_found_the_mailbox_full() -> None:
    """The batch scheduler's note finds capacity and reserve full; the row still becomes ready."""
    port = FillingPort()
    async with ActorSystem() as system:
        gateway = system.open_inbox(64, prefix="gateway-")
        answers = system.open_inbox(4 * (CAPACITY + RESERVE), prefix="stats-")
        port.target = system.spawn(
            "batch",
            lambda: BatchScheduler(gateway=gateway.address, executor=None,  # type: ignore[arg-type]
                                   engine=IdleEngine(), max_rows=2, max_queue=2,  # type: ignore[arg-type]
                                   checkpoints=port),
            capacity=CAPACITY, reserve=RESERVE,
        )
        port.filler = _stats_to(answers, BatchStatsRequest)
        request = Generate(request_id="r1", prompt_tokens=PROMPT,
                           params=GenerationParams(max_tokens=4), stream_to=answers.address)
        await system.tell("batch", request)
        with anyio.fail_after(5):
            while True:
                body = (await gateway.receive()).body
                if isinstance(body, BatchWants) and body.ready:
                    break
        gateway.close()
        answers.close()
    assert port.filled is not None
    assert port.filled[1] == RESERVE  # NOTE: the reserved room was filled too.
