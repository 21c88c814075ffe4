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

Nothing reaches llguidance's compiler unchecked (it is native code: a grammar
it recurses too deep on kills the process): every JSON schema first passes
:func:`check_schemas` (named limits, ``_schema_limits``), and every grammar
is first compiled in a child process (``_grammar_compiler``), then in this
process on a thread with a larger stack than the child's.

NOTE: llguidance ships Metal kernels for applying masks; they do not run on
the CPU, so the mask is applied with ``mx.where`` here.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kernels._errors import KernelError

from ._grammar_compiler import GrammarCompiler, default_compiler, run_with_stack
from ._grammar_errors import InvalidGrammar
from ._schema_limits import DEFAULT_LIMITS, SchemaLimits, check_schemas
from ._schema_rewrite import strict_schema

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


class GrammarViolation(KernelError):
    """Decoding left the grammar (a token outside the mask was consumed, or no token is allowed)."""


def _llg() -> Any:
    import llguidance

    return llguidance


_VALIDATED_KEPT = 1024
"""Digests of grammars the child compiled, kept so admission and the engine do not ask twice."""

_VALIDATED: OrderedDict[bytes, None] = OrderedDict()
_VALIDATED_LOCK = threading.Lock()


def _digest(grammar: str) -> bytes:
    return hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).digest()


def _validated(grammar: str) -> bool:
    key = _digest(grammar)
    with _VALIDATED_LOCK:
        if key in _VALIDATED:
            _VALIDATED.move_to_end(key)
            return True
    return False


def check_grammar(grammar: str, compiler: GrammarCompiler | None = None) -> None:
    """Raise :class:`InvalidGrammar` with llguidance's reason if ``grammar`` does not compile.

    Compiled in a child process (``compiler``, default the process's pool):
    a grammar that crashes the compiler or runs past its deadline raises
    :class:`GrammarTooComplex`; no free child within the deadline raises
    ``GrammarCompilerBusy``. Blocks: call it on a worker thread.
    """
    if _validated(grammar):
        return
    result = (compiler or default_compiler()).validate(grammar)
    if result.is_error:
        raise InvalidGrammar(result.messages[0] if result.messages
                             else "the grammar does not compile")
    with _VALIDATED_LOCK:
        _VALIDATED[_digest(grammar)] = None
        while len(_VALIDATED) > _VALIDATED_KEPT:
            _VALIDATED.popitem(last=False)


def json_schema_grammar(schema: Mapping[str, Any] | None = None, *,
                        where: str = "response_format.json_schema.schema",
                        limits: SchemaLimits = DEFAULT_LIMITS) -> str:
    """The grammar of JSON documents valid under ``schema`` (``None``: any JSON object).

    Unsupported schema keywords are refused (never ignored), so every
    completed output validates against the schema. The schema passes
    :func:`check_schemas` (``where`` names it in the error) before any
    compiling. Raises :class:`InvalidGrammar` (:class:`SchemaTooComplex`
    over a limit). No MLX, no tokenizer; blocks on the compiler child.
    """
    body: dict[str, Any] = {"type": "object"} if schema is None else dict(schema)
    check_schemas([(where, body)], limits)
    try:
        grammar = str(_llg().LLMatcher.grammar_from_json_schema(body, overrides=_JSON_OPTIONS))
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidGrammar(f"invalid JSON schema: {exc}") from None
    check_grammar(grammar)
    return grammar


def _lark_literal(text: str) -> str:
    # NOTE: a JSON string is a valid llguidance Lark string literal.
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]],
    *,
    start: str,
    end: str,
    name: str | None = None,
    multiple: bool = True,
    limits: SchemaLimits = DEFAULT_LIMITS,
) -> str:
    """The grammar of tool calls in the JSON-in-tags format (``<tool_call>{"name", "arguments"}</tool_call>``).

    ``tools`` are OpenAI tool definitions (``{"type": "function", "function":
    {"name", "parameters", "strict"}}``); ``name`` restricts the call to that
    function; ``multiple`` allows several calls, one right after another
    (no text between them). Each call's
    ``arguments`` follow the function's ``parameters`` schema, compiled as
    its own JSON schema root (so its ``$ref``s into its own ``$defs``
    resolve); with ``strict: true`` an object that does not say otherwise
    takes no property it does not declare. The parameters pass
    :func:`check_schemas` (summed over the tools). Raises
    :class:`InvalidGrammar`.
    """
    chosen: list[tuple[int, str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidGrammar("every tool needs function.name")
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters")
        chosen.append((i, fn["name"], dict(params) if isinstance(params, Mapping)
                       else {"type": "object"}))
    if not chosen:
        raise InvalidGrammar(f"no tool named {name!r}" if name is not None else "no tools")
    check_schemas([(f"tools.{i}.function.parameters", params) for i, _, params in chosen], limits)
    rules: list[str] = []
    bodies: list[str] = []
    for n, (i, fn_name, params) in enumerate(chosen):
        fn = tools[i]["function"]
        if fn.get("strict") is True:
            params = strict_schema(params)
        try:
            embedded = json.dumps({**params, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidGrammar(f"invalid tool parameters: {exc}") from None
        # NOTE: each function's arguments are their own %json rule, so the
        # schema's root (what "#/$defs/..." points into) is the parameters
        # object itself, as the client wrote it. The call object around them
        # is spelled literally, in the order and separators json.dumps uses.
        head = _lark_literal('{"name": ' + json.dumps(fn_name, ensure_ascii=False)
                             + ', "arguments": ')
        bodies.append(f"body_{n}")
        rules.append(f"body_{n}: {head} args_{n} \"}}\"")
        rules.append(f"args_{n}: %json {embedded}")
    opener = _lark_literal(start + "\n")
    closer = _lark_literal("\n" + end)
    # NOTE: calls follow each other with nothing between them: text between
    # the markers would be the message's content, and a message that only
    # calls tools has none (OpenAI's content: null).
    repeat = "+" if multiple else ""
    lark = "\n".join([f"start: call{repeat}",
                      f"call: {opener} body {closer}",
                      "body: " + " | ".join(bodies),
                      *rules]) + "\n"
    try:
        grammar = str(_llg().LLMatcher.grammar_from_lark(lark))
    except (ValueError, TypeError) as exc:
        raise InvalidGrammar(f"invalid tool parameters: {exc}") from None
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

    Any thread (no MLX); blocks on the compiler child the first time a
    grammar is seen. The returned matcher is a prototype: never advance
    it; :class:`GrammarProcessor` works on a copy. Raises
    :class:`InvalidGrammar`.
    """
    entry = _grammars(tokenizer, vocab)
    with _LOCK:
        proto = entry.matchers.get(grammar)
        if proto is not None:
            entry.matchers.move_to_end(grammar)
            return proto
    # NOTE: the child compiles it first (a crash there is a 400, not this
    # process's end); then this process compiles it on a thread with a
    # larger stack than the child's, so it cannot overflow here.
    check_grammar(grammar)
    proto = run_with_stack(lambda: _llg().LLMatcher(entry.lltok, grammar, log_level=0))
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

    def __init__(self, tokenizer: Any, grammar: str, *, contain: bool = False) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._matcher: Any = None
        self._eos = sorted(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or ()))
        self._contain = contain
        self.violation: str | None = None
        """With ``contain``: why the grammar failed (the processor then masks nothing)."""

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if not self._contain:
            return self._masked(history, logits)
        if self.violation is not None:
            return logits
        try:
            return self._masked(history, logits)
        except GrammarViolation as exc:
            # NOTE: a batch row's processor runs inside the whole batch's step:
            # raising would fail every row. The row's owner reads ``violation``
            # after the step, drops the row's unmasked token and fails it alone.
            self.violation = str(exc)
            return logits

    def _masked(self, history: mx.array, logits: mx.array) -> mx.array:
        vocab = int(logits.shape[-1])
        if self._matcher is None:
            self._matcher = prepare_grammar(self._tokenizer, self._grammar, vocab).deep_copy()
        else:
            # NOTE: start this forward before waiting for the previous token on
            # the host: the device computes it while the matcher consumes that
            # token and builds the mask. Without it the forward is launched only
            # after the mask (the step's async_eval), and a batch with a grammar
            # row loses the pipelined decode's overlap on every step.
            mx.async_eval(logits)  # type: ignore[no-untyped-call]
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
