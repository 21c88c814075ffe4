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
  Whitespace-only text is held until what follows is known: before a call
  or at the end of an answer that holds calls it is dropped (so a message
  with only calls has ``content`` null, streamed or not), else it is sent
  with the text that follows.
- **Logprobs**: one entry per generated token, in order, except a final
  stop token (EOS), which is not part of the answer. Entries ride along
  with the next chunk that carries content or calls (a token can release no
  text yet: part of a character, or text that may start a marker); what is
  left goes with the last chunk. ``-inf`` (a token a grammar forbids) and
  NaN are reported as -9999.0, as JSON has no infinity.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kernels.engine import ToolCallSplitter, ToolFormat, ToolSegment, parse_tool_call
from messages.gateway import DoneEvent, PromptLogprobs, TokenEvent, Usage

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
    "Echo",
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
    keep_stop: bool = False
    """Report a final stop token too (``echo``: every token the model produced is scored)."""

    def add(self, event: TokenEvent) -> None:
        if self.held is not None:
            self.ready.append(self.held)
            self.held = None
        if not self.keep_stop and event.token_id in self.options.spell.eos_token_ids:
            self.held = event
        else:
            self.ready.append(event)

    def take(self) -> list[TokenEvent]:
        out, self.ready = self.ready, []
        return out

    def end(self, stopped: bool) -> None:
        # NOTE: a stop token that ended the generation is not part of the
        # answer; one the answer ran past (ignore_eos, cut by length) is.
        if self.held is not None and not stopped:
            self.ready.append(self.held)
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
        forced: bool = False,
    ) -> None:
        self._tools = tools
        self.forced = forced
        """The request forces tool calls (``tool_choice`` ``required`` or named): no text is expected."""
        self._held = ""
        self._splitter = ToolCallSplitter(tools.fmt) if tools is not None else None
        self._logprobs = _Logprobs(logprobs) if logprobs is not None else None
        self._call_id = call_id
        self._content: list[str] = []
        self._calls: list[ToolCallBody] = []
        self._entries: list[TokenLogprob] = []
        self.finish_reason: str | None = None

    @property
    def may_call(self) -> bool:
        """True when the answer may carry tool calls (tools offered, ``tool_choice`` not ``none``)."""
        return self._tools is not None

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
            self._logprobs.end(done.finish_reason == "stop")
        piece = self._piece(segments, final=True)
        self.finish_reason = finish_reason(done, called=bool(self._calls))
        return None if piece.empty else piece

    def _text(self, out: list[str], text: str) -> None:
        """Send ``text``; with tools, whitespace-only text waits to see what follows it."""
        if self._tools is not None and not text.strip():
            self._held += text
            return
        out.append(self._held + text)
        self._held = ""

    def _piece(self, segments: Sequence[ToolSegment], *, final: bool) -> ChatPiece:
        text: list[str] = []
        first = len(self._calls)
        for seg in segments:
            if seg.kind == "text":
                self._text(text, seg.text)
                continue
            assert self._tools is not None
            fmt = self._tools.fmt
            try:
                parsed = parse_tool_call(fmt, seg.text, self._tools.tools)
            except ValueError:
                self._text(text, fmt.start + seg.text + (fmt.end if seg.closed else ""))
                continue
            # NOTE: whitespace before a call (the newline a model writes
            # between calls) is not content: OpenAI's message with only calls
            # has content null, and a streamed one sends no text delta.
            self._held = ""
            for call in parsed:
                self._calls.append(ToolCallBody(
                    id=self._call_id(len(self._calls)),
                    function=FunctionCallBody(name=call.name, arguments=call.arguments)))
        if final:
            # NOTE: whitespace at the end of an answer with calls is dropped
            # too; an answer without calls keeps all its text.
            if not self._calls and self._held:
                text.append(self._held)
            self._held = ""
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


@dataclass(frozen=True, slots=True)
class Echo:
    """``echo: true``: the prompt (its text, or its token ids spelled by ``spell``) comes first."""

    prompt: str | Sequence[int]
    spell: TokenSpeller


@dataclass(frozen=True, slots=True)
class _Row:
    """One reported token of a text completion, in OpenAI's legacy columns."""

    token: str
    logprob: float | None
    top: dict[str, float] | None
    offset: int


def _spelled_text(spell: TokenSpeller, token_ids: Sequence[int]) -> str:
    return b"".join(spell(token_ids)).decode("utf-8", errors="replace")


class CompletionAnswer:
    """One text completion's answer: text and OpenAI's legacy logprobs (``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``).

    With ``echo`` the first chunk starts with the prompt's text (the prompt
    string as sent; a prompt of token ids, spelled); with logprobs too, the
    prompt's tokens come first in every column, scored by the engine
    (``TokenEvent.prompt_logprobs``): the first with ``null``s, each offset
    the character where the token's bytes start in the prompt's spelling;
    and a stop token that ended the generation is reported (its text is
    none), so the entries are exactly the prompt's and the generated tokens.
    ``scores_only`` (``max_tokens: 0``): the one token the engine generates
    is not part of the answer (no text, no logprobs, ``completion_tokens``
    0, ``finish_reason`` ``length``).
    """

    def __init__(self, *, logprobs: LogprobOptions | None = None, echo: Echo | None = None,
                 scores_only: bool = False) -> None:
        self._options = logprobs
        # NOTE: with echo a final stop token is reported too: an evaluation
        # harness drops the last entry as the generated one (lm-eval's
        # local-completions reads token_logprobs[ctxlen:-1]).
        self._logprobs = (_Logprobs(logprobs, keep_stop=echo is not None)
                          if logprobs is not None else None)
        self._echo = echo
        self._scores_only = scores_only
        self._text: list[str] = []
        self._chars = 0
        self._offsets: dict[int, int] = {}
        self._rows: list[_Row] = []
        self.finish_reason: str | None = None

    def feed(self, event: TokenEvent) -> CompletionPiece | None:
        """The chunk this token releases, or ``None`` when it releases no text yet."""
        echoed = self._echo_prompt(event)
        if not self._scores_only:
            self._offsets[event.index] = self._chars
            self._chars += len(event.text)
            self._text.append(event.text)
            if self._logprobs is not None:
                self._logprobs.add(event)
        text = echoed + ("" if self._scores_only else event.text)
        if not text:
            return None
        return CompletionPiece(text=text, logprobs=self._take())

    def finish(self, done: DoneEvent) -> CompletionPiece | None:
        """A last chunk with text or logprobs still unsent, or ``None``."""
        self.finish_reason = "length" if self._scores_only else finish_reason(done)
        # NOTE: a stream that ended before its first token still echoes the prompt.
        echoed = self._echo_prompt(None)
        if self._logprobs is not None:
            self._logprobs.end(done.finish_reason == "stop")
        rest = self._take()
        if not echoed and rest is None:
            return None
        return CompletionPiece(text=echoed, logprobs=rest)

    def generated(self, tokens: int) -> int:
        """Completion tokens to report after ``tokens`` events (none when the prompt is only scored)."""
        return 0 if self._scores_only else tokens

    def usage(self, usage: Usage) -> Usage:
        """The usage to report: no completion tokens when the prompt was only scored."""
        return usage.model_copy(update={"completion_tokens": 0}) if self._scores_only else usage

    def _echo_prompt(self, event: TokenEvent | None) -> str:
        """The prompt's text the first time (its scored rows queued), else ``""``."""
        echo, self._echo = self._echo, None
        if echo is None:
            return ""
        prompt = echo.prompt
        text = prompt if isinstance(prompt, str) else _spelled_text(echo.spell, prompt)
        scores = event.prompt_logprobs if event is not None else None
        if self._options is not None and scores is not None:
            self._rows.extend(self._prompt_rows(scores, self._options, text))
        self._chars += len(text)
        self._text.append(text)
        return text

    @staticmethod
    def _prompt_rows(scores: PromptLogprobs, options: LogprobOptions, text: str) -> list[_Row]:
        top = min(scores.top, options.top)
        ids = list(scores.token_ids)
        distinct = list(dict.fromkeys([*ids, *scores.top_ids]))
        raw = dict(zip(distinct, options.spell(distinct), strict=True))
        # NOTE: offsets index the echoed text; a prompt string the tokenizer
        # put a BOS before spells longer than it: those tokens sit at 0.
        spelled = b"".join(raw[t] for t in ids).decode("utf-8", errors="replace")
        offset = len(text) - len(spelled) if spelled.endswith(text) else 0
        # NOTE: an incremental decoder gives each token the character its
        # first byte starts (a token inside a multi-byte character shares it).
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        rows: list[_Row] = []
        for i, token_id in enumerate(ids):
            chunk = raw[token_id]
            if i == 0:
                rows.append(_Row(_token_text(chunk), None, None, max(offset, 0)))
            else:
                start = (i - 1) * scores.top
                alternatives = {
                    _token_text(raw[t]): _number(v)
                    for t, v in zip(scores.top_ids[start:start + top],
                                    scores.top_logprobs[start:start + top], strict=True)
                } if options.top else None
                rows.append(_Row(_token_text(chunk), _number(scores.logprobs[i - 1]), alternatives,
                                 max(offset, 0)))
            offset += len(decoder.decode(chunk))
        return rows

    def _take(self) -> CompletionLogprobs | None:
        if self._logprobs is None or self._options is None:
            return None
        options = self._options
        events = self._logprobs.take()
        if events:
            ids = [e.token_id for e in events]
            for e in events:
                ids.extend(t for t, _ in e.top_logprobs)
            raw = dict(zip(ids, options.spell(ids), strict=True))
            self._rows.extend(_Row(
                token=_token_text(raw[e.token_id]),
                logprob=_number(e.logprob if e.logprob is not None else float("nan")),
                top={_token_text(raw[t]): _number(lp) for t, lp in e.top_logprobs[:options.top]}
                if options.top else None,
                offset=self._offsets[e.index]) for e in events)
        rows, self._rows = self._rows, []
        if not rows:
            return None
        part = _columns(rows, top=bool(options.top))
        self._all.tokens.extend(part.tokens)
        self._all.token_logprobs.extend(part.token_logprobs)
        if part.top_logprobs is not None and self._all.top_logprobs is not None:
            self._all.top_logprobs.extend(part.top_logprobs)
        self._all.text_offset.extend(part.text_offset)
        return part

    @functools.cached_property
    def _all(self) -> CompletionLogprobs:
        top = self._options is not None and bool(self._options.top)
        return CompletionLogprobs(tokens=[], token_logprobs=[],
                                  top_logprobs=[] if top else None, text_offset=[])

    @property
    def text(self) -> str:
        """The whole text (the echoed prompt first)."""
        return "".join(self._text)

    @property
    def logprobs(self) -> CompletionLogprobs | None:
        """Every reported token's logprobs (``None`` when none were asked)."""
        return self._all if self._logprobs is not None else None


def _columns(rows: Sequence[_Row], *, top: bool) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[r.token for r in rows],
        token_logprobs=[r.logprob for r in rows],
        top_logprobs=[r.top for r in rows] if top else None,
        text_offset=[r.offset for r in rows],
    )
