"""Tool calls in generated text, through mlx-lm's tool-call formats and parsers.

mlx-lm's tokenizer loader recognises a model's tool-call format from its
chat template (or vocabulary) and exposes it on the ``TokenizerWrapper``:
``has_tool_calling``, ``tool_call_start`` / ``tool_call_end`` (the markers
around each call) and ``tool_parser`` (text between the markers → a call).
:func:`tool_format` reads that; :class:`ToolCallSplitter` separates a
stream of generated text into plain text and call texts, with mlx-lm's
``TextStateMachine`` (matched on text, so markers split across tokens are
found, and text that may start a marker is held back); :func:`parse_tool_call`
runs the model's parser. Tokenizer-level work only: no MLX, any thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mlx_lm.generate import TextStateMachine

__all__ = [
    "ParsedToolCall",
    "ToolCallSplitter",
    "ToolFormat",
    "ToolSegment",
    "parse_tool_call",
    "tool_format",
]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one model writes tool calls (from mlx-lm's tokenizer wrapper).

    ``json_in_tags``: calls are ``start`` + a JSON object ``{"name",
    "arguments"}`` + ``end`` (mlx-lm's ``json_tools`` parser: Hermes, Qwen
    2.5, SmolLM3 ...): the format kvtier can also force with a grammar
    (``tool_choice`` ``required`` or a named function).
    """

    start: str
    end: str
    parser: Callable[[str, Any], Any]
    json_in_tags: bool


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The model's tool-call format, or ``None`` when mlx-lm knows none for it."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    start = getattr(tokenizer, "tool_call_start", None)
    parser = getattr(tokenizer, "tool_parser", None)
    if not isinstance(start, str) or not start or parser is None:
        return None
    end = getattr(tokenizer, "tool_call_end", None) or ""
    from mlx_lm.tool_parsers import json_tools

    json_in_tags = (parser is json_tools.parse_tool_call and start == json_tools.tool_call_start
                    and end == json_tools.tool_call_end)
    return ToolFormat(start=start, end=str(end), parser=parser, json_in_tags=json_in_tags)


@dataclass(frozen=True, slots=True)
class ToolSegment:
    """A piece of generated text: answer text, or one call's text (markers removed).

    ``closed`` is False for a call the generation ended inside (no end marker).
    """

    kind: Literal["text", "call"]
    text: str
    closed: bool = True


class ToolCallSplitter:
    """Splits streamed text into answer text and tool-call texts.

    Feed each token's text to :meth:`feed`; it returns the segments that are
    settled (text that may still begin a marker is held back). At the end,
    :meth:`finish` returns what is left: held-back text, and an unfinished
    call (its text after the start marker, as a ``call`` segment, which may
    not parse).
    """

    def __init__(self, fmt: ToolFormat) -> None:
        transitions: dict[str, list[tuple[str, str]]] = {"normal": [(fmt.start, "tool")]}
        # NOTE: a format without an end marker (Mistral's) calls until the text ends.
        transitions["tool"] = [(fmt.end, "normal")] if fmt.end else []
        self._machine = TextStateMachine(transitions)  # type: ignore[no-untyped-call]
        self._state = self._machine.make_state("normal")  # type: ignore[no-untyped-call]
        self._call: list[str] = []
        self._in_call = False

    def feed(self, text: str) -> list[ToolSegment]:
        """The segments ``text`` settles, in order."""
        if not text:
            return []
        self._state, parts = TextStateMachine.split(self._state, text)  # type: ignore[no-untyped-call]
        return self._segments(parts)

    def finish(self) -> list[ToolSegment]:
        """The segments left at the end of the generation."""
        self._state, rest, state = TextStateMachine.flush(self._state)  # type: ignore[no-untyped-call]
        out = self._segments([(state, rest)])
        if self._in_call:
            out.append(ToolSegment("call", "".join(self._call), closed=False))
            self._call = []
            self._in_call = False
        return out

    def _segments(self, parts: Sequence[tuple[str | None, str]]) -> list[ToolSegment]:
        out: list[ToolSegment] = []
        for state, text in parts:
            if state == "tool":
                self._in_call = True
                self._call.append(text)
                continue
            if self._in_call:
                # NOTE: leaving the tool state means its end marker was matched.
                out.append(ToolSegment("call", "".join(self._call)))
                self._call = []
                self._in_call = False
            if text:
                out.append(ToolSegment("text", text))
        return out


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str


def parse_tool_call(
    fmt: ToolFormat, text: str, tools: Sequence[Mapping[str, Any]] | None
) -> list[ParsedToolCall]:
    """The calls in one call text, by the model's own parser.

    Raises ``ValueError`` when the text is not a call (a truncated call, or
    text the parser does not read), or, when ``tools`` is given, when a call
    names a function that is not among them (OpenAI never returns a call to
    an undeclared tool; the caller keeps such text as content).
    """
    try:
        parsed = fmt.parser(text, list(tools) if tools is not None else None)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a tool call ({type(exc).__name__}: {exc})") from None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls: list[ParsedToolCall] = []
    for item in items:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise ValueError("not a tool call (no function name)")
        args = item.get("arguments", {})
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                raise ValueError("not a tool call (arguments are not JSON)") from None
            text_args = args
        else:
            try:
                text_args = json.dumps(args, ensure_ascii=False)
            except (TypeError, ValueError):
                raise ValueError("not a tool call (arguments are not JSON)") from None
        calls.append(ParsedToolCall(name=item["name"], arguments=text_args))
    if tools is not None:
        declared = {_declared_name(t) for t in tools}
        unknown = [c.name for c in calls if c.name not in declared]
        if unknown:
            raise ValueError(f"not a tool call (undeclared function {unknown[0]!r})")
    return calls


def _declared_name(tool: Mapping[str, Any]) -> str | None:
    """The function name of an OpenAI ``tools`` entry (``{"type": "function", "function": {...}}``)."""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
    return name if isinstance(name, str) else None
