"""The durability coordinator: dirty records, write-behind snapshots, flush to a durable boundary.

``core`` holds the rules (sans-IO), ``actor`` the shell, ``ports`` what the
shell is given (the cloner, the background-step registry, the alarm). See
``docs/durability.md``.
"""

from __future__ import annotations

from . import core
from .actor import DURABILITY_ADDRESS, DurabilityCoordinator, DurabilityTargets
from .core import DurabilityConfig, DurabilityState
from .ports import (
    Alarm,
    Cloner,
    CloneSlot,
    GatewaySteps,
    LoopAlarm,
    RegistryCloner,
    StepRegistry,
)

__all__ = [
    "DURABILITY_ADDRESS",
    "Alarm",
    "CloneSlot",
    "Cloner",
    "DurabilityConfig",
    "DurabilityCoordinator",
    "DurabilityState",
    "DurabilityTargets",
    "GatewaySteps",
    "LoopAlarm",
    "RegistryCloner",
    "StepRegistry",
    "core",
]
