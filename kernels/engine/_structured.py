"""Constrained decoding: a grammar as an mlx-lm logits processor, on llguidance.

A request's ``GenerationParams.grammar`` is an llguidance grammar (a string):
:func:`json_schema_grammar` makes one from a JSON schema (``None``: any JSON
object), :func:`tool_call_grammar` one that spells a tool call in a model's
``<tool_call>`` JSON format. Before each sampled token the request's
:class:`GrammarProcessor` sets the logit of every token the grammar does not
allow next to ``-inf``, so the sampler (greedy or not) can only pick allowed
tokens; once the grammar is complete only EOS is allowed. The processor has
mlx-lm's shape ``(history, logits) -> logits``, so it runs in the same chain
as logit bias and penalties (and the log-probabilities a request reports are
those of the masked logits, the distribution the token was drawn from).

Why llguidance (docs/operations.md, "Structured output", has the figures):
its masks are computed lazily per step (no index over the vocabulary built
up front, so a new schema costs microseconds, not seconds), a mask costs
tens of microseconds on this CPU, it has no Python dependency beyond its
wheel, and it accepts JSON schema and Lark grammars that embed JSON schema.

Two costs are kept off the engine thread: building llguidance's view of the
tokenizer (about a second for a 50k vocabulary) and compiling a grammar.
:func:`prepare_grammar` does both on any thread (the ``Engine`` calls it on a
worker thread before admission) and caches the result per tokenizer; the
engine thread then only copies the compiled matcher.

NOTE: llguidance ships Metal kernels for applying masks; they do not run on
the CPU, so the mask is applied with ``mx.where`` here.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kernels._errors import InvalidPrompt, KernelError

__all__ = [
    "GrammarProcessor",
    "GrammarViolation",
    "InvalidGrammar",
    "check_grammar",
    "json_schema_grammar",
    "prepare_grammar",
    "tool_call_grammar",
]

# NOTE: no free whitespace: a grammar that allows any run of spaces lets a
# weak model spend its whole budget on them. The separators are the ones
# models see most (Python's json.dumps), so the constrained text stays likely.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

_MATCHERS_PER_TOKENIZER = 64
"""Compiled grammars kept per tokenizer (least recently used dropped first)."""


class InvalidGrammar(InvalidPrompt):
    """A grammar (or the JSON schema it came from) that cannot constrain decoding; says why."""


class GrammarViolation(KernelError):
    """Decoding left the grammar (a token outside the mask was consumed, or no token is allowed)."""


def _llg() -> Any:
    import llguidance

    return llguidance


def check_grammar(grammar: str) -> None:
    """Raise :class:`InvalidGrammar` with llguidance's reason if ``grammar`` does not compile."""
    try:
        is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError) as exc:
        raise InvalidGrammar(str(exc)) from None
    if is_error:
        raise InvalidGrammar(messages[0] if messages else "the grammar does not compile")


def json_schema_grammar(schema: Mapping[str, Any] | None = None) -> str:
    """The grammar of JSON documents valid under ``schema`` (``None``: any JSON object).

    Unsupported schema keywords are refused (never ignored), so every
    completed output validates against the schema. Raises
    :class:`InvalidGrammar`. Pure (no MLX, no tokenizer).
    """
    body: dict[str, Any] = {"type": "object"} if schema is None else dict(schema)
    try:
        grammar = str(_llg().LLMatcher.grammar_from_json_schema(body, overrides=_JSON_OPTIONS))
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidGrammar(f"invalid JSON schema: {exc}") from None
    check_grammar(grammar)
    return grammar


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]],
    *,
    start: str,
    end: str,
    name: str | None = None,
    multiple: bool = True,
) -> str:
    """The grammar of tool calls in the JSON-in-tags format (``<tool_call>{"name", "arguments"}</tool_call>``).

    ``tools`` are OpenAI tool definitions (``{"type": "function", "function":
    {"name", "parameters"}}``); ``name`` restricts the call to that function;
    ``multiple`` allows several calls, one per line. Each call's
    ``arguments`` follow the function's ``parameters`` schema. Raises
    :class:`InvalidGrammar`.
    """
    alternatives: list[dict[str, Any]] = []
    for tool in tools:
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidGrammar("every tool needs function.name")
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters")
        alternatives.append({
            "type": "object",
            "properties": {
                "name": {"const": fn["name"]},
                "arguments": dict(params) if isinstance(params, Mapping) else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    if not alternatives:
        raise InvalidGrammar(f"no tool named {name!r}" if name is not None else "no tools")
    schema: dict[str, Any] = (
        alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    )
    schema = {**schema, "x-guidance": _JSON_OPTIONS}
    try:
        embedded = json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidGrammar(f"invalid tool parameters: {exc}") from None
    opener = json.dumps(start + "\n", ensure_ascii=False)
    closer = json.dumps("\n" + end, ensure_ascii=False)
    repeat = ' ("\\n" call)*' if multiple else ""
    lark = f"start: call{repeat}\ncall: {opener} %json {embedded} {closer}\n"
    grammar = str(_llg().LLMatcher.grammar_from_lark(lark))
    check_grammar(grammar)
    return grammar


@dataclass
class _TokenizerGrammars:
    """llguidance's tokenizer for one (tokenizer, vocabulary size) and its compiled grammars."""

    lltok: Any
    matchers: OrderedDict[str, Any] = field(default_factory=OrderedDict)


_LOCK = threading.Lock()
_CACHE: weakref.WeakKeyDictionary[Any, dict[int, _TokenizerGrammars]] = (
    weakref.WeakKeyDictionary()
)


def _grammars(tokenizer: Any, vocab: int) -> _TokenizerGrammars:
    with _LOCK:
        entry = _CACHE.get(tokenizer, {}).get(vocab)
    if entry is not None:
        return entry
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or ()))
    try:
        from llguidance.hf import from_tokenizer

        lltok = from_tokenizer(hf, n_vocab=vocab, eos_token=eos or None)
    except (ValueError, TypeError) as exc:
        raise InvalidGrammar(
            f"structured output is not available for this model's tokenizer: {exc}"
        ) from None
    with _LOCK:
        per_vocab = _CACHE.setdefault(tokenizer, {})
        # NOTE: two threads may have built it; keep the first (either is correct).
        return per_vocab.setdefault(vocab, _TokenizerGrammars(lltok))


def prepare_grammar(tokenizer: Any, grammar: str, vocab: int) -> Any:
    """The compiled matcher of ``grammar`` for ``tokenizer`` over ``vocab`` logits (cached).

    Any thread (no MLX). The returned matcher is a prototype: never advance
    it; :class:`GrammarProcessor` works on a copy. Raises
    :class:`InvalidGrammar`.
    """
    entry = _grammars(tokenizer, vocab)
    with _LOCK:
        proto = entry.matchers.get(grammar)
        if proto is not None:
            entry.matchers.move_to_end(grammar)
            return proto
    proto = _llg().LLMatcher(entry.lltok, grammar, log_level=0)
    if proto.is_error():
        raise InvalidGrammar(str(proto.get_error()))
    with _LOCK:
        entry.matchers[grammar] = proto
        while len(entry.matchers) > _MATCHERS_PER_TOKENIZER:
            entry.matchers.popitem(last=False)
    return proto


class GrammarProcessor:
    """mlx-lm logits processor: only tokens the grammar allows next keep their logits.

    Called once per sampled token with the token history so far; from the
    second call on, the history's last token is the one sampled after the
    previous call, and it advances the grammar. Engine thread (one request's
    own state; the compiled grammar is shared read-only).
    """

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._matcher: Any = None
        self._eos = sorted(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or ()))

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        vocab = int(logits.shape[-1])
        if self._matcher is None:
            self._matcher = prepare_grammar(self._tokenizer, self._grammar, vocab).deep_copy()
        else:
            token = int(history[-1].item())  # type: ignore[arg-type]
            if not self._matcher.consume_token(token) or self._matcher.is_error():
                raise GrammarViolation(
                    f"token {token} is outside the grammar: {self._matcher.get_error()}"
                )
        if self._matcher.is_stopped():
            # NOTE: the grammar is complete and its end (EOS) was just consumed:
            # this forward's token is never used; keep the mask valid anyway.
            allowed = np.zeros(vocab, dtype=np.bool_)
            allowed[[t for t in self._eos if t < vocab]] = True
        else:
            words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(words, bitorder="little")[:vocab].astype(np.bool_)
        if not allowed.any():
            raise GrammarViolation(f"the grammar allows no next token: {self._matcher.get_error()}")
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))
