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
one change in ``_step`` (:func:`decode_step`), the order of a step's work
where ``async_eval`` blocks (``read_first``, in :func:`decode_step`), and
three changes in what joining and leaving cost (in its docstring);
:func:`enter_generation` builds it where mlx-lm's
``PromptProcessingBatch.generate`` would build its own. Engine thread only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.models.cache import BatchKVCache, TokenBuffer

from kernels.cache import cache_arrays
from kernels.model import compiled_decode_of, declare_equal_offsets, has_shared_rope

from ._sampling import _argmax, _KeyedSampler

__all__ = [
    "HOLE_STEPS",
    "TRIM_MIN_TOKENS",
    "GreedyGenerationBatch",
    "argmax_with_logprobs",
    "decode_step",
    "enter_generation",
    "greedy_without_logprobs",
    "waiting_generation",
]


HOLE_STEPS = 8
"""Steps a vacated slot waits for a joining row before the batch is compacted without it."""

TRIM_MIN_TOKENS = 64
"""The least left padding every row of a layer shares that a trim drops (a trim copies the layer)."""

_HOLE_UID = -1
"""The uid of a vacant slot (a row's uid is never negative)."""

_ROW_LISTS = (
    "uids", "tokens", "samplers", "logits_processors", "max_tokens", "stop_sequences",
    "_matchers", "_token_context", "_num_tokens", "_next_logprobs", "_priming",
)
"""mlx-lm's (and kvtier's) per-row lists of a decode batch: what a row filling a hole brings."""


@dataclass(frozen=True, slots=True)
class _Retract:
    """A read-first batch as it was before its step built the next forward (:meth:`GreedyGenerationBatch.retract`).

    NOTE: ``layers`` holds handles to each layer's arrays as they were. While
    they live, the built forward's in-place cache writes cannot reuse those
    buffers (a whole-layer copy each), so they are dropped before anything
    evaluates that forward: at the next step's start, or as soon as anything
    else touches the batch.
    """

    layers: tuple[tuple[Any, mx.array, mx.array, mx.array, int], ...]
    """Per layer: the layer, its keys, values and offset arrays, and its write index."""
    keys: tuple[tuple[_KeyedSampler, mx.array], ...]
    """Per sampled row's sampler: the key its next draw would have split."""


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

    Three changes to what rows joining and leaving cost:

    - **Rows enter without a forward of their own** (:func:`enter_generation`):
      a prefilled row's last prompt token waits in the batch's next inputs
      and is forwarded by the next decode step together with every other row
      (a *priming* row: that step returns its prompt token, which is not an
      emitted token). mlx-lm forwards it at once, a separate forward of the
      joining rows per join (H200, 8B shape, 32 rows: 13.9 ms a join).
    - **Leaving rows are filtered without a device round trip per layer**:
      mlx-lm's ``BatchKVCache.filter`` reads each layer's smallest left
      padding to the host to trim it (32 synchronizations for 32 layers,
      12.8 ms a filter on the H200). Here the minima are computed
      asynchronously and the trim is applied after the next step's forward
      was queued (:meth:`_settle_trim`), or before an extend.
    - **A leaving row's slot is reused** (every layer a ``BatchKVCache``):
      the row is extracted and its slot stays in the batch as a *hole*
      (forwarded with the rest, its output dropped) instead of every
      layer's keys and values being gathered into new arrays; a row
      entering later is written into a hole's slot (:meth:`absorb`, one
      in-place slice per layer) instead of every layer being padded and
      concatenated. On the H200 (8B shape, 32 rows) the decode forward after
      a join or a leave took ~29 ms against ~18 ms for a plain one: those
      whole-batch copies. A hole nobody takes for :data:`HOLE_STEPS` steps
      is compacted away (one filter), and a trim waits until the shared
      left padding reaches :data:`TRIM_MIN_TOKENS` (each trim is a copy).
    """

    def __init__(self, model: Any, uids: Any, inputs: Any, prompt_cache: Any, *rest: Any) -> None:
        self._equal_offsets = _offsets_equal(model, prompt_cache)
        # NOTE: one flag per row, kept through filter / extend: True while the
        # row's queued input is its last prompt token (not to be emitted).
        self._priming: list[bool] = [False] * len(uids)
        # NOTE: per BatchKVCache layer, its rows' smallest left padding after a
        # filter, evaluated asynchronously; applied by _settle_trim.
        self._trim: list[tuple[Any, mx.array]] = []
        # NOTE: per row: None for a row, else the steps its slot has been vacant.
        self._hole_age: list[int | None] = [None] * len(uids)
        self._retract: _Retract | None = None
        """What the last read-first step's build replaced (:meth:`retract`); None once anything else touched the batch."""
        self._owed = False
        """Whether the last :meth:`next` forwarded priming rows without handing out their first tokens."""
        super().__init__(model, uids, inputs, prompt_cache, *rest)

    @property
    def holes(self) -> int:
        """Vacant slots: forwarded with the rows, their output dropped, waiting for a joining row."""
        return sum(age is not None for age in self._hole_age)

    reuse_slots: bool = True
    """Leave holes for joining rows (``False``: mlx-lm's filter and extend; ``KVTIER_BATCH_SLOT_REUSE``)."""

    read_first: bool = False
    """A step computes its own tokens before it builds the next forward (:func:`decode_step`; ``KVTIER_READ_FIRST``)."""

    def _slots_reusable(self) -> bool:
        """True when every layer is a ``BatchKVCache`` holding arrays (a slot can be vacated and refilled)."""
        layers: list[Any] = list(self.prompt_cache)
        return self.reuse_slots and bool(layers) and all(type(c) is BatchKVCache and c.keys is not None for c in layers)

    def vacate(self, index: int) -> tuple[list[Any], list[int]]:
        """Take row ``index`` out: its extracted cache and token ids; its slot becomes a hole when reusable.

        Otherwise (a layer kind that cannot hold a hole) the batch is
        filtered, as mlx-lm does. When no row is left but holes, the batch
        is emptied (``len(self) == 0``).
        """
        self_: Any = self
        cache, tokens = self._leaving(index)
        if self._slots_reusable():
            self._make_hole(index)
            if all(age is not None for age in self._hole_age):
                self.filter([])
        else:
            self.filter([i for i in range(len(self_.uids)) if i != index])
        return cache, tokens

    def _make_hole(self, index: int) -> None:
        """Turn slot ``index`` into a hole: no row's state, every layer's padding covering it."""
        self._retract = None
        self_: Any = self
        self_.uids[index] = _HOLE_UID
        self_.tokens[index] = []
        self_.samplers[index] = _argmax
        self_.logits_processors[index] = []
        self_.max_tokens[index] = 0
        self_.stop_sequences[index] = StopSequences(None)
        self_._matchers[index] = self_.stop_sequences[index].matcher()
        self_._token_context[index] = TokenBuffer([])  # type: ignore[no-untyped-call]
        self_._num_tokens[index] = 0
        self_._next_logprobs[index] = None
        self._priming[index] = False
        self._hole_age[index] = 0
        slot = mx.arange(len(self_.uids)) == index
        trim: list[tuple[Any, mx.array]] = []
        for layer in self.prompt_cache:
            c: Any = layer
            # NOTE: all padding: the slot's stale keys are masked, it holds no
            # token a trim must keep, and its position restarts at 0.
            c.left_padding = mx.where(slot, c._idx, c.left_padding)
            c.offset = mx.where(slot, 0, c.offset)
            trim.append((c, mx.min(c.left_padding)))
        self._trim = trim
        mx.async_eval([m for _, m in trim])  # type: ignore[no-untyped-call]

    def absorb(self, batch: GreedyGenerationBatch) -> None:
        """Add ``batch``'s rows: each into a hole where one is free and the row fits, the rest by :meth:`extend`.

        A row fits a hole when its cache (``len(batch.tokens[j])`` tokens,
        left-padded in ``batch``'s layers) is no longer than this batch's
        time axis: it is written right-aligned into the hole's slot of every
        layer, the slot's padding and offset set to match.
        """
        self._retract = None
        other: Any = batch
        holes = [i for i, age in enumerate(self._hole_age) if age is not None]
        placed: list[int] = []
        if holes and self._slots_reusable() and batch._slots_reusable():
            self._settle_trim()
            for j in range(len(other.uids)):
                if other._hole_age[j] is not None:
                    continue
                n = len(other.tokens[j])
                if not holes or any(n > c._idx or n > o._idx for c, o in
                                    zip(self.prompt_cache, other.prompt_cache, strict=True)):
                    continue
                self._fill(holes.pop(0), other, j, n)
                placed.append(j)
        if len(placed) == len(other.uids):
            self._equal_offsets = self._equal_offsets and bool(batch._equal_offsets)
            return
        if placed:
            batch.filter([j for j in range(len(other.uids)) if j not in placed])
        self.extend(batch)

    def _fill(self, index: int, other: Any, j: int, n: int) -> None:
        """Write row ``j`` of ``other`` (``n`` cached tokens) into hole ``index``."""
        self_: Any = self
        slot = mx.arange(len(self_.uids)) == index
        for layer, source in zip(self.prompt_cache, other.prompt_cache, strict=True):
            c: Any = layer
            o: Any = source
            end = c._idx
            # NOTE: an in-place slice write into the layer's buffers (no other
            # reference holds them once the previous step is queued).
            c.keys[index : index + 1, :, end - n : end, :] = o.keys[j : j + 1, :, o._idx - n : o._idx, :]
            c.values[index : index + 1, :, end - n : end, :] = o.values[
                j : j + 1, :, o._idx - n : o._idx, :
            ]
            c.left_padding = mx.where(slot, end - n, c.left_padding)
            c.offset = mx.where(slot, n, c.offset)
        for name in _ROW_LISTS:
            getattr(self, name)[index] = getattr(other, name)[j]
        self_._next_tokens = mx.where(slot, other._next_tokens[j], self_._next_tokens)
        self._hole_age[index] = None
        self._equal_offsets = self._equal_offsets and bool(other._equal_offsets)

    def extend(self, batch: Any) -> None:
        """mlx-lm's extend; offsets stay equal across layers when they were in both batches."""
        self._retract = None
        # NOTE: a pending trim was computed over this batch's rows alone;
        # extend pads them to the joined rows' length, so it must land first.
        self._settle_trim()
        equal = self._equal_offsets and bool(getattr(batch, "_equal_offsets", False))
        super().extend(batch)  # type: ignore[no-untyped-call]
        self._equal_offsets = equal
        self._priming.extend(batch._priming)
        self._hole_age.extend(batch._hole_age)

    def filter(self, keep: list[int]) -> None:
        """mlx-lm's filter; ``BatchKVCache`` layers trim their left padding later, without a sync."""
        self._retract = None
        self._priming = [self._priming[i] for i in keep]
        self._hole_age = [self._hole_age[i] for i in keep]
        # NOTE: only when every layer is a BatchKVCache: a layer kind that trims
        # inside its own filter (transitioning, rotating) would leave the
        # layers' lengths apart until the next step, and the model builds one
        # mask for all of them.
        plain = all(type(c) is BatchKVCache for c in self.prompt_cache)
        if not keep or not plain:
            self._trim = []
            super().filter(keep)
            return
        index = mx.array(keep, dtype=mx.int32)
        trim: list[tuple[Any, mx.array]] = []
        layers: list[Any] = list(self.prompt_cache)
        for layer in layers:
            # NOTE: Any: mlx-lm declares the arrays None until set.
            c: Any = layer
            if c.keys is not None:
                c.keys = c.keys[index]
                c.values = c.values[index]
            c.offset = c.offset[index]
            c.left_padding = c.left_padding[index]
            trim.append((c, mx.min(c.left_padding)))
        self._trim = trim
        mx.async_eval([m for _, m in trim])  # type: ignore[no-untyped-call]
        # NOTE: the per-row lists through mlx-lm's own filter, the caches
        # (filtered above) hidden from it for that call.
        caches = self.prompt_cache
        self.prompt_cache = []
        try:
            super().filter(keep)
        finally:
            self.prompt_cache = caches

    def extract_cache(self, idx: int) -> list[Any]:
        """mlx-lm's per-layer extraction, every layer's left padding evaluated in one call.

        NOTE: ``BatchKVCache.extract`` evaluates its layer's ``left_padding``;
        after a trim or an extend each layer's is a separate lazy array, so
        32 layers were 32 device round trips (8.7 ms a leaving row, H200).
        """
        # NOTE: an extraction is evaluated soon after (a leaving row, a
        # checkpoint), the built forward with it: no handle may hold its buffers.
        self._retract = None
        layers: list[Any] = list(self.prompt_cache)
        mx.eval([c.left_padding for c in layers if type(c) is BatchKVCache])
        return [c.extract(idx) for c in layers]

    def _leaving(self, idx: int) -> tuple[list[Any], list[int]]:
        """A leaving row's cache and token ids: cut before the held build where there is one, else after it.

        NOTE: every row leaving in one step is cut before anything drops the
        held forward (a hole, a filter). After the build, the extraction's
        copies are queued at once, ahead of the next step's in-place writes:
        once queued they no longer hold the layer's buffers, so the next
        write updates them in place instead of copying (on the CPU this
        runs the built forward).
        """
        before = self._extract_before_build(idx)
        if before is not None:
            return before
        self_: Any = self
        cache = self.extract_cache(idx)
        mx.async_eval(*cache_arrays(cache))  # type: ignore[no-untyped-call]
        return cache, list(self_.tokens[idx])

    def _extract_before_build(self, idx: int) -> tuple[list[Any], list[int]] | None:
        """Row ``idx``'s cache and token ids as they were before the last read-first step built the next forward.

        Where that forward is held untouched (:meth:`retract` could take it
        back), a leaving row's cache is cut from the layers it was built on:
        every token but the one the row handed out last, whose own forward is
        not needed. The copies are evaluated here (one row's keys and values,
        no forward), so on the CPU, where evaluating anything of the built
        forward runs most of it before returning, a leaving row's last token
        goes out without waiting for that forward, and a lone row's is never
        computed. ``None`` where no such forward is held (mlx-lm's order, a
        layer or sampler kind a retract refuses, anything done to the batch
        since the build): :meth:`extract_cache` then.
        """
        saved = self._retract
        if saved is None:
            return None
        self_: Any = self
        layers: list[Any] = []
        for layer, keys, values, _offset, write_index in saved.layers:
            # NOTE: a shallow copy: the layer's left padding (a build does not
            # change it) with the arrays and write index from before the build.
            view = copy.copy(layer)
            view.keys, view.values, view._idx = keys, values, write_index
            layers.append(view)
        mx.eval([c.left_padding for c in layers])
        cache = [c.extract(idx) for c in layers]
        # NOTE: evaluated now, so the copies hold none of the saved buffers
        # when the built forward's in-place writes run (they would copy the
        # whole layer instead).
        mx.eval(*cache_arrays(cache))
        return cache, list(self_.tokens[idx][:-1])

    def _settle_trim(self) -> None:
        """Drop the left padding every row of a layer has (mlx-lm's filter's shift), once its minimum is known."""
        trim, self._trim = self._trim, []
        if not trim:
            return
        shifts = cast("list[int]", mx.stack([m for _, m in trim]).tolist())
        # NOTE: with slot reuse a trim is the only copy left: it copies the
        # layer (the next in-place write finds a strided view), and a little
        # shared padding costs less per step. Without it, mlx-lm's rule.
        least = TRIM_MIN_TOKENS if self.reuse_slots else 1
        for (c, _), shift in zip(trim, shifts, strict=True):
            if shift < least:
                continue
            self._retract = None
            if c.keys is not None:
                c.keys = c.keys[..., shift:, :]
                c.values = c.values[..., shift:, :]
            c._idx -= shift
            c.left_padding = c.left_padding - shift

    def next(self) -> list[Any]:
        """mlx-lm's ``next`` (its loop, in its order); a priming row's step returns nothing for it, and a pending trim lands."""
        self_: Any = self
        if not self_.uids:
            self._owed = False
            return []
        priming = self._priming
        if any(priming):
            self._priming = [False] * len(self_.uids)
            if self.read_first and all(p or age is not None for p, age in zip(priming, self._hole_age, strict=True)):
                # NOTE: read first, and no row of this step would hand out a
                # token (rows entering, the running ones' built forward taken
                # back: retract). One step forwards the queued inputs, the next
                # computes that forward and hands out what it gives: entering
                # rows hand out their first token in the turn they enter.
                self._step()
                priming = [False] * len(priming)
        self._owed = any(priming)
        tokens, logprobs = self._step()
        # NOTE: here, between the step and this step's filter: the minima of the
        # previous filter were queued before this step's forward, so reading
        # them waits for nothing the step did not already wait for (after this
        # step's filter, they would wait for its whole forward).
        self._settle_trim()
        keep: list[int] = []
        done_rows: list[int] = []
        responses: list[Any] = []
        holes = self._hole_age
        for i in range(len(self_.uids)):
            if priming[i] or holes[i] is not None:
                keep.append(i)
                continue
            finish_reason = None
            self_._num_tokens[i] += 1
            if self_._num_tokens[i] >= self_.max_tokens[i]:
                finish_reason = "length"
            if self_._matchers[i].advance(tokens[i]):
                finish_reason = "stop"
            done = finish_reason is not None
            cache, cache_tokens = self._leaving(i) if done else (None, None)
            responses.append(
                self.Response(
                    uid=self_.uids[i],
                    token=tokens[i],
                    logprobs=logprobs[i],
                    finish_reason=finish_reason,
                    prompt_cache=cache,
                    all_tokens=cache_tokens,
                )
            )
            if not done:
                keep.append(i)
            else:
                done_rows.append(i)
        if done_rows and self._slots_reusable():
            for i in done_rows:
                self._make_hole(i)
            keep = sorted([*keep, *done_rows])
        keep = self._age_holes(keep)
        if len(keep) < len(self_.uids):
            self.filter(keep)
        return responses

    def _age_holes(self, keep: list[int]) -> list[int]:
        """Count a step for every hole in ``keep``; drop those past :data:`HOLE_STEPS`, and all when no row is left."""
        ages = self._hole_age
        for i in keep:
            age = ages[i]
            if age is not None:
                ages[i] = age + 1
        if all(ages[i] is not None for i in keep):
            return []
        return [i for i in keep if (ages[i] or 0) <= HOLE_STEPS]

    @property
    def owes_first(self) -> bool:
        """Whether the last :meth:`next` forwarded entering rows' last prompt tokens without handing out their first tokens (the next step does)."""
        return self._owed

    def _retract_state(self, samplers: list[Any]) -> _Retract | None:
        """What this step's build will replace, where a retract can put it back (else ``None``).

        Plain ``BatchKVCache`` layers holding arrays, no logits processor
        (their token context would move), and samplers whose only state is
        a key kvtier can put back. What it keeps is what mlx-lm 0.32.2's
        ``BatchKVCache.update_and_fetch`` changes (tests/kernels/test_mlx_lm_copies.py).
        """
        self_: Any = self
        layers: list[Any] = list(self.prompt_cache)
        if not layers or not all(type(c) is BatchKVCache and c.keys is not None for c in layers):
            return None
        if any(self_.logits_processors):
            return None
        if not all(s is _argmax or s is argmax_with_logprobs or isinstance(s, _KeyedSampler) for s in samplers):
            return None
        # NOTE: copy.copy(a) is a second handle on a's present value, no
        # operation of its own (mx.array(a) would be a lazy copy): the build's
        # in-place writes (``keys[...] = ...``) rebind the layer's own array.
        return _Retract(
            layers=tuple((c, copy.copy(c.keys), copy.copy(c.values), c.offset, c._idx) for c in layers),
            keys=tuple((s, s.key) for s in dict.fromkeys(samplers) if isinstance(s, _KeyedSampler)),
        )

    def retract(self) -> bool:
        """Take back the next forward the last read-first step built and left unevaluated.

        The rows' tokens of that step (emitted already) become their queued
        inputs again, as priming rows', so rows entering now share that
        forward and hand out their first tokens with the running rows' next
        ones in one step (:meth:`next`), instead of waiting for the built
        forward and then their own. Every layer, the rows' token histories
        and the samplers' keys return to where they were before the build.
        Returns False (nothing changed) where no such forward is held: not
        read first, a layer or sampler kind that cannot be put back, or
        anything done to the batch since the build.
        """
        saved, self._retract = self._retract, None
        if saved is None:
            return False
        self_: Any = self
        for layer, keys, values, offset, idx in saved.layers:
            layer.keys, layer.values, layer.offset, layer._idx = keys, values, offset, idx
        for sampler, key in saved.keys:
            sampler.restore(key)
        self_._next_tokens = self_._current_tokens
        self_._next_logprobs = self_._current_logprobs
        for history in self_.tokens:
            history.pop()
        self._priming = [age is None for age in self._hole_age]
        return True

    def _step(self) -> tuple[list[int], list[Any]]:
        # NOTE: mlx-lm's attributes are untyped (None until set); read them as Any.
        self_: Any = self
        if self._equal_offsets:
            declare_equal_offsets(self_.model, [c.offset for c in self_.prompt_cache])
        samplers = [
            self_.fallback_sampler if s is None else s
            for s in (self_.samplers or [None] * len(self_.uids))
        ]
        # NOTE: before decode_step's async_eval evaluates the forward the last
        # retract state described (its handles must be gone by then).
        self._retract = self._retract_state(samplers) if self.read_first else None
        return decode_step(
            self_, samplers, normalize=not greedy_without_logprobs(samplers), read_first=self.read_first
        )


def decode_step(
    batch: Any, samplers: list[Any], *, normalize: bool, read_first: bool
) -> tuple[list[int], list[Any]]:
    """mlx-lm's ``GenerationBatch._step`` (generate.py): forward this step's tokens, return them.

    Its operations in its order, with two choices. ``normalize=False`` (every
    row plain greedy, :func:`greedy_without_logprobs`): the next tokens are
    the logits' ``argmax``, without the log-softmax. ``read_first``: this
    step's tokens are computed before the next forward is built, and the
    next forward is left unevaluated (the next step computes it): where
    ``mx.async_eval`` runs most of a forward before it returns (the CPU,
    :func:`kernels.async_eval_blocks`), mlx-lm's order (queue the next
    forward, then read this step's tokens) hands every token out one whole
    forward late, a lone request's first token included. The tokens and the
    caches' contents are the same either way: only when each forward runs
    changes. A model with a compiled decode (``KVTIER_COMPILED_DECODE``,
    :mod:`kernels.model._compiled_decode`) replays its forward from a trace
    where it applies, leaving the caches as the built forward would. The
    copy is of mlx-lm 0.32.2's; tests/kernels/test_mlx_lm_copies.py
    fails while the installed mlx-lm's step differs from it.
    """
    batch._current_tokens = batch._next_tokens
    batch._current_logprobs = batch._next_logprobs
    inputs = batch._current_tokens
    if read_first:
        # NOTE: this step's tokens (the forward the last step built) start
        # now; building the next forward below overlaps their last operations.
        mx.async_eval(inputs, batch._current_logprobs)  # type: ignore[no-untyped-call]

    compiled = compiled_decode_of(batch.model)
    if compiled is not None and compiled.applies(inputs[:, None], batch.prompt_cache):
        # NOTE: the forward replayed from a trace (kernels.model._compiled_decode).
        logits = compiled.forward(inputs[:, None], batch.prompt_cache)
    else:
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

    if normalize:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        # NOTE: one batched call when the batch shares a sampler (mlx-lm's rule).
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else batch.fallback_sampler)(logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
        batch._next_tokens = sampled
        batch._next_logprobs = list(logprobs)
    else:
        batch._next_tokens = mx.argmax(logits, axis=-1)
        # NOTE: no row reads a logprob (greedy_without_logprobs); None keeps
        # the per-row list's shape for filter / extend.
        batch._next_logprobs = [None] * len(batch.uids)
    if not read_first:
        mx.async_eval(batch._next_tokens, batch._next_logprobs, token_context)  # type: ignore[no-untyped-call]

    mx.eval(inputs, batch._current_logprobs)
    tokens: list[int] = inputs.tolist()
    for sti, ti in zip(batch.tokens, tokens, strict=True):
        sti.append(ti)
    return tokens, batch._current_logprobs


def waiting_generation(
    model: Any,
    uids: list[int],
    inputs: list[int],
    prompt_cache: list[Any],
    tokens: list[list[int]],
    samplers: list[Any],
    fallback_sampler: Any,
    logits_processors: list[Any],
    stop_sequences: list[Any],
    max_tokens: list[int],
    *,
    num_tokens: list[int],
    priming: bool,
    reuse_slots: bool = True,
    read_first: bool = False,
) -> GreedyGenerationBatch:
    """A decode batch whose rows' next inputs are queued and not forwarded yet (its next step does).

    ``priming``: the inputs are the rows' last prompt tokens (their step
    emits nothing); otherwise sampled tokens not emitted yet (a resumed
    row's pending token), emitted by the next step like any other.
    ``num_tokens``: tokens each row has emitted (counted against ``max_tokens``).
    ``reuse_slots``, ``read_first``: :attr:`GreedyGenerationBatch.reuse_slots`,
    :attr:`GreedyGenerationBatch.read_first`.
    """
    batch = GreedyGenerationBatch(
        model, [], mx.array([], dtype=mx.uint32), [], [], [], fallback_sampler, [], [], []
    )
    self_: Any = batch
    self_.uids = list(uids)
    self_.prompt_cache = prompt_cache
    self_.tokens = tokens
    self_.samplers = samplers
    self_.logits_processors = logits_processors
    self_.stop_sequences = stop_sequences
    self_.max_tokens = max_tokens
    self_._next_tokens = mx.array(inputs, dtype=mx.uint32)
    # NOTE: read only for rows asking for logprobs; a priming row's are the
    # ones its first forward computes, a resumed row never asks.
    self_._next_logprobs = [None] * len(uids)
    self_._token_context = [TokenBuffer(t) for t in tokens]  # type: ignore[no-untyped-call]
    self_._num_tokens = list(num_tokens)
    self_._matchers = [s.matcher() for s in stop_sequences]
    batch._equal_offsets = _offsets_equal(model, prompt_cache)
    batch._priming = [priming] * len(uids)
    batch._hole_age = [None] * len(uids)
    batch.reuse_slots = reuse_slots
    batch.read_first = read_first
    return batch


def enter_generation(
    prefill: Any,
    last_tokens: list[int],
    *,
    forward_now: bool = False,
    reuse_slots: bool = True,
    read_first: bool = False,
) -> GreedyGenerationBatch:
    """The decode batch of a prefill batch whose rows forwarded all but ``last_tokens``, without a forward.

    What mlx-lm's ``PromptProcessingBatch.generate`` builds for one-token
    tails, except that the last prompt tokens are not forwarded now: they
    are the rows' next inputs, forwarded by the decode step they join
    (priming rows). The rows' caches, tokens, samplers and stops move over.
    ``forward_now``: forward them at once instead, as mlx-lm does (their
    first tokens sampled and queued; the batch has no priming rows).
    """
    generation = waiting_generation(
        prefill.model,
        prefill.uids,
        last_tokens,
        prefill.prompt_cache,
        prefill.tokens,
        prefill.samplers,
        prefill.fallback_sampler,
        prefill.logits_processors,
        prefill.stop_sequences,
        prefill.max_tokens,
        num_tokens=[0] * len(prefill.uids),
        priming=True,
        reuse_slots=reuse_slots,
        read_first=read_first,
    )
    prefill.uids = []
    prefill.prompt_cache = []
    prefill.tokens = []
    prefill.samplers = []
    prefill.logits_processors = []
    prefill.max_tokens = []
    if forward_now:
        # NOTE: mlx-lm's first step: the returned tokens are the prompt's last,
        # appended to the rows' token history, not emitted.
        generation._step()
        generation._priming = [False] * len(generation)
    return generation
