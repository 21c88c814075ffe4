"""The gateway: admission, the serial lane and the engine-turn token (``core``,
``actor``), and the turn runner that performs granted turns on the engine
thread (``runner_core``, ``runner``; engine-thread work in ``engine_work`` and
``burst``; its ports in ``ports``; background steps in ``steps``)."""

from __future__ import annotations

from .actor import Gateway
from .burst import AHEAD
from .ports import Backend, Executor, InlineExecutor, Registered, StepResult, StepToken
from .runner import TurnRunner
from .steps import BackgroundSteps, StepHandle, StepNotRun

__all__ = [
    "AHEAD",
    "Backend",
    "BackgroundSteps",
    "Executor",
    "Gateway",
    "InlineExecutor",
    "Registered",
    "StepHandle",
    "StepNotRun",
    "StepResult",
    "StepToken",
    "TurnRunner",
]
