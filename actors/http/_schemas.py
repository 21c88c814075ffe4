"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests reject unknown fields (OpenAI answers "Unrecognized request
argument" with a 400) and validate strictly: ``"max_tokens": "10"``,
``"max_tokens": true`` or ``"stream": "yes"`` are 400s, as OpenAI answers,
never coerced; ``NaN``/``Infinity`` are refused for every number. Parameters OpenAI defines but kvtier does not
implement are accepted only at their neutral value (``n=1``, ``best_of=1``,
``suffix=null``...), so a client that sends the default works and a client
that relies on the feature gets a clear 400 instead of a silently different
answer.
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

from messages.prompt_cache import CACHE_SALT_MAX_CHARS

from ._json_depth import MAX_JSON_DEPTH, json_too_deep

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceLogprobs",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "Delta",
    "FunctionCall",
    "FunctionCallBody",
    "FunctionDef",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "ModelCard",
    "ModelList",
    "NamedToolChoice",
    "PromptTokensDetails",
    "ResponseMessage",
    "StreamOptions",
    "TextFormat",
    "TextPart",
    "TokenLogprob",
    "ToolCall",
    "ToolCallBody",
    "ToolCallDelta",
    "ToolCallDeltaFunction",
    "ToolDef",
    "TopLogprob",
    "UsageBody",
]

MAX_MESSAGES = 2048
"""Most messages one chat request may carry (more is a 400 before any rendering)."""

MAX_TOOLS = 128
"""Most tools one request may define (OpenAI's own bound)."""

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a chat request may ask for (OpenAI's bound)."""

MAX_COMPLETION_LOGPROBS = 5
"""Most alternatives per token a text completion may ask for (OpenAI's bound)."""

MAX_CHOICES = 128
"""Most choices one request may ask for: ``n`` times the prompts of a completions batch.

NOTE: each choice is a generation of its own (a batch row); the HTTP edge
runs at most ``HttpSettings.choice_window`` of one request's at once, so a
large batch waits for rows instead of filling the admission queue.
"""

_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"

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


class FunctionCall(_Strict):
    """The function an assistant message called: its name and JSON-encoded arguments."""

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _not_too_deep(cls, value: str) -> str:
        # NOTE: parsed later (json.loads, the template's tojson), which recurse.
        if json_too_deep(value):
            raise ValueError(f"the arguments nest deeper than {MAX_JSON_DEPTH} levels")
        return value


class ToolCall(_Strict):
    """One tool call of an earlier assistant message (as the server returned it)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    """One chat message; ``content`` is a string or a list of text parts.

    An ``assistant`` message may carry the ``tool_calls`` it made (then
    ``content`` may be null); a ``tool`` message answers one of them and
    names it in ``tool_call_id``.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    # NOTE: the openai client echoes `refusal: null` when an answer is sent back as history.
    refusal: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: object) -> object:
        # NOTE: named here, before the union's own errors ("Input should be a
        # valid string (and 3 more error(s))"), which do not say why.
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type '{kind}' are not supported: "
                                     "this server serves a text-only model; send text parts")
        return value

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        return self

    def text(self) -> str:
        """The message's text with parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` ends a stream with a usage chunk;
    ``continuous_usage_stats`` (vLLM's field; with ``include_usage``) puts the
    usage so far on every chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # NOTE: vLLM's field: a request reuses cached prefixes only when the salt
    # matches too (docs/operations.md, "Cache isolation").
    cache_salt: Annotated[str, Field(min_length=1, max_length=CACHE_SALT_MAX_CHARS)] | None = None
    # NOTE: vLLM's field (load generators send it): generate max_tokens tokens, past EOS.
    ignore_eos: bool = False

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

    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (as vLLM: needs ``include_usage``)."""
        return self.include_usage() and bool(
            self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        """The completion-length bound the client asked for, if any."""
        return self.max_tokens


class TextFormat(_Strict):
    """``response_format`` ``{"type": "text"}``: free text (the default)."""

    type: Literal["text"]


class JsonObjectFormat(_Strict):
    """``response_format`` ``{"type": "json_object"}``: the answer is one JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    """The schema an answer must follow (``response_format.json_schema``)."""

    name: Annotated[str, Field(pattern=_FUNCTION_NAME)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    """``response_format`` ``{"type": "json_schema", ...}``: a JSON document valid under the schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class FunctionDef(_Strict):
    """A function the model may call: name, description, JSON schema of its arguments."""

    name: Annotated[str, Field(pattern=_FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    """One entry of ``tools`` (functions are the only kind of tool)."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    """The function ``tool_choice`` names."""

    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` ``{"type": "function", "function": {"name": ...}}``: call exactly this one."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and not any(
                t.function.name == choice.function.name for t in self.tools or ()):
            raise ValueError(f"tool_choice names '{choice.function.name}', which is not in tools")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @field_validator("messages", mode="before")
    @classmethod
    def _count_first(cls, v: Any) -> Any:
        # NOTE: before the items are validated: refusing 100,000 messages must
        # not cost building 100,000 models first (pydantic checks max_length
        # after the items).
        if isinstance(v, list) and len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages are allowed, got {len(v)}")
        return v

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (a string or a list of token ids) or a batch of them.

    A batch (a list of strings, or a list of token-id lists) answers with
    ``n`` choices per prompt, choice ``i * n + j`` being prompt ``i``'s
    ``j``-th, as OpenAI's API numbers them.

    ``echo: true`` puts the prompt before the completion; with ``logprobs``
    the prompt's tokens are scored too (the first one has no logprob, as
    OpenAI reported it), and ``max_tokens: 0`` scores without generating
    (what evaluation harnesses send for log-likelihoods).
    """

    prompt: str | _TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] \
        | Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: Literal[1] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: None = None

    @model_validator(mode="after")
    def _non_empty(self) -> CompletionRequest:
        if any(isinstance(p, str) and not p for p in self.prompt_values()):
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 only scores the prompt, which needs echo: true")
        return self

    @property
    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt is scored, nothing is generated."""
        return self.echo and self.max_tokens == 0

    def prompt_values(self) -> list[str | list[int]]:
        """The prompts in order: one, or the batch's (a list of ints is one prompt of token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [[int(t) for t in p if isinstance(t, int)]]
        return [q if isinstance(q, str) else list(q) for q in p if isinstance(q, (str, list))]


# ----------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """How many prompt tokens were served from a cache instead of prefilled."""

    cached_tokens: int = 0


class UsageBody(BaseModel):
    """Token accounting of one response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None
    """``None`` on the running usage of a chunk before the last (cached tokens are known at the end)."""


class TopLogprob(BaseModel):
    """One of the most likely tokens at a step: its text, log-probability and bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(BaseModel):
    """A generated token's log-probability, with the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """``choices[].logprobs`` of a chat answer (or of one streamed chunk)."""

    content: list[TokenLogprob] | None
    refusal: None = None


class FunctionCallBody(BaseModel):
    """The function a tool call invokes, with its arguments as a JSON text."""

    name: str
    arguments: str


class ToolCallBody(BaseModel):
    """One tool call of the answer."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ResponseMessage(BaseModel):
    """The assistant's message in a non-streamed chat response (``tool_calls`` only when it made some)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallBody] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    """One non-streamed chat choice."""

    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    """Non-streamed chat response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    system_fingerprint: str | None = None


class ToolCallDeltaFunction(BaseModel):
    """The function part of a streamed tool call."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """One streamed tool call (kvtier sends each call whole, in one chunk)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction | None = None


class Delta(BaseModel):
    """The increment a streamed chat chunk carries (absent fields are omitted, like OpenAI's)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None}


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat response."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageBody | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    """``choices[].logprobs`` of a text completion (OpenAI's legacy shape).

    With ``echo`` the prompt's tokens come first; the very first has
    ``null`` for its logprob and its alternatives (nothing precedes it).
    """

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One choice of a (streamed or not) text completion."""

    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


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
