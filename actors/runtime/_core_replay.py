"""Replaying a live trace (``_core_trace``): every recorded call through the same core.

Each actor's segment starts from its recorded state; each call line's
arguments go through the function the segment names (or the line's
``"f"``), and the effects it returns now are compared with the recorded
ones, effect by effect, as the codec writes them. The first difference (an
effect, a count, an exception, a line number out of sequence) ends the
replay with the line where it happened.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._core_codec import CodecError, Decoder, Encoder, dumps
from ._core_trace import LIVE_TRACE_VERSION
from ._replay import ReplayReport

__all__ = ["MAX_TRACE_LINE_BYTES", "is_live_trace", "replay_core_trace"]

MAX_TRACE_LINE_BYTES = 256 << 20
"""256 MiB: the longest line a live trace may hold (a state snapshot); longer is refused."""

_TRUSTED_MODULES = ("actors.",)
"""Where a trace's core functions may live."""


def is_live_trace(header: str) -> bool:
    """Whether ``header`` (a trace's first line) opens a live trace."""
    try:
        value = json.loads(header)
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("live") is True


class _Diverged(Exception):
    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(expected, actual)
        self.expected = expected
        self.actual = actual


@dataclass(slots=True)
class _Segment:
    function: Callable[..., Any]
    state: Any


def _resolve(name: str, cache: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    known = cache.get(name)
    if known is not None:
        return known
    module_name, sep, qualname = name.partition(":")
    if not sep or not module_name.startswith(_TRUSTED_MODULES):
        raise _Diverged("a core function under actors/", name)
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise _Diverged("an importable core module", f"{name} ({exc})") from exc
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not inspect.isfunction(target):
        raise _Diverged("a core function", name)
    cache[name] = target
    return target


def replay_core_trace(lines: Sequence[str]) -> ReplayReport:
    """Replay a live trace's lines (header first); the report names the first difference."""
    lines = [line for line in lines if line.strip()]
    total = len(lines)
    if not lines:
        return ReplayReport(False, 0, 1, "(a live trace header)", "(empty file)")
    try:
        header = json.loads(lines[0])
        if not isinstance(header, dict) or header.get("kvtier_trace") != LIVE_TRACE_VERSION:
            raise ValueError("not a kvtier live trace header")
    except ValueError as exc:
        return ReplayReport(False, total, 1, "(a kvtier live trace header)", f"{lines[0]} ({exc})")
    decoder = Decoder()
    encoder = Encoder()
    functions: dict[str, Callable[..., Any]] = {}
    segments: dict[str, _Segment] = {}
    calls = 0
    for index, line in enumerate(lines[1:], start=2):
        try:
            if len(line) > MAX_TRACE_LINE_BYTES:
                raise _Diverged(f"a line under {MAX_TRACE_LINE_BYTES} bytes", f"{len(line)} bytes")
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise _Diverged("a JSON line", f"{line[:200]} ({exc})") from exc
            if not isinstance(record, dict):
                raise _Diverged("a JSON object", line[:200])
            if "end" in record or "truncated" in record:
                return _closing(record, index, total, calls)
            _step(record, index - 1, decoder, encoder, functions, segments)
            calls += "args" in record
        except _Diverged as exc:
            return ReplayReport(False, total, index, exc.expected, exc.actual)
        except CodecError as exc:
            return ReplayReport(False, total, index, "(a decodable value)", str(exc))
    return ReplayReport(True, total, note=f"no end line: the recording did not close; "
                                           f"the {calls} calls it holds replayed")


def _closing(record: dict[str, Any], index: int, total: int, calls: int) -> ReplayReport:
    if index != total:
        return ReplayReport(False, total, index + 1, "(end of trace)", "(lines after the end)")
    if "truncated" in record:
        info = record["truncated"]
        reason = info.get("reason") if isinstance(info, dict) else None
        return ReplayReport(True, total, note=f"truncated ({reason}): the first {calls} calls "
                                               "replayed; later ones were not recorded")
    info = record["end"]
    expected = info.get("lines") if isinstance(info, dict) else None
    if expected != index - 2:
        return ReplayReport(False, total, index, f"{expected} lines before the end",
                            f"{index - 2} lines")
    return ReplayReport(True, total)


def _step(
    record: dict[str, Any],
    number: int,
    decoder: Decoder,
    encoder: Encoder,
    functions: dict[str, Callable[..., Any]],
    segments: dict[str, _Segment],
) -> None:
    if record.get("n") != number:
        raise _Diverged(f"line number n={number}",
                        f"n={record.get('n')} (a line is missing or out of order)")
    actor = record.get("a")
    if not isinstance(actor, str):
        raise _Diverged("an actor name", repr(actor))
    if "state" in record:
        segments[actor] = _Segment(_resolve(str(record.get("fn")), functions),
                                   decoder.decode(record["state"]))
        return
    segment = segments.get(actor)
    if segment is None:
        raise _Diverged(f"a state line for {actor!r} first", "a call without one")
    function = segment.function if "f" not in record else _resolve(str(record["f"]), functions)
    raw_args = record.get("args")
    if not isinstance(raw_args, list):
        raise _Diverged("a list of arguments", repr(raw_args)[:200])
    args = [decoder.decode(arg) for arg in raw_args]
    try:
        state, effects = function(segment.state, *args)
    except Exception as exc:
        # NOTE: broad on purpose: what a core raises is an outcome compared with the trace.
        if record.get("err") == type(exc).__name__:
            del segments[actor]
            return
        raise _Diverged(f"{actor}: effects {_short(record.get('fx'))}",
                        f"{actor}: raised {type(exc).__name__}: {exc}") from exc
    if "err" in record:
        raise _Diverged(f"{actor}: raised {record['err']}", f"{actor}: returned effects")
    segment.state = state
    _compare(actor, record.get("fx"), [encoder.encode(effect) for effect in effects])


def _compare(actor: str, recorded: Any, produced: list[Any]) -> None:
    if not isinstance(recorded, list):
        raise _Diverged("a list of effects", repr(recorded)[:200])
    for position, (want, got) in enumerate(zip(recorded, produced, strict=False)):
        want_text, got_text = dumps(want), dumps(got)
        if want_text != got_text:
            raise _Diverged(f"{actor}: effect {position}: {want_text}",
                            f"{actor}: effect {position}: {got_text}")
    if len(recorded) != len(produced):
        raise _Diverged(f"{actor}: {len(recorded)} effects {_short(recorded)}",
                        f"{actor}: {len(produced)} effects {_short(produced)}")


def _short(value: Any) -> str:
    text = dumps(value)
    return text if len(text) <= 400 else text[:400] + "..."
