"""The memory actor: admission relief when a request does not fit the memory budget.

``core`` holds the rules (sans-IO), ``actor`` the shell, ``ports`` what the
shell reads (the engine thread's memory gauges) and its alarm. The protocol
is ``messages.memory``; see docs/operations.md ("Memory-pressure guard").
"""

from __future__ import annotations

from . import core
from .actor import MEMORY_ADDRESS, MemoryActor, MemoryTargets
from .core import Gauges, MemoryConfig, MemoryState
from .ports import AdmissionCheck, GaugePort, GuardGauges

__all__ = [
    "MEMORY_ADDRESS",
    "AdmissionCheck",
    "GaugePort",
    "Gauges",
    "GuardGauges",
    "MemoryActor",
    "MemoryConfig",
    "MemoryState",
    "MemoryTargets",
    "core",
]
