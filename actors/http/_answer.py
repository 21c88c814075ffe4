"""Sans-IO shaping of one request's events into OpenAI's answer: text, tool calls, logprobs.

A :class:`ChatAnswer` (or :class:`CompletionAnswer`) is fed the request's
``TokenEvent``s in order and then its ``DoneEvent``. Streaming reads the
pieces :meth:`feed` and :meth:`finish` return, one SSE chunk each; a
non-streamed answer reads the whole (``content``, ``tool_calls``,
``logprobs``) after :meth:`finish`. Both paths run the same code, so a
streamed answer joins to the non-streamed one.

Rules:

- **Tool calls** (when the request has tools and ``tool_choice`` is not
  ``none``): generated text is split by the model's markers
  (``kernels.engine.ToolCallSplitter``); each call's text goes through the
  model's mlx-lm parser. A call that does not parse (cut by ``max_tokens``,
  or not in the model's format) is returned as text, markers included, so
  nothing the model wrote is hidden. ``finish_reason`` is ``tool_calls``
  when the answer holds calls and the model stopped by itself.
- **Logprobs**: one entry per generated token, in order, except a final
  stop token (EOS), which is not part of the answer. Entries ride along
  with the next chunk that carries content or calls (a token can release no
  text yet: part of a character, or text that may start a marker); what is
  left goes with the last chunk. ``-inf`` (a token a grammar forbids) and
  NaN are reported as -9999.0, as JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kernels.engine import ToolCallSplitter, ToolFormat, ToolSegment, parse_tool_call
from messages.gateway import DoneEvent, TokenEvent

from ._schemas import (
    CompletionLogprobs,
    FunctionCallBody,
    TokenLogprob,
    ToolCallBody,
    TopLogprob,
)

__all__ = [
    "ChatAnswer",
    "ChatPiece",
    "CompletionAnswer",
    "CompletionPiece",
    "LogprobOptions",
    "TokenSpeller",
    "ToolParsing",
    "finish_reason",
]

_FLOOR = -9999.0
"""Reported instead of ``-inf``/NaN (OpenAI reports very unlikely tokens this way)."""


class TokenSpeller(Protocol):
    """Token ids → the bytes they stand for (``kernels.engine.TokenBytes``)."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a generation."""
        ...

    def __call__(self, token_ids: Iterable[int]) -> list[bytes]:
        """The bytes of each id."""
        ...


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """Report each token's logprob and ``top`` alternatives, spelled by ``spell``."""

    top: int
    spell: TokenSpeller


@dataclass(frozen=True, slots=True)
class ToolParsing:
    """Find the model's tool calls (``fmt``) in the answer; ``tools`` go to its parser."""

    fmt: ToolFormat
    tools: Sequence[Mapping[str, Any]]


def _number(value: float) -> float:
    return value if value >= _FLOOR else _FLOOR  # NOTE: False for NaN too.


def _token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        # NOTE: part of a multi-byte character: OpenAI's spelling of raw bytes.
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def finish_reason(done: DoneEvent, *, called: bool = False) -> str:
    """OpenAI's ``finish_reason``: ``tool_calls`` after calls, never ``cancelled``.

    NOTE: "cancelled" only happens when the client left; nobody reads it, but
    OpenAI clients know just "stop"/"length"/"tool_calls".
    """
    if done.finish_reason == "cancelled":
        return "stop"
    if called and done.finish_reason == "stop":
        return "tool_calls"
    return done.finish_reason


@dataclass
class _Logprobs:
    """Per-token entries waiting to be sent; a trailing stop token waits to see what follows."""

    options: LogprobOptions
    ready: list[TokenEvent] = field(default_factory=list)
    held: TokenEvent | None = None

    def add(self, event: TokenEvent) -> None:
        if self.held is not None:
            self.ready.append(self.held)
            self.held = None
        if event.token_id in self.options.spell.eos_token_ids:
            self.held = event
        else:
            self.ready.append(event)

    def take(self) -> list[TokenEvent]:
        out, self.ready = self.ready, []
        return out

    def end(self) -> None:
        # NOTE: a stop token that ended the generation is not part of the answer.
        self.held = None


@dataclass(frozen=True, slots=True)
class ChatPiece:
    """What one streamed chat chunk carries (any part may be empty)."""

    content: str = ""
    tool_calls: tuple[ToolCallBody, ...] = ()
    first_call_index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def empty(self) -> bool:
        """Nothing to send."""
        return not (self.content or self.tool_calls or self.logprobs)


class ChatAnswer:
    """One chat request's answer, built from its events (see the module docstring).

    ``call_id(n)`` names the n-th tool call of the answer.
    """

    def __init__(
        self,
        *,
        tools: ToolParsing | None = None,
        logprobs: LogprobOptions | None = None,
        call_id: Callable[[int], str] = lambda n: f"call_{n}",
    ) -> None:
        self._tools = tools
        self._splitter = ToolCallSplitter(tools.fmt) if tools is not None else None
        self._logprobs = _Logprobs(logprobs) if logprobs is not None else None
        self._call_id = call_id
        self._content: list[str] = []
        self._calls: list[ToolCallBody] = []
        self._entries: list[TokenLogprob] = []
        self.finish_reason: str | None = None

    @property
    def reports_logprobs(self) -> bool:
        """True when the request asked for logprobs."""
        return self._logprobs is not None

    def feed(self, event: TokenEvent) -> ChatPiece | None:
        """The chunk this token releases, or ``None`` when it releases nothing yet."""
        if self._logprobs is not None:
            self._logprobs.add(event)
        segments = (self._splitter.feed(event.text) if self._splitter is not None
                    else [ToolSegment("text", event.text)] if event.text else [])
        piece = self._piece(segments, final=False)
        return None if piece.empty else piece

    def finish(self, done: DoneEvent) -> ChatPiece | None:
        """The last chunk before the finish chunk (held text, calls, logprobs), or ``None``."""
        segments = self._splitter.finish() if self._splitter is not None else []
        if self._logprobs is not None:
            self._logprobs.end()
        piece = self._piece(segments, final=True)
        self.finish_reason = finish_reason(done, called=bool(self._calls))
        return None if piece.empty else piece

    def _piece(self, segments: Sequence[ToolSegment], *, final: bool) -> ChatPiece:
        text: list[str] = []
        first = len(self._calls)
        for seg in segments:
            if seg.kind == "text":
                text.append(seg.text)
                continue
            assert self._tools is not None
            fmt = self._tools.fmt
            try:
                parsed = parse_tool_call(fmt, seg.text, self._tools.tools)
            except ValueError:
                text.append(fmt.start + seg.text + (fmt.end if seg.closed else ""))
                continue
            for call in parsed:
                self._calls.append(ToolCallBody(
                    id=self._call_id(len(self._calls)),
                    function=FunctionCallBody(name=call.name, arguments=call.arguments)))
        content = "".join(text)
        self._content.append(content)
        # NOTE: entries wait for a chunk that carries something (or the last one).
        sending = final or bool(content) or len(self._calls) > first
        entries = (self._spell(self._logprobs.take())
                   if self._logprobs is not None and sending else ())
        self._entries.extend(entries)
        return ChatPiece(content=content, tool_calls=tuple(self._calls[first:]),
                         first_call_index=first, logprobs=tuple(entries))

    def _spell(self, events: list[TokenEvent]) -> tuple[TokenLogprob, ...]:
        if not events:
            return ()
        assert self._logprobs is not None
        spell = self._logprobs.options.spell
        ids = [e.token_id for e in events]
        for e in events:
            ids.extend(t for t, _ in e.top_logprobs)
        raw = dict(zip(ids, spell(ids), strict=True))
        out: list[TokenLogprob] = []
        for e in events:
            alternatives = [
                TopLogprob(token=_token_text(raw[t]), logprob=_number(lp), bytes=list(raw[t]))
                for t, lp in e.top_logprobs[: self._logprobs.options.top]
            ]
            chosen = raw[e.token_id]
            out.append(TokenLogprob(
                token=_token_text(chosen),
                logprob=_number(e.logprob if e.logprob is not None else float("nan")),
                bytes=list(chosen), top_logprobs=alternatives))
        return tuple(out)

    # -- the whole answer (after finish) ----------------------------------------

    @property
    def content(self) -> str | None:
        """The answer's text; ``None`` when it is empty and the answer holds tool calls."""
        text = "".join(self._content)
        return None if not text and self._calls else text

    @property
    def tool_calls(self) -> list[ToolCallBody]:
        """Every tool call of the answer, in order."""
        return list(self._calls)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Every reported token's entry, in order."""
        return list(self._entries)


@dataclass(frozen=True, slots=True)
class CompletionPiece:
    """What one streamed text-completion chunk carries."""

    text: str = ""
    logprobs: CompletionLogprobs | None = None


class CompletionAnswer:
    """One text completion's answer: text and OpenAI's legacy logprobs (``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

    def __init__(self, *, logprobs: LogprobOptions | None = None) -> None:
        self._logprobs = _Logprobs(logprobs) if logprobs is not None else None
        self._text: list[str] = []
        self._chars = 0
        self._offsets: dict[int, int] = {}
        self._all = CompletionLogprobs(tokens=[], token_logprobs=[],
                                       top_logprobs=[] if logprobs and logprobs.top else None,
                                       text_offset=[])
        self.finish_reason: str | None = None

    def feed(self, event: TokenEvent) -> CompletionPiece | None:
        """The chunk this token releases, or ``None`` when it releases no text yet."""
        self._offsets[event.index] = self._chars
        self._chars += len(event.text)
        self._text.append(event.text)
        if self._logprobs is not None:
            self._logprobs.add(event)
        if not event.text:
            return None
        return CompletionPiece(text=event.text, logprobs=self._take())

    def finish(self, done: DoneEvent) -> CompletionPiece | None:
        """A last chunk with logprobs still unsent, or ``None``."""
        self.finish_reason = finish_reason(done)
        if self._logprobs is None:
            return None
        self._logprobs.end()
        rest = self._take()
        return CompletionPiece(logprobs=rest) if rest is not None else None

    def _take(self) -> CompletionLogprobs | None:
        if self._logprobs is None:
            return None
        events = self._logprobs.take()
        if not events:
            return None
        options = self._logprobs.options
        ids = [e.token_id for e in events]
        for e in events:
            ids.extend(t for t, _ in e.top_logprobs)
        raw = dict(zip(ids, options.spell(ids), strict=True))
        part = CompletionLogprobs(
            tokens=[_token_text(raw[e.token_id]) for e in events],
            token_logprobs=[_number(e.logprob if e.logprob is not None else float("nan"))
                            for e in events],
            top_logprobs=[{_token_text(raw[t]): _number(lp) for t, lp in e.top_logprobs[:options.top]}
                          for e in events] if options.top else None,
            text_offset=[self._offsets[e.index] for e in events],
        )
        self._all.tokens.extend(part.tokens)
        self._all.token_logprobs.extend(part.token_logprobs)
        if part.top_logprobs is not None and self._all.top_logprobs is not None:
            self._all.top_logprobs.extend(part.top_logprobs)
        self._all.text_offset.extend(part.text_offset)
        return part

    @property
    def text(self) -> str:
        """The whole text."""
        return "".join(self._text)

    @property
    def logprobs(self) -> CompletionLogprobs | None:
        """Every reported token's logprobs (``None`` when none were asked)."""
        return self._all if self._logprobs is not None else None
