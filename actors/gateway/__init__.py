"""The gateway: admission, the serial lane and the engine-turn token (``core``,
``actor``), and the turn runner that performs granted turns on the engine
thread (``runner_core``, ``runner``; engine-thread work in ``engine_work`` and
``burst``). The executor, the backend protocol, background steps and the
memory guard it uses live in ``actors.engine_thread``."""

from __future__ import annotations

from .actor import Gateway
from .runner import TurnRunner

__all__ = ["Gateway", "TurnRunner"]
