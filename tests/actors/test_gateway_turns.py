"""``GatewayTurns``: a callable runs in a turn the gateway grants; refusals and timeouts surface."""

from __future__ import annotations

import anyio
import pytest

from actors.engine_thread import BackgroundSteps
from actors.errors import TurnUnavailable
from actors.gateway import GatewayTurns
from actors.runtime import Actor, ActorSystem, AskTimeout, Context
from messages import Envelope
from messages.gateway import RunWhenIdle, TurnDone

pytestmark = pytest.mark.anyio


class ScriptedGateway(Actor):
    """Grants (runs the registered step, as the runner does), refuses, or never answers."""

    def __init__(self, steps: BackgroundSteps, mode: str, seen: list[RunWhenIdle]) -> None:
        self._steps = steps
        self._mode = mode
        self._seen = seen

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        body = envelope.body
        assert isinstance(body, RunWhenIdle)
        self._seen.append(body)
        if self._mode == "silent":
            return
        if self._mode == "refuse":
            await ctx.reply(envelope, TurnDone(step_id=body.step_id, ok=False,
                                               error_code="stopped", detail="turns stopped"))
            return
        fn = self._steps.take(body.step_id)
        assert fn is not None
        try:
            value, error = fn(), None
        except ValueError as exc:
            value, error = None, exc
        self._steps.settle(body.step_id, value, error)
        await ctx.reply(envelope, TurnDone(step_id=body.step_id, ok=error is None))


async def _turns(system: ActorSystem, mode: str, seen: list[RunWhenIdle]) -> GatewayTurns:
    steps = BackgroundSteps()
    system.spawn("gateway", lambda: ScriptedGateway(steps, mode, seen))
    return GatewayTurns(system, steps, timeout=5.0, label="ssd_writer.store")


async def test_a_granted_turn_returns_the_callables_value_or_raises_its_error() -> None:
    """The step is asked for by the gateway address with a deadline; its value and error come back."""
    seen: list[RunWhenIdle] = []
    async with ActorSystem() as system:
        turns = await _turns(system, "grant", seen)
        assert await turns.run_when_idle(lambda: 41 + 1) == 42

        def broken() -> int:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await turns.run_when_idle(broken)
    assert [s.label for s in seen] == ["ssd_writer.store"] * 2
    assert seen[0].step_id != seen[1].step_id
    assert all(s.deadline is not None for s in seen)


async def test_a_refused_turn_raises_turn_unavailable_and_never_runs() -> None:
    """A TurnDone without a run is TurnUnavailable carrying the gateway's reason."""
    seen: list[RunWhenIdle] = []
    ran: list[int] = []
    async with ActorSystem() as system:
        turns = await _turns(system, "refuse", seen)
        with pytest.raises(TurnUnavailable, match="turns stopped"):
            await turns.run_when_idle(lambda: ran.append(1))
    assert ran == []


async def test_no_turn_in_time_is_an_ask_timeout_and_the_step_is_withdrawn() -> None:
    """A gateway that never grants: AskTimeout after the wait, and the step can no longer run."""
    seen: list[RunWhenIdle] = []
    steps = BackgroundSteps()
    async with ActorSystem() as system:
        system.spawn("gateway", lambda: ScriptedGateway(steps, "silent", seen))
        turns = GatewayTurns(system, steps, timeout=5.0)
        with anyio.fail_after(5), pytest.raises(AskTimeout):
            await turns.run_when_idle(lambda: 1, timeout=0.1)
    assert len(seen) == 1
    assert steps.take(seen[0].step_id) is None
