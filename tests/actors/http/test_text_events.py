"""The template encoding of a chat or text-completion answer's text chunks equals the model's own SSE event byte for byte."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from actors.http._answer import ChatPiece, CompletionPiece
from actors.http._convert import chat_chunk, completion_chunk
from actors.http._sse import TextEvents, sse_json

# NOTE: texts a detokenizer emits: any Unicode (control characters, quotes,
# backslashes, U+2028, astral planes) except lone surrogates, which no
# decoded byte string holds.
_TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)
_NAME = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=30)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT, rid=_NAME, model=_NAME, created=st.integers(0, 2**40))
def test_template_event_equals_the_model_event(text: str, rid: str, model: str, created: int) -> None:
    """For any text, request id, model name and time, TextEvents gives the bytes sse_json gives
    for the same chunk built as a pydantic model."""
    def build(t: str) -> BaseModel:
        return chat_chunk(rid, created, model, piece=ChatPiece(content=t))

    events = TextEvents.of(build)
    assert events is not None
    assert events.event(text) == sse_json(build(text))


@settings(max_examples=300, deadline=None)
@given(text=_TEXT, rid=_NAME, model=_NAME, created=st.integers(0, 2**40))
def test_completion_template_event_equals_the_model_event(
    text: str, rid: str, model: str, created: int
) -> None:
    """The same for a text completion's chunk (/v1/completions): TextEvents gives sse_json's bytes."""
    def build(t: str) -> BaseModel:
        return completion_chunk(rid, created, model, piece=CompletionPiece(text=t))

    events = TextEvents.of(build)
    assert events is not None
    assert events.event(text) == sse_json(build(text))


def test_no_template_when_the_marker_is_not_there_once() -> None:
    """A chunk whose other fields hold the marker (or that drops the text) gives no template,
    so the caller keeps the model path."""
    twice = TextEvents.of(lambda t: chat_chunk(t, 1, "m", piece=ChatPiece(content=t)))
    dropped = TextEvents.of(lambda t: chat_chunk("id", 1, "m", piece=ChatPiece(content="")))
    assert twice is None
    assert dropped is None
