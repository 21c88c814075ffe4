"""The steppable generation kernel: one prefill chunk or one decode step per call.

The gateway drives a :class:`Generation` through the engine thread, one
engine turn per call, and streams every :class:`StepOutput` to the
requester. The arithmetic follows ``mlx_lm.generate.generate_step`` step for
step (same chunking, same ``mx.eval``/``mx.async_eval`` points, same
pipelining of the next forward before reading the current token), so greedy
output equals ``mlx_lm.generate``'s token for token.

Every method and property that touches arrays (construction included) must
run on the engine thread.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from jinja2 import TemplateError
from mlx_lm.models.cache import make_prompt_cache

from kernels._device import generation_stream, read_first_setting
from kernels._errors import GenerationFinished, InvalidPrompt, PrefillIncomplete
from messages.gateway import PromptLogprobs

from ._detokenize import TextStream
from ._logprobs import PromptScorer, score_rows, top_logprobs
from ._sampling import SamplingParams, _argmax, make_request_processors, make_request_sampler
from ._token_cache import piece_encoder

__all__ = [
    "CacheHook",
    "Generation",
    "KernelFinishReason",
    "SnapshotBoundary",
    "StepOutput",
    "encode_prompt",
    "probe_snapshot_boundary",
    "render_chat",
    "run_generation",
]

KernelFinishReason = Literal["stop", "length"]
"""``stop``: EOS, a stop token id or a stop string; ``length``: ``max_tokens`` reached."""

CacheHook = Callable[[list[Any]], None]
"""Called on the per-layer cache list after every forward (e.g. KV quantization)."""

# NOTE: mlx-lm clears MLX's buffer cache every 256 decode steps; keep the cadence.
_CLEAR_EVERY = 256


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One decoded token and the text it released.

    ``text`` may be empty (bytes of a multi-byte character still pending, or
    text held back because it may start a stop string) and may carry text of
    earlier tokens released now. ``finish_reason`` is set on the last step.
    ``logprob`` is the chosen token's log-probability when requested;
    ``top_logprobs`` the ``params.top_logprobs`` most likely ``(token_id,
    logprob)`` pairs, most likely first (both from the distribution the token
    was sampled from). ``prompt_logprobs``: the prompt's scores, on the first
    step only, when ``params.prompt_logprobs`` is set.
    """

    token_id: int
    text: str
    finish_reason: KernelFinishReason | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: PromptLogprobs | None = None


class Generation:
    """One request's generation state: prompt, live cache, sampler, text stream.

    ``cache``/``cached_tokens``: a reused per-layer cache list that already
    holds the KV of ``prompt[:cached_tokens]`` (from the prompt cache); only
    the remaining suffix is forwarded. At least one prompt token must remain
    (``cached_tokens < len(prompt)``), because the last prompt token's forward
    produces the first sampled token. Without a cache a fresh one is built.
    The cache is updated in place.

    ``prefill_step_size`` bounds each prefill chunk (one engine turn).
    ``cache_hook`` runs after every forward, where mlx-lm quantizes the KV.

    ``params.prompt_logprobs`` scores the prompt from the prefill's own
    forwards (:class:`PromptScorer`); a reused prefix has no logits, so such
    a generation takes no cache (``cached_tokens`` must be 0) and its chunks
    are cut to :func:`score_rows` rows.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        prefill_step_size: int = 2048,
        cache: list[Any] | None = None,
        cached_tokens: int = 0,
        cache_hook: CacheHook | None = None,
    ) -> None:
        if len(prompt) == 0:
            raise InvalidPrompt("the prompt has no tokens")
        if prefill_step_size < 1:
            raise InvalidPrompt(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        if cache is None and cached_tokens != 0:
            raise InvalidPrompt("cached_tokens > 0 needs the cache that holds them")
        if not 0 <= cached_tokens < len(prompt):
            raise InvalidPrompt(
                f"cached_tokens={cached_tokens} must leave at least one of the "
                f"{len(prompt)} prompt tokens to forward"
            )
        if params.prompt_logprobs is not None and cached_tokens != 0:
            raise InvalidPrompt("scoring the prompt (prompt_logprobs) needs the whole prompt "
                                f"forwarded; got cached_tokens={cached_tokens}")
        if cache is not None:
            _check_cache_offset(cache, cached_tokens)
        self._model = model
        self._params = params
        self._prompt = [int(t) for t in prompt]
        self._cached = cached_tokens
        self._step_size = prefill_step_size
        self._scorer: PromptScorer | None = None
        if params.prompt_logprobs is not None:
            self._scorer = PromptScorer(self._prompt, params.prompt_logprobs)
            self._step_size = min(prefill_step_size, score_rows(_vocab_size(model, tokenizer)))
        self._hook = cache_hook
        self._cache: list[Any] = cache if cache is not None else make_prompt_cache(model)
        # NOTE: the token ids whose KV the live cache holds, in order; the
        # prompt cache keys its entry on exactly this sequence.
        self._cache_tokens: list[int] = self._prompt[:cached_tokens]
        self._cursor = cached_tokens
        self._prefill_done = False
        self._processors = make_request_processors(params, tokenizer=tokenizer)
        # NOTE: the penalty history is the FULL prompt (reused prefix too), so a
        # cache hit samples exactly as a cold prefill does.
        self._history: mx.array | None = mx.array(self._prompt) if self._processors else None
        eos = frozenset(int(t) for t in (getattr(tokenizer, "eos_token_ids", ()) or ()))
        special = eos | frozenset(params.stop_token_ids)
        # NOTE: ignore_eos only stops EOS from ending the answer; XTC still spares it.
        self._stop_ids = frozenset(params.stop_token_ids) if params.ignore_eos else special
        self._sampler = make_request_sampler(params, xtc_special_tokens=sorted(special))
        # NOTE: _greedy.py: a plain-greedy request that reads no logprob takes
        # the largest logit's index and skips the log-softmax, as the batch lane does.
        self._skip_log_softmax = self._sampler is _argmax and not (
            params.logprobs or params.top_logprobs
        )
        self._text = TextStream(tokenizer.detokenizer, params.stop)
        self._next: tuple[mx.array, mx.array] | None = None
        # NOTE: where async_eval blocks (the CPU), each call computes its own
        # token first and leaves the next forward for the next call
        # (kernels.read_first_setting); elsewhere mlx-lm's order.
        self._read_first = read_first_setting()
        self._generated: list[int] = []
        self._finish: KernelFinishReason | None = None

    # -- state --------------------------------------------------------------

    @property
    def cache(self) -> list[Any]:
        """The live per-layer cache list (for the prompt cache to ``put`` afterwards)."""
        return self._cache

    @property
    def cache_tokens(self) -> tuple[int, ...]:
        """The token ids whose KV the cache holds, in order (prompt, then forwarded output)."""
        return tuple(self._cache_tokens)

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        """The whole prompt's token ids (reused prefix included)."""
        return tuple(self._prompt)

    @property
    def generated_tokens(self) -> tuple[int, ...]:
        """The token ids decoded so far (a final EOS included)."""
        return tuple(self._generated)

    @property
    def completion_tokens(self) -> int:
        """How many tokens were decoded so far."""
        return len(self._generated)

    @property
    def cached_tokens(self) -> int:
        """How many prompt tokens came from the reused cache."""
        return self._cached

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens not yet forwarded (the last one is forwarded by the first decode step)."""
        return len(self._prompt) - self._cursor

    @property
    def prefill_done(self) -> bool:
        """True once :meth:`prefill_step` has reported completion."""
        return self._prefill_done

    @property
    def finish_reason(self) -> KernelFinishReason | None:
        """Why the generation ended, or ``None`` while it runs."""
        return self._finish

    @property
    def params(self) -> SamplingParams:
        """The request's sampling parameters."""
        return self._params

    # -- steps --------------------------------------------------------------

    def prefill_step(self, limit: int | None = None) -> bool:
        """Forward one chunk of at most ``prefill_step_size`` prompt tokens (and at most ``limit``).

        Returns True when everything but the last prompt token is in the
        cache (then call :meth:`decode_step`); a call after that returns True
        without work. Mirrors mlx-lm's prefill loop: chunk, hook, evaluate the
        cache state, release MLX's buffer cache. ``limit`` (>= 1) ends the
        chunk early, e.g. exactly at a prompt-boundary snapshot point.
        """
        if self._prefill_done:
            return True
        if limit is not None and limit < 1:
            raise InvalidPrompt(f"a prefill chunk limit must be >= 1, got {limit}")
        remaining = len(self._prompt) - self._cursor
        if remaining > 1:
            n = min(self._step_size, remaining - 1, limit if limit is not None else remaining)
            chunk = self._prompt[self._cursor : self._cursor + n]
            with mx.stream(generation_stream()):
                logits = self._model(mx.array(chunk)[None], cache=self._cache)
                if self._hook is not None:
                    self._hook(self._cache)
                mx.eval([c.state for c in self._cache])
                if self._scorer is not None:
                    # NOTE: only a scoring request evaluates a prefill's logits.
                    self._scorer.add(logits[0], self._cursor)
                del logits
            self._cache_tokens.extend(chunk)
            self._cursor += n
            mx.clear_cache()
        self._prefill_done = len(self._prompt) - self._cursor <= 1
        return self._prefill_done

    def decode_step(self) -> StepOutput:
        """Produce one token: its id, the text it releases, and a finish reason on the last.

        The first call forwards the last prompt token. Like mlx-lm, each call
        queues the NEXT token's forward (``mx.async_eval``) before reading the
        current one, so the engine computes while the caller streams; the
        forward is skipped when this token is the ``max_tokens``-th. Where
        ``async_eval`` blocks (the CPU: ``kernels.read_first_setting``) the
        next forward is only built, and the next call computes it first: the
        token comes out one forward sooner, the same token.
        """
        if self._finish is not None:
            raise GenerationFinished(f"the generation already finished ({self._finish})")
        if not self._prefill_done:
            raise PrefillIncomplete("prefill_step() has not reported completion")
        n = len(self._generated)
        last_by_length = n + 1 >= self._params.max_tokens
        with mx.stream(generation_stream()):
            if self._next is None:
                tail = self._prompt[self._cursor :]
                y, logprobs = self._forward(mx.array(tail), first=True)
                mx.async_eval(y, logprobs)  # type: ignore[no-untyped-call]
                self._cache_tokens.extend(tail)
                self._cursor = len(self._prompt)
            else:
                y, logprobs = self._next
                self._next = None
                if self._read_first:
                    # NOTE: this token's forward (built by the last call) runs
                    # now; building the next one below overlaps its last operations.
                    mx.async_eval(y, logprobs)  # type: ignore[no-untyped-call]
            if not last_by_length:
                self._next = self._forward(y, first=False)
                if not self._read_first:
                    mx.async_eval(*self._next)  # type: ignore[no-untyped-call]
            token = int(y.item())  # type: ignore[arg-type]
        if not last_by_length:
            self._cache_tokens.append(token)
        scores: PromptLogprobs | None = None
        if n == 0 and self._scorer is not None:
            scores = self._scorer.result()
            self._scorer = None
        logprob: float | None = None
        if self._params.logprobs:
            logprob = float(logprobs[token].item())  # type: ignore[arg-type]
        top = top_logprobs(logprobs, self._params.top_logprobs) if self._params.top_logprobs else ()
        if n % _CLEAR_EVERY == 0:
            mx.clear_cache()
        self._generated.append(token)

        finish: KernelFinishReason | None = None
        if token in self._stop_ids:
            finish = "stop"
            text = self._text.finish()
        else:
            text = self._text.add(token)
            if self._text.finished:
                finish = "stop"
            elif last_by_length:
                finish = "length"
                text += self._text.finish()
        if finish is not None:
            self._finish = finish
            if self._next is not None and self._read_first:
                # NOTE: the cache holds the built forward's writes (cache_tokens
                # records its token); it runs here, on the engine thread, before
                # the cache is handed on, as mlx-lm's order had it run by now.
                mx.eval(*self._next)
            # NOTE: the queued forward (if any) already wrote its token into the
            # cache, which ``cache_tokens`` records; only the arrays are dropped.
            self._next = None
        return StepOutput(token_id=token, text=text, finish_reason=finish, logprob=logprob,
                          top_logprobs=top, prompt_logprobs=scores)

    def _forward(self, tokens: mx.array, *, first: bool) -> tuple[mx.array, mx.array]:
        """mlx-lm's ``_step``: forward, penalties, hook, log-softmax, sample."""
        logits = self._model(tokens[None], cache=self._cache)[:, -1, :]
        if self._processors:
            assert self._history is not None
            if not first:
                self._history = mx.concat([self._history, tokens])
            for processor in self._processors:
                logits = processor(self._history, logits)
        if self._hook is not None:
            self._hook(self._cache)
        if self._skip_log_softmax:
            # NOTE: the second value is only read for logprobs, which this request does not ask for.
            return mx.argmax(logits, axis=-1), logits.squeeze(0)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        sampled = self._sampler(logprobs)
        return sampled, logprobs.squeeze(0)


def _vocab_size(model: Any, tokenizer: Any) -> int:
    """The model's vocabulary size (its output rows): the model's args, else the tokenizer's."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 1 << 17


def _check_cache_offset(cache: list[Any], cached_tokens: int) -> None:
    """Reject a reused cache whose layers do not hold exactly ``cached_tokens`` tokens.

    Only layers with an integer ``offset`` (KV caches) are checked; recurrent
    state has no token count to compare.
    """
    for i, layer in enumerate(cache):
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int) and offset != cached_tokens:
            raise InvalidPrompt(
                f"cache layer {i} holds {offset} tokens but cached_tokens={cached_tokens}"
            )


def run_generation(gen: Generation) -> list[StepOutput]:
    """Drive ``gen`` to completion in the calling thread (tests, tools, benchmarks)."""
    while not gen.prefill_step():
        pass
    out: list[StepOutput] = []
    while gen.finish_reason is None:
        out.append(gen.decode_step())
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    allow_special_tokens: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready to generate.

    ``add_generation_prompt=True``; ``tools`` and extra keyword arguments go
    to the template. Pure tokenizer work (no MLX): safe off the engine thread.

    Only the template makes control tokens: text in the messages (and in
    ``tools``) that spells a special token, such as ``<|im_end|>``, is
    tokenized as the plain text it is, so a message cannot close its own turn
    and forge another. ``allow_special_tokens=True`` turns that off (the
    caller trusts its messages).
    """
    kwargs: dict[str, Any] = dict(template_kwargs)
    msgs: list[dict[str, Any]] = [dict(m) for m in messages]
    tool_list = [dict(t) for t in tools] if tools is not None else None
    pattern = None if allow_special_tokens else _special_pattern(_special_texts(tokenizer))
    if pattern is not None:
        escaper = _Escaper(pattern)
        msgs = [{k: v if k == "role" else escaper.escape(v) for k, v in m.items()} for m in msgs]
        tool_list = escaper.escape(tool_list)
        if escaper.texts:
            if tool_list is not None:
                kwargs["tools"] = tool_list
            text = tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False, **kwargs)
            return escaper.encode(tokenizer, str(text))
    if tool_list is not None:
        kwargs["tools"] = tool_list
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs)
    # NOTE: what ``tokenize=True`` would return, with the unchanged pieces of
    # the conversation (split at control tokens) taken from a cache.
    return piece_encoder(tokenizer).encode(str(text))


def _special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The spellings of the tokenizer's special (control) tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, Mapping):
        return ()
    return tuple(sorted({str(t.content) for t in added.values()
                         if getattr(t, "special", False) and str(getattr(t, "content", ""))}))


@functools.lru_cache(maxsize=16)
def _special_pattern(texts: tuple[str, ...]) -> re.Pattern[str] | None:
    if not texts:
        return None
    # NOTE: longest first, so a special that extends another one wins.
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


class _Escaper:
    """Swaps special-token spellings in message text for placeholders the template passes through.

    A placeholder is a per-call random nonce and an index, in lowercase
    letters and digits only, so it survives whatever the template does to
    the text (``tojson``, ``repr``, ``trim``). Message text cannot guess a
    nonce, and a guessed one would still map back to plain text only.
    """

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self._pattern = pattern
        self._nonce = secrets.token_hex(8)
        self._marker = re.compile(f"kvtier{self._nonce}s(\\d+)e")
        self.texts: list[str] = []

    def _placeholder(self, match: re.Match[str]) -> str:
        self.texts.append(match.group(0))
        return f"kvtier{self._nonce}s{len(self.texts) - 1}e"

    def escape(self, value: Any) -> Any:
        """``value`` with every special spelling in its strings replaced (dicts and lists walked)."""
        if isinstance(value, str):
            return self._pattern.sub(self._placeholder, value)
        if isinstance(value, Mapping):
            return {k: self.escape(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape(v) for v in value]
        return value

    def encode(self, tokenizer: Any, rendered: str) -> list[int]:
        """Token ids of the rendered prompt: template specials as control tokens, escaped text as text.

        NOTE: added tokens split the text before BPE runs, so encoding the
        pieces between placeholders on their own gives the ids the whole
        text would get; each escaped spelling is encoded with special
        tokens split, as the characters it is made of.
        """
        ids: list[int] = []
        pos = 0
        for match in self._marker.finditer(rendered):
            if match.start() > pos:
                ids += piece_encoder(tokenizer).encode(rendered[pos:match.start()])
            ids += _encode_plain(tokenizer, self.texts[int(match.group(1))])
            pos = match.end()
        if pos < len(rendered):
            ids += piece_encoder(tokenizer).encode(rendered[pos:])
        return [int(t) for t in ids]


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    """``text`` as ordinary tokens, never as the special token it spells."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False,
                                             split_special_tokens=True)]


# NOTE: plain words that start with a letter, like most replies, so the probe
# sees the same token merges at the header/content junction as real turns do.
_PROBE_SYSTEM = "You are a helpful assistant."
_PROBE_HISTORY = (
    {"role": "user", "content": "Name a colour of the sea."},
    {"role": "assistant", "content": "Blue, mostly."},
)
_PROBE_ASK = {"role": "user", "content": "And at night?"}
_PROBE_NEXT = (
    {"role": "assistant", "content": "Almost black."},
    {"role": "user", "content": "Thank you."},
)


@dataclass(frozen=True, slots=True)
class SnapshotBoundary:
    """Which tail of a rendered chat prompt the next turn's rendering does not repeat.

    ``unstable``: token tails the chat template appends for generation that
    history renders differently (longest first), e.g. the ``<think>`` opener
    of a thinking template that strips reasoning from past assistant turns.
    Empty when the generation prompt reappears verbatim (ChatML and most
    templates). Made by :func:`probe_snapshot_boundary`.
    """

    unstable: tuple[tuple[int, ...], ...] = ()

    def stable_prefix(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` the next turn repeats: the snapshot point.

        At most ``len(prompt) - 1`` (the last prompt token is forwarded by the
        first decode step). A prompt that does not end with a probed tail
        (its template was rendered with other options) falls back to that.
        """
        n = len(prompt)
        for tail in self.unstable:
            if n > len(tail) and tuple(prompt[n - len(tail) :]) == tail:
                return min(n - len(tail), n - 1)
        return max(0, n - 1)


def probe_snapshot_boundary(tokenizer: Any, **template_kwargs: Any) -> SnapshotBoundary:
    """Find the prompt tail that the next chat turn re-renders, by rendering probe conversations.

    Each probe (a first turn, and a turn with history, each with and without a
    system message) is rendered ready to generate, then again followed by an
    assistant reply and a new user message, as the next turn would send it.
    The first rendering's tokens past the two renderings' common prefix are
    the tail that does not survive. A probe the template refuses (a role it
    does not know) is skipped. Pure tokenizer work, no MLX.
    """
    probes = (
        [_PROBE_ASK],
        [{"role": "system", "content": _PROBE_SYSTEM}, _PROBE_ASK],
        [*_PROBE_HISTORY, _PROBE_ASK],
        [{"role": "system", "content": _PROBE_SYSTEM}, *_PROBE_HISTORY, _PROBE_ASK],
    )
    tails: set[tuple[int, ...]] = set()
    for probe in probes:
        try:
            now = render_chat(tokenizer, probe, **template_kwargs)
            later = render_chat(tokenizer, [*probe, *_PROBE_NEXT], **template_kwargs)
        except (ValueError, TypeError, KeyError, IndexError, TemplateError):
            continue
        shared = 0
        for a, b in zip(now, later, strict=False):
            if a != b:
                break
            shared += 1
        if shared < len(now):
            tails.add(tuple(now[shared:]))
    return SnapshotBoundary(tuple(sorted(tails, key=len, reverse=True)))


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain completion prompt, as ``mlx_lm.stream_generate`` encodes it.

    Special tokens (BOS) are added unless the text already starts with BOS.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not text.startswith(bos)
    # NOTE: through the piece encoder's checked backend, which keeps the GIL (_token_cache).
    return piece_encoder(tokenizer).plain(text, add_special_tokens=add_special)
