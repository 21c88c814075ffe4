"""Sampling parameters and the per-request sampler built from them.

``SamplingParams`` is plain validated data (no MLX), so the event loop can
check a request before admission. ``make_request_sampler`` and
``make_request_processors`` build the MLX side; call them on the engine
thread.

Every sampled request owns its PRNG key: each sampled token splits the
request's key exactly as MLX splits its global key, so a seeded request gives
the same tokens whatever else the engine thread did in between, and the same
tokens as ``mlx_lm`` after ``mx.random.seed(seed)``. An unseeded request
draws its key's seed from an entropy port (``secrets`` by default).

NOTE: nothing here touches MLX's global random state, and the filters are
plain functions. mlx-lm's filters are ``mx.compile``d with
``inputs=outputs=mx.random.state``: when tracing one raises (``top_k`` at or
above the vocabulary size did), the global key is left holding a tracer
without a primitive, and every later draw from it fails with "Attempting to
eval an array without a primitive" until the process restarts. With no
shared state, a request that fails can only fail itself.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from messages.gateway import GenerationParams

from ._structured import GrammarProcessor, InvalidGrammar

__all__ = [
    "LogitsProcessor",
    "Sampler",
    "SamplingParams",
    "SeedSource",
    "make_request_processors",
    "make_request_sampler",
]

Sampler = Callable[[mx.array], mx.array]
"""Maps log-probabilities of shape ``(1, vocab)`` to a token array of shape ``(1,)``."""

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""Maps (token history, logits) to adjusted logits (mlx-lm's processor shape)."""

SeedSource = Callable[[], int]
"""Returns a fresh seed in ``[0, 2**63)`` for a request that names none."""


# NOTE: one definition of a request's sampling parameters, in `messages`
# (which may not import kernels; kernels may import messages): the gateway
# hands the message's value to the kernel unchanged.
SamplingParams = GenerationParams
"""How one request samples and when it stops: :class:`messages.GenerationParams`."""

_Filter = Callable[[mx.array], mx.array]


def _fresh_seed() -> int:
    return secrets.randbits(63)


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


# The filters below compute what mlx-lm's apply_top_p / apply_min_p /
# apply_top_k / apply_xtc compute (same operations in the same order, so a
# seeded request still reproduces mlx-lm), without the compiled global state.


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    sorted_logprobs = mx.sort(logprobs, axis=-1)
    sorted_probs = mx.exp(sorted_logprobs.astype(mx.float32))
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total_mass = mass_above[..., :1] + sorted_probs[..., :1]
    num_dropped = (mass_above >= top_p * total_mass).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_logprobs, num_dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def _min_p(logprobs: mx.array, min_p: float, min_tokens_to_keep: int) -> mx.array:
    top_logprobs = mx.max(logprobs, axis=-1, keepdims=True)
    tokens_to_remove = logprobs < top_logprobs + math.log(min_p)
    keep = min(min_tokens_to_keep, logprobs.shape[-1])
    if keep > 1:
        top = mx.argpartition(logprobs, kth=-keep, axis=-1)[..., -keep:]
        tokens_to_remove = mx.put_along_axis(tokens_to_remove, top, mx.array(False), axis=-1)
    return mx.where(tokens_to_remove, -float("inf"), logprobs)


def _top_k(logprobs: mx.array, top_k: int) -> mx.array:
    # NOTE: k at or above the vocabulary keeps every token: no filter at all
    # (argpartition would refuse such a k).
    if top_k >= logprobs.shape[-1]:
        return logprobs
    mask_idx = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, mask_idx, mx.array(-float("inf"), logprobs.dtype), axis=-1)


class _KeyedSampler:
    """mlx-lm's sampler chain with the request's own PRNG key."""

    def __init__(self, seed: int, temperature: float, filters: list[_Filter]) -> None:
        self._key = mx.random.key(seed)
        self._inv_temp = 1.0 / temperature
        # NOTE: shared list; make_request_sampler inserts the keyed XTC filter later.
        self._filters = filters

    @property
    def key(self) -> mx.array:
        """The key the next draw splits (each draw replaces it)."""
        return self._key

    def restore(self, key: mx.array) -> None:
        """Hold ``key`` as the next draw's key: one held before draws that were taken back, or a checkpoint's."""
        self._key = key

    def next_key(self) -> mx.array:
        # NOTE: same split order as MLX's global KeySequence (keep [0], use [1]),
        # so a seeded request reproduces mlx-lm after mx.random.seed(seed).
        pair = mx.random.split(self._key)
        self._key = pair[0]
        return pair[1]

    def __call__(self, logprobs: mx.array) -> mx.array:
        for method in self._filters:
            logprobs = method(logprobs)
        return mx.random.categorical(logprobs * self._inv_temp, key=self.next_key())


def _keyed_xtc(sampler: _KeyedSampler, params: SamplingParams, special: list[int]) -> _Filter:
    def xtc(logits: mx.array) -> mx.array:
        probs = mx.softmax(logits, -1)
        mask = probs > mx.where(probs > params.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
        if special:
            mask[..., special] = False
        draw = mx.random.uniform(0, 1, key=sampler.next_key())
        return mx.where(draw > params.xtc_probability, logits, mx.where(mask, -mx.inf, logits))

    return xtc


def make_request_sampler(
    params: SamplingParams,
    *,
    xtc_special_tokens: list[int] | None = None,
    seed_source: SeedSource = _fresh_seed,
) -> Sampler:
    """The sampler for one request (engine thread): mlx-lm's chain with the request's own key.

    The chain order is mlx-lm's: top-p, min-p, XTC, top-k, then a categorical
    draw at ``temperature``. ``xtc_special_tokens`` (usually EOS and newline
    ids) are never removed by XTC. ``seed_source`` seeds a request that names
    no ``seed``; a ``top_k`` at or above the vocabulary size filters nothing.
    """
    if params.greedy:
        return _argmax
    special = [int(t) for t in xtc_special_tokens or []]
    filters: list[_Filter] = []
    if 0.0 < params.top_p < 1.0:
        top_p = params.top_p
        filters.append(lambda x: _top_p(x, top_p))
    if params.min_p != 0.0:
        min_p, keep = params.min_p, params.min_tokens_to_keep
        filters.append(lambda x: _min_p(x, min_p, keep))
    xtc_index = len(filters) if params.xtc_probability > 0.0 else -1
    if params.top_k > 0:
        top_k = params.top_k
        filters.append(lambda x: _top_k(x, top_k))
    seed = params.seed if params.seed is not None else seed_source()
    sampler = _KeyedSampler(seed, params.temperature, filters)
    if xtc_index >= 0:
        filters.insert(xtc_index, _keyed_xtc(sampler, params, special))
    return sampler


def make_request_processors(params: SamplingParams, *, tokenizer: Any = None,
                            contain_grammar: bool = False) -> list[LogitsProcessor]:
    """mlx-lm logits processors for the request's bias, penalties and grammar (engine thread).

    The grammar's mask comes last, after bias and penalties, so nothing can
    lift a token it forbids. A request with a ``grammar`` needs the
    ``tokenizer`` (raises :class:`InvalidGrammar` without it).
    ``contain_grammar``: a violation is recorded on the processor
    (:attr:`GrammarProcessor.violation`) instead of raised (a batch row's).
    """
    processors: list[LogitsProcessor] = make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=params.frequency_context_size,
    )
    if params.grammar is not None:
        if tokenizer is None:
            raise InvalidGrammar("a constrained request needs the tokenizer to build its grammar")
        processors.append(GrammarProcessor(tokenizer, params.grammar, contain=contain_grammar))
    return processors
