"""Recording what every sans-IO core of a live system handles: a live trace.

A shell calls its core through :meth:`Context.traced` (``self.state, effects
= ctx.traced(core.handle, self.state, event)``). Without a recorder that is
the plain call. Inside :func:`record_core_trace` every call is written to a
JSONL file, one line each, in the order the calls happened:

- the header ``{"kvtier_trace": 1, "live": true, "max_bytes": N}``;
- ``{"n": i, "a": actor, "fn": "module:function", "state": S}`` whenever an
  actor's core is called with a state that is not the one its last call
  returned (its first call, a restart with a fresh state): the state as it
  was before that call;
- ``{"n": i, "a": actor, "args": [...], "fx": [...]}`` per call: the
  arguments after the state (the event, which carries its time) and the
  effects returned, each written by the codec of ``_core_codec``; ``"f"``
  names the function when it is not the segment's (no shell calls one:
  every core's one entry point is ``handle``); ``"err"`` replaces ``"fx"``
  when the core raised (its exception's type name);
- ``{"end": {"lines": i, "truncated": false}}`` when the recording closes.

``n`` counts the lines after the header, so a line removed or moved is seen
at once. The effects' outcomes that a shell feeds back to its core
(``LeaseUndelivered``, ``SendFailed``, ...) are calls of their own, hence
recorded like every other event.

The file is bounded: a line that would take it past ``max_bytes`` is not
written; a ``{"truncated": {...}}`` line ends the file instead and nothing
more is recorded (``kvtier replay`` says the trace is truncated). Lines go
to the file on a writer thread, so the event loop only encodes; when the
writer falls ``max_pending`` bytes behind, recording also stops (truncated,
``"reason": "writer behind"``) rather than growing memory or waiting.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, TypeVarTuple, Unpack

from ._core_codec import Encoder, dumps

__all__ = [
    "DEFAULT_TRACE_MAX_BYTES",
    "LIVE_TRACE_VERSION",
    "CoreTraceRecorder",
    "current_core_trace",
    "record_core_trace",
    "recording",
    "traced",
]

LIVE_TRACE_VERSION = 1
DEFAULT_TRACE_MAX_BYTES = 1 << 30
"""1 GiB: the default bound of a live trace file."""
DEFAULT_MAX_PENDING = 64 << 20
"""64 MiB: how far the writer thread may fall behind before recording stops."""

_END_RESERVE = 256
"""Bytes kept free under ``max_bytes`` for the closing line."""

_UNENCODABLE = (RecursionError, TypeError, ValueError)
"""What writing a value may raise (a cycle recurses without end)."""

Ts = TypeVarTuple("Ts")
S = TypeVar("S")
R = TypeVar("R")

_CURRENT: contextvars.ContextVar[CoreTraceRecorder | None] = contextvars.ContextVar(
    "kvtier_core_trace", default=None
)


def _function_name(function: Callable[..., Any]) -> str:
    return f"{function.__module__}:{function.__qualname__}"


class CoreTraceRecorder:
    """Writes one live trace file (see the module docstring); thread-safe ``close``."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = DEFAULT_TRACE_MAX_BYTES,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be at least 1024, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self.lines = 0
        self.written_bytes = 0
        self.truncated: str | None = None
        self._failed: str | None = None
        self._encoder = Encoder()
        # NOTE: the last returned state itself, not its id: an id may be
        # reused by a fresh state after a restart.
        self._last_state: dict[str, object] = {}
        self._segment_fn: dict[str, str] = {}
        self._pending: deque[str] = deque()
        self._pending_bytes = 0
        self._closed = False
        self._cond = threading.Condition()
        # NOTE: 0o600 and no symlink followed: a trace holds prompts' tokens.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        header = dumps({"kvtier_trace": LIVE_TRACE_VERSION, "live": True, "max_bytes": max_bytes})
        self._queue(header + "\n")
        self._thread = threading.Thread(target=self._write_loop, name="kvtier-trace", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """Whether calls are still recorded (not closed, not truncated)."""
        return not self._closed and self.truncated is None

    def call(self, actor: str, function: Callable[..., Any], state: Any, args: tuple[Any, ...]) -> Any:
        """Run ``function(state, *args)`` and record it (with the state first if it is new).

        Recording never changes what the call does: a value the codec
        cannot write (a cycle, say) stops the recording (truncated, ``cannot
        encode``) and the call runs as it would untraced.
        """
        if not self.active:
            return function(state, *args)
        try:
            record = self._opening(actor, function, state, args)
        except _UNENCODABLE as exc:
            self._truncate(f"cannot encode: {type(exc).__name__}: {exc}")
            return function(state, *args)
        if record is None:
            return function(state, *args)
        try:
            new_state, effects = function(state, *args)
        except Exception as exc:
            record["err"] = type(exc).__name__
            # NOTE: the shell's supervision decides what follows; a fresh
            # state after a restart starts a new segment.
            self._last_state.pop(actor, None)
            self._emit(record)
            raise
        try:
            record["fx"] = [self._encoder.encode(effect) for effect in effects]
        except _UNENCODABLE as exc:
            self._truncate(f"cannot encode: {type(exc).__name__}: {exc}")
            return new_state, effects
        self._last_state[actor] = new_state
        self._emit(record)
        return new_state, effects

    def _opening(
        self, actor: str, function: Callable[..., Any], state: Any, args: tuple[Any, ...]
    ) -> dict[str, Any] | None:
        """The call's record so far (the state line emitted first if due); ``None``: bound reached."""
        name = _function_name(function)
        if self._last_state.get(actor) is not state:
            snapshot = {"a": actor, "fn": name, "state": self._encoder.encode(state)}
            if not self._emit(snapshot):
                return None
            self._segment_fn[actor] = name
            # NOTE: the segment has begun; a failure below truncates the file.
            self._last_state[actor] = state
        record: dict[str, Any] = {"a": actor}
        if self._segment_fn.get(actor) != name:
            record["f"] = name
        record["args"] = [self._encoder.encode(arg) for arg in args]
        return record

    def _emit(self, record: dict[str, Any]) -> bool:
        record = {"n": self.lines + 1, **record}
        line = dumps(record) + "\n"
        size = len(line)  # NOTE: dumps writes ASCII: characters are bytes
        if self.written_bytes + size > self.max_bytes - _END_RESERVE:
            self._truncate("max_bytes reached")
            return False
        if self._pending_bytes + size > self.max_pending:
            self._truncate("writer behind")
            return False
        self.lines += 1
        self._queue(line)
        return True

    def _truncate(self, reason: str) -> None:
        self.truncated = reason
        self._last_state.clear()
        self._queue(dumps({"truncated": {"lines": self.lines, "reason": reason}}) + "\n")

    def _queue(self, line: str) -> None:
        size = len(line)
        with self._cond:
            self._pending.append(line)
            self._pending_bytes += size
            self.written_bytes += size
            self._cond.notify()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                batch = list(self._pending)
                self._pending.clear()
                done = self._closed
            if batch:
                text = "".join(batch)
                try:
                    if self._failed is None:
                        # NOTE: flushed per batch, so a process that dies
                        # leaves every line the writer had taken.
                        self._file.write(text)
                        self._file.flush()
                except OSError as exc:
                    # NOTE: the file is unusable; recording stops (the loop sees
                    # ``truncated``) and the lines already queued are dropped.
                    self._failed = f"write failed: {exc}"
                    self.truncated = self._failed
                with self._cond:
                    self._pending_bytes -= len(text)
            if done and not batch:
                return

    def close(self) -> None:
        """Write the end line (unless truncated), drain the writer, close the file."""
        with self._cond:
            if self._closed:
                return
        if self.truncated is None:
            self._queue(dumps({"end": {"lines": self.lines, "truncated": False}}) + "\n")
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        self._file.close()


def current_core_trace() -> CoreTraceRecorder | None:
    """The recorder in effect for this context, or ``None``."""
    return _CURRENT.get()


@contextmanager
def record_core_trace(
    path: Path, *, max_bytes: int = DEFAULT_TRACE_MAX_BYTES
) -> Iterator[CoreTraceRecorder]:
    """Record every traced core call made in this context (and tasks started from it)."""
    with recording(CoreTraceRecorder(path, max_bytes=max_bytes)) as recorder:
        yield recorder


@contextmanager
def recording(recorder: CoreTraceRecorder) -> Iterator[CoreTraceRecorder]:
    """Put ``recorder`` in effect for this context; close it on the way out."""
    token = _CURRENT.set(recorder)
    try:
        yield recorder
    finally:
        _CURRENT.reset(token)
        recorder.close()


def traced(
    actor: str, function: Callable[[S, Unpack[Ts]], R], state: S, *args: *Ts
) -> R:
    """``function(state, *args)``, recorded under ``actor`` when a recorder is in effect."""
    recorder = _CURRENT.get()
    if recorder is None:
        return function(state, *args)
    result: R = recorder.call(actor, function, state, args)
    return result


