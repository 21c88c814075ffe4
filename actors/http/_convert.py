"""Sans-IO translation between OpenAI request/response bodies and engine types.

Pure functions: request body + settings → ``GenerationParams`` (or an
``ApiError``), engine events → response bodies and SSE payloads. No I/O, no
clock, no ids: callers pass them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from actors.engine.config import EngineConfig
from messages.gateway import DoneEvent, GenerationParams, Usage

from ._errors import ApiError
from ._schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    PromptTokensDetails,
    ResponseMessage,
    UsageBody,
    _SamplingFields,
)

__all__ = [
    "Defaults",
    "chat_chunk",
    "chat_messages",
    "chat_response",
    "check_against_vocab",
    "completion_chunk",
    "completion_response",
    "resolve_model",
    "to_params",
    "usage_body",
]


_CONFIG = EngineConfig()


@dataclass(frozen=True, slots=True)
class Defaults:
    """Server-side defaults and bounds applied to every request.

    The values (and their bounds) are ``EngineConfig``'s sampling fields:
    :meth:`from_config` is how ``kvtier serve`` builds them; the field
    defaults are ``EngineConfig()``'s, so they cannot drift apart.
    """

    max_tokens: int = _CONFIG.max_tokens
    max_tokens_limit: int = _CONFIG.max_tokens_limit
    temperature: float = _CONFIG.temperature
    top_p: float = _CONFIG.top_p
    top_k: int = _CONFIG.top_k
    min_p: float = _CONFIG.min_p

    def __post_init__(self) -> None:
        # NOTE: the same validation as the flags (bounds, finiteness): a
        # ConfigError (a ValueError) naming the option.
        EngineConfig.build({f: getattr(self, f) for f in self.__dataclass_fields__})

    @classmethod
    def from_config(cls, config: EngineConfig) -> Defaults:
        """The request defaults of ``config``."""
        return cls(
            max_tokens=config.max_tokens,
            max_tokens_limit=config.max_tokens_limit,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p,
        )


def resolve_model(requested: str | None, served: str, aliases: Sequence[str]) -> str:
    """The served model id if ``requested`` names it (or is absent), else a 404 ``ApiError``."""
    if requested is None or requested == served or requested in aliases:
        return served
    raise ApiError(
        404,
        f"The model '{requested}' does not exist; this server serves '{served}'.",
        code="model_not_found",
        param="model",
    )


def to_params(body: _SamplingFields, defaults: Defaults) -> GenerationParams:
    """Sampling parameters for the engine; bounds violations become a 400 ``ApiError``."""
    max_tokens = body.requested_max_tokens()
    param = "max_completion_tokens" if (
        isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
    ) else "max_tokens"
    if max_tokens is None:
        max_tokens = defaults.max_tokens
    elif max_tokens > defaults.max_tokens_limit:
        raise ApiError(
            400,
            f"{param} is too large: {max_tokens}. This server allows at most "
            f"{defaults.max_tokens_limit} completion tokens.",
            code="invalid_value",
            param=param,
        )
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": defaults.temperature if body.temperature is None else body.temperature,
        "top_p": defaults.top_p if body.top_p is None else body.top_p,
        "top_k": defaults.top_k if body.top_k is None else body.top_k,
        "min_p": defaults.min_p if body.min_p is None else body.min_p,
        "repetition_penalty": body.repetition_penalty,
        # NOTE: 0 is OpenAI's "off"; None keeps the processor out of the loop entirely.
        "presence_penalty": body.presence_penalty or None,
        "frequency_penalty": body.frequency_penalty or None,
        "logit_bias": (
            {int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None
        ),
        "stop": tuple(body.stop_list()),
        "seed": body.seed,
    }
    try:
        return GenerationParams(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"Invalid value for '{loc}': {first.get('msg')}",
                       code="invalid_value", param=loc or None) from None


def check_against_vocab(body: _SamplingFields, params: GenerationParams,
                        vocab: int | None) -> None:
    """Refuse (400 naming the field) token ids and ``top_k`` the model's vocabulary cannot take.

    NOTE: the engine checks the same before admission (embedders call it
    directly); here the error can name the request field.
    """
    if vocab is None:
        return
    if params.top_k > vocab:
        raise ApiError(400, f"top_k is {params.top_k}, larger than the model's vocabulary "
                            f"({vocab} tokens).", code="invalid_value", param="top_k")
    bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"logit_bias names token id {bad}, outside the model's vocabulary "
                            f"(0..{vocab - 1}).", code="invalid_value", param="logit_bias")
    if isinstance(body, CompletionRequest):
        prompt = body.prompt_value()
        if not isinstance(prompt, str):
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt holds token id {bad}, outside the model's "
                                    f"vocabulary (0..{vocab - 1}).",
                               code="invalid_value", param="prompt")


_ROLE_FOR_TEMPLATE = {"developer": "system"}


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the engine's chat template takes them (text only).

    NOTE: "developer" is OpenAI's newer name for "system"; chat templates of
    open models only know "system".
    """
    return [
        {"role": _ROLE_FOR_TEMPLATE.get(m.role, m.role), "content": m.text()}
        for m in body.messages
    ]


def usage_body(usage: Usage) -> UsageBody:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens``."""
    return UsageBody(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def _finish(done: DoneEvent) -> str:
    # NOTE: "cancelled" only happens when the client left; nobody reads it, but
    # OpenAI clients know just "stop"/"length", so never expose it.
    return "stop" if done.finish_reason == "cancelled" else done.finish_reason


def chat_response(rid: str, created: int, model: str, text: str, done: DoneEvent) -> ChatCompletion:
    """The non-streamed chat completion body."""
    return ChatCompletion(
        id=rid, created=created, model=model,
        choices=[ChatChoice(message=ResponseMessage(content=text), finish_reason=_finish(done))],
        usage=usage_body(done.usage),
    )


def completion_response(rid: str, created: int, model: str, text: str,
                        done: DoneEvent) -> CompletionResponse:
    """The non-streamed text completion body."""
    return CompletionResponse(
        id=rid, created=created, model=model,
        choices=[CompletionChoice(text=text, finish_reason=_finish(done))],
        usage=usage_body(done.usage),
    )


def chat_chunk(rid: str, created: int, model: str, *, role: bool = False,
               content: str | None = None, done: DoneEvent | None = None,
               usage_only: bool = False) -> ChatCompletionChunk:
    """One streamed chat chunk: the role opener, a content delta, the finish, or the usage tail."""
    if usage_only:
        assert done is not None
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                   usage=usage_body(done.usage))
    choice = ChatChunkChoice(
        delta=Delta(role="assistant" if role else None, content=content),
        finish_reason=_finish(done) if done is not None else None,
    )
    return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])


def completion_chunk(rid: str, created: int, model: str, *, text: str = "",
                     done: DoneEvent | None = None,
                     usage_only: bool = False) -> CompletionResponse:
    """One streamed text-completion chunk (same object as the non-streamed body)."""
    if usage_only:
        assert done is not None
        return CompletionResponse(id=rid, created=created, model=model, choices=[],
                                  usage=usage_body(done.usage))
    choice = CompletionChoice(text=text, finish_reason=_finish(done) if done else None)
    return CompletionResponse(id=rid, created=created, model=model, choices=[choice])
