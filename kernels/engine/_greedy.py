"""Greedy tokens without the log-softmax nobody reads.

mlx-lm normalizes every decode step's logits over the whole vocabulary
(``logits - logsumexp(logits)``) before sampling, for every row, because a
sampler works on log-probabilities and a caller may ask for them. A greedy
row that does not ask for its logprob needs only the index of its largest
logit. On a CPU the normalization is not small: MLX's ``logsumexp`` runs a
scalar ``exp`` over the 49,152-entry vocabulary of the default model, 0.6 ms
a step for one row and 2.4 / 8 ms for 4 / 8 rows (2026-11-30, this CPU),
3-10 % of a decode step.

So a decode step in which every row is greedy and no row reads its logprob
takes ``argmax`` of the (processed) logits directly. The token is the first
index of the largest logit; mlx-lm's is the first index of the largest
``fl(logit - c)``. Subtracting one value ``c`` from every entry never
reorders two entries; it can only make two of them equal when they differ
by less than one float32 rounding step of the result (about 1e-6 for this
model's logprobs), and then mlx-lm's tie-break picks the earlier index.
Outside such a tie the tokens are the same; the serial lane and the batch
lane both use this rule, so they agree with each other.

:class:`GreedyGenerationBatch` is mlx-lm's ``GenerationBatch`` with that
one change in ``_step``; :func:`start_generation` builds it where mlx-lm's
``PromptProcessingBatch.generate`` would build its own. Engine thread only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from kernels.model import declare_equal_offsets, has_shared_rope

from ._sampling import _argmax

__all__ = [
    "GreedyGenerationBatch",
    "argmax_with_logprobs",
    "greedy_without_logprobs",
    "start_generation",
]


def argmax_with_logprobs(logprobs: mx.array) -> mx.array:
    """The greedy sampler of a row that reads its logprobs (same tokens as ``_argmax``; another identity)."""
    return mx.argmax(logprobs, axis=-1)


def greedy_without_logprobs(samplers: list[Any]) -> bool:
    """True when every sampler is the plain greedy one (no row samples, none reads its logprob)."""
    return bool(samplers) and all(s is _argmax for s in samplers)


def _offsets_equal(model: Any, caches: list[Any]) -> bool:
    """True when the model shares RoPE tables, every layer is a ``BatchKVCache`` and all hold the same offsets.

    Reads the offsets (one evaluation) only for a model with shared tables
    (the CPU forward transform); elsewhere there is nothing to declare.
    """
    if not has_shared_rope(model):
        return False
    if not caches or not all(type(c) is BatchKVCache for c in caches):
        return False
    offsets = mx.stack([c.offset for c in caches])
    return bool(mx.all(offsets == offsets[0]).item())


class GreedyGenerationBatch(GenerationBatch):
    """mlx-lm's decode batch; a step whose rows are all plain-greedy skips the log-softmax.

    It also tells a model with shared RoPE tables (``kernels.model._rope``)
    that its layers' offsets are equal before each forward, so one table
    serves every layer. Checked when the batch is built or extended (the
    rows' caches hold the same tokens in every layer); filtering keeps it,
    since mlx-lm applies the same rows to every layer.
    """

    def __init__(self, model: Any, uids: Any, inputs: Any, prompt_cache: Any, *rest: Any) -> None:
        self._equal_offsets = _offsets_equal(model, prompt_cache)
        super().__init__(model, uids, inputs, prompt_cache, *rest)

    def extend(self, batch: Any) -> None:
        """mlx-lm's extend; offsets stay equal across layers when they were in both batches."""
        equal = self._equal_offsets and bool(getattr(batch, "_equal_offsets", False))
        super().extend(batch)  # type: ignore[no-untyped-call]
        self._equal_offsets = equal

    def _step(self) -> tuple[list[int], list[Any]]:
        # NOTE: mlx-lm's attributes are untyped (None until set); read them as Any.
        self_: Any = self
        if self._equal_offsets:
            declare_equal_offsets(self_.model, [c.offset for c in self_.prompt_cache])
        samplers = [
            self_.fallback_sampler if s is None else s
            for s in (self_.samplers or [None] * len(self_.uids))
        ]
        if not greedy_without_logprobs(samplers):
            result: tuple[list[int], list[Any]] = super()._step()
            return result
        return _greedy_step(self_)


def _greedy_step(batch: Any) -> tuple[list[int], list[Any]]:
    """mlx-lm's ``GenerationBatch._step`` (generate.py) without the normalization; the rest in the same order."""
    batch._current_tokens = batch._next_tokens
    batch._current_logprobs = batch._next_logprobs
    inputs = batch._current_tokens

    logits = batch.model(inputs[:, None], cache=batch.prompt_cache)
    logits = logits[:, -1, :]

    token_context = []
    if any(batch.logits_processors):
        processed_logits = []
        for e in range(len(batch.uids)):
            sample_logits = logits[e : e + 1]
            processors = batch.logits_processors[e] or ()
            if processors:
                context = batch._token_context[e].update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                for processor in processors:
                    sample_logits = processor(context, sample_logits)
            processed_logits.append(sample_logits)
        logits = mx.concatenate(processed_logits, axis=0)

    batch._next_tokens = mx.argmax(logits, axis=-1)
    # NOTE: no row reads a logprob (greedy_without_logprobs); None keeps
    # the per-row list's shape for filter / extend.
    batch._next_logprobs = [None] * len(batch.uids)
    mx.async_eval(batch._next_tokens, token_context)  # type: ignore[no-untyped-call]

    mx.eval(inputs, batch._current_logprobs)
    tokens: list[int] = inputs.tolist()
    for sti, ti in zip(batch.tokens, tokens, strict=True):
        sti.append(ti)
    return tokens, batch._current_logprobs


def start_generation(prefill: Any, last_tokens: list[int]) -> GreedyGenerationBatch:
    """The decode batch of a prefill batch whose rows forwarded all but ``last_tokens``.

    What mlx-lm's ``PromptProcessingBatch.generate`` does for one-token tails:
    the rows' caches, tokens, samplers and stops move to the decode batch,
    whose first step forwards ``last_tokens``.
    """
    generation = GreedyGenerationBatch(
        prefill.model,
        prefill.uids,
        mx.array(last_tokens),
        prefill.prompt_cache,
        prefill.tokens,
        prefill.samplers,
        prefill.fallback_sampler,
        prefill.logits_processors,
        prefill.stop_sequences,
        prefill.max_tokens,
    )
    prefill.uids = []
    prefill.prompt_cache = []
    prefill.tokens = []
    prefill.samplers = []
    prefill.logits_processors = []
    prefill.max_tokens = []
    return generation
