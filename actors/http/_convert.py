"""Sans-IO translation between OpenAI request/response bodies and engine types.

Pure functions: request body + settings → ``GenerationParams`` (or an
``ApiError``), engine events → response bodies and SSE payloads. No I/O, no
clock, no ids: callers pass them in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from actors.engine.config import EngineConfig
from actors.errors import GrammarCompilerBusy, SchemaTooComplex
from kernels.engine import GrammarCompilerBusy as CompilerBusy
from kernels.engine import (
    GrammarTooComplex,
    InvalidGrammar,
    ToolFormat,
    json_schema_grammar,
    tool_call_grammar,
)
from kernels.engine import SchemaTooComplex as SchemaOverLimit
from messages.gateway import DoneEvent, GenerationParams, Usage

from ._answer import ChatAnswer, ChatPiece, CompletionAnswer, CompletionPiece, ToolParsing
from ._errors import ApiError
from ._schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    PromptTokensDetails,
    ResponseMessage,
    ToolCallDelta,
    ToolCallDeltaFunction,
    UsageBody,
    _SamplingFields,
)

__all__ = [
    "Defaults",
    "chat_chunk",
    "chat_messages",
    "chat_response",
    "check_against_vocab",
    "choices_usage",
    "completion_chunk",
    "completion_response",
    "grammar_for",
    "needs_grammar",
    "resolve_model",
    "running_usage",
    "to_params",
    "tool_parsing",
    "tools_for_template",
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


def to_params(body: _SamplingFields, defaults: Defaults,
              grammar: str | None = None, cache_scope: str | None = None) -> GenerationParams:
    """Sampling parameters for the engine; bounds violations become a 400 ``ApiError``.

    ``grammar`` (from :func:`grammar_for`) constrains decoding. ``cache_scope``
    (the server's, e.g. from the API key) joins the body's ``cache_salt`` in
    choosing the prompt-cache namespace.
    """
    max_tokens = body.requested_max_tokens()
    param = "max_completion_tokens" if (
        isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
    ) else "max_tokens"
    if max_tokens is None:
        max_tokens = defaults.max_tokens
    elif max_tokens == 0:
        # NOTE: echo with max_tokens 0 only scores the prompt; the engine
        # generates one token, which the answer leaves out (CompletionAnswer).
        max_tokens = 1
    elif max_tokens > defaults.max_tokens_limit:
        raise ApiError(
            400,
            f"{param} is too large: {max_tokens}. This server allows at most "
            f"{defaults.max_tokens_limit} completion tokens.",
            code="invalid_value",
            param=param,
        )
    if body.ignore_eos and grammar is not None:
        raise ApiError(400, "ignore_eos cannot be combined with response_format or a forced "
                            "tool_choice: the constrained answer ends with EOS.",
                       code="unsupported", param="ignore_eos")
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
        "grammar": grammar,
        "cache_salt": body.cache_salt,
        "ignore_eos": body.ignore_eos,
        "cache_scope": cache_scope,
    }
    if isinstance(body, ChatCompletionRequest):
        fields["logprobs"] = bool(body.logprobs)
        fields["top_logprobs"] = (body.top_logprobs or 0) if body.logprobs else 0
    elif isinstance(body, CompletionRequest):
        # NOTE: the legacy API's `logprobs: n` asks for the chosen token's and n alternatives.
        fields["logprobs"] = body.logprobs is not None
        fields["top_logprobs"] = body.logprobs or 0
        if body.echo and body.logprobs is not None:
            # NOTE: the prompt's tokens are reported too: the engine scores them.
            fields["prompt_logprobs"] = body.logprobs
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
        for prompt in body.prompt_values():
            if isinstance(prompt, str):
                continue
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt holds token id {bad}, outside the model's "
                                    f"vocabulary (0..{vocab - 1}).",
                               code="invalid_value", param="prompt")


_ROLE_FOR_TEMPLATE = {"developer": "system"}


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the engine's chat template takes them.

    NOTE: "developer" is OpenAI's newer name for "system"; chat templates of
    open models only know "system". An assistant message's tool calls carry
    their arguments decoded (templates write them with ``tojson``, as
    mlx-lm's server passes them); a tool message keeps its ``tool_call_id``.
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        msg: dict[str, Any] = {"role": _ROLE_FOR_TEMPLATE.get(m.role, m.role), "content": m.text()}
        if m.name is not None and m.role in ("tool", "user", "assistant"):
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls is not None:
            calls: list[dict[str, Any]] = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    raise ApiError(
                        400, "A tool call's arguments must be a JSON text.",
                        code="invalid_value",
                        param=f"messages.{i}.tool_calls.{j}.function.arguments") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def tools_for_template(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """``tools`` as the chat template takes them (OpenAI's shape), or ``None``.

    NOTE: rendered even with ``tool_choice: none``: the conversation may
    hold calls of these tools, and the prompt stays the one the other turns
    render (so the prompt cache keeps matching).
    """
    if not body.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


_NO_TOOLS = (
    "This model's chat template has no tool-call format that mlx-lm recognises, so it "
    "cannot call tools (docs/operations.md, 'Tools', lists models that can)."
)


def tool_parsing(body: ChatCompletionRequest, fmt: ToolFormat | None) -> ToolParsing | None:
    """How to find tool calls in the answer (``None``: the answer is all text).

    A request that lets the model call tools on a model without a tool-call
    format is a 400 naming ``tools``.
    """
    if body.effective_tool_choice() == "none":
        return None
    if fmt is None:
        raise ApiError(400, _NO_TOOLS, code="unsupported", param="tools")
    return ToolParsing(fmt=fmt, tools=tools_for_template(body) or [])


def needs_grammar(body: ChatCompletionRequest) -> bool:
    """True when the answer is constrained (JSON ``response_format``, forced tool calls)."""
    choice = body.effective_tool_choice()
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    return forced or isinstance(body.response_format, JsonObjectFormat | JsonSchemaFormat)


def _compile(make: Callable[[], str], param: str, refused: str) -> str:
    """Run a grammar builder; its typed failures become the request's errors.

    A schema over a limit or one the compiler died or stalled on raises
    ``SchemaTooComplex`` (400 naming ``param`` and the limit); every
    compiler busy raises ``GrammarCompilerBusy`` (429); any other invalid
    schema is a 400 ``invalid_value`` prefixed with ``refused``.
    """
    try:
        return make()
    except SchemaOverLimit as exc:
        raise SchemaTooComplex(str(exc), limit=exc.limit, param=exc.where) from None
    except GrammarTooComplex as exc:
        raise SchemaTooComplex(str(exc), limit="compile", param=param) from None
    except CompilerBusy as exc:
        raise GrammarCompilerBusy(str(exc)) from None
    except InvalidGrammar as exc:
        raise ApiError(400, f"{refused}: {exc}", code="invalid_value", param=param) from None


def grammar_for(body: ChatCompletionRequest, fmt: ToolFormat | None) -> str | None:
    """The grammar that constrains the answer, or ``None``.

    ``response_format`` ``json_object`` / ``json_schema``: JSON (valid under
    the schema). ``tool_choice`` ``required`` or a named function: tool
    calls in the model's format (only the JSON-in-tags format can be
    forced), each function's ``parameters`` with their own ``$defs``, and
    with ``strict: true`` no undeclared property. Every schema passes the
    named limits before it is compiled, and is compiled in a child process
    first (``kernels.engine``): over a limit, or a compiler crash, is a 400
    ``schema_too_complex``; an invalid schema a 400 naming the field.
    Blocks (milliseconds; at most the compiler's deadline): call it on a
    worker thread.
    """
    choice = body.effective_tool_choice()
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    fmt_json = isinstance(body.response_format, JsonObjectFormat | JsonSchemaFormat)
    if forced and fmt_json:
        raise ApiError(400, "response_format and a forced tool_choice cannot both constrain "
                            "the answer; send one of them.", code="unsupported",
                       param="response_format")
    if forced:
        if fmt is None:
            raise ApiError(400, _NO_TOOLS, code="unsupported", param="tools")
        if not fmt.json_in_tags:
            raise ApiError(
                400, "tool_choice 'required' or a named function is supported for models whose "
                     "tool calls are JSON between <tool_call> tags; this model writes calls "
                     "another way. Use tool_choice 'auto'.", code="unsupported", param="tool_choice")
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        tools = tools_for_template(body) or []
        return _compile(
            lambda: tool_call_grammar(tools, start=fmt.start, end=fmt.end, name=name,
                                      multiple=name is None and body.parallel_tool_calls is not False),
            "tools", "The tools' parameters cannot constrain decoding")
    fmt_body = body.response_format
    if isinstance(fmt_body, JsonObjectFormat | JsonSchemaFormat):
        schema = fmt_body.json_schema.schema_ if isinstance(fmt_body, JsonSchemaFormat) else None
        param = ("response_format.json_schema.schema" if isinstance(fmt_body, JsonSchemaFormat)
                 else "response_format")
        return _compile(lambda: json_schema_grammar(schema, where=param), param,
                        "Invalid schema for response_format")
    return None


def usage_body(usage: Usage) -> UsageBody:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens``."""
    return UsageBody(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def running_usage(prompt_tokens: int, completion_tokens: int) -> UsageBody:
    """The usage so far on a streamed chunk (``continuous_usage_stats``); cached tokens come at the end."""
    return UsageBody(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=None)


def _message_content(content: str | None, has_calls: bool) -> str | None:
    """``None`` for a message that carries only tool calls (its text is only whitespace).

    NOTE: a model's newline between calls is text outside the call markers;
    OpenAI's message with only calls has ``content: null``, and clients test
    for it. (Forced calls have no text between them: the grammar puts none.)
    """
    if has_calls and (content is None or not content.strip()):
        return None
    return content


def choices_usage(usages: Sequence[Usage], n: int) -> Usage:
    """The usage of a request of several choices, ``n`` per prompt, in choice order.

    As OpenAI counts it: each prompt once (its first choice's prompt and
    cached tokens), every choice's completion tokens.
    """
    firsts = usages[::n]
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in firsts),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in firsts))


def chat_response(rid: str, created: int, model: str,
                  answers: Sequence[tuple[ChatAnswer, DoneEvent]], *,
                  logprobs: bool = False) -> ChatCompletion:
    """The non-streamed chat completion body: one choice per answer (after ``answer.finish(done)``)."""
    return ChatCompletion(
        id=rid, created=created, model=model,
        choices=[ChatChoice(
            index=i,
            message=ResponseMessage(content=_message_content(answer.content, bool(answer.tool_calls)),
                                    tool_calls=answer.tool_calls or None),
            finish_reason=answer.finish_reason,
            logprobs=ChoiceLogprobs(content=answer.logprobs) if logprobs else None)
            for i, (answer, _) in enumerate(answers)],
        usage=usage_body(choices_usage([done.usage for _, done in answers], len(answers))),
    )


def completion_response(rid: str, created: int, model: str,
                        answers: Sequence[tuple[CompletionAnswer, DoneEvent]],
                        n: int = 1) -> CompletionResponse:
    """The non-streamed text completion body, ``n`` choices per prompt (after ``answer.finish(done)``)."""
    return CompletionResponse(
        id=rid, created=created, model=model,
        choices=[CompletionChoice(index=i, text=answer.text, finish_reason=answer.finish_reason,
                                  logprobs=answer.logprobs)
                 for i, (answer, _) in enumerate(answers)],
        usage=usage_body(choices_usage([answer.usage(done.usage) for answer, done in answers], n)),
    )


def chat_chunk(rid: str, created: int, model: str, *, role: bool = False,
               calls_only: bool = False, piece: ChatPiece | None = None,
               finish: str | None = None, usage: Usage | None = None,
               logprobs: bool = False, running: UsageBody | None = None,
               index: int = 0) -> ChatCompletionChunk:
    """One streamed chat chunk: the role opener, a piece of the answer, the finish, or the usage tail.

    The role opener carries ``content: ""`` (as OpenAI's), except when the
    answer may be tool calls (``calls_only``: tools offered and
    ``tool_choice`` not ``none``): then it carries no content, so a client
    that adds up the deltas of an answer of calls only ends with
    ``content`` null, as the non-streamed message has. ``running``:
    the usage so far, on a chunk with a choice (``continuous_usage_stats``).
    ``index``: the choice the chunk belongs to (a request of several choices).
    """
    if usage is not None:
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                   usage=usage_body(usage))
    content: str | None = "" if role and not calls_only else None
    calls: list[ToolCallDelta] | None = None
    entries = None
    if piece is not None:
        content = piece.content or None
        if piece.tool_calls:
            calls = [ToolCallDelta(index=piece.first_call_index + n, id=c.id, type="function",
                                   function=ToolCallDeltaFunction(name=c.function.name,
                                                                  arguments=c.function.arguments))
                     for n, c in enumerate(piece.tool_calls)]
        if logprobs:
            entries = ChoiceLogprobs(content=list(piece.logprobs))
    choice = ChatChunkChoice(
        index=index,
        delta=Delta(role="assistant" if role else None, content=content, tool_calls=calls),
        finish_reason=finish, logprobs=entries,
    )
    return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice],
                               usage=running)


def completion_chunk(rid: str, created: int, model: str, *,
                     piece: CompletionPiece | None = None, finish: str | None = None,
                     usage: Usage | None = None,
                     running: UsageBody | None = None, index: int = 0) -> CompletionResponse:
    """One streamed text-completion chunk (same object as the non-streamed body); ``running`` and ``index`` as in :func:`chat_chunk`."""
    if usage is not None:
        return CompletionResponse(id=rid, created=created, model=model, choices=[],
                                  usage=usage_body(usage))
    choice = CompletionChoice(index=index, text=piece.text if piece is not None else "",
                              finish_reason=finish,
                              logprobs=piece.logprobs if piece is not None else None)
    return CompletionResponse(id=rid, created=created, model=model, choices=[choice],
                              usage=running)
