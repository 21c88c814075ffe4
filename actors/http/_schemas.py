"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests reject unknown fields (OpenAI answers "Unrecognized request
argument" with a 400) and validate strictly: ``"max_tokens": "10"``,
``"max_tokens": true`` or ``"stream": "yes"`` are 400s, as OpenAI answers,
never coerced; ``NaN``/``Infinity`` are refused for every number. Parameters OpenAI defines but kvtier does not
implement are accepted only at their neutral value (``n=1``,
``logprobs=false``, penalties ``0``...), so a client that sends the default
works and a client that relies on the feature gets a clear 400 instead of a
silently different answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "Delta",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "ResponseMessage",
    "StreamOptions",
    "TextPart",
    "UsageBody",
]

MAX_MESSAGES = 2048
"""Most messages one chat request may carry (more is a 400 before any rendering)."""

_STOP_MAX = 16
_STOP_LEN_MAX = 256


class _Strict(BaseModel):
    # NOTE: strict: JSON types must match (an int field takes no string or
    # bool); a float field still takes a JSON integer, as OpenAI's does.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    """A text content part (the only part type a text model can take)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message; ``content`` is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text with parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    """``stream_options``: only ``include_usage`` is meaningful here."""

    include_usage: bool = False


_Prob = Annotated[float, Field(ge=0.0, le=1.0)]


class _SamplingFields(_Strict):
    """Fields shared by both generation endpoints."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # NOTE: top_k / min_p / repetition_penalty are mlx-lm extensions (vLLM spells them alike).
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: _Prob | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > _STOP_MAX:
            raise ValueError(f"at most {_STOP_MAX} stop sequences are allowed")
        if any(not s or len(s) > _STOP_LEN_MAX for s in stops):
            raise ValueError(f"stop sequences must be 1..{_STOP_LEN_MAX} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return v

    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        """The completion-length bound the client asked for, if any."""
        return self.max_tokens


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None
    response_format: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _count_first(cls, v: Any) -> Any:
        # NOTE: before the items are validated: refusing 100,000 messages must
        # not cost building 100,000 models first (pydantic checks max_length
        # after the items).
        if isinstance(v, list) and len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages are allowed, got {len(v)}")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` (one prompt: a string or a list of token ids)."""

    prompt: str | _TokenIds | Annotated[list[str], Field(min_length=1, max_length=1)] \
        | Annotated[list[_TokenIds], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    logprobs: None = None
    suffix: None = None

    @model_validator(mode="after")
    def _non_empty(self) -> CompletionRequest:
        if isinstance(self.prompt, str) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompt_value(self) -> str | list[int]:
        """The single prompt, unwrapped from the one-element batch forms."""
        p = self.prompt
        if isinstance(p, str):
            return p
        first = p[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return list(first)
        return [int(t) for t in p if isinstance(t, int)]


# ----------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """How many prompt tokens were served from a cache instead of prefilled."""

    cached_tokens: int = 0


class UsageBody(BaseModel):
    """Token accounting of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ResponseMessage(BaseModel):
    """The assistant's message in a non-streamed chat response."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One non-streamed chat choice."""

    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    """Non-streamed chat response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    system_fingerprint: str | None = None


class Delta(BaseModel):
    """The increment a streamed chat chunk carries (absent fields are omitted, like OpenAI's)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="plain")
    def _omit_absent(self) -> dict[str, str]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat response."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageBody | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    """One choice of a (streamed or not) text completion."""

    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Text completion (also the shape of each streamed chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageBody | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvtier"


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
