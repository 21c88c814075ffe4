"""The gateway: admission, the serial lane and the engine-turn token (``core``,
``actor``), and the turn runner that performs granted turns on the engine
thread (``runner_core``, ``runner``; engine-thread work in ``engine_work`` and
``burst``). The executor, the backend protocol, background steps and the
memory guard it uses live in ``actors.engine_thread``. ``turns``: the
gateway's idle turns as a port (:class:`GatewayTurns`) for callers that
await a callable's outcome (the SSD store worker, ``Engine.run_when_idle``)."""

from __future__ import annotations

from .actor import Gateway
from .runner import TurnRunner
from .turns import GatewayTurns

__all__ = ["Gateway", "GatewayTurns", "TurnRunner"]
