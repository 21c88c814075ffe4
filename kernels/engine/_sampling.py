"""Sampling parameters and the per-request sampler built from them.

``SamplingParams`` is plain validated data (no MLX), so the event loop can
check a request before admission. ``make_request_sampler`` and
``make_request_processors`` build the MLX side; call them on the engine
thread.

Seeded sampling uses a per-request PRNG key: each sampled token splits the
request's own key, exactly as MLX splits its global key, so a seeded request
gives the same tokens whatever else the engine thread did in between (other
requests, background turns), and the same tokens as ``mlx_lm`` after
``mx.random.seed(seed)``. An unseeded request draws from the engine thread's
global MLX key, as ``mlx_lm`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    categorical_sampling,
    make_logits_processors,
)

from messages.gateway import GenerationParams

__all__ = [
    "LogitsProcessor",
    "Sampler",
    "SamplingParams",
    "make_request_processors",
    "make_request_sampler",
]

Sampler = Callable[[mx.array], mx.array]
"""Maps log-probabilities of shape ``(1, vocab)`` to a token array of shape ``(1,)``."""

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""Maps (token history, logits) to adjusted logits (mlx-lm's processor shape)."""


# NOTE: one definition of a request's sampling parameters, in `messages`
# (which may not import kernels; kernels may import messages): the gateway
# hands the message's value to the kernel unchanged.
SamplingParams = GenerationParams
"""How one request samples and when it stops: :class:`messages.GenerationParams`."""


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class _KeyedSampler:
    """mlx-lm's sampler chain with an explicit per-request PRNG key."""

    def __init__(self, params: SamplingParams, filters: list[Callable[[mx.array], mx.array]]) -> None:
        assert params.seed is not None
        self._key = mx.random.key(params.seed)
        self._inv_temp = 1.0 / params.temperature
        # NOTE: shared list; make_request_sampler inserts the keyed XTC filter later.
        self._filters = filters

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


def _keyed_xtc(sampler: _KeyedSampler, params: SamplingParams, special: list[int]) -> Callable[[mx.array], mx.array]:
    def xtc(logits: mx.array) -> mx.array:
        probs = mx.softmax(logits, -1)
        mask = probs > mx.where(probs > params.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
        if special:
            mask[..., special] = False
        draw = mx.random.uniform(0, 1, key=sampler.next_key())
        return mx.where(draw > params.xtc_probability, logits, mx.where(mask, -mx.inf, logits))

    return xtc


def make_request_sampler(params: SamplingParams, *, xtc_special_tokens: list[int] | None = None) -> Sampler:
    """The sampler for one request (engine thread): mlx-lm's chain, keyed when seeded.

    The chain order is mlx-lm's: top-p, min-p, XTC, top-k, then a categorical
    draw at ``temperature``. ``xtc_special_tokens`` (usually EOS and newline
    ids) are never removed by XTC.
    """
    if params.greedy:
        return _argmax
    special = list(xtc_special_tokens or [])
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0.0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p, params.min_tokens_to_keep))
    xtc_index = len(filters) if params.xtc_probability > 0.0 else -1
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))

    if params.seed is None:
        if xtc_index >= 0:
            filters.insert(
                xtc_index,
                lambda x: apply_xtc(x, params.xtc_probability, params.xtc_threshold, special),
            )
        temp = params.temperature

        def global_sampler(logprobs: mx.array) -> mx.array:
            for method in filters:
                logprobs = method(logprobs)
            return categorical_sampling(logprobs, temp)

        return global_sampler

    keyed = _KeyedSampler(params, filters)
    if xtc_index >= 0:
        filters.insert(xtc_index, _keyed_xtc(keyed, params, special))
    return keyed


def make_request_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """mlx-lm logits processors for the request's bias and penalties (engine thread)."""
    processors: list[LogitsProcessor] = make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=params.frequency_context_size,
    )
    return processors
