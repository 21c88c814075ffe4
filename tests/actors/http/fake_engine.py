"""A scripted engine for unit tests of the HTTP edge (the subject is HTTP, not the model).

Each request replays a script: token texts, then a finish reason, or an
admission error raised from ``start()``, or a failure after N tokens.
``gate`` (an anyio Event) can hold a stream between tokens so tests control
timing; every stream records whether it was closed and whether it ran to the end.

Token ids are ``101, 102, ...`` in script order; ``token_bytes`` spells an
id as its script text (``FAKE_EOS`` as ``<eos>``). ``logprobs`` scripts each
token's logprob, ``top`` its alternatives. The model writes tool calls in
mlx-lm's ``json_tools`` format (``<tool_call>{...}</tool_call>``) unless
``tool_format`` is set to ``None``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.lowlevel

from actors.errors import GenerationFailed, KvtierError, ServerShuttingDown
from kernels.engine import ToolFormat, tool_format
from messages.gateway import DoneEvent, GenerationEvent, GenerationParams, TokenEvent, Usage

FAKE_EOS = 2
"""The fake model's end-of-sequence id (a script ends with it when ``eos=True``)."""


def json_tools_format() -> ToolFormat:
    """mlx-lm's ``json_tools`` format, as a Hermes-style tokenizer reports it."""

    class _Tokenizer:
        from mlx_lm.tool_parsers import json_tools as _mod

        has_tool_calling = True
        tool_call_start = _mod.tool_call_start
        tool_call_end = _mod.tool_call_end
        tool_parser = staticmethod(_mod.parse_tool_call)

    fmt = tool_format(_Tokenizer())
    assert fmt is not None
    return fmt


@dataclass
class Script:
    """What the next request does."""

    tokens: Sequence[str] = ("Hel", "lo", "!")
    finish_reason: str = "stop"
    prompt_tokens: int = 7
    cached_tokens: int = 3
    admission_error: KvtierError | None = None
    fail_after: int | None = None
    gate: anyio.Event | None = None
    admitted: anyio.Event | None = None
    logprobs: Sequence[float] | None = None
    top: Sequence[Sequence[tuple[int, float]]] | None = None
    eos: bool = False
    readmitted_at: float | None = None
    """What the stream reports as its take-back's second admission (``None``: none)."""
    render_span: tuple[float, float, float] | None = None
    """What the stream reports as its render's ask, start and end (``None``: no render)."""


@dataclass
class Call:
    """One request the fake saw."""

    kind: str
    payload: Any
    params: GenerationParams | None
    request_id: str | None
    tools: Any = None
    closed: bool = False
    finished: bool = False
    events: int = 0


class FakeStream:
    """Plays one ``Script`` through the ``GenerationStream`` surface."""

    def __init__(self, engine: FakeEngine, script: Script, call: Call) -> None:
        self._engine = engine
        self._script = script
        self._call = call
        self._started = False
        self._i = 0
        self._done = False

    async def start(self) -> None:
        if self._started:
            return
        if self._engine.shutting_down:
            raise ServerShuttingDown()
        if self._script.admission_error is not None:
            raise self._script.admission_error
        self._started = True
        self._engine.active += 1
        if self._script.admitted is not None:
            self._script.admitted.set()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerationEvent:
        await self.start()
        if self._done:
            raise StopAsyncIteration
        s = self._script
        if s.fail_after is not None and self._i >= s.fail_after:
            raise GenerationFailed("scripted engine failure")
        if s.gate is not None:
            await s.gate.wait()
        await anyio.lowlevel.checkpoint()
        self._call.events += 1
        if self._i < len(s.tokens) + s.eos:
            i = self._i
            self._i += 1
            eos = i == len(s.tokens)
            return TokenEvent(
                request_id=self._call.request_id or "", index=i,
                token_id=FAKE_EOS if eos else 101 + i, text="" if eos else s.tokens[i],
                logprob=s.logprobs[i] if s.logprobs is not None else None,
                top_logprobs=tuple(s.top[i]) if s.top is not None else ())
        self._done = True
        self._call.finished = True
        return DoneEvent(
            request_id=self._call.request_id or "",
            finish_reason=s.finish_reason,  # type: ignore[arg-type]
            usage=Usage(prompt_tokens=s.prompt_tokens, completion_tokens=len(s.tokens) + s.eos,
                        cached_tokens=s.cached_tokens),
        )

    async def aclose(self) -> None:
        if not self._call.closed and self._started:
            self._engine.active -= 1
        self._call.closed = True

    @property
    def prompt_tokens(self) -> int:
        return self._script.prompt_tokens

    @property
    def readmitted_at(self) -> float | None:
        return self._script.readmitted_at

    @property
    def render_span(self) -> tuple[float, float, float] | None:
        return self._script.render_span


class FakeTokenBytes:
    """Spells the fake model's ids: ``101 + i`` as the i-th text of the scripts seen so far."""

    eos_token_ids = frozenset({FAKE_EOS})

    def __init__(self) -> None:
        self.texts: dict[int, bytes] = {FAKE_EOS: b"<eos>"}

    def learn(self, script: Script) -> None:
        for i, text in enumerate(script.tokens):
            self.texts.setdefault(101 + i, text.encode())

    def __call__(self, token_ids: Iterable[int]) -> list[bytes]:
        return [self.texts.get(t, f"<{t}>".encode()) for t in token_ids]


@dataclass
class FakeEngine:
    """Scripted ``EnginePort``: pops one ``Script`` per request (the default when empty)."""

    model_id: str = "fake-model"
    vocab_size: int | None = 1000
    scripts: list[Script] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    shutting_down: bool = False
    active: int = 0
    fit_context: list[bool] = field(default_factory=list)
    shared_prompt: list[bool] = field(default_factory=list)
    tool_format: ToolFormat | None = field(default_factory=json_tools_format)
    token_bytes: FakeTokenBytes = field(default_factory=FakeTokenBytes)

    def _next(self, kind: str, payload: Any, params: GenerationParams | None,
              request_id: str | None, tools: Any = None) -> FakeStream:
        script = self.scripts.pop(0) if self.scripts else Script()
        self.token_bytes.learn(script)
        call = Call(kind, payload, params, request_id, tools)
        self.calls.append(call)
        return FakeStream(self, script, call)

    def chat(self, messages: Sequence[Mapping[str, Any]], params: GenerationParams | None = None,
             *, request_id: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
             fit_context: bool = False) -> FakeStream:
        self.fit_context.append(fit_context)
        return self._next("chat", [dict(m) for m in messages], params, request_id, tools)

    def generate(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                 *, request_id: str | None = None, fit_context: bool = False,
                 shared_prompt: bool = False) -> FakeStream:
        self.fit_context.append(fit_context)
        self.shared_prompt.append(shared_prompt)
        return self._next("generate", prompt, params, request_id)

    async def stats(self) -> dict[str, Any]:
        return {"gateway": {"active": self.active}, "token": {"grants": 0}}

    def begin_shutdown(self) -> None:
        self.shutting_down = True
