"""The serial lane loads a request's generation checkpoint at admission, beside its prompt-cache
lookup, never inside its first engine turn; the first ``RunTurn`` carries what was found."""

from __future__ import annotations

import threading

import anyio
import pytest

from actors.checkpoints import ResumeFrom
from actors.gateway import Gateway
from actors.gateway import core as gc
from actors.runtime import Actor, ActorSystem, Context
from messages import Envelope
from messages.gateway import AdmissionReply, Generate, GenerationParams, RunTurn
from tests.actors.checkpoints.gated_port import GatedPort
from tests.actors.polling import until

pytestmark = pytest.mark.anyio

PROMPT = (1, 2, 3, 4, 5)


class RecordingRunner(Actor):
    """Records every ``RunTurn`` the gateway grants (and runs nothing)."""

    def __init__(self) -> None:
        self.turns: list[RunTurn] = []

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Keep the turn."""
        if isinstance(envelope.body, RunTurn):
            self.turns.append(envelope.body)


async def _admit(system: ActorSystem, rid: str, params: GenerationParams) -> None:
    inbox = system.open_inbox(16, prefix=f"stream-{rid}-")
    request = Generate(request_id=rid, prompt_tokens=PROMPT, params=params, stream_to=inbox.address)
    reply = await system.ask("gateway", request, timeout=5, expect=AdmissionReply)
    assert reply.accepted, reply


async def test_checkpoint_is_loaded_before_the_first_turn_and_handed_to_it() -> None:
    """No turn is granted while the load runs (on a worker thread); the first RunTurn carries the key and the found checkpoint's handle."""
    found = ResumeFrom(path="p", header=None, host=None)  # type: ignore[arg-type]
    port = GatedPort(found)
    runner = RecordingRunner()
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: Gateway(runner="runner", max_queue=2, checkpoints=port))
        system.spawn("runner", lambda: runner)
        await _admit(system, "r1", GenerationParams(max_tokens=4))
        await until(lambda: len(port.loads) == 1)
        key, namespace, prompt, thread = port.loads[0]
        assert thread != threading.get_ident()
        assert (namespace, prompt) == ("", PROMPT)
        await anyio.sleep(0.1)
        assert runner.turns == []  # NOTE: the load is still running: no turn yet.
        port.gate.set()
        await until(lambda: bool(runner.turns))
    turn = runner.turns[0]
    assert turn.start is not None
    assert turn.start.request_id == "r1"
    assert turn.checkpoint_key == key
    assert turn.checkpoint is not None
    assert port.claim(turn.checkpoint) is found
    assert port.claim(turn.checkpoint) is None  # NOTE: claimed once.


async def test_request_without_a_key_loads_nothing_and_its_turn_carries_none() -> None:
    """A request v1 does not checkpoint (logprobs) is counted as refused, never loaded, and its turn carries no key."""
    port = GatedPort(None)
    runner = RecordingRunner()
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: Gateway(runner="runner", max_queue=2, checkpoints=port))
        system.spawn("runner", lambda: runner)
        await _admit(system, "r1", GenerationParams(max_tokens=4, logprobs=True))
        await until(lambda: bool(runner.turns))
    assert port.loads == []
    assert port.counters.refused == {"logprobs": 1}
    assert (runner.turns[0].checkpoint_key, runner.turns[0].checkpoint) == (None, None)


def test_core_waits_for_both_lookup_and_checkpoint_load() -> None:
    """The core starts the Take and the checkpoint load together (lane holder and queue head) and grants the first turn only once both answered."""
    state = gc.GatewayState(max_queue=2, lookups=True)
    state, out = gc.handle(state, gc.AdmitRequest("r1", 0.0, checkpoint=True))
    assert [type(e) for e in out if not isinstance(e, gc.RequestAdmitted)] == [
        gc.StartLookup, gc.LoadCheckpoint
    ]
    state, out = gc.handle(state, gc.AdmitRequest("r2", 0.1, checkpoint=True))
    assert gc.LoadCheckpoint("r2") in out
    state, out = gc.handle(state, gc.LookupDone("r1", 0.2))
    assert not any(isinstance(e, gc.RunRequestTurn) for e in out)
    state, out = gc.handle(state, gc.CheckpointLoaded("r1", 0.3))
    assert gc.RunRequestTurn("r1", 1) in out
    assert state.snapshot(0.3)["checkpoint_loads"] == 2
    # NOTE: a queued request that leaves drops its load's state.
    state, _ = gc.handle(state, gc.CancelRequest("r2", 0.4))
    assert "r2" not in state.checkpoint
