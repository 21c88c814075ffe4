"""The gateway's idle engine turns as a port, for callers that run a callable and await it.

:class:`GatewayTurns` registers a callable with the turn runner's
:class:`~actors.engine_thread.BackgroundSteps`, asks the gateway for ONE
background turn (``RunWhenIdle``, with the wait as its deadline) and returns
the callable's outcome once the ``TurnDone`` arrives. It has the shape of
``actors.ssd_writer.TimedEngineTurns``: the SSD store worker's tensor
read-backs ask the gateway through it directly (the wiring hands it to the
cold tier), and ``Engine.run_when_idle`` is a call of it.

NOTE: the ask is the caller's own await (the store worker's task, an
embedder's task); nothing here is shared with another actor but the step
registry, which is the runner's one crossing point for callables
(docs/engine-turn.md). Safe to use from several tasks at once: each call
registers its own step id.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TypeVar

from actors.engine_thread import BackgroundSteps
from actors.errors import TurnUnavailable
from actors.runtime import ActorSystem
from messages.gateway import RunWhenIdle, TurnDone

__all__ = ["GatewayTurns"]

T = TypeVar("T")


class GatewayTurns:
    """Runs callables in idle engine turns the gateway at ``gateway`` grants.

    ``timeout`` (seconds) is the wait when a call names none. ``label``
    marks the asks in the gateway's statistics and traces; ``prefix`` keeps
    step ids of several users apart.
    """

    def __init__(
        self,
        system: ActorSystem,
        steps: BackgroundSteps,
        *,
        timeout: float,
        gateway: str = "gateway",
        label: str = "",
        prefix: str = "turn-",
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self._system = system
        self._steps = steps
        self._timeout = timeout
        self._gateway = gateway
        self._label = label
        self._prefix = f"{prefix}{id(self):x}-"
        self._ids = itertools.count(1)

    async def run_when_idle(self, fn: Callable[[], T], *, timeout: float | None = None) -> T:
        """Run ``fn()`` on the engine thread in one idle turn; its value, or its exception re-raised.

        Raises ``AskTimeout`` when no turn came within ``timeout`` (the
        gateway then never grants the step), ``TurnUnavailable`` when the
        gateway refused it (turns stopped at shutdown).
        """
        wait = self._timeout if timeout is None else timeout
        step = self._steps.add(f"{self._prefix}{next(self._ids)}", fn)
        # NOTE: the deadline tells the gateway when this ask stops waiting, so
        # a step that times out here is never granted later.
        ask = RunWhenIdle(
            step_id=step.step_id, label=self._label, deadline=self._system.clock.now() + wait
        )
        try:
            reply = await self._system.ref(self._gateway).ask(ask, timeout=wait, expect=TurnDone)
        finally:
            step.withdraw()
        if step.ran:
            return step.result()
        raise TurnUnavailable(reply.detail or reply.error_code or "the step did not run")
