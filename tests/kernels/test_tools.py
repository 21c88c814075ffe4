"""Tool calls found in streamed text by mlx-lm's markers and parsers."""

from __future__ import annotations

from typing import Any

import pytest

from kernels.engine import (
    ToolCallSplitter,
    ToolFormat,
    ToolSegment,
    parse_tool_call,
    tool_format,
)
from tests.tiny_models import tiny_tokenizer
from tests.tool_models import tool_tokenizer


@pytest.fixture(scope="module")
def fmt() -> ToolFormat:
    """The json_tools format of the tiny tool tokenizer."""
    found = tool_format(tool_tokenizer())
    assert found is not None
    return found


def _split(fmt: ToolFormat, pieces: list[str]) -> list[ToolSegment]:
    splitter = ToolCallSplitter(fmt)
    out: list[ToolSegment] = []
    for piece in pieces:
        out += splitter.feed(piece)
    return out + splitter.finish()


def _joined(segments: list[ToolSegment]) -> list[tuple[str, str, bool]]:
    """Adjacent text segments merged (how many pieces text arrives in is not the point)."""
    out: list[tuple[str, str, bool]] = []
    for s in segments:
        if out and s.kind == "text" and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + s.text, True)
        else:
            out.append((s.kind, s.text, s.closed))
    return out


def test_format_comes_from_mlx_lms_tokenizer_wrapper(fmt: ToolFormat) -> None:
    """A Hermes-style tokenizer reports mlx-lm's json_tools markers; a plain one reports none."""
    assert (fmt.start, fmt.end, fmt.json_in_tags) == ("<tool_call>", "</tool_call>", True)
    assert tool_format(tiny_tokenizer()) is None


def test_markers_split_across_tokens_are_found(fmt: ToolFormat) -> None:
    """Markers cut into several tokens still delimit the call; the text around it stays text."""
    pieces = ["Sure", ". <to", "ol_c", "all>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool", "_call>", " done"]
    assert _joined(_split(fmt, pieces)) == [
        ("text", "Sure. ", True),
        ("call", '\n{"name": "f", "arguments": {}}\n', True),
        ("text", " done", True),
    ]


def test_text_that_may_start_a_marker_is_held_back(fmt: ToolFormat) -> None:
    """'<to' could begin a call, so it is not released until the next text decides."""
    splitter = ToolCallSplitter(fmt)
    assert splitter.feed("a <to") == [ToolSegment("text", "a ")]
    assert splitter.feed("y") == [ToolSegment("text", "<toy")]


def test_a_call_cut_by_the_end_is_unclosed(fmt: ToolFormat) -> None:
    """A generation that ends inside a call returns its text as an unclosed call."""
    segments = _split(fmt, ["<tool_call>\n{\"name\": \"f\", \"argu"])
    assert _joined(segments) == [("call", '\n{"name": "f", "argu', False)]


def test_two_calls_in_a_row(fmt: ToolFormat) -> None:
    """Consecutive calls come out as two call segments."""
    one = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
    two = '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    kinds = [s.kind for s in _split(fmt, [one, "\n", two]) if s.kind == "call" or s.text.strip()]
    assert kinds == ["call", "call"]


def test_parser_output_becomes_name_and_json_arguments(fmt: ToolFormat) -> None:
    """The model's parser reads the call; arguments come back as a JSON text."""
    [call] = parse_tool_call(fmt, '\n{"name": "get", "arguments": {"city": "Zürich"}}\n', None)
    assert call.name == "get"
    assert call.arguments == '{"city": "Zürich"}'


@pytest.mark.parametrize("text", ['{"name": "f", "argu', '["not", "a", "call"]', '{"arguments": {}}'])
def test_text_that_is_no_call_is_refused(fmt: ToolFormat, text: str) -> None:
    """A truncated call, or JSON without a function name, is not a call."""
    with pytest.raises(ValueError):
        parse_tool_call(fmt, text, None)


def test_other_formats_are_found_but_not_forced() -> None:
    """A format other than JSON-in-tags (Mistral's, no end marker) is read but cannot be forced."""
    from mlx_lm.tool_parsers import mistral

    class _Tok:
        has_tool_calling = True
        tool_call_start = mistral.tool_call_start
        tool_call_end = mistral.tool_call_end
        tool_parser = staticmethod(mistral.parse_tool_call)

    found: Any = tool_format(_Tok())
    assert found is not None
    assert not found.json_in_tags
    segments = _split(found, ["Hi [TOOL_", "CALLS]get[ARGS]{\"a\": 1}"])
    assert segments[-1].kind == "call"
    assert segments[-1].closed is False
