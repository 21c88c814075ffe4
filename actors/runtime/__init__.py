"""The actor runtime: actors, bounded mailboxes, ask/tell, supervision,
tracing, injected ports, the simulated runtime with record/replay, and
live traces of every core call (recorded while serving, replayed offline).

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
from ._asking import NotSent, WakeAlarm, perform_all, send_while_room, try_request
from ._context import current_envelope, use_correlation
from ._core_codec import CodecError, Decoder, Encoder, Opaque
from ._core_replay import is_live_trace, replay_core_trace
from ._core_trace import (
    DEFAULT_TRACE_MAX_BYTES,
    CoreTraceRecorder,
    current_core_trace,
    record_core_trace,
    recording,
    traced,
)
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
from ._system import MAX_STREAK, ActorRef, ActorSystem, DeadLetter, Inbox
from ._tracing import configure_logging, get_logger, set_tracing

__all__ = [
    "DEFAULT_TRACE_MAX_BYTES",
    "MAX_STREAK",
    "Actor",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "Alarm",
    "AskCycle",
    "AskTimeout",
    "Clock",
    "CodecError",
    "Context",
    "CoreActor",
    "CoreTraceRecorder",
    "DeadLetter",
    "DeadlineExceeded",
    "Decoder",
    "Effect",
    "Encoder",
    "EndStream",
    "HandlerFailed",
    "Ids",
    "Inbox",
    "LoopAlarm",
    "MailboxClosed",
    "MailboxFull",
    "MailboxStatistics",
    "ManualClock",
    "NotSent",
    "Opaque",
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
    "WakeAlarm",
    "configure_logging",
    "current_core_trace",
    "current_envelope",
    "get_logger",
    "is_live_trace",
    "perform_all",
    "record_core_trace",
    "record_trace",
    "recording",
    "replay_core_trace",
    "replay_trace",
    "send_while_room",
    "set_tracing",
    "traced",
    "try_request",
    "use_correlation",
]
