"""Per-request timeline of a streamed generation: where the time to the first byte goes.

Six marks, in milliseconds after the request's **arrival** (the generation
route's entry, before the body is parsed):

| mark | taken |
|---|---|
| ``admitted`` | the gateway (serial lane) or the batch scheduler admitted it |
| ``lookup_start`` / ``lookup_done`` | its prompt-cache ``Take`` was sent / answered |
| ``joined`` | its first engine turn began (serial lane) or its row joined a batch step |
| ``first_token`` | the engine turn or step that produced its first token ended |
| ``first_byte`` | the SSE response finished writing the chunk of its first token |

The engine's marks travel back in the request's ``DoneEvent``
(``messages.gateway.Timings``: the admission's clock reading, the rest as
offsets from it), so nothing mutable is shared with the actors. The edge
places them on its own monotonic clock through ``Timings.admitted_at``;
both are ``time.monotonic`` in ``kvtier serve``. NOTE: should the clocks
differ (an injected engine clock), the admission is clamped between the
arrival and the moment the edge saw the admission answered, and every mark
to the interval between the previous mark and the first byte: the marks
stay ordered and the phases always sum to the first byte's time.

Phases are the gaps between consecutive marks: ``admission`` (arrival to
admitted: body parsing, prompt rendering and tokenizing, the admission
ask; for a request taken back to admission by a refusal for memory before
its prefill, everything up to its second admission), ``queue`` (admitted to lookup start: waiting for a place), ``lookup``,
``join`` (lookup answered to joined: waiting for the engine turn or the
next step), ``first_step`` (joined to first token: the prefill, restore
included) and ``write`` (first token to first byte: delivery, detokenizing,
encoding and the socket write). Without a lookup ``queue`` and ``lookup``
are 0 and ``join`` holds the whole wait.

A request whose prompt was rendered (a chat, or a completion given as
text) also has its ``admission`` split in four parts, ``admission_parts_ms``,
summing to it: ``parse`` (arrival to the render asked for: the body's read,
parse and checks), ``render_wait`` (until a worker thread took the render;
0 for a short prompt, rendered on the loop),
``render`` (the chat template and tokenizing) and ``admit`` (the render's
end to the admission: the prompt's checks, the memory and admission asks,
and the loop's hops in between). Not for a request taken back to admission.

Only streamed requests that end with their ``DoneEvent`` and produced a
token are recorded (a non-streamed answer writes its first byte at its end).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import structlog

from messages.gateway import DoneEvent, GenerationEvent, Timings, TokenEvent

from ._port import StreamPort

__all__ = ["ADMISSION_PARTS", "MARKS", "PHASES", "TIMELINE_WINDOW", "TimedStream", "Timeline",
           "TimelineWindow", "admission_parts", "timeline_marks"]

_log = structlog.get_logger("kvtier.http")

MARKS = ("admitted", "lookup_start", "lookup_done", "joined", "first_token", "first_byte")
"""The marks after arrival, in order."""

PHASES = ("admission", "queue", "lookup", "join", "first_step", "write")
"""Phase ``i`` runs from mark ``i - 1`` (arrival for the first) to mark ``i``."""

ADMISSION_PARTS = ("parse", "render_wait", "render", "admit")
"""The parts of ``admission`` for a rendered prompt, in order."""

TIMELINE_WINDOW = 1024
"""How many recent requests ``/stats``'s ``http.timeline`` distributions cover."""


def timeline_marks(arrived: float, admit_seen: float, timings: Timings,
                   first_byte: float) -> dict[str, float]:
    """The marks in ms after ``arrived`` (the edge's clock), ordered and ending at ``first_byte``.

    ``admit_seen``: when the edge saw the admission answered; ``timings``:
    the engine's marks (``admitted_at`` on the engine's clock, the rest
    offsets from it).
    """
    end = max(first_byte, arrived)
    admitted = min(max(timings.admitted_at, arrived), max(admit_seen, arrived), end)
    raw = (
        admitted,
        admitted + (timings.lookup_start_s or 0.0),
        admitted + (timings.lookup_done_s or 0.0),
        admitted + timings.queued_s,
        admitted + timings.ttft_s,
        end,
    )
    marks: dict[str, float] = {}
    prev = arrived
    for name, at in zip(MARKS, raw, strict=True):
        prev = min(max(prev, at), end)
        marks[name] = (prev - arrived) * 1e3
    return marks


def admission_parts(arrived: float, render_span: tuple[float, float, float],
                    admitted_ms: float) -> dict[str, float]:
    """``admission`` (``admitted_ms`` after ``arrived``) split at the render's ask, start and end (ms).

    NOTE: each point is clamped between the previous one and the admission
    (the render's clock is ``time.monotonic``; an injected edge clock may
    differ), so the parts are never negative and always sum to ``admitted_ms``.
    """
    out: dict[str, float] = {}
    prev = 0.0
    for name, at in zip(ADMISSION_PARTS, (*render_span, None), strict=True):
        point = admitted_ms if at is None else min(max((at - arrived) * 1e3, prev), admitted_ms)
        out[name] = point - prev
        prev = point
    return out


def _phases(marks: dict[str, float]) -> dict[str, float]:
    prev = 0.0
    out: dict[str, float] = {}
    for phase, mark in zip(PHASES, MARKS, strict=True):
        out[phase] = marks[mark] - prev
        prev = marks[mark]
    return out


@dataclass(slots=True)
class Timeline:
    """One streamed request's edge marks (monotonic seconds); lives on the event loop only."""

    request_id: str
    arrived: float
    clock: Callable[[], float] = time.monotonic
    admit_seen: float | None = None
    token_seen: bool = False
    first_byte: float | None = None
    timings: Timings | None = None
    tokens: int = 0
    """Generated tokens (the ``DoneEvent``'s usage)."""
    readmitted_at: float | None = None
    """When it was admitted again after a take-back (``None``: never taken back)."""
    render_span: tuple[float, float, float] | None = None
    """Its prompt render's ask, start and end (``time.monotonic``; ``None``: no render)."""

    def admitted(self) -> None:
        """The admission was answered (accepted)."""
        self.admit_seen = self.clock()

    def readmitted(self, at: float) -> None:
        """The request was taken back to admission and admitted again at ``at`` (this clock).

        NOTE: the engine's marks then count from that second admission; kept
        at the first, the wait in between fell into ``write`` (the marks are
        clamped to the admission the edge saw). It is ``admission`` time.
        """
        self.readmitted_at = at
        self.admit_seen = at if self.admit_seen is None else max(self.admit_seen, at)

    def wrote(self) -> None:
        """A body chunk was written; the first one after the first token is the first byte."""
        if self.token_seen and self.first_byte is None:
            self.first_byte = self.clock()

    def marks(self) -> dict[str, float] | None:
        """The marks (ms after arrival), or ``None`` when the request did not reach its end."""
        if self.timings is None or self.first_byte is None:
            return None
        seen = self.admit_seen if self.admit_seen is not None else self.first_byte
        return timeline_marks(self.arrived, seen, self.timings, self.first_byte)


class TimedStream:
    """A generation stream that tells its :class:`Timeline` about the first token and the end."""

    def __init__(self, inner: StreamPort, timeline: Timeline) -> None:
        self._inner = inner
        self._timeline = timeline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def start(self) -> None:
        """Admit the wrapped stream."""
        await self._inner.start()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerationEvent:
        event = await self._inner.__anext__()
        if isinstance(event, TokenEvent):
            self._timeline.token_seen = True
        elif isinstance(event, DoneEvent):
            self._timeline.timings = event.timings
            self._timeline.tokens = event.usage.completion_tokens
            again = self._inner.readmitted_at
            if again is not None:
                self._timeline.readmitted(again)
            self._timeline.render_span = self._inner.render_span
        return event

    async def aclose(self) -> None:
        """Close the wrapped stream."""
        await self._inner.aclose()

    @property
    def prompt_tokens(self) -> int:
        """The wrapped stream's prompt length."""
        return self._inner.prompt_tokens


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest rank."""
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99 of ``values`` (nearest rank, ms rounded to µs)."""
    ordered = sorted(values)
    return {f"p{q}": round(_percentile(ordered, q), 3) for q in (50, 90, 99)}


@dataclass
class TimelineWindow:
    """The phases of the last ``size`` recorded requests, and their distributions for ``/stats``."""

    size: int = TIMELINE_WINDOW
    recorded: int = 0
    _rows: deque[dict[str, float]] = field(default_factory=deque)

    def record(self, timeline: Timeline) -> dict[str, float] | None:
        """Log ``timeline``'s line (``request.timeline``) and keep its phases; ``None``: incomplete."""
        marks = timeline.marks()
        if marks is None:
            return None
        phases = _phases(marks)
        timings = timeline.timings
        assert timings is not None
        parts: dict[str, float] = {}
        if timeline.render_span is not None and timeline.readmitted_at is None:
            parts = admission_parts(timeline.arrived, timeline.render_span, marks["admitted"])
        # NOTE: ``decode_ms`` (engine time in decode turns or steps) with
        # ``tokens`` gives the engine-side decode rate, to hold against what
        # a client measures through the socket.
        _log.info("request.timeline", request_id=timeline.request_id,
                   looked_up=timings.lookup_start_s is not None,
                   taken_back=timeline.readmitted_at is not None,
                   tokens=timeline.tokens, decode_ms=round(timings.decode_s * 1e3, 3),
                   **{f"{k}_ms": round(v, 3) for k, v in marks.items()},
                   phases_ms={k: round(v, 3) for k, v in phases.items()},
                   **({"admission_parts_ms": {k: round(v, 3) for k, v in parts.items()}}
                      if parts else {}))
        row = {**phases, "first_byte": marks["first_byte"],
               **{f"admission.{k}": v for k, v in parts.items()}}
        self._rows.append(row)
        if len(self._rows) > self.size:
            self._rows.popleft()
        self.recorded += 1
        return marks

    def snapshot(self) -> dict[str, Any]:
        """``requests`` in the window, ``recorded`` in all; p50/p90/p99 (ms) of each phase and of
        ``first_byte`` (arrival to first byte); the same of each admission part over the
        requests that rendered a prompt (``admission_parts_ms``, ``rendered`` of them)."""
        dist = {name: _percentiles([r[name] for r in self._rows])
                for name in ((*PHASES, "first_byte") if self._rows else ())}
        rendered = [r for r in self._rows if "admission.render" in r]
        parts = {name: _percentiles([r[f"admission.{name}"] for r in rendered])
                 for name in (ADMISSION_PARTS if rendered else ())}
        return {"requests": len(self._rows), "recorded": self.recorded, "window": self.size,
                "phases_ms": dist, "rendered": len(rendered), "admission_parts_ms": parts}
