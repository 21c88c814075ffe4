"""The batch lane sends a keyed row's prompt-cache ``Take`` while its checkpoint lookup still runs.

A checkpoint is found only for the retry of an interrupted answer; the row's
prompt-cache lookup does not wait for the checkpoint's worker thread. The
row becomes ready only once both answered, and a found checkpoint gives the
``Take``'s lease back (``Release``).
"""

from __future__ import annotations

import anyio
import pytest

from actors.batch_scheduler import BatchScheduler
from actors.checkpoints import ResumeFrom
from actors.runtime import Actor, ActorSystem, Context, ReceiveTimeout
from messages import Envelope
from messages.batch_scheduler import BatchWants
from messages.gateway import Generate, GenerationParams
from messages.prompt_cache import Release, Take, TakeResult
from tests.actors.checkpoints.gated_port import GatedPort
from tests.actors.polling import until

pytestmark = pytest.mark.anyio

PROMPT = (1, 2, 3, 4, 5)


class LendingCache(Actor):
    """A prompt cache that answers every ``Take`` with a 4-token hit under a lease, and records releases."""

    def __init__(self) -> None:
        self.takes: list[Take] = []
        self.released: list[str] = []

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """Lend ``lease-N``; keep what is released."""
        body = envelope.body
        if isinstance(body, Take):
            self.takes.append(body)
            hit = TakeResult(lease_id=f"lease-{len(self.takes)}", handle="h", cached_tokens=4,
                             entry_tokens=4)
            await ctx.reply(envelope, hit)
        elif isinstance(body, Release):
            self.released.append(body.lease_id)


class IdleEngine:
    """The batch lane's engine half for a row that never runs a step (only statistics are asked)."""

    def blas_stats(self) -> None:
        """No BLAS thread choice."""


@pytest.mark.parametrize("found", [False, True])
async def test_take_goes_out_while_the_checkpoint_lookup_runs(found: bool) -> None:
    """The Take reaches the prompt cache with the checkpoint lookup still gated; the row is ready only after both."""
    resume = ResumeFrom(path="p", header=None, host=None) if found else None  # type: ignore[arg-type]
    port = GatedPort(resume)
    cache = LendingCache()
    async with ActorSystem() as system:
        gateway = system.open_inbox(64, prefix="gateway-")
        streams = system.open_inbox(16, prefix="stream-")
        system.spawn("prompt_cache", lambda: cache)
        system.spawn(
            "batch",
            lambda: BatchScheduler(gateway=gateway.address, executor=None,  # type: ignore[arg-type]
                                   engine=IdleEngine(), max_rows=2, max_queue=2,  # type: ignore[arg-type]
                                   prompt_cache="prompt_cache", checkpoints=port),
        )
        request = Generate(request_id="r1", prompt_tokens=PROMPT,
                           params=GenerationParams(max_tokens=4), stream_to=streams.address)
        await system.tell("batch", request)
        await until(seconds=5, check=lambda: len(cache.takes) == 1 and len(port.loads) == 1)
        # NOTE: the lookup's answer has been sent back; give the row every
        # chance to turn ready early before the gate opens.
        await anyio.sleep(0.1)
        wants: list[BatchWants] = []
        while True:
            try:
                body = (await gateway.receive(timeout=0.01)).body
            except ReceiveTimeout:
                break
            if isinstance(body, BatchWants):
                wants.append(body)
        assert not any(w.ready for w in wants), "ready before its checkpoint lookup answered"
        port.gate.set()
        with anyio.fail_after(5):
            while True:
                body = (await gateway.receive()).body
                if isinstance(body, BatchWants) and body.ready:
                    break
        await until(seconds=5, check=lambda: len(cache.released) == (1 if found else 0))
        await anyio.sleep(0.05)
        # NOTE: checked before the system stops (a stopping scheduler gives every lease back).
        assert cache.released == (["lease-1"] if found else [])
        gateway.close()
        streams.close()
