"""A request's prompt before admission: its rendering into token ids, the checks it passes,
and the grammar compile (worker thread).

Pure reads of the loaded model's shape (no MLX): its vocabulary size, its
context length, and ``EngineConfig.max_prompt_tokens``. A refused prompt
never queues or takes a turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from actors.errors import ContextTooLong, EngineNotStarted, InvalidRequest
from messages.gateway import GenerationParams

from .config import EngineConfig
from .startup import ModelParts

__all__ = [
    "Render",
    "chat_renderer",
    "fit_to_context",
    "prepare_grammar",
    "text_renderer",
    "validate_prompt",
    "vocab_size",
]

@dataclass(frozen=True, slots=True)
class Render:
    """Renders a prompt into token ids with the model's tokenizer (mlx-lm's, untyped).

    ``chars``: the characters of the text it renders from (message contents,
    tools, or the completion prompt), which admission reads to choose where
    it runs (``EngineConfig.render_inline_chars``).
    """

    fn: Callable[[Any], list[int]]
    chars: int

    def __call__(self, tokenizer: Any) -> list[int]:
        return self.fn(tokenizer)


def chat_renderer(messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None,
                  template_kwargs: Mapping[str, Any] | None) -> Render:
    """The rendering of a chat request with the model's chat template (copies of the inputs)."""
    if not messages:
        raise InvalidRequest("messages must not be empty")
    msgs = [dict(m) for m in messages]
    tool_list = [dict(t) for t in tools] if tools is not None else None
    kwargs = dict(template_kwargs or {})

    def render(tokenizer: Any) -> list[int]:
        from kernels import render_chat

        return render_chat(tokenizer, msgs, tools=tool_list, **kwargs)

    # NOTE: an estimate that never undercounts text by much: every value's
    # text (a content made of parts counts its parts' repr).
    chars = sum(len(v) if isinstance(v, str) else len(repr(v)) for m in msgs for v in m.values())
    if tool_list is not None:
        chars += len(repr(tool_list))
    return Render(render, chars)


def text_renderer(text: str) -> Render:
    """The encoding of a raw completion prompt (BOS added as mlx-lm does)."""

    def render(tokenizer: Any) -> list[int]:
        from kernels import encode_prompt

        return encode_prompt(tokenizer, text)

    return Render(render, len(text))


def vocab_size(loaded: ModelParts | None) -> int | None:
    """Token ids run ``0..vocab_size - 1`` (``None``: no model, or its size is unknown)."""
    if loaded is None:
        return None
    # NOTE: plain attribute reads (no MLX): mlx-lm models keep their
    # ModelArgs; fall back to the tokenizer's size.
    size = getattr(getattr(loaded.model, "args", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    try:
        return len(loaded.tokenizer)  # type: ignore[arg-type]
    except TypeError:
        return None


def fit_to_context(loaded: ModelParts | None, tokens: Sequence[int],
                   params: GenerationParams) -> GenerationParams:
    """``params`` with ``max_tokens`` shrunk to the context the prompt leaves."""
    context = None if loaded is None else loaded.max_context
    if context is None or len(tokens) >= context:
        return params
    room = context - len(tokens)
    if params.max_tokens <= room:
        return params
    return params.model_copy(update={"max_tokens": room})


def prepare_grammar(loaded: ModelParts | None, grammar: str) -> None:
    """Compile ``grammar`` for this tokenizer into the kernel's cache (worker thread).

    A grammar the compiler crashes or stalls on raises ``SchemaTooComplex``
    (its child process is replaced; this process never runs it);
    every compiler busy raises ``GrammarCompilerBusy``.
    """
    from actors.errors import GrammarCompilerBusy, SchemaTooComplex
    from kernels.engine import GrammarCompilerBusy as CompilerBusy
    from kernels.engine import GrammarTooComplex, InvalidGrammar
    from kernels.engine import prepare_grammar as compile_grammar

    vocab = vocab_size(loaded)
    if loaded is None or vocab is None:
        raise EngineNotStarted("start the engine first")
    try:
        compile_grammar(loaded.tokenizer, grammar, vocab)
    except GrammarTooComplex as exc:
        raise SchemaTooComplex(f"invalid grammar: {exc}", limit="compile") from None
    except InvalidGrammar as exc:
        raise InvalidRequest(f"invalid grammar: {exc}") from None
    except CompilerBusy as exc:
        raise GrammarCompilerBusy(str(exc)) from None


def validate_prompt(loaded: ModelParts | None, config: EngineConfig, tokens: Sequence[int],
                    params: GenerationParams) -> None:
    """Refuse a prompt the engine cannot serve (``InvalidRequest``, ``ContextTooLong``), before admission."""
    # NOTE: runs before admission, so a refused prompt never queues or takes a turn.
    if not tokens:
        raise InvalidRequest("the prompt has no tokens")
    # NOTE: prompt scoring is served with a batch lane too: the gateway keeps
    # such a request on the serial lane (kernels.engine.batch_params_refusal,
    # counted in gateway.token.batch_refused); grammar and top_logprobs are rows.
    vocab = vocab_size(loaded)
    if vocab is not None:
        ids = [*tokens, *(params.logit_bias or {}), *params.stop_token_ids]
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            # NOTE: an out-of-range id would fail inside an engine turn instead.
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if params.top_k > vocab:
            raise InvalidRequest(
                f"top_k {params.top_k} is larger than the vocabulary ({vocab} tokens)"
            )
    if params.prompt_logprobs is not None:
        from kernels.engine import MAX_PROMPT_LOGPROB_ENTRIES, prompt_logprob_entries

        entries = prompt_logprob_entries(len(tokens), params.prompt_logprobs)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            # NOTE: bounds what scoring a prompt holds in memory (kernels.engine).
            raise InvalidRequest(
                f"scoring this prompt would report {entries} log-probabilities "
                f"({len(tokens)} tokens x {1 + params.prompt_logprobs}); at most "
                f"{MAX_PROMPT_LOGPROB_ENTRIES} are allowed: shorten the prompt or ask "
                "for fewer alternatives")
    cap = config.max_prompt_tokens
    if cap is not None and len(tokens) > cap:
        raise ContextTooLong(len(tokens), cap, limit_name="max_prompt_tokens")
    context = None if loaded is None else loaded.max_context
    if context is not None and len(tokens) + params.max_tokens > context:
        raise ContextTooLong(
            len(tokens),
            context,
            max_tokens=params.max_tokens,
            limit_name="the model's context",
        )
