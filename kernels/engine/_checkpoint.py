"""Generation checkpoints on the engine thread: capture the state of an answer, resume it.

A checkpoint is taken right after :meth:`Generation.decode_step` returned a
token that did not finish the answer. At that boundary the live caches
cover the prompt and every emitted token, and the next token (the
*pending* one) is already sampled (its forward was queued by the step) but
not emitted. :func:`checkpoint_point` reads that state;
:func:`resume_generation` builds a generation from restored caches that
first replays the emitted tokens (:func:`replay_step`: no forward, the same
text stream, so the client sees the same text events as the first time)
and then continues from the pending token with the request's PRNG key as
it was after the pending token's draw. The sample index is the number of
emitted tokens and the logits processors' history is prompt + emitted
tokens, both restored from the token list.

NOTE: these functions set private state of :class:`Generation` (a sibling
module of the same package) instead of widening its constructor: the
decode step itself is unchanged, so an uninterrupted and a resumed run
execute the same arithmetic from the pending token on.

Every function runs on the engine thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kernels._errors import InvalidPrompt

from ._generation import Generation, StepOutput
from ._sampling import SamplingParams, _KeyedSampler

__all__ = [
    "CheckpointPoint",
    "checkpoint_point",
    "replay_pending",
    "replay_step",
    "resume_generation",
    "sampler_key",
    "set_sampler_key",
]


@dataclass(frozen=True, slots=True)
class CheckpointPoint:
    """What a checkpoint records beside the caches (``cache_tokens`` = prompt + ``generated``)."""

    prompt_len: int
    generated: tuple[int, ...]
    pending_token: int
    rng_key: tuple[int, int] | None

    @property
    def cache_tokens(self) -> int:
        """Tokens the caches cover at the boundary."""
        return self.prompt_len + len(self.generated)


def _sampler_key(gen: Generation) -> tuple[int, int] | None:
    return sampler_key(gen._sampler)


def sampler_key(sampler: object) -> tuple[int, int] | None:
    """The PRNG key of a request's sampler as two words (``None``: the sampler draws no key)."""
    key = sampler_key_array(sampler)
    return None if key is None else key_words(key)


def sampler_key_array(sampler: object) -> Any:
    """The sampler's PRNG key array as it is now, unread (``None``: the sampler draws no key).

    NOTE: each draw replaces the sampler's key array, so the array taken
    now stays the key after the last draw, whenever it is read.
    """
    if not isinstance(sampler, _KeyedSampler):
        return None
    return sampler.key


def key_words(key: Any) -> tuple[int, int]:
    """A PRNG key array as two words (reading it waits for its computation)."""
    raw: Any = key.tolist()
    words = [int(w) for w in raw]
    if len(words) != 2:
        raise ValueError(f"a PRNG key of {len(words)} words")
    return words[0], words[1]


def checkpoint_point(gen: Generation) -> CheckpointPoint | None:
    """The boundary state of ``gen`` after a decode step, or ``None`` where there is none.

    ``None`` while the prefill runs, after the answer finished, while a
    resumed generation still replays, or when no next token is queued (the
    last step by ``max_tokens``). Reading the pending token waits for its
    forward (already queued by the decode step).
    """
    nxt = gen._next
    if not gen.prefill_done or gen.finish_reason is not None or nxt is None:
        return None
    if replay_pending(gen):
        return None
    pending = int(nxt[0].item())  # type: ignore[arg-type]
    return CheckpointPoint(
        prompt_len=len(gen.prompt_tokens),
        generated=gen.generated_tokens,
        pending_token=pending,
        rng_key=_sampler_key(gen),
    )


def set_sampler_key(sampler: object, key: tuple[int, int] | None) -> None:
    """Give a request's sampler the PRNG key a checkpoint saved (raises when the two do not fit)."""
    if isinstance(sampler, _KeyedSampler):
        if key is None:
            raise InvalidPrompt("a sampled request's checkpoint has no PRNG key")
        sampler.restore(mx.array(list(key), dtype=mx.uint32))
    elif key is not None:
        raise InvalidPrompt("a greedy request's checkpoint carries a PRNG key")


# NOTE: the replay queue of a resumed generation, by object identity; a
# generation is dropped with its queue (weak keys would need __weakref__ on
# Generation, which has no __slots__, so a plain attribute is used instead).
_REPLAY_ATTR = "_kvtier_replay"


def replay_pending(gen: Generation) -> bool:
    """True while a resumed generation has saved tokens left to replay."""
    queue: deque[int] | None = getattr(gen, _REPLAY_ATTR, None)
    return bool(queue)


def replay_step(gen: Generation) -> StepOutput:
    """The next step of ``gen``: a saved token replayed (no forward) while any remain, else a decode step."""
    queue: deque[int] | None = getattr(gen, _REPLAY_ATTR, None)
    if not queue:
        return gen.decode_step()
    token = queue.popleft()
    gen._generated.append(token)
    text = gen._text.add(token)
    # NOTE: the saved tokens did not end the original answer (it went on to
    # sample the pending token), so none of them finishes it here either.
    if token in gen._stop_ids or gen._text.finished:
        raise InvalidPrompt("a saved checkpoint token ends the answer: not a checkpoint")
    return StepOutput(token_id=token, text=text)


def resume_generation(
    model: Any,
    tokenizer: Any,
    prompt: Sequence[int],
    params: SamplingParams,
    caches: list[Any],
    point: CheckpointPoint,
    *,
    prefill_step_size: int = 2048,
    cache_hook: Any = None,
) -> Generation:
    """A generation that replays ``point.generated`` and continues from ``point.pending_token``.

    ``caches`` cover exactly ``prompt + point.generated`` (a restored
    checkpoint file's caches). Step it with :func:`replay_step`. Raises
    :class:`InvalidPrompt` when the pieces do not fit (the checkpoint is
    then not used: a fresh generation is the caller's fallback).
    """
    if point.prompt_len != len(prompt):
        raise InvalidPrompt("the checkpoint was taken for a prompt of another length")
    if len(point.generated) + 1 >= params.max_tokens:
        raise InvalidPrompt("the checkpoint's pending token would be past max_tokens")
    if params.logprobs or params.top_logprobs or params.prompt_logprobs is not None \
            or params.grammar is not None:
        raise InvalidPrompt("requests with logprobs or a grammar are not resumed")
    covered = point.cache_tokens
    for i, layer in enumerate(caches):
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int) and offset != covered:
            raise InvalidPrompt(f"restored layer {i} holds {offset} tokens, expected {covered}")
    # NOTE: built on the prompt alone (a fresh cache object list, no forward),
    # then moved to the boundary: prefill done, caches and history covering
    # the emitted tokens, the pending token queued as the next one.
    gen = Generation(model, tokenizer, prompt, params, prefill_step_size=prefill_step_size,
                     cache_hook=cache_hook)
    tokens = [int(t) for t in prompt] + [int(t) for t in point.generated]
    gen._cache = caches
    gen._cache_tokens = tokens
    gen._cursor = len(gen._prompt)
    gen._prefill_done = True
    if gen._processors:
        gen._history = mx.array(tokens)
    set_sampler_key(gen._sampler, point.rng_key)
    # NOTE: the argmax/categorical tokens are uint32 arrays of shape (1,); the
    # second value (log-probabilities) is read only by logprob requests,
    # which are never resumed.
    gen._next = (mx.array([point.pending_token], dtype=mx.uint32), mx.zeros((1,)))
    setattr(gen, _REPLAY_ATTR, deque(int(t) for t in point.generated))
    return gen
