"""The SSE events of one choice of a streamed answer, its usage tail and its error event.

A streamed response is these events in order: the choice's (for several
choices, interleaved, each chunk with its index), then the usage tail when
asked for, then ``[DONE]``; or, where the engine fails after the headers
went out, an error event last (``_app.py`` assembles them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from actors.errors import KvtierError
from messages.gateway import TokenEvent, Usage

from ._answer import ChatAnswer, ChatPiece, CompletionAnswer, CompletionPiece
from ._convert import chat_chunk, completion_chunk, running_usage, usage_body
from ._errors import error_body, kvtier_error_to_api
from ._port import StreamPort
from ._schemas import UsageBody
from ._sse import TextEvents, sse_json

__all__ = ["choice_events", "error_event", "usage_tail"]

_Answer = ChatAnswer | CompletionAnswer


def _chunk(rid: str, ts: int, model: str, answer: _Answer,
           piece: ChatPiece | CompletionPiece, running: UsageBody | None,
           index: int) -> bytes:
    """One piece of choice ``index`` as an SSE event (chat or text completion)."""
    if isinstance(answer, ChatAnswer):
        assert isinstance(piece, ChatPiece)
        return sse_json(chat_chunk(rid, ts, model, piece=piece,
                                   logprobs=answer.reports_logprobs, running=running,
                                   index=index))
    assert isinstance(piece, CompletionPiece)
    return sse_json(completion_chunk(rid, ts, model, piece=piece, running=running,
                                     index=index))


def usage_tail(rid: str, ts: int, model: str, answer: _Answer, usage: Usage) -> bytes:
    """The chunk of ``stream_options.include_usage``: no choice, the whole usage."""
    return sse_json(chat_chunk(rid, ts, model, usage=usage) if isinstance(answer, ChatAnswer)
                    else completion_chunk(rid, ts, model, usage=usage))


async def choice_events(stream: StreamPort, rid: str, ts: int, model: str,
                         answer: _Answer, continuous: bool, index: int,
                         ended: list[Usage]) -> AsyncIterator[bytes]:
    """The SSE events of one choice: the opener (chat), its pieces, its finish chunk.

    ``continuous`` (``continuous_usage_stats``, as vLLM): every chunk with
    a choice carries the usage so far; the finish chunk carries the final
    usage (cached tokens included), as the usage tail does. The choice's
    final usage is appended to ``ended``. An engine failure propagates
    (``KvtierError``): the caller ends the response with an error event.
    """
    tokens = 0
    # NOTE: an answer's text-only chunks (no logprobs, calls or running
    # usage: the usual token) are encoded from one template, the same bytes.
    text_events: TextEvents | None = None
    if not continuous and isinstance(answer, ChatAnswer) and not answer.reports_logprobs:
        text_events = TextEvents.of(
            lambda t: chat_chunk(rid, ts, model, piece=ChatPiece(content=t), index=index))
    elif not continuous and isinstance(answer, CompletionAnswer):
        text_events = TextEvents.of(
            lambda t: completion_chunk(rid, ts, model, piece=CompletionPiece(text=t),
                                       index=index))

    def running() -> UsageBody | None:
        if not continuous:
            return None
        done = answer.generated(tokens) if isinstance(answer, CompletionAnswer) else tokens
        return running_usage(stream.prompt_tokens, done)

    if isinstance(answer, ChatAnswer):
        # NOTE: whenever calls may come, the opener carries no content: it
        # goes out before the answer is known, and an answer of calls
        # only must add up to content null (text later adds to it).
        yield sse_json(chat_chunk(rid, ts, model, role=True, calls_only=answer.may_call,
                                  running=running(), index=index))
    async for event in stream:
        if isinstance(event, TokenEvent):
            tokens += 1
            # NOTE: a token may release nothing yet (part of a character,
            # text that may start a tool-call marker).
            piece = answer.feed(event)
            if piece is None:
                continue
            if (text_events is not None and isinstance(piece, ChatPiece) and piece.content
                    and not piece.tool_calls):
                yield text_events.event(piece.content)
            elif (text_events is not None and isinstance(piece, CompletionPiece)
                  and piece.text and piece.logprobs is None):
                yield text_events.event(piece.text)
            else:
                yield _chunk(rid, ts, model, answer, piece, running(), index)
            continue
        last = answer.finish(event)
        if last is not None:
            yield _chunk(rid, ts, model, answer, last, running(), index)
        usage = event.usage if isinstance(answer, ChatAnswer) else answer.usage(event.usage)
        whole = usage_body(usage) if continuous else None
        final = (chat_chunk(rid, ts, model, finish=answer.finish_reason, running=whole,
                            index=index)
                 if isinstance(answer, ChatAnswer)
                 else completion_chunk(rid, ts, model, finish=answer.finish_reason,
                                       running=whole, index=index))
        yield sse_json(final)
        ended.append(usage)


def error_event(exc: KvtierError, rid: str) -> bytes:
    """The error event that ends a stream whose headers are gone.

    NOTE: the only way left to tell the client (the openai client raises
    APIError on it).
    """
    err = kvtier_error_to_api(exc, rid)
    return sse_json(error_body(err.message, err.type, err.code, err.param))
