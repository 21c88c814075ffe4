"""The actor runtime: actors, bounded mailboxes, ask/tell, supervision,
tracing, injected ports, and the simulated runtime with record/replay.

See docs/runtime.md for how to write, run and test an actor.
"""

from __future__ import annotations

from ._actor import (
    Actor,
    Context,
    CoreActor,
    Effect,
    EndStream,
    Reply,
    RestartWindow,
    Supervision,
    Tell,
)
from ._alarm import Alarm, LoopAlarm
from ._context import current_envelope, use_correlation
from ._errors import (
    ActorStopped,
    AskCycle,
    AskTimeout,
    DeadlineExceeded,
    HandlerFailed,
    MailboxClosed,
    MailboxFull,
    ReceiveTimeout,
    ReplayDiverged,
    RuntimeFailure,
    SupervisionEscalated,
    UnexpectedReply,
    UnknownAddress,
)
from ._ports import (
    Clock,
    Ids,
    ManualClock,
    Rng,
    SeededRng,
    SequentialIds,
    SystemClock,
    SystemIds,
    SystemRng,
)
from ._replay import ReplayReport, record_trace, replay_trace
from ._sim import Scenario, SimulatedSystem, SimulationStalled
from ._stats import MailboxStatistics, SystemStatistics
from ._system import ActorRef, ActorSystem, DeadLetter, Inbox
from ._tracing import configure_logging, get_logger, set_tracing

__all__ = [
    "Actor",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "Alarm",
    "AskCycle",
    "AskTimeout",
    "Clock",
    "Context",
    "CoreActor",
    "DeadLetter",
    "DeadlineExceeded",
    "Effect",
    "EndStream",
    "HandlerFailed",
    "Ids",
    "Inbox",
    "LoopAlarm",
    "MailboxClosed",
    "MailboxFull",
    "MailboxStatistics",
    "ManualClock",
    "ReceiveTimeout",
    "ReplayDiverged",
    "ReplayReport",
    "Reply",
    "RestartWindow",
    "Rng",
    "RuntimeFailure",
    "Scenario",
    "SeededRng",
    "SequentialIds",
    "SimulatedSystem",
    "SimulationStalled",
    "Supervision",
    "SupervisionEscalated",
    "SystemClock",
    "SystemIds",
    "SystemRng",
    "SystemStatistics",
    "Tell",
    "UnexpectedReply",
    "UnknownAddress",
    "configure_logging",
    "current_envelope",
    "get_logger",
    "record_trace",
    "replay_trace",
    "set_tracing",
    "use_correlation",
]
