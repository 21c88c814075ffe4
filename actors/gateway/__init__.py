"""The gateway: admission, the serial lane and the engine-turn token (``core``,
``actor``), and the turn runner that performs granted turns on the engine thread
(``runner``)."""

from __future__ import annotations

from .actor import Gateway
from .runner import (
    Backend,
    BackgroundSteps,
    Executor,
    InlineExecutor,
    Registered,
    StepResult,
    StepToken,
    TurnControl,
    TurnRunner,
    end_stream,
)

__all__ = [
    "Backend",
    "BackgroundSteps",
    "Executor",
    "Gateway",
    "InlineExecutor",
    "Registered",
    "StepResult",
    "StepToken",
    "TurnControl",
    "TurnRunner",
    "end_stream",
]
